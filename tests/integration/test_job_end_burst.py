"""A job whose last rows and goodbyes come in one burst (a spool replayed, a consumer catching up) is judged
ended once the processor has read everything: the judgement waits for the job's partitions to be read to
their end, and no later row of that job may come to ask again. Here the goodbyes are followed, in the same
in-flight partition, by another job's watchdog reports, so when they are handled that partition is not yet
read to its end."""
from __future__ import annotations

import time

import pyarrow as pa
from kafka import KafkaProducer

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.wire.encode import encode_arrow
from stepwatch.devtools.scenarios_indep import IndepJob, IndepScenario
from stepwatch.stream.processor import Processor

import pytest
pytestmark = pytest.mark.integration

S = 1_000_000_000


def _send(prod, kafka, kind: str, job: str, payload: bytes) -> None:
    prod.send(kafka.topic(kind), payload, key=job.encode(), partition=0,
              headers=[("content-type", b"application/vnd.apache.arrow.stream"), ("schema", f"{kind}/1".encode())])


def _inflight(rows: list[dict]) -> bytes:
    return encode_arrow(conform(pa.Table.from_pylist(rows), wire.SCHEMAS["inflight"]))


def _why(proc, job):
    rt = proc.jobs.get(job)
    if rt is None:
        return "job not seen"
    ctx = proc._ctx(rt)
    life = rt.telemetry.life
    return dict(first=len(life.first), outcome=life.outcome, caught_up=ctx.caught_up(), steps_caught_up=
                proc.caught.steps_caught_up(rt), steps_ev=ctx.steps_event_ns, host_ev=ctx.host_event_ns,
                bye=max([e.t for e in life.first.values()] or [0]), max_step=rt.state.max_step,
                parts=(rt.steps_partition, rt.inflight_partition, rt.host_partition))


def test_goodbyes_read_in_a_burst_with_other_jobs_rows_behind_them_end_the_job(kafka, tmp_path):
    sc = IndepScenario("burst-end", [], ranks=8, per_node=4, steps=40, seed=3, checkpoint_every=None)
    job = IndepJob(sc)
    msgs = sorted(job.messages(with_comm=False), key=lambda m: (m.produce_ns, m.seq))
    prod = KafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=5)
    last = -1
    for m in msgs:                                           # the job ends after step 29; host samples go on
        if m.kind == "steps":
            top = int(pa.compute.max(pa.ipc.open_stream(m.payload).read_all().column("step")).as_py())
            if top >= 30:
                continue
            last = max(last, top)
        _send(prod, kafka, m.kind, sc.job, m.payload)
    t_bye = int(job.t_end[last]) + S // 10
    nodes = job.topology().column("node").to_pylist()
    _send(prod, kafka, "inflight", sc.job, _inflight([
        {"job": sc.job, "node": nodes[r], "rank": r, "t": t_bye + r, "source": "probe", "state": "exited",
         "exit_code": 0} for r in range(sc.ranks)]))
    for i in range(40):                                      # another job's watchdog reports behind them
        _send(prod, kafka, "inflight", "other", _inflight([
            {"job": "other", "node": "n9", "rank": 0, "t": t_bye + i * S, "source": "probe", "state": "compute",
             "step": 5, "elapsed_ms": 1000.0 * i}]))
    prod.flush(30)
    prod.close()

    alerts = []
    proc = Processor(kafka, tmp_path / "store", group=f"g-{kafka.prefix}", flush_interval_s=0.5,
                     on_alert=alerts.append, profiling=None)
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(e.kind == "job_end" for e in proc.events):
            proc.poll_once(timeout_ms=200)
        ends = [e for e in proc.events if e.kind == "job_end" and e.job == sc.job]
        assert [(a.evidence["outcome"], a.evidence["ranks_ended"]) for a in ends] == [("finished", sc.ranks)], \
            ([a.line()[:160] for a in alerts], _why(proc, sc.job))
        rt = proc.jobs[sc.job]
        assert rt.state.max_step == last
        assert [a for a in alerts if a.kind == "job_hang"] == []
    finally:
        proc.close()

"""Job-hang judgement under a real consumer group: the job's steps partition is paused (consumer.pause)
while its host partition is read minutes of event time ahead; no hang is reported while the steps are
merely unread, and the real hang in the same stream is reported once they are read."""
from __future__ import annotations

import json
import time

from kafka import KafkaProducer

from stepwatch.devtools.scenarios_indep import IndepJob, IndepScenario
from stepwatch.stream.processor import Processor

import pytest
pytestmark = pytest.mark.integration


def _produce(kafka, job: IndepJob, msgs) -> dict:
    prod = KafkaProducer(bootstrap_servers=kafka.bootstrap, max_request_size=64 << 20, linger_ms=5)
    n = {}
    for m in msgs:
        prod.send(kafka.topic(m.kind), m.payload, key=job.sc.job.encode(),
                  headers=[("content-type", b"application/vnd.apache.arrow.stream"),
                           ("schema", f"{m.kind}/1".encode())])
        n[m.kind] = n.get(m.kind, 0) + 1
    prod.flush(30)
    prod.close()
    return n


def _poll_until(proc, cond, timeout_s=60.0):
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        proc.poll_once(timeout_ms=200)
        if cond():
            return True
    return False


def test_paused_steps_partition_is_no_hang_and_the_real_hang_is_found(kafka, tmp_path):
    # 32 ranks on 4 nodes, 1 s steps, 5 steps per message per node; rank 9 stops at step 120, the rest
    # block a step later; host samples go on to 200 s
    sc = IndepScenario("cg-hang", [dict(kind="hang", rank=9, start=120)], ranks=32, per_node=8, steps=200,
                       seed=5, checkpoint_every=None)
    job = IndepJob(sc)
    msgs = job.messages(with_comm=False)
    t_cut = int(job.t_end[20])                                  # the first ~20 steps first
    sent = _produce(kafka, job, [m for m in msgs if m.produce_ns <= t_cut])
    alerts = []
    proc = Processor(kafka, tmp_path / "store", group=f"g-{kafka.prefix}", flush_interval_s=0.5,
                     on_alert=alerts.append, profiling=None)
    proc.start()
    try:
        steps_topic = kafka.topic("steps")
        assert _poll_until(proc, lambda: sc.job in proc.jobs and proc.jobs[sc.job].state.max_step >= 0)
        paused = [tp for tp in proc.consumer.assignment() if tp.topic == steps_topic]
        proc.consumer.pause(*paused)
        rt = proc.jobs[sc.job]
        top_paused = rt.state.max_step
        rest = _produce(kafka, job, [m for m in msgs if m.produce_ns > t_cut])
        # read the host topic to its end while the steps wait: host event time runs far ahead
        assert _poll_until(proc, lambda: rt.telemetry.host_event_ns >= job.t_stop - 2_000_000_000)
        for _ in range(10):                                     # and a few more polls (ticks, flushes)
            proc.poll_once(timeout_ms=100)
        ahead_s = (rt.telemetry.host_event_ns - rt.state.max_t_end) / 1e9
        assert ahead_s > 150 and rt.state.max_step < 60, (ahead_s, rt.state.max_step, top_paused)
        assert [a for a in alerts if a.kind == "job_hang"] == []
        # the steps come: the stream holds a real hang (steps end at 120/121, host goes on to 200 s)
        proc.consumer.resume(*paused)
        assert _poll_until(proc, lambda: any(a.kind == "job_hang" for a in alerts), timeout_s=90)
        assert rt.state.max_step == 120
        hangs = [a for a in alerts if a.kind == "job_hang"]
        assert [(a.status, a.ranks, a.step_first) for a in hangs] == [("firing", [9], 120)], json.dumps(hangs[0].evidence)
        assert hangs[0].evidence["steps_read_to_end"] is True and hangs[0].evidence["judged"] == "per_node"
        assert hangs[0].incident_id.startswith("inc-")
        assert sent["steps"] + rest["steps"] == 100 and sent["host"] + rest["host"] > 100
    finally:
        proc.close()


def test_after_a_restart_unread_steps_are_no_hang(kafka, tmp_path):
    """A processor restarted on the same store and group rebuilds the job from the store (its steps up to
    ~20) before it has read any of the job's new step rows; its steps partitions are paused from the
    moment they are assigned while the host topic is read ~180 s ahead: no hang until they are read."""
    sc = IndepScenario("cg-restart", [dict(kind="hang", rank=21, start=120)], ranks=32, per_node=8, steps=200,
                       seed=6, checkpoint_every=None)
    job = IndepJob(sc)
    msgs = job.messages(with_comm=False)
    t_cut = int(job.t_end[20])
    _produce(kafka, job, [m for m in msgs if m.produce_ns <= t_cut])
    store, group = tmp_path / "store", f"g-{kafka.prefix}r"
    first = Processor(kafka, store, group=group, flush_interval_s=0.2, on_alert=lambda a: None, profiling=None)
    first.start()
    try:
        assert _poll_until(first, lambda: sc.job in first.jobs and first.jobs[sc.job].state.max_step >= 19)
        first._flush()
    finally:
        first.close()
    _produce(kafka, job, [m for m in msgs if m.produce_ns > t_cut])
    alerts = []
    proc = Processor(kafka, store, group=group, flush_interval_s=0.5, on_alert=alerts.append, profiling=None)
    steps_topic = kafka.topic("steps")
    assigned = proc._assigned

    def pause_steps(tps):                      # test control: the steps partitions are read later
        assigned(tps)
        proc.consumer.pause(*[tp for tp in tps if tp.topic == steps_topic])

    proc._assigned = pause_steps
    proc.start()
    try:
        assert _poll_until(proc, lambda: sc.job in proc.jobs
                           and proc.jobs[sc.job].telemetry.host_event_ns >= job.t_stop - 2_000_000_000)
        rt = proc.jobs[sc.job]
        for _ in range(10):
            proc.poll_once(timeout_ms=100)
        assert rt.steps_partition is None and 19 <= rt.state.max_step < 30      # rebuilt from the store only
        assert (rt.telemetry.host_event_ns - rt.state.max_t_end) / 1e9 > 150
        assert [a for a in alerts if a.kind == "job_hang"] == []
        proc.consumer.resume(*proc.consumer.paused())
        assert _poll_until(proc, lambda: any(a.kind == "job_hang" for a in alerts), timeout_s=90)
        assert [(a.ranks, a.step_first) for a in alerts if a.kind == "job_hang"] == [([21], 120)]
    finally:
        proc.close()


def test_a_rejoin_that_reads_again_from_the_stored_offsets_is_not_read_to_the_end(kafka, tmp_path):
    """The read-to-end proof (hang judgement, idle exit) after the group took the partitions away and gave
    them back (an expired session): the consumer reads again from the offsets stored in the lake, so what
    was handled before the loss proves nothing until those records are read again."""
    sc = IndepScenario("cg-rejoin", [], ranks=8, per_node=8, steps=60, seed=7, checkpoint_every=None)
    job = IndepJob(sc)
    msgs = job.messages(with_comm=False)
    t_cut = int(job.t_end[20])
    _produce(kafka, job, [m for m in msgs if m.produce_ns <= t_cut])
    proc = Processor(kafka, tmp_path / "store", group=f"g-{kafka.prefix}j", flush_interval_s=3600,
                     on_alert=lambda a: None, profiling=None)
    proc.start()
    try:
        assert _poll_until(proc, lambda: proc.caught.all_caught_up() and sc.job in proc.jobs)
        proc._flush()                                   # stored up to here, with the offsets
        _produce(kafka, job, [m for m in msgs if m.produce_ns > t_cut])
        assert _poll_until(proc, lambda: proc.lake.rows > 0 and proc.caught.all_caught_up())
        tps = list(proc.consumer.assignment())
        proc.fencing.lost(tps)                         # what kafka-python calls after the session expired
        proc._assigned(tps)                             # and on the rejoin: seek to the stored offsets
        assert not proc.caught.all_caught_up()
        assert _poll_until(proc, proc.caught.all_caught_up)
        proc._flush()
    finally:
        proc.close()
    from stepwatch.storage.views import connect
    con = connect(tmp_path / "store")
    n, uniq = con.execute("SELECT count(*), count(DISTINCT (rank, step)) FROM steps WHERE job = ?",
                          [sc.job]).fetchone()
    assert n == uniq == 8 * 60


def test_idle_exit_waits_for_partitions_not_yet_read(kafka, tmp_path):
    """``--idle-exit``: silence alone does not end the run while an assigned partition is unread (here the
    steps partitions, paused for 3 s from their assignment, as a consumer is while it rejoins)."""
    import threading
    sc = IndepScenario("cg-idle", [], ranks=8, per_node=8, steps=40, seed=8, checkpoint_every=None)
    job = IndepJob(sc)
    _produce(kafka, job, job.messages(with_comm=False))
    proc = Processor(kafka, tmp_path / "store", group=f"g-{kafka.prefix}i", flush_interval_s=0.3,
                     on_alert=lambda a: None, profiling=None)
    steps_topic = kafka.topic("steps")
    assigned, t_paused = proc._assigned, []

    def pause_steps(tps):
        assigned(tps)
        proc.consumer.pause(*[tp for tp in tps if tp.topic == steps_topic])
        t_paused.append(time.monotonic())

    def tick(p):                                        # test control: the steps are read 3 s later
        if t_paused and time.monotonic() - t_paused[0] > 3 and p.consumer.paused():
            p.consumer.resume(*p.consumer.paused())

    proc._assigned = pause_steps
    t = time.monotonic()
    th = threading.Thread(target=proc.run, kwargs=dict(idle_exit_s=0.5, on_tick=tick), daemon=True)
    th.start()
    th.join(120)
    assert not th.is_alive() and t_paused and time.monotonic() - t > 3
    from stepwatch.storage.views import connect
    assert connect(tmp_path / "store").execute("SELECT count(*) FROM steps WHERE job = ?",
                                               [sc.job]).fetchone()[0] == 8 * 40


def test_the_hang_proof_asks_the_end_offsets_after_the_poll_it_judges(kafka, tmp_path):
    """The read-to-end proof of a hang (``caught_up``) compares what was handled with the broker's end
    offsets; those are cached for 0.5 s. A goodbye produced just before the host sample being judged may
    be missing from an end offset asked before that sample's poll: replaying a GPU run's spool, a clean
    1-rank job got a job_hang at its end in one replay of two (its end and the next 30 s of host samples
    arrive within a second). The proof asks again once per poll: here a record lands in the job's
    in-flight partition after the cached answer, then a poll happens, and the job is no longer read to
    its end."""
    sc = IndepScenario("cg-fresh", [], ranks=4, per_node=4, steps=30, seed=9, checkpoint_every=None)
    job = IndepJob(sc)
    msgs = job.messages(with_comm=False)
    _produce(kafka, job, msgs)
    proc = Processor(kafka, tmp_path / "store", group=f"g-{kafka.prefix}f", flush_interval_s=3600,
                     on_alert=lambda a: None, profiling=None)
    proc.start()
    try:
        assert _poll_until(proc, lambda: proc.caught.all_caught_up() and sc.job in proc.jobs)
        rt = proc.jobs[sc.job]
        assert proc.caught.caught_up(rt)                           # read to the end; the answer cached
        _produce(kafka, job, [m for m in msgs if m.kind == "inflight"][:1] or
                 [next(m for m in msgs if m.kind == "steps")])       # a record more, not yet read
        for key, (t, end) in list(proc.caught._cache.items()):      # ... the cached answers still young
            proc.caught._cache[key] = (time.monotonic(), end)
        proc.caught.polled_at = time.monotonic() + 1e-6           # a poll (that did not bring it) since
        assert not proc.caught.caught_up(rt)
    finally:
        proc.close()

"""Job hangs when the topics are read at different rates (issue 25): the steps topic read 60 s behind the
others. The ranks' own watchdog reports prove a hang within the threshold and one report interval, whatever
the steps topic's lag; a rank whose steps are merely unread, or whose reported step did end, is no hang."""
from __future__ import annotations

import pytest

import numpy as np

from stepwatch.detectors.base import JobContext, StepBlock
from stepwatch.detectors.context import JobTelemetry
from stepwatch.detectors.stall import Stall
from stepwatch.devtools import scenarios_indep

pytestmark = [pytest.mark.unit, pytest.mark.slow]


NS = 1_000_000_000
LAG_S = 60


def _steps_lag(msgs, shuffle, seed=0):
    """Consumer order: the steps topic read LAG_S behind its producers, every other topic at once."""
    deliver = np.array([m.produce_ns + (LAG_S * NS if m.kind == "steps" else 0) for m in msgs], dtype=np.int64)
    return sorted(range(len(msgs)), key=lambda i: (deliver[i], msgs[i].produce_ns, i)), deliver


def _run(monkeypatch, tmp_path, name, faults, **kw):
    from stepwatch.devtools.eval import run_scenario
    from stepwatch.devtools.evalsuite import Scenario
    monkeypatch.setattr(scenarios_indep, "deliveries", _steps_lag)
    sc = Scenario(name, faults, ranks=32, steps=110, seed=3, checkpoint_every=None, **kw)
    return run_scenario(sc, tmp_path, shuffle=True)


def test_a_hang_is_raised_from_the_watchdogs_reports_while_the_steps_are_read_60s_behind(monkeypatch, tmp_path):
    res = _run(monkeypatch, tmp_path, "lag-hang", ["job-hang:rank=7,start=40"], inflight="python")
    t_fault = int(res["step_starts"][40])
    hangs = [e for e in res["emitted"] if e.alert.kind == "job_hang"]
    assert [e.alert.status for e in hangs] == ["firing"]        # once, and not resolved by old steps read late
    e = hangs[0]
    a = e.alert
    # seen on the consumer's clock within the threshold (30 s) and one watchdog interval (5 s)
    assert 30.0 <= (e.consumer_ns - t_fault) / NS <= 35.0, ((e.consumer_ns - t_fault) / NS, a.evidence)
    assert e.steps_ns < t_fault - 20 * NS                       # the steps were still read far behind
    assert (a.ranks, a.step_first, a.cause) == ([7], 40, "communication")
    assert a.evidence["judged"] == "watchdog" and a.evidence["steps_read_to_end"] is False
    assert a.evidence["inflight"]["culprits"][0]["what"] == "compute"


def test_ranks_whose_steps_are_read_60s_behind_are_no_hang(monkeypatch, tmp_path):
    # a clean job, and one with a 45 s evaluation step its watchdogs report (kind eval: not a hang)
    for name, kw in (("lag-clean", {}), ("lag-eval", dict(inflight="", long_steps={50: ("eval", 45_000.0)}))):
        res = _run(monkeypatch, tmp_path / name, name, [], **kw)
        assert [e.alert.kind for e in res["emitted"] if e.alert.kind in ("job_hang", "rank_stall", "node_stall")] \
            == [], name


R = 32


def _ctx(tel: JobTelemetry, last_step: int, host_s: float) -> JobContext:
    last = np.full(R, last_step, np.int64)
    ctx = JobContext(job="lag", world_size=R, nodes=np.array([f"n{r // 8}" for r in range(R)], dtype=object),
                     stage=np.zeros(R, np.int32), last_step=last, last_t_end=(last + 1) * NS,
                     max_step=last_step, steps_event_ns=(last_step + 1) * NS)
    tel.attach(ctx)
    ctx.host_event_ns = max(ctx.host_event_ns, int(host_s * NS))
    ctx.caught_up = lambda: False                          # the steps partition is never read to its end
    return ctx


def _reports(tel: JobTelemetry, ranks, t_s: float, step: int, since_s: float, state="collective", kind=None):
    import pyarrow as pa
    from stepwatch.wire.tables import INFLIGHT
    n = len(ranks)
    d = {"job": ["lag"] * n, "node": [f"n{r // 8}" for r in ranks], "rank": list(ranks), "t": [int(t_s * NS)] * n,
         "source": ["probe"] * n, "state": [state] * n, "step": [step] * n, "step_kind": [kind] * n,
         "elapsed_ms": [(t_s - since_s) * 1e3] * n, "since": [int(since_s * NS)] * n,
         "op": ["all_reduce"] * n, "group": ["world"] * n, "seq": [step + 1] * n, "group_size": [R] * n}
    tel.add("inflight", pa.Table.from_pydict({f.name: d.get(f.name, [None] * n) for f in INFLIGHT}, schema=INFLIGHT))


def _warm(det):
    steps = np.arange(0, 50, dtype=np.int64)
    a = np.full((len(steps), R), 100.0)
    det.update(JobContext(job="lag", world_size=R, nodes=np.array([f"n{r // 8}" for r in range(R)], dtype=object),
                          stage=np.zeros(R, np.int32)),
               StepBlock(steps, (steps + 1) * NS, step_ms=a, data_ms=a * 0.05, compute_ms=a * 0.7,
                         comm_ms=a * 0.1, comm_wait_ms=a * 0.1, gc_ms=a * 0.0))


def test_watchdog_judgement_needs_most_ranks_a_step_not_read_as_ended_and_resolves_on_a_newer_step():
    det = Stall()
    _warm(det)                                             # 100 ms steps: threshold 30 s
    tel = JobTelemetry()
    # steps read up to 99 (t = 100 s); the ranks say they are in step 300 since 1000 s, at 1031 s
    _reports(tel, range(4), 1031, 300, 1000)               # 4 of 32 ranks: not the job
    assert det.tick(_ctx(tel, 99, 1031), 0) == []
    _reports(tel, range(R), 1020, 300, 1000)               # all of them, but only 20 s yet
    assert det.tick(_ctx(tel, 99, 1031), 0) == []
    _reports(tel, range(R), 1031, 300, 1000)
    [a] = det.tick(_ctx(tel, 99, 1031), 0)
    assert (a.kind, a.status, a.step_first, a.evidence["judged"]) == ("job_hang", "firing", 300, "watchdog")
    assert det.tick(_ctx(tel, 299, 1040), 0) == []         # older steps read late: still hung
    [r] = det.tick(_ctx(tel, 300, 1041), 0)                # the step they were in ended: over
    assert (r.status, r.alert_id) == ("resolved", a.alert_id)
    # a report for a step whose end was read, or of an evaluation step, is no hang
    det2 = Stall()
    _warm(det2)
    tel2 = JobTelemetry()
    _reports(tel2, range(R), 1031, 300, 1000)
    assert det2.tick(_ctx(tel2, 300, 1031), 0) == []
    tel3 = JobTelemetry()
    _reports(tel3, range(R), 1031, 300, 1000, state="compute", kind="eval")
    assert det2.tick(_ctx(tel3, 99, 1031), 0) == []

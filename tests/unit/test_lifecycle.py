"""How a job ended (detectors/lifecycle.py), judged from its ranks' ends as in-flight rows: every outcome,
the culprit among several ends, the launcher's SIGTERM after a crash, an abort in teardown, a hung job
killed, and that no job_hang is raised once a rank ended."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from stepwatch.detectors.lifecycle import JobLife, Lifecycle
from stepwatch.detectors.stall import Stall
from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.wire.catalog import headers
from stepwatch.wire.encode import encode_arrow
from testkit import job_context

import pytest
pytestmark = pytest.mark.unit

S = 1_000_000_000
T0 = 1_800_000_000 * S


def _ctx(R=4, last=50):
    ctx = job_context(R, 2)
    ctx.last_step = np.full(R, last, np.int64)
    ctx.last_t_end = np.full(R, T0, np.int64)
    ctx.max_step, ctx.steps_event_ns = last, T0
    ctx.life = JobLife()
    return ctx


def _end(ctx, rank, dt_s, state="exited", **kw):
    row = {"job": "j", "node": ctx.node_of(rank), "rank": rank, "t": T0 + int(dt_s * S), "source":
           "agent" if state == "gone" else "probe", "state": state, **kw}
    ctx.life.add(conform(pa.Table.from_pylist([row]), wire.SCHEMAS["inflight"]))


def _judge(ctx, at_s):
    return Lifecycle().tick(ctx, T0 + int(at_s * S))


def test_every_rank_exits_0_is_a_finished_event_only_after_the_settle_time():
    ctx = _ctx()
    for r in range(4):
        _end(ctx, r, 0.1 * r, exit_code=0)
    assert _judge(ctx, 0.5) == []                       # the last steps may still be in the poll
    out = _judge(ctx, 2.0)
    assert [(a.kind, a.severity, a.status, a.evidence["outcome"]) for a in out] == \
        [("job_end", "info", "resolved", "finished")]
    assert _judge(ctx, 3.0) == []                       # judged once


def test_ranks_waiting_for_the_others_to_end_are_not_judged():
    ctx = _ctx()
    _end(ctx, 0, 0, exit_code=0)
    assert _judge(ctx, 60) == []                        # a clean exit of one rank: wait for the others


def test_a_scheduler_stop_is_an_event_and_a_peer_lost_exception_after_it_a_consequence():
    ctx = _ctx()
    for r in range(3):
        _end(ctx, r, 0.01 * r, signal=15)
    _end(ctx, 3, 0.2, exit_code=1, error="RuntimeError: Connection closed by peer [127.0.0.1]:29500")
    out = _judge(ctx, 3)
    assert [(a.kind, a.evidence["outcome"]) for a in out] == [("job_end", "stopped")]


def test_the_launchers_sigterm_after_a_rank_died_is_the_dead_ranks_crash():
    ctx = _ctx()
    for r in (0, 2, 3):                                 # torchrun: the others get SIGTERM at once ...
        _end(ctx, r, 0.0, signal=15)
    _end(ctx, 1, 0.6, state="gone", pid=4242)           # ... the agent sees rank 1 gone at its next tick
    out = _judge(ctx, 3)
    assert [a.kind for a in out] == ["rank_crash"]
    a = out[0]
    assert a.ranks == [1] and a.nodes == ["n0"] and a.severity == "critical" and a.cost_pct == 100.0
    assert a.evidence["end"]["how"] == "gone" and "ended without a word" in a.suggestion and "4242" in a.suggestion


def test_a_crash_with_the_others_still_running_is_raised_after_the_grace_time():
    ctx = _ctx()
    tb = ('Traceback (most recent call last):\n  File "/srv/train.py", line 88, in step\n    loss = model(x)\n'
          'ValueError: NaN in batch 7\n')
    _end(ctx, 2, 0.0, exit_code=1, error="ValueError: NaN in batch 7", stack=tb)
    assert _judge(ctx, 1.0) == []
    out = _judge(ctx, 2.5)
    assert [a.kind for a in out] == ["rank_crash"] and out[0].ranks == [2]
    ev = out[0].evidence
    assert ev["running"] == [0, 1, 3] and ev["at"] == "/srv/train.py:88 in step" and ev["end"]["exit_code"] == 1
    assert "NaN in batch 7" in out[0].suggestion


def test_the_culprit_is_the_rank_that_died_not_the_peers_that_lost_it():
    ctx = _ctx()
    _end(ctx, 0, 0.0, exit_code=1, error="RuntimeError: [gloo] Connection closed by peer")
    _end(ctx, 3, 0.05, exit_code=1, error="RuntimeError: NCCL communicator was aborted")
    _end(ctx, 2, 0.4, state="gone")                     # the process that really died, seen later
    _end(ctx, 1, 0.1, exit_code=1, error="RuntimeError: Connection reset by peer")
    out = _judge(ctx, 3)
    assert [a.kind for a in out] == ["rank_crash"] and out[0].ranks == [2]


def test_an_abort_in_teardown_after_a_clean_exit_is_one_warning_and_the_end():
    ctx = _ctx(R=2)
    _end(ctx, 0, 0.0, exit_code=0)
    _end(ctx, 1, 0.0, exit_code=0)
    _end(ctx, 1, 0.1, signal=6)                         # terminate called without an active exception
    out = _judge(ctx, 3)
    assert [(a.kind, a.severity) for a in out] == [("exit_failed", "warning"), ("job_end", "info")]
    assert out[0].ranks == [1] and "SIGABRT" in out[0].suggestion and out[1].evidence["outcome"] == "exit_failed"


def test_an_abort_at_the_last_step_while_the_others_exit_0_is_not_a_crash():
    ctx = _ctx(R=2)
    _end(ctx, 1, 0.0, signal=6)                         # aborted in destroy_process_group, before atexit
    _end(ctx, 0, 0.2, exit_code=0)
    out = _judge(ctx, 3)
    assert [a.kind for a in out] == ["exit_failed", "job_end"]


def test_a_hung_job_that_is_killed_ends_with_an_event_not_a_crash():
    ctx = _ctx()
    ctx.life.hung_ns = T0 - 10 * S                      # its job_hang fired before
    for r in range(4):
        _end(ctx, r, 0.01 * r, state="gone")
    out = _judge(ctx, 3)
    assert [(a.kind, a.evidence["outcome"]) for a in out] == [("job_end", "ended_while_hung")]


def test_no_job_hang_once_a_rank_has_ended():
    st = Stall(hang_s=1.0)
    ctx = _ctx()
    ctx.host_event_ns = T0 + 60 * S                     # a minute of host time without a step
    assert [a.kind for a in st.tick(ctx, ctx.host_event_ns)] == ["job_hang"]
    st2 = Stall(hang_s=1.0)
    _end(ctx, 0, 0.0, exit_code=0)
    assert st2.tick(ctx, ctx.host_event_ns) == []


def test_steps_after_the_judged_end_are_a_restart():
    ctx = _ctx()
    for r in range(4):
        _end(ctx, r, 0, exit_code=0)
    _judge(ctx, 2)
    assert ctx.life.outcome == "finished"
    assert not ctx.life.restarted(T0 + 1 * S) and ctx.life.restarted(T0 + 30 * S)


def test_a_goodbye_read_after_the_agent_saw_the_rank_go_says_how_it_ended():
    ctx = _ctx(R=2)
    _end(ctx, 1, 0.0, state="gone")                     # os._exit: no word
    _end(ctx, 0, 0.0, state="gone")                     # seen exiting (a zombie) in the same tick ...
    _end(ctx, 0, 0.3, exit_code=1, error="RuntimeError: [gloo] Connection closed by peer")   # ... then its word
    out = _judge(ctx, 3)
    assert [a.kind for a in out] == ["rank_crash"] and out[0].ranks == [1], out[0].evidence
    assert out[0].evidence["ends"]["0"]["how"] == "error"


def _processor(tmp_path, job: str):
    """A real processor fed as its consumer loop feeds it: (processor, send(kind, table), alerts seen)."""
    from stepwatch.devtools.eval import Record
    from stepwatch.kafkaio import KafkaSettings
    from stepwatch.stream.processor import Processor
    seen = []
    p = Processor(KafkaSettings(), tmp_path, on_alert=seen.append)
    off = iter(range(10**6))

    def send(kind, t):
        p.process_message(Record(p.kafka.topic(kind), 0, next(off), job.encode(), encode_arrow(t), headers(kind)))
    return p, send, seen


def test_a_restart_from_a_checkpoint_reruns_its_steps_and_every_row_is_aligned_and_judged(tmp_path):
    """A job that finished (every rank said goodbye) starts again under the same id from its checkpoint at
    step 60: it runs steps 60-179 again, newer in time. Those rows are the new attempt's, not duplicates of
    the old ones: every one is kept and aligned (before: steps 60-119 were dropped as duplicates of the
    first attempt, lost to the store and the detectors), and the new attempt's straggler is named."""
    from stepwatch.devtools.simulate import Simulation

    t0 = 1_767_225_600 * S                          # 2026-01-01 (rows from the future are refused)
    first = Simulation(job="rs", ranks=8, ranks_per_node=4, steps=120, step_ms=100.0, seed=5, t0_ns=t0)
    p, send, seen = _processor(tmp_path, "rs")

    send("topology", first.topology())
    for a in range(0, 120, 10):
        send("steps", first.generate(a, a + 10)["steps"])
    end = p.jobs["rs"].state.max_t_end + S // 10
    bye = [{"job": "rs", "node": f"node-{r // 4:04d}", "rank": r, "t": end + r * 1_000_000, "source": "probe",
            "state": "exited", "exit_code": 0} for r in range(8)]
    send("inflight", conform(pa.Table.from_pylist(bye), wire.SCHEMAS["inflight"]))
    tick = [{"job": "rs", "node": "node-0000", "rank": 0, "t": end + 5 * S, "source": "agent", "state": "gone"}]
    send("inflight", conform(pa.Table.from_pylist(tick), wire.SCHEMAS["inflight"]))
    assert [a.evidence.get("outcome") for a in p.events] == ["finished"]
    dup0 = p.metrics.value(p.metrics.dropped, "duplicate")
    # the restart, 60 s after the end, from the checkpoint at step 60; rank 5 is 40% slower from step 140
    again = Simulation(job="rs", ranks=8, ranks_per_node=4, steps=180, step_ms=100.0, seed=6,
                       t0_ns=end + 60 * S - 60 * 100 * 1_000_000, faults=["slow-rank:rank=5,start=140,pct=40"])
    send("topology", again.topology())
    for a in range(60, 180, 10):
        send("steps", again.generate(a, a + 10)["steps"])
    assert p.metrics.value(p.metrics.dropped, "duplicate") == dup0
    rt = p.jobs["rs"]
    assert rt.state.max_step == 179
    named = [a for a in seen if a.kind == "slow_rank" and a.status == "firing"]
    assert named and named[0].ranks == [5] and named[0].step_first >= 140, [a.line() for a in seen]


def _announce_run(tmp_path, announce: bool):
    """A steady 8-rank job whose step time grows by 50% at step 150 (its batch doubled), then by 15%
    more at step 290 (a real regression); ``announce``: its ranks marked the change at step 150
    (``probe.mark_change("batch_size")``: the phase ``change:batch_size`` in that step's ``phases``)."""
    from stepwatch.devtools.simulate import Simulation

    sim = Simulation(job="bs", ranks=8, ranks_per_node=4, steps=360, step_ms=100.0, seed=9,
                     t0_ns=1_767_225_600 * S, faults=["regression:start=150,pct=50,cause=computation",
                                                      "regression:start=290,pct=15,cause=computation"])
    p, send, seen = _processor(tmp_path, "bs")

    send("topology", sim.topology())
    for a in range(0, 360, 10):
        t = sim.generate(a, a + 10)["steps"]
        if announce and a == 150:
            steps = t.column("step").to_pylist()
            ph = pa.array([[("change:batch_size", 3.0)] if s == 150 else None for s in steps],
                          type=t.schema.field("phases").type)
            t = t.set_column(t.schema.get_field_index("phases"), "phases", ph)
        send("steps", t)
    return [a for a in seen if a.status == "firing" and a.kind in ("regression", "mfu_regression", "jitter")]


def test_an_announced_change_is_a_new_baseline_not_a_regression(tmp_path):
    """Without the announcement the batch change is a regression (right: nothing said it was meant); with
    it, no alert for it, and the real regression 140 steps later is still found against the new level."""
    plain = _announce_run(tmp_path / "plain", announce=False)
    assert any(abs(a.step_first - 150) <= 3 for a in plain), [a.line() for a in plain]
    said = _announce_run(tmp_path / "said", announce=True)
    assert not any(abs(a.step_first - 150) <= 10 for a in said), [a.line() for a in said]
    assert any(a.kind == "regression" and abs(a.step_first - 290) <= 3 for a in said), [a.line() for a in said]

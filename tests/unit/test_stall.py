"""Stall / hang: ranks and nodes missing from closed steps, job hangs judged on host event time, and
the same through the real processor (alignment closes steps on event time only)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from stepwatch.detectors.base import JobContext, StepBlock
from stepwatch.detectors.stall import Stall
from testkit import job_context

import pytest
pytestmark = pytest.mark.unit

R = 32
NS = 1_000_000_000


def ctx_(**kw) -> JobContext:
    return job_context(R, 8, job="st", **kw)


def block(steps, missing=()):
    """Steps with every rank reporting 100 ms, except (rank, from_step) pairs in ``missing``."""
    steps = np.asarray(steps, dtype=np.int64)
    a = np.full((len(steps), R), 100.0)
    for r, s0 in missing:
        a[steps >= s0, r] = np.nan
    f = dict(step_ms=a, data_ms=a * 0.05, compute_ms=a * 0.7, comm_ms=a * 0.1, comm_wait_ms=a * 0.1,
             gc_ms=a * 0.0)
    return StepBlock(steps, (steps + 1) * NS, **f)


def run(det, ctx, S, missing=(), size=5):
    out = []
    for i in range(0, S, size):
        out += det.update(ctx, block(np.arange(i, min(S, i + size)), missing))
    return out


def test_rank_missing_from_k_closed_steps_fires_once_and_resolves_when_back():
    det, ctx = Stall(), ctx_()
    alerts = run(det, ctx, 40, missing=[(13, 20)])
    assert [(a.kind, a.status, a.ranks, a.nodes, a.step_first, a.step_detected) for a in alerts] == \
        [("rank_stall", "firing", [13], ["n1"], 20, 22)]
    a = alerts[0]
    assert a.evidence["stopped_first"] == [13] and a.cause == "unknown" and a.suggestion
    back = det.update(ctx, block(np.arange(40, 42)))
    assert [(b.status, b.alert_id) for b in back] == [("resolved", a.alert_id)]


def test_a_whole_node_is_one_node_stall_naming_the_first_rank():
    det, ctx = Stall(), ctx_()
    missing = [(r, 30) for r in range(8, 16)] + [(11, 28)]   # rank 11 went first
    alerts = run(det, ctx, 50, missing=missing, size=1)
    fired = [a for a in alerts if a.status == "firing"]
    assert [(a.kind, a.ranks) for a in fired] == [("node_stall", list(range(8, 16)))]
    assert fired[0].evidence["stopped_first"] == [11] and fired[0].step_first == 28


def test_never_reporting_ranks_and_late_short_gaps_are_not_stalls():
    det, ctx = Stall(), ctx_()
    b = block(np.arange(0, 30), missing=[(5, 0)])              # rank 5 never reported
    b.step_ms[10:12, 7] = np.nan                                # two missing steps: below k=3
    assert det.update(ctx, b) == []
    # steps nobody reported (a gap in the numbering) do not count
    assert det.update(ctx, block(np.arange(30, 35), missing=[(r, 30) for r in range(R)])) == []


def test_job_hang_on_host_event_time_names_the_rank_that_stopped_first():
    det = Stall()
    det.update(ctx_(), block(np.arange(0, 50)))                 # typical step: 100 ms -> threshold 30 s
    last = np.full(R, 51, dtype=np.int64)
    last[9] = 49                                                # rank 9 stopped two steps earlier
    lt = (last + 1) * NS
    base = dict(last_step=last, last_t_end=lt, max_step=51, steps_event_ns=52 * NS)
    assert det.tick(ctx_(host_event_ns=52 * NS, **base), 0) == []          # step 51 just arrived
    assert det.tick(ctx_(host_event_ns=52 * NS + 29 * NS, **base), 0) == []
    assert det.tick(ctx_(host_event_ns=52 * NS + 31 * NS, backlog=True, **base), 0) == []   # steps in flight
    [a] = det.tick(ctx_(host_event_ns=52 * NS + 31 * NS, **base), 0)
    assert (a.kind, a.status, a.ranks, a.nodes, a.step_first, a.cause) == \
        ("job_hang", "firing", [9], ["n1"], 50, "communication")
    assert a.evidence["stopped_first_last_step"] == 49 and a.evidence["others_last_step"] == 51
    assert det.tick(ctx_(host_event_ns=52 * NS + 60 * NS, **base), 0) == []                 # once
    moved = dict(base, max_step=52, steps_event_ns=53 * NS)
    [r] = det.tick(ctx_(host_event_ns=53 * NS, **moved), 0)
    assert (r.status, r.alert_id) == ("resolved", a.alert_id)
    # all ranks stopped at the same step: a job hang naming nobody
    det2 = Stall()
    same = dict(last_step=np.full(R, 51), last_t_end=np.full(R, 52 * NS), max_step=51, steps_event_ns=52 * NS)
    det2.tick(ctx_(host_event_ns=52 * NS, **same), 0)
    [a2] = det2.tick(ctx_(host_event_ns=90 * NS, **same), 0)
    assert a2.ranks == [] and a2.step_first == 52 and a2.evidence["all_stopped_at_step"] == 51


def test_clocks_ahead_per_node_and_a_steps_partition_read_behind_are_not_a_hang():
    """One watermark per source: node n3's clock runs 45 s ahead (its host samples and its ranks' step
    ends), and a host-only node 'cpu-x' is 60 s ahead; neither is a hang, because each node's host
    samples are compared with its own ranks' steps. When the steps stop, it is a hang once every node
    is silent past the threshold, and only when the steps partition is known to be read to its end."""
    det = Stall()
    det.update(ctx_(), block(np.arange(0, 50)))                 # 100 ms steps -> threshold 30 s
    skew = np.where(np.arange(R) >= 24, 45 * NS, 0)             # ranks 24..31 live on n3

    def state(top, host_t):
        lt = (top + 1) * NS + skew
        hn = {f"n{i}": host_t + (45 * NS if i == 3 else 0) for i in range(4)}
        hn["cpu-x"] = host_t + 60 * NS
        return dict(last_step=np.full(R, top), last_t_end=lt, max_step=top, steps_event_ns=int(lt.max()),
                    host_event_ns=max(hn.values()), host_node_ns=hn)

    for top in range(50, 90):
        assert det.tick(ctx_(**state(top, (top + 1) * NS)), 0) == []
    # the steps stop at 89; host samples go on
    assert det.tick(ctx_(**state(89, (90 + 29) * NS)), 0) == []
    read_behind = state(89, (90 + 31) * NS)
    assert det.tick(ctx_(caught_up=lambda: False, **read_behind), 0) == []   # steps may still be in flight
    [a] = det.tick(ctx_(caught_up=lambda: True, **read_behind), 0)
    assert a.kind == "job_hang" and a.evidence["judged"] == "per_node" and a.evidence["nodes_judged"] == 4
    assert 31.0 <= a.evidence["silent_s"] < 32.0 and a.evidence["steps_read_to_end"] is True


def test_a_quorum_of_silent_nodes_is_a_hang_while_one_nodes_host_batch_is_on_the_way_and_a_stepping_node_is_not():
    """Host samples come in batches per node (an agent ships every second; the independent producer batches five
    one-second samples): a node whose batch is on the way shows an older silence, not a step. The hang waited for
    the last node's batch: 35.09 s for a 30 s threshold on that producer."""
    det = Stall()
    det.update(ctx_(), block(np.arange(0, 50)))                 # 100 ms steps -> threshold 30 s
    lt = np.full(R, 50 * NS)                                    # every rank's last step ended at 50 s

    def tick(silence_s, lt=lt):                                 # n0..n3's newest host samples, s after that
        hn = {f"n{i}": 50 * NS + int(x * NS) for i, x in enumerate(silence_s)}
        return det.tick(ctx_(last_step=np.full(R, 49), last_t_end=lt, max_step=49, steps_event_ns=int(lt.max()),
                             host_event_ns=max(hn.values()), host_node_ns=hn, caught_up=lambda: True), 0)
    assert tick([29.5, 29.0, 26.0, 27.5]) == []                 # no node past the threshold
    assert tick([31.0, 29.0, 26.0, 27.5]) == []                 # one of four
    # two of four past it, the others' batches on the way (silent 26-29 s, more than half the threshold)
    [a] = tick([31.0, 30.5, 26.0, 27.5])
    assert a.kind == "job_hang" and 30.5 <= a.evidence["silent_s"] < 31.0
    assert a.evidence["least_silent_s"] == 26.0
    # a node whose ranks stepped a moment ago (by its own clock): no hang, however many are silent
    det = Stall()
    det.update(ctx_(), block(np.arange(0, 50)))
    stepped = np.where(np.arange(R) >= 24, 89_800_000_000, lt)  # n3's ranks (24..31) ended a step at 89.8 s
    assert tick([40.0, 40.0, 40.0, 40.0], stepped) == []


def test_host_samples_read_far_ahead_of_batched_steps_are_not_a_hang():
    """The issue's false hangs: five steps per message, host samples read minutes ahead of the steps;
    the event-time silence is there, the proof that the steps partition was read to its end is not."""
    det = Stall()
    det.update(ctx_(), block(np.arange(0, 50)))
    fired = []
    for top in range(54, 400, 5):                               # a batch of 5 steps at a time
        st = dict(last_step=np.full(R, top), last_t_end=np.full(R, (top + 1) * NS), max_step=top,
                  steps_event_ns=(top + 1) * NS)
        host = (top + 1 + 120) * NS                             # host topic read 2 minutes ahead
        hn = {f"n{i}": host for i in range(4)}
        # the steps of the next 2 minutes are produced and not yet read: not caught up
        fired += det.tick(ctx_(host_event_ns=host, host_node_ns=hn, caught_up=lambda: False, **st), 0)
    assert fired == []


def _run(name, faults, order="steps-first", steps=80, ranks=64):
    from stepwatch.devtools.eval import run_scenario
    from stepwatch.devtools.evalsuite import Scenario
    sc = Scenario(name, faults, ranks=ranks, steps=steps, seed=3)
    with tempfile.TemporaryDirectory() as d:
        return run_scenario(sc, Path(d), host_first=(order == "host-first"))


def test_through_the_processor_rank_hang_and_job_hang_and_arrival_order():
    # a rank stops while the others go on: its steps close on the lateness bound of event time (10 s)
    res = _run("t-rank-hang", ["rank-hang:rank=20,start=40"])
    fired = [e for e in res["emitted"] if e.alert.status == "firing"]
    assert [(e.alert.kind, e.alert.ranks, e.alert.step_first) for e in fired] == [("rank_stall", [20], 40)]
    assert 10 <= fired[0].newest_step - 40 <= 15                  # lateness + k steps of event time
    # every rank stops (rank 7 first) while host samples go on: a job hang naming rank 7
    res = _run("t-job-hang", ["job-hang:rank=7,start=30"], steps=80)
    fired = [e.alert for e in res["emitted"] if e.alert.status == "firing"]
    assert [(a.kind, a.ranks, a.step_first) for a in fired] == [("job_hang", [7], 30)]
    # host samples of each step arriving before its step rows change nothing
    res2 = _run("t-job-hang", ["job-hang:rank=7,start=30"], order="host-first", steps=80)
    assert [e.alert.row() for e in res2["emitted"]] == [e.alert.row() for e in res["emitted"]]


def test_a_restarted_processor_warms_the_host_context_and_still_judges_the_hang(tmp_path):
    """After a restart the job's host/GC windows come back from the store with the steps, so the hang
    of a job whose steps stopped before the restart is still found when the next host sample comes."""
    from stepwatch.wire.catalog import headers
    from stepwatch.wire.encode import encode_arrow
    from stepwatch.devtools.simulate import Simulation
    from stepwatch.devtools.eval import Record
    from stepwatch.storage.store import LakeStore
    from stepwatch.kafkaio import KafkaSettings
    from stepwatch.stream.processor import Processor

    sim = Simulation(job="rh", ranks=64, steps=90, seed=2, faults=["job-hang:rank=3,start=40"],
                     t0_ns=1_767_225_600_000_000_000)
    g = sim.generate(0, 70)                       # steps stop at 41; host samples go on to step 69
    st = LakeStore(tmp_path).init()
    st.write_flush({"topology": [sim.topology()], "steps": [g["steps"]], "host": [g["host"]],
                    "gc": [g["gc"]]}, {})
    seen = []
    p = Processor(KafkaSettings(), tmp_path, on_alert=seen.append)
    rt = p._job("rh")
    assert len(rt.telemetry.host) > 0 and rt.state.max_step == 41 and seen == []
    # each node's host samples are compared with its own ranks' newest step (one clock per node): the
    # restarted processor needs no history of the host lead, and reports the hang with the first host
    # sample past the threshold (30 s of silence)
    for i, s in enumerate((71, 80, 90, 101)):
        more = sim.generate(s, s + 1)["host"]
        p.process_message(Record(p.kafka.topic("host"), 0, i, b"rh", encode_arrow(more), headers("host")))
        assert len(seen) == 1, s
    assert [(a.kind, a.ranks, a.step_first) for a in seen] == [("job_hang", [3], 40)]
    assert seen[0].evidence["silent_s"] >= 30.0 and seen[0].evidence["judged"] == "per_node"

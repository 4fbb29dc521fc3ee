"""Jitter: slow-step ratio against a spike-proof baseline, checkpoint cadence, what coincided."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.detectors.base import JobContext
from stepwatch.detectors.context import JobTelemetry
from stepwatch.detectors.jitter import Jitter
from testkit import alerts_of, job_context, step_blocks

import pytest
pytestmark = pytest.mark.unit

R = 64
STEP_NS = 1_000_000_000


def ctx_() -> JobContext:
    return job_context(R, 8, job="jit")


def job(S, seed=0, gc_pause=None, slow_rank=None, ckpt_every=0, stall=None, shift=None, gc_in_gap=False):
    """Synchronous steps (ms): compute 80 +-1%, data 5, gap 3, comm 10; extras:
    gc_pause=(start, prob, ms) one random rank pauses; slow_rank=(rank, start, every, factor);
    ckpt_every: all ranks +40 ms host gap on steps k*every; stall=(start, prob, ms) all ranks wait for
    data; shift=(start, factor) a level shift of compute; gc_in_gap: the pause is not reported in gc_ms."""
    rng = np.random.default_rng(seed)
    compute = 80.0 * (1 + 0.01 * rng.standard_normal((S, R)))
    data = np.full((S, R), 5.0)
    gap = np.full((S, R), 3.0)
    gc = np.zeros((S, R))
    steps = np.arange(S)
    gate = np.full(S, -1)
    if gc_pause:
        a, p, ms = gc_pause
        for s in range(a, S):
            if rng.random() < p:
                r = int(rng.integers(R))
                gate[s] = r
                (gap if gc_in_gap else gc)[s, r] += ms
    if slow_rank:
        r, a, every, f = slow_rank
        compute[a::every, r] *= f
    if ckpt_every:
        gap[(steps > 0) & (steps % ckpt_every == 0)] += 40.0
    if stall:
        a, p, ms = stall
        hit = (steps >= a) & (rng.random(S) < p)
        data[hit] += ms
    if shift:
        a, f = shift
        compute[a:] *= f
    comm = np.full((S, R), 10.0)
    own = data + compute + gap + gc
    step = np.repeat(np.max(own + comm, axis=1, keepdims=True), R, axis=1)
    return dict(step_ms=step, data_ms=data, compute_ms=compute, comm_ms=comm, comm_wait_ms=step - own - comm,
                gc_ms=gc), gate


def feed(det, arr, size=10, ctx=None):
    return alerts_of(det, ctx or ctx_(), step_blocks(arr, size, STEP_NS))


def firing(alerts):
    return [a for a in alerts if a.status == "firing"]


def test_clean_job_and_level_shift_and_sparse_spikes_are_quiet():
    arr, _ = job(300, seed=1)
    assert feed(Jitter(), arr) == []
    arr, _ = job(300, seed=2, shift=(150, 1.2))         # a regression is the change point's, not jitter
    assert feed(Jitter(), arr) == []
    arr, _ = job(300, seed=3, gc_pause=(0, 0.04, 30.0))  # 4% of steps: under the 4-in-20 rule
    assert feed(Jitter(), arr) == []


def test_unsynchronised_gc_pauses_fire_with_cause_gc_and_no_rank():
    arr, _ = job(200, seed=4, gc_pause=(60, 0.35, 25.0))
    fired = firing(feed(Jitter(), arr))
    assert len(fired) == 1
    a = fired[0]
    assert a.kind == "jitter" and a.cause == "gc" and a.ranks == []
    assert 60 <= a.step_first <= a.step_detected <= 100
    ev = a.evidence
    assert ev["coincided"]["GC pause"] >= 0.9 and ev["ratio_window"] >= 0.2 and ev["job_wide_share"] == 0.0
    assert a.cost_pct > 0 and "gc.freeze" in a.suggestion


def test_intermittent_straggler_is_named_with_its_phase():
    arr, _ = job(150, seed=5, slow_rank=(22, 40, 3, 1.3))
    fired = firing(feed(Jitter(), arr))
    assert [(a.ranks, a.nodes, a.cause) for a in fired] == [([22], ["n2"], "computation")]
    assert fired[0].evidence["gating_rank"]["share"] >= 0.9 and 40 <= fired[0].step_first <= 43


def test_job_wide_data_stalls_fire_with_cause_io_and_resolve():
    arr, _ = job(260, seed=6, stall=(50, 0.3, 30.0))
    arr2, _ = job(260, seed=6)
    for k in arr:                                        # stalls only on steps 50..149
        arr[k][150:] = arr2[k][150:]
    alerts = feed(Jitter(), arr)
    assert [(a.status, a.cause) for a in alerts] == [("firing", "io"), ("resolved", "io")]
    assert alerts[0].evidence["job_wide_share"] == 1.0 and "checkpoint_every" not in alerts[0].evidence
    assert 150 <= alerts[1].step_detected <= 200


def test_regular_checkpoints_are_cadence_not_jitter_unless_configured():
    arr, _ = job(200, seed=7, ckpt_every=5)              # 20% of the steps are checkpoint spikes
    det = Jitter()
    assert feed(det, arr) == []
    assert det._cad == (5, 0)
    fired = firing(feed(Jitter(alarm_checkpoints=True), arr))
    assert len(fired) == 1 and fired[0].evidence["checkpoint_every"] == 5 and fired[0].cause == "cpu"
    # a real problem on top of checkpoints still fires, and reports the cadence
    arr, _ = job(200, seed=8, ckpt_every=10, gc_pause=(80, 0.4, 30.0))
    fired = firing(feed(Jitter(), arr))
    assert len(fired) == 1 and fired[0].cause == "gc" and fired[0].evidence["checkpoint_every"] == 10
    assert not set(fired[0].evidence["slow_steps"]) & set(range(0, 200, 10))


def test_gc_records_name_gc_when_the_steps_do_not_report_gc_ms():
    """A producer that sends GC records but puts the pause in no phase: the gap grows (cpu), the
    records show the gating rank collecting inside the slow steps."""
    arr, gate = job(160, seed=9, gc_pause=(40, 0.4, 30.0), gc_in_gap=True)
    assert firing(feed(Jitter(), arr))[0].cause == "cpu"            # phases alone
    tel = JobTelemetry()
    s = np.flatnonzero(gate >= 0)
    rows = {"job": ["jit"] * len(s), "node": [f"n{g // 8}" for g in gate[s]], "rank": gate[s].astype(np.int32),
            "t": pa.array(((s + 1) * STEP_NS - 50_000_000).astype(np.int64)).cast(wire.TS),  # in the step
            "generation": np.full(len(s), 2, np.int32), "duration_ms": np.full(len(s), 30.0)}
    tel.add("gc", conform(pa.table(rows), wire.GC))
    ctx = ctx_()
    tel.attach(ctx)
    a = firing(feed(Jitter(), arr, ctx=ctx))[0]
    assert a.cause == "gc" and a.evidence["gc_records"]["slow_steps_gated_by_gc"] >= 0.9
    assert "GC records" in a.evidence["cause_reason"]


def test_block_sizes_give_the_same_alerts():
    arr, _ = job(220, seed=10, gc_pause=(60, 0.35, 25.0), ckpt_every=25)
    rows = [[a.row() for a in feed(Jitter(), arr, size=n)] for n in (1, 7, 220)]
    assert rows[0] == rows[1] == rows[2] and rows[0]


def test_the_warm_up_steps_are_neither_judged_nor_a_baseline():
    """A job's first steps (allocator growth, autotuning, compilation, DDP's bucket rebuild) jitter by
    nature: slow steps among the first 20 make no alert, the same slow steps after them do."""
    for start, fires in ((0, False), (25, True)):
        arr, _ = job(120, seed=7)
        slow = np.arange(start + 1, start + 20, 3)           # 7 slow steps in 20, +30%
        arr["step_ms"][slow] *= 1.3
        arr["compute_ms"][slow] += 0.3 * arr["step_ms"][slow] / 1.3
        fired = firing(feed(Jitter(), arr, size=7))
        assert bool(fired) is fires, (start, [(a.step_first, a.step_detected) for a in fired])
    arr, _ = job(120, seed=7)
    arr["step_ms"][np.arange(1, 20, 3)] *= 1.3
    assert firing(feed(Jitter(warmup=0), arr, size=7))    # without the warm-up: an alert on the job's start

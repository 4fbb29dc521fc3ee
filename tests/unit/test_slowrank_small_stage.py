"""A small stage (4 ranks, judged pairwise: each rank against the median of the others and against its own
learned offset, with a 20 % allowance for a permanent asymmetry): a rank far beyond the allowance from its
first step is named even when its own steps are noisy, and a permanent asymmetry inside the allowance is
not. The noisy case is the real GC-pressure run of tests/test_distributed.py (one gloo rank collecting a
large heap every step): its pauses vary by a few ms per step, and one full-suite run had rank 1 38 %
slower than its peers for 80 steps with no alert, because no single step was z_min of its own noise
above the allowance."""
from __future__ import annotations

import numpy as np

from stepwatch.detectors.base import StepBlock
from stepwatch.detectors.slowrank import SlowRank
from testkit import job_context

import pytest
pytestmark = pytest.mark.unit

R, STEP = 4, 50.0


def _run(extra_gc, extra_compute, steps=120, seed=0):
    """Synchronous steps: every rank waits for the slowest; ``extra_*``: (steps,) ms added to rank 1."""
    rng = np.random.default_rng(seed)
    compute = STEP + rng.normal(0, 0.4, (steps, R))
    gc = np.zeros((steps, R))
    compute[:, 1] += extra_compute
    gc[:, 1] += extra_gc
    busy = compute + gc
    step = busy.max(axis=1, keepdims=True) + 0.3
    wait = step - busy
    arr = dict(step_ms=np.repeat(step, R, axis=1), data_ms=np.full((steps, R), 0.2), compute_ms=compute,
               comm_ms=wait + 0.3, comm_wait_ms=wait, gc_ms=gc)
    t_end = (np.arange(steps, dtype=np.int64) + 1) * 50_000_000
    ctx = job_context(R, per_node=R, job="small", node="node-a")
    det, out = SlowRank(), []
    for i in range(0, steps, 4):
        st = np.arange(i, min(steps, i + 4))
        out += det.update(ctx, StepBlock(st, t_end[st], **{c: v[st] for c, v in arr.items()}))
    return [a for a in out if a.status == "firing"]


def test_a_noisy_gc_straggler_beyond_the_allowance_from_the_first_step_is_named():
    rng = np.random.default_rng(3)
    for pause in (15.0, 19.0):                 # 30 % and 38 % of the peers' busy time, +-4 ms per step
        gc = pause + rng.uniform(-6.0, 6.0, 120) + rng.exponential(2.0, 120)
        fired = _run(gc, 0.0)
        assert [a.ranks for a in fired] == [[1]], (pause, [(a.ranks, a.step_detected) for a in fired])
        assert fired[0].cause == "gc" and fired[0].step_detected <= 40, (pause, fired[0].cause, fired[0].step_detected)


def test_a_permanent_asymmetry_inside_the_allowance_is_not_named():
    rng = np.random.default_rng(4)
    for extra in (5.0, 7.5):                   # 10 % and 15 % slower from the first step, quiet or noisy
        for noise in (0.3, 3.0):
            fired = _run(np.zeros(120), extra + rng.normal(0, noise, 120), seed=int(extra * 10 + noise))
            assert fired == [], (extra, noise, [(a.ranks, a.step_detected) for a in fired])


def _pair(extra, steps=160, seed=0):
    """A 2-rank job (one stage, judged pairwise); ``extra``: (steps, 2) ms added to each rank's compute."""
    rng = np.random.default_rng(seed)
    busy = 20.0 + rng.normal(0, 0.3, (steps, 2)) + extra
    step = busy.max(axis=1, keepdims=True) + 150.0             # most of the step outside the busy time
    wait = step - busy
    arr = dict(step_ms=np.repeat(step, 2, axis=1), data_ms=np.full((steps, 2), 0.2), compute_ms=busy,
               comm_ms=wait + 0.1, comm_wait_ms=wait, gc_ms=np.zeros((steps, 2)))
    t_end = (np.arange(steps, dtype=np.int64) + 1) * 170_000_000
    ctx = job_context(2, per_node=2, job="pair", node="gpu0")
    det, out = SlowRank(), []
    for i in range(steps):
        out += det.update(ctx, StepBlock(np.array([i]), t_end[[i]], **{c: v[[i]] for c, v in arr.items()}))
    return [a for a in out if a.status == "firing"]


def test_a_pair_that_takes_turns_being_slow_names_neither_rank():
    """The real 2-rank FSDP2 job sharing one H200 (eval.md, GPU table): from step ~160 each rank's busy
    time was ~12 ms above its pair's on one step in three, the other rank's on another, and slow_rank
    named rank 0, then rank 1, then both, at 2.4-3 % of the step. Contention within the pair, no
    straggler."""
    extra = np.zeros((160, 2))
    turn = np.arange(160) % 3
    extra[60:, 0] += np.where(turn[60:] == 0, 12.0, 0.0)
    extra[60:, 1] += np.where(turn[60:] == 1, 12.0, 0.0)
    for seed in range(3):
        fired = _pair(extra, seed=seed)
        assert fired == [], (seed, [(a.ranks, a.step_detected, a.cost_pct) for a in fired])


def test_a_pair_with_one_intermittent_straggler_names_it():
    """The same excess on one rank only (slow on one step in three): that rank is the straggler."""
    extra = np.zeros((160, 2))
    extra[60:, 1] += np.where(np.arange(60, 160) % 3 == 0, 12.0, 0.0)
    for seed in range(3):
        fired = _pair(extra, seed=seed)
        assert [a.ranks for a in fired] == [[1]], (seed, [(a.ranks, a.step_detected) for a in fired])
        assert fired[0].step_detected <= 60 + 20, fired[0].step_detected


def test_a_fault_after_a_lead_in_where_the_machine_slowed_the_peer_is_named_in_time():
    """realrun's CPU hog on rank 1's core (2026-11-28, a noisy VM): the lead-in had rank 0 slower by
    4-8 % for 8 steps (the machine), then the hog made rank 1 18 % slower. The turns test counted those 8
    steps against rank 1 and named it only 14-25 steps after the hog took the core. Turns are alike both
    ways; an excess more than twice the peer's is a fault of its own."""
    extra = np.zeros((160, 2))
    extra[63:71, 0] += 6.0                      # the machine slows rank 0 (~6 % of the step) for 8 steps
    extra[105:, 1] += 18.0                      # the hog on rank 1's core from step 105
    for seed in range(3):
        fired = _pair(extra, seed=seed)
        mine = [a for a in fired if a.ranks == [1] and a.step_detected >= 105]
        assert mine and mine[0].step_detected <= 105 + 10, (seed, [(a.ranks, a.step_detected) for a in fired])


def test_a_fault_after_a_lead_in_of_short_slowdowns_of_the_peer_is_named_in_time():
    """CI's hog on rank 1's core (make test, 2026-11-28 (10)): in the 64 steps before, the machine made rank 0
    5-6 % slower on 14 steps, never more than 3 in a row; then the hog made rank 1 7-10 % slower on every
    step, 10-25 % from its fifth. Alike in count and size, the turns test dropped rank 1's fires and named it 11 steps after the
    hog took the core. A turn ends, a fault holds: a run more than twice the peer's longest is no turn."""
    rng = np.random.default_rng(7)
    extra = np.zeros((160, 2))
    at = 40
    while at < 100:                             # the machine slows rank 0 by ~6 % in runs of 1-3 steps
        n = int(rng.integers(1, 4))
        extra[at:at + n, 0] += 1.2
        at += n + int(rng.integers(2, 6))
    extra[105:, 1] += 2.0                       # the hog: rank 1 ~10 % slower from step 105, then ~17 %
    extra[110:, 1] += 1.5
    for seed in range(3):
        fired = _pair(extra, seed=seed)
        mine = [a for a in fired if a.ranks == [1] and a.step_detected >= 105]
        assert mine and mine[0].step_detected <= 105 + 10, (seed, [(a.ranks, a.step_detected) for a in fired])
        assert not [a for a in fired if a.step_detected < 105], [(a.ranks, a.step_detected) for a in fired]

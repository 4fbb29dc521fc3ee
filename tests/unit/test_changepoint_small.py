"""The change-point detector in jobs of small stages (2-4 ranks, what slow_rank judges pairwise): one rank's
change is the straggler's, left to slow_rank; a change of every rank is the job's, reported. Measured on
`stepwatch eval --real`'s sleep-r1 (2 gloo DDP ranks, a 15 ms sleep in rank 1's forward): besides the
`slow_rank` naming rank 1, a job-wide `regression` of the compute time (the median of 2 ranks is their
mean, and moves by half the straggler's excess), a second alert of one fault."""
from __future__ import annotations

import numpy as np
import pytest

from stepwatch.detectors.changepoint import ChangePoint
from testkit import alerts_of, job_context, make_block

pytestmark = pytest.mark.unit


def _job(R: int, S: int = 260, seed: int = 0, slow_rank_from=None, extra=15.0, data_from=None, gc_from=None,
         block: int = 1):
    rng = np.random.default_rng(seed)
    compute = 25.0 * (1.0 + 0.01 * rng.standard_normal((S, R)))
    data = np.full((S, R), 1.0) + 0.05 * rng.standard_normal((S, R))
    gc = np.zeros((S, R))
    if slow_rank_from is not None:
        compute[slow_rank_from:, R - 1] += extra          # one rank: a sleep in its forward
    if data_from is not None:
        data[data_from:, :] += extra                       # every rank reads slower
    if gc_from is not None:
        gc[gc_from:, R - 1] += extra                       # one rank's GC pauses
    for i in range(0, S, block):
        sl = slice(i, min(S, i + block))
        yield make_block(np.arange(sl.start, sl.stop), compute[sl], data=data[sl], gc=gc[sl])


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_one_ranks_slowdown_in_a_small_job_is_left_to_slow_rank(R, seed):
    alerts = alerts_of(ChangePoint(), job_context(R, R), _job(R, seed=seed, slow_rank_from=120), strict=True)
    assert alerts == [], [(a.kind, a.step_first, a.evidence.get("series")) for a in alerts]


@pytest.mark.parametrize("R", [2, 4])
def test_one_ranks_gc_pauses_in_a_small_job_are_left_to_slow_rank(R):
    alerts = alerts_of(ChangePoint(), job_context(R, R), _job(R, gc_from=120), strict=True)
    assert alerts == [], [(a.kind, a.step_first, a.evidence.get("series")) for a in alerts]


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_slower_reads_on_every_rank_of_a_small_job_are_the_jobs_regression(R, seed):
    alerts = alerts_of(ChangePoint(), job_context(R, R), _job(R, seed=seed, data_from=120), strict=True)
    assert [a.kind for a in alerts] == ["regression"], [(a.kind, a.step_first) for a in alerts]
    a = alerts[0]
    assert abs(a.step_first - 120) <= 3 and a.step_detected - 120 <= 10 and a.cause == "io"


def test_a_job_of_large_stages_is_not_judged_by_this_rule():
    """Sixteen ranks in one stage: the rule does not apply (a large stage's median does not move with one
    rank; the straggler-driven changes there are told apart by the stages' busy medians)."""
    det = ChangePoint()
    lead = {"series": "step_ms", "seg": (0, 100, 200), "before": 30.0, "after": 45.0}
    ph = np.zeros((200, len(det._PH) + 4))                 # the least busy time never moves
    assert det._one_ranks(job_context(2, 2), lead, ph)
    assert not det._one_ranks(job_context(16, 8), lead, ph)
    assert not det._one_ranks(job_context(2, 2), dict(lead, series="comm_ms"), ph)

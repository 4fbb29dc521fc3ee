"""A rank's open slow_rank alert overtaken by a second, different fault on the same rank: the first alert
resolves (evidence ``superseded``) and the new fault gets an alert of its own with its own cause; a fault
that only worsens in its own phase stays one alert. Found by make test's realrun: another benchmark on
rank 1's core slowed it first (slow_rank, cause cpu), and the injected 15 ms sleep in its forward then got
no alert of its own."""
from __future__ import annotations

import numpy as np
import pytest

from stepwatch.detectors.base import StepBlock
from stepwatch.detectors.slowrank import SlowRank
from testkit import job_context

pytestmark = pytest.mark.unit

STEPS = 220


def _run(host_extra, compute_extra, ranks=2, seed=0):
    """Synchronous steps of a ``ranks``-rank job; ``*_extra``: (STEPS,) ms added to rank 1's host time /
    compute. Returns the alerts (all states), one step per block."""
    rng = np.random.default_rng(seed)
    compute = 30.0 + rng.normal(0, 0.3, (STEPS, ranks))
    host = 2.0 + np.abs(rng.normal(0, 0.1, (STEPS, ranks)))
    compute[:, 1] += compute_extra
    host[:, 1] += host_extra
    data = np.full((STEPS, ranks), 0.5)
    busy = compute + host + data
    step = busy.max(axis=1, keepdims=True) + 5.0
    wait = step - busy
    arr = dict(step_ms=np.repeat(step, ranks, axis=1), data_ms=data, compute_ms=compute, comm_ms=wait + 0.5,
               comm_wait_ms=wait, gc_ms=np.zeros((STEPS, ranks)))
    t_end = (np.arange(STEPS, dtype=np.int64) + 1) * 40_000_000
    ctx = job_context(ranks, per_node=ranks, job="sup", node="node-a")
    det, out = SlowRank(), []
    for i in range(STEPS):
        out += det.update(ctx, StepBlock(np.array([i]), t_end[[i]], **{c: v[[i]] for c, v in arr.items()}))
    return out


def _steps(a, b):
    x = np.zeros(STEPS)
    x[a:b] = 1.0
    return x


@pytest.mark.parametrize("ranks", [2, 16])
def test_a_second_fault_of_another_cause_on_a_rank_under_alert_gets_its_own_alert(ranks):
    out = _run(8.0 * _steps(40, STEPS), 15.0 * _steps(120, STEPS), ranks=ranks)
    firing = [a for a in out if a.status == "firing"]
    assert [(a.ranks, a.cause) for a in firing] == [([1], "cpu"), ([1], "computation")], \
        [(a.ranks, a.cause, a.step_first, a.step_detected) for a in firing]
    first, second = firing
    assert 40 <= first.step_first and first.step_detected <= 50, (first.step_first, first.step_detected)
    assert 118 <= second.step_first <= 125 and second.step_detected <= 130, (second.step_first, second.step_detected)
    sup = [a for a in out if a.status == "resolved" and a.alert_id == first.alert_id]
    assert len(sup) == 1 and sup[0].evidence["superseded"]["phase"] == "compute_ms", sup
    assert sup[0].step_detected <= second.step_detected
    assert first.alert_id != second.alert_id


def test_a_fault_that_only_worsens_in_its_own_phase_stays_one_alert():
    out = _run(8.0 * _steps(40, STEPS) + 16.0 * _steps(120, STEPS), np.zeros(STEPS))
    firing = [a for a in out if a.status == "firing"]
    assert [(a.ranks, a.cause) for a in firing] == [([1], "cpu")], \
        [(a.ranks, a.cause, a.step_first, a.step_detected) for a in firing]
    assert not [a for a in out if a.status == "resolved"]


def test_the_overtaking_fault_opens_an_incident_of_its_own():
    from stepwatch.detectors.incidents import Incidents
    out = _run(8.0 * _steps(40, STEPS), 15.0 * _steps(120, STEPS))
    inc = Incidents()
    for a in out:
        inc.assign(a)
    firing = [a for a in out if a.status == "firing"]
    assert len(firing) == 2 and firing[0].incident_id != firing[1].incident_id, \
        [(a.kind, a.status, a.cause, a.incident_id) for a in out]
    assert firing[1].evidence["incident"]["role"] == "root"

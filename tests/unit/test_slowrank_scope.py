"""SlowRank: what a node/group alert may name (co-members materially slow, not merely hot) and the
effect-size gate of every alert (an immaterial excess is no alert)."""
from __future__ import annotations

import numpy as np
import pytest

from stepwatch.detectors.slowrank import SlowRank
from test_slowrank import _small_job, firing, make_ctx, noisy, run

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("R", [3, 4])
def test_a_noisy_neighbour_on_the_node_does_not_turn_a_straggler_into_a_slow_node(R):
    """All ranks on one node (the real-DDP layout): rank 1 10% slow; from the same step rank 2 carries a
    1% excess and two bursts of 15% (a noisy neighbour: two flags in the window make it "hot"). One
    slow_rank alert naming rank 1 only (before the co-member rule: a slow_node naming [1, 2])."""
    for seed in range(4):
        rng = np.random.default_rng(300 + seed)
        comp = _small_job(rng, 300, R, asym=0.0, burst=0.03)
        comp[150:, 1] *= 1.10
        comp[150:, 2] *= 1.01
        comp[[149, 152], 2] *= 1.15
        fired = firing(run(SlowRank(), make_ctx(R, per_node=8), comp))
        assert [(a.kind, a.ranks) for a in fired] == [("slow_rank", [1])], \
            (seed, [(a.kind, a.ranks, a.step_detected) for a in fired])
        assert 150 <= fired[0].step_detected <= 160


def test_a_node_whose_ranks_are_all_slow_is_still_one_slow_node_alert():
    rng = np.random.default_rng(7)
    comp = noisy(rng, 200, 64)
    comp[80:, 24:32] *= 1.12 + 0.04 * rng.random(8)             # unequal, all material
    fired = firing(run(SlowRank(), make_ctx(64), comp))
    assert [(a.kind, a.ranks) for a in fired] == [("slow_node", list(range(24, 32)))]


def test_a_node_alert_leaves_out_a_hot_member_with_an_immaterial_excess():
    """Half of a node 20% slow, one more rank of it hot with 2%: the node alert names the four slow ranks,
    and the neighbour whose excess is a tenth of theirs is not one of them."""
    rng = np.random.default_rng(11)
    comp = noisy(rng, 200, 64)
    comp[80:, 24:28] *= 1.20
    comp[80:, 28] *= 1.02
    fired = firing(run(SlowRank(), make_ctx(64), comp))
    assert fired and fired[0].kind == "slow_node" and fired[0].ranks == [24, 25, 26, 27], \
        [(a.kind, a.ranks) for a in fired]
    assert all(28 not in a.ranks for a in fired)


def test_the_effect_size_gate_drops_an_immaterial_fire_and_restarts_the_test():
    """With the gate at 20%, a 10% straggler is immaterial: no alert; when it grows to 40% it fires, and
    its start is where the material excess began (the gated excursion did not carry over)."""
    rng = np.random.default_rng(5)
    comp = noisy(rng, 260, 64)
    comp[60:, 9] *= 1.10
    comp[160:, 9] *= 1.4 / 1.1
    assert [a.ranks for a in firing(run(SlowRank(), make_ctx(64), comp[:160]))] == [[9]]   # default gate: fires
    fired = firing(run(SlowRank(min_alert_effect=0.2), make_ctx(64), comp))
    assert [(a.kind, a.ranks) for a in fired] == [("slow_rank", [9])]
    # (the persistence window may hold flags of the 10% steps just before: at most n = 13 steps back)
    assert 160 - 13 <= fired[0].step_first and 160 <= fired[0].step_detected <= 170, (fired[0].step_first, fired[0].step_detected)
    assert fired[0].evidence["effect_pct"] > 20.0


def test_gate_settings_are_validated():
    with pytest.raises(ValueError):
        SlowRank(min_alert_effect=-0.1)
    with pytest.raises(ValueError):
        SlowRank(member_share=1.5)


@pytest.mark.parametrize("R", [2, 3])
def test_a_small_stage_alerts_only_from_the_small_stage_effect(R):
    """Judged pairwise, a rank 6% slower than its pair (what a shared machine gives a rank for tens of
    steps) is no alert; the same job with 15% is one, naming that rank."""
    for seed in range(3):
        rng = np.random.default_rng(400 + seed)
        base = _small_job(rng, 300, R, asym=0.0, burst=0.0)
        comp = base.copy()
        comp[150:, 1] *= 1.06
        fired = firing(run(SlowRank(), make_ctx(R), comp))
        assert not fired, (seed, [(a.ranks, a.step_detected, a.evidence["effect_pct"]) for a in fired])
        assert firing(run(SlowRank(small_alert_effect=0.0), make_ctx(R), comp)), seed   # the gate is what held it
        comp = base.copy()
        comp[150:, 1] *= 1.15
        fired = firing(run(SlowRank(), make_ctx(R), comp))
        assert [(a.kind, a.ranks) for a in fired] == [("slow_rank", [1])], seed


def test_an_alerts_cause_query_is_taken_again_over_the_steps_since_it_fired():
    """The probe spreads a rank's run-queue wait over the steps of a ~500 ms sample, so at a contention's
    onset the excess shows as compute first and moves to the host gap a few steps later. The alert fires
    on the first steps (phase cause computation); its host query, which the processor's re-decision reads
    once the host samples came (stream/hostwait.py), follows the steps since: the host gap."""
    rng = np.random.default_rng(21)
    S, R = 130, 64
    comp = noisy(rng, S, R)
    host = np.full((S, R), 2.0)
    comp[100:103, 9] += 15.0
    comp[103:, 9] += 3.0
    host[103:, 9] += 12.0
    det, ctx = SlowRank(), make_ctx(R)
    alerts = run(det, ctx, comp, block_size=1, host=host)
    fired = firing(alerts)
    assert [(a.kind, a.ranks) for a in fired] == [("slow_rank", [9])]
    a = fired[0]
    assert a.step_detected <= 103 and a.evidence["phase_cause"] == "computation", a.evidence
    assert a.host_query["phase_cause"] == "cpu" and a.host_query["wait_rise_ms"] >= 10.0, a.host_query


@pytest.mark.parametrize("R", [2, 3, 4])
def test_a_small_stage_names_a_rank_slow_from_its_first_step(R):
    """Judged pairwise, a rank learns its usual difference to its peers (a permanently 12% unequal pair is
    no straggler: tests/test_slowrank.py); a rank 40% slower from the first step is one all the same (its
    learned baseline stops at 20%): the real 4-rank gloo job of tests/test_distributed.py (20 ms more on
    50 ms steps)."""
    rng = np.random.default_rng(9)
    comp = noisy(rng, 120, R, base=30.0, sd=0.02)
    comp[:, 1] += 15.0                  # busy 52 ms vs 37
    fired = firing(run(SlowRank(), make_ctx(R), comp, block_size=5))
    assert [(a.kind, a.ranks) for a in fired] == [("slow_rank", [1])], [(a.ranks, a.step_detected) for a in fired]
    assert fired[0].step_detected <= 50 and fired[0].evidence["effect_pct"] > 30.0

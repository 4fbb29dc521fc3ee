"""The random sweep's yardstick (stepwatch/devtools/evalsweep.py): a fault's effect is counted in units of
the noise the detector faces, measured on the independent producer's own rows of a clean copy of the
scenario. Modelled from the scenario's parameters alone it left out the producer's step-end jitter (up to
2 ms, every step), which at a 10 ms step is most of a rank's busy-time noise, and called a ~1-sd straggler
of a 4-rank job a 6-sd one, its miss a failure of the detector."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from stepwatch.devtools import evalsweep
from stepwatch.devtools.scenarios_indep import IndepJob

pytestmark = pytest.mark.unit


def _sd_of_rank_against_its_peer(sc, r: int, steps: int = 400) -> float:
    """Independently of effect_in_sd: a 2-rank copy of ``sc`` run for more steps; the robust sd of rank
    ``r``'s reported busy time relative to the other's."""
    job = IndepJob(dataclasses.replace(sc, faults=[], ranks=2, pp=1, per_node=2, steps=steps))
    s = np.repeat(np.arange(20, steps), 2)
    t = job._steps_table(s, np.tile(np.arange(2), steps - 20))
    busy = (np.asarray(t["step_ms"]) - np.asarray(t["comm_wait_ms"])).reshape(-1, 2)
    x = busy[:, r] / busy[:, 1 - r] - 1.0
    return 1.4826 * float(np.median(np.abs(x - np.median(x))))


def test_a_straggler_of_a_10_ms_job_is_counted_against_its_step_ends_jitter():
    sc, info = evalsweep.draw(5, 2)              # 4 ranks, 10.1 ms steps, 0.81 % phase noise, a 7.6 % straggler
    assert info["kind"] == "straggler" and info["ranks"] == 4 and info["pct_step"] == pytest.approx(7.56)
    eff = evalsweep.effect_in_sd(sc, info)
    assert 0.5 < eff < 1.5, eff                  # ~1 sd: the 2 ms jitter is ~7 % of a 8 ms busy time
    # the same straggler on a 1 s step: the jitter is nothing there, the phases' own noise is what is left
    slow = dataclasses.replace(sc, step_ms=1000.0, gc_scale=1.0)
    assert evalsweep.effect_in_sd(slow, info) > 3 * eff


@pytest.mark.parametrize("i,seed", [(5, 2), (21, 1), (33, 0)])
def test_the_measured_noise_is_that_of_a_pair_of_the_producers_ranks(i, seed):
    sc, info = evalsweep.draw(i, seed)
    assert info["kind"] == "straggler" and info["ranks"] <= 4
    sd = info["pct_step"] / 100.0 / evalsweep.effect_in_sd(sc, info)
    pair = _sd_of_rank_against_its_peer(sc, 0)   # one other rank, not the median of 1-3: a bit wider
    assert pair / 1.6 < sd < pair * 1.2, (sd, pair)


def test_a_job_wide_change_is_counted_against_the_job_steps_own_change():
    sc, info = evalsweep.draw(3, 0)              # 128 ranks, a 14.6 % comm change
    assert info["kind"] == "phase"
    eff = evalsweep.effect_in_sd(sc, info)
    quiet = dataclasses.replace(sc, noise=sc.noise / 4, ar_sd=sc.ar_sd / 4, checkpoint_every=None)
    assert evalsweep.effect_in_sd(quiet, info) > 1.5 * eff > 0

"""What the training script's own clock saw around an injected fault (``stepwatch eval --real`` prints it beside
each run, so a missed fault can be told from a fault that did not take: the full run of 2026-11-28 missed
``link-slow`` once and kept nothing to say which)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from stepwatch.devtools.realrun import step_times_around, straggle_is_real

pytestmark = pytest.mark.unit


def test_step_times_around_a_fault_are_the_ranks_median_steps_before_and_after_it(tmp_path):
    steps = np.r_[np.full(120, 0.025), np.full(40, 0.050)]          # step 120 on: 50 ms instead of 25
    for r, skew in ((0, 0.0), (1, 0.001)):
        ends = np.cumsum(np.r_[1.0 + skew, steps])
        (tmp_path / f"rank{r}.json").write_text(json.dumps({"ends": ends.tolist()}))
    before, after = step_times_around(str(tmp_path), 120)
    assert before == pytest.approx(25.0) and after == pytest.approx(50.0)
    assert step_times_around(str(tmp_path / "none"), 120) is None      # no rank files: nothing to say
    assert step_times_around(str(tmp_path), 500) is None                # the fault after the last step


def _report(path, rank, cpu_ms, off_ms=None, step_ms=16.0):
    n = len(cpu_ms)
    rep = {"ends": np.cumsum(np.r_[1.0, np.full(n, step_ms / 1e3)]).tolist(),
           "cpu": np.cumsum(np.r_[0.5, np.asarray(cpu_ms) / 1e3]).tolist()}
    if off_ms is not None:
        rep["off"] = np.cumsum(np.r_[0.0, np.asarray(off_ms) / 1e3]).tolist()
    (path / f"rank{rank}.json").write_text(json.dumps(rep))


def test_a_straggle_the_machine_made_by_waking_a_rank_late_is_confirmed_by_its_wall_clock(tmp_path):
    """CI's 2-core machine made rank 1 of a clean run 1.5 ms (10 %) slower for 26 steps: its device-time
    sleep (the pad) woke late, time its CPU clock does not count. Its own work (CPU time plus its forward's
    time off the CPU) shows it; a rank whose clocks stayed flat is not confirmed."""
    cpu = np.full(80, 4.0)
    off = np.r_[np.full(32, 10.1), np.full(48, 11.6)]             # from step 32 the sleep wakes 1.5 ms late
    _report(tmp_path, 1, cpu, off)
    assert straggle_is_real(str(tmp_path), 1, 32, 36)
    assert not straggle_is_real(str(tmp_path), 1, 20, 26)         # before it: flat
    _report(tmp_path, 1, cpu)                                     # an older report: CPU time alone
    assert not straggle_is_real(str(tmp_path), 1, 32, 36)
    _report(tmp_path, 1, np.r_[np.full(32, 4.0), np.full(48, 5.5)], np.full(80, 10.1))
    assert straggle_is_real(str(tmp_path), 1, 32, 36)             # more CPU time: as before

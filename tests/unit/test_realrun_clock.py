"""What the training script's own clock saw around an injected fault (``stepwatch eval --real`` prints it beside
each run, so a missed fault can be told from a fault that did not take: the full run of 2026-11-28 missed
``link-slow`` once and kept nothing to say which)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from stepwatch.devtools.realrun import step_times_around

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

"""The fuzz harness (stepwatch.fuzz) on a bounded budget: CI runs a few seconds per boundary;
``stepwatch bench fuzz`` runs 100,000 inputs each."""
from __future__ import annotations

import pytest

from stepwatch.fuzz import BOUNDARIES


@pytest.mark.parametrize("name", sorted(BOUNDARIES))
def test_fuzz_boundary_bounded_budget(name):
    r = BOUNDARIES[name](100, 7)
    assert r["tried"] == 100
    assert r["crashes"] == 0 and r["hangs"] == 0, r["examples"]

"""The fuzz harness (stepwatch.devtools.fuzz) on a bounded budget: CI runs a few seconds of the Kafka
message boundary (the node's boundaries, also registered, have their own CI budget in
tests/test_fuzz_trust.py); ``stepwatch bench fuzz`` runs 100,000 inputs of each."""
from __future__ import annotations

import pytest

from stepwatch.devtools.fuzz import BOUNDARIES

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["kafka-message"])
def test_fuzz_boundary_bounded_budget(name):
    assert {"kafka-message", "agent-datagram", "control-verify"} <= set(BOUNDARIES)
    r = BOUNDARIES[name](100, 7)
    assert r["tried"] == 100
    assert r["crashes"] == 0 and r["hangs"] == 0, r["examples"]

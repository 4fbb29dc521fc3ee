"""Issue 16: the agent-side fuzzers (stepwatch.devtools.fuzz_targets) on a bounded CI budget: the agent's
datagram decode and the control-command verify (agent and probe) never raise, never hang, and accept
nothing that is not validly sealed. The full runs (>= 100,000 inputs per boundary) are
``python -m stepwatch.devtools.fuzz_targets all 100000`` / ``stepwatch bench fuzz``."""
from __future__ import annotations

import logging

import pytest

pytestmark = pytest.mark.unit

pytest.importorskip("hypothesis", reason="the fuzzers use hypothesis (pip install hypothesis)")

from stepwatch.devtools.fuzz_targets import fuzz_control, fuzz_datagram  # noqa: E402

BUDGET = 2000


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def test_fuzz_the_agents_datagram_decode():
    r = fuzz_datagram(BUDGET, seed=16)
    assert r["tried"] == BUDGET and r["structured"] >= 500 and r["mutated"] > 0
    assert r["crashes"] == 0 and r["hangs"] == 0, r["examples"]
    # the fuzzer reached past the decode: hellos accepted, rows built into Arrow tables, refusals counted
    assert r["rows_built"] > 0 and r["bad_datagrams"] > 0, r


def test_fuzz_the_control_command_verify():
    r = fuzz_control(BUDGET, seed=16)
    assert r["tried"] == BUDGET and r["crashes"] == 0 and r["hangs"] == 0, r["examples"]
    assert r["accepted_unverified"] == 0
    # every path was exercised: valid commands verified on both sides, each refusal reason seen
    assert r["verified_inputs"] > 0 and r["probe_runs_started"] > 0
    assert {"bad_envelope", "bad_signature", "unknown_key", "bad_command"} <= set(r["agent_rejected"]), r
    assert {"bad_envelope", "bad_signature", "unknown_key", "bad_command"} <= set(r["probe_rejected"]), r

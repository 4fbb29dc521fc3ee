"""Smoke test of ``python tools/bench_ingress.py`` (the processor's message path apart from
the broker): it runs tiny, stores every step row and prints its JSON line. No figure is asserted."""
import json

import pytest

from testkit import tool

bench_ingress = tool("bench_ingress")      # tools/bench_ingress.py
pytestmark = pytest.mark.unit


def test_bench_ingress_runs_tiny_and_stores_every_step_row(capsys):
    assert bench_ingress.main(["--ranks", "64", "--steps", "12", "--flush-rows", "300", "--parts"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["rows_steps"] == 64 * 12 and res["deadletter"] == 0
    assert res["cpu_msg_s_per_M"] > 0 and res["cpu_flush_s_per_M"] > 0 and res["parts_s_per_M"]

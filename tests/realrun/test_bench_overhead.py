"""``stepwatch bench overhead`` runs end to end (a real agent process, real gloo, both loops); the
figures themselves are measured by running the bench, not asserted here."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.realrun, pytest.mark.slow]

pytest.importorskip("torch", reason="the overhead bench trains real PyTorch loops (pip install torch==2.13.0)")


def test_probe_overhead_bench_reports_every_condition_and_call():
    from stepwatch.agents.probe import eventlog
    from stepwatch.devtools.bench_overhead import CALLS, probe_overhead
    lines: list[str] = []
    res = probe_overhead(rounds=2, block_steps=5, out=lines.append)
    text = "\n".join(lines)
    assert ("C hot path" if eventlog.FAST else "pure-Python") in lines[0]
    for loop in ("minimal", "mlp"):
        for clock in ("cpu", "wall"):
            r = res[loop][clock]
            assert set(r["step_us"]) == {"off", "on", "no-agent"} and all(v > 0 for v in r["step_us"].values())
        split = res[loop]["calls"]["split"]
        assert len(split["on"]) == len(CALLS) == 4
        assert res[loop]["calls"]["on"]["overhead_us"] == pytest.approx(sum(split["on"]))
    assert res["isolated"]["off"] > 0
    assert "replay+send" in text and "target <= 20 µs/step" in text and isinstance(res["ok"], bool)

"""``stepwatch demo --real``: real gloo training under ``stepwatch wrap`` -> agent -> embedded broker ->
processor, one run with a slow rank and one with GC pressure, each named by an alert."""
from __future__ import annotations

import pytest

from stepwatch.cli import main

pytestmark = [pytest.mark.realrun, pytest.mark.slow]

pytest.importorskip("torch", reason="demo --real trains a real PyTorch model (pip install torch==2.13.0)")


def test_demo_real_names_the_slow_rank_and_the_gc_rank(tmp_path, capsys):
    from stepwatch.devtools.demo import run_real_demo
    assert run_real_demo(ranks=4, steps=60, slow_rank=3, gc_rank=0, data_dir=str(tmp_path / "d")) == 0
    out = capsys.readouterr().out
    assert "FOUND  rank 3 sleeps 20 ms more per step: slow_rank alert names rank [3]" in out
    assert "FOUND  rank 0 builds reference cycles" in out and "names rank [0]" in out and "cause gc" in out
    assert "step rows stored: 240 of 240" in out
    assert (tmp_path / "d" / "demo-real-slow-r3.log").exists()


def test_demo_real_rejects_bad_ranks_with_a_clear_message(tmp_path, capsys):
    assert main(["demo", "--real", "--ranks", "4", "--slow-rank", "4", "--data-dir", str(tmp_path)]) == 2
    assert "--slow-rank 4 is not one of the 4 ranks" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--gc-rank needs --real"):
        main(["demo", "--gc-rank", "1", "--data-dir", str(tmp_path)])

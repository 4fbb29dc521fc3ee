"""A two-rank stage, recorded from the real DDP job of tests/test_ddp_real.py (gloo, 2 CPU ranks; rank 1's
forward sleeps 15 ms more from step 100): the straggler is named, and the healthy rank is never, though
beside the straggler it is the fast one for a long time and its own offset follows it (the sequential test
judges a rank against that offset: once the straggler's excess eases, the healthy rank looks slower than
its recent self while it is still faster than its peer)."""
from __future__ import annotations

import csv

import numpy as np

from stepwatch.detectors.base import StepBlock
from stepwatch.detectors.slowrank import SlowRank
from testkit import DATA, job_context

import pytest
pytestmark = pytest.mark.unit

TRACE = DATA / "ddp_sleep_2ranks.csv"
COLS = ("step_ms", "data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms")


def test_the_healthy_rank_of_a_two_rank_stage_is_never_named():
    rows = list(csv.DictReader(TRACE.open()))
    S, R = max(int(r["step"]) for r in rows) + 1, 2
    arr = {c: np.full((S, R), np.nan) for c in COLS}
    t_end = np.zeros(S, np.int64)
    for r in rows:
        s, k = int(r["step"]), int(r["rank"])
        t_end[s] = max(t_end[s], int(r["t_end_ns"]))
        for c in COLS:
            arr[c][s, k] = float(r[c])
    ctx = job_context(R, per_node=R, job="ddp", node="node-a")
    det, out = SlowRank(), []
    for i in range(0, S, 8):                       # the agent ships a few steps at a time
        st = np.arange(i, min(S, i + 8))
        out += det.update(ctx, StepBlock(st, t_end[st], **{c: arr[c][st] for c in COLS}))
    fired = [(a.ranks, a.step_first, a.step_detected) for a in out if a.status == "firing"]
    assert [f[0] for f in fired] == [[1]], [(a.ranks, a.step_first, a.step_detected, a.evidence.get("effect_pct"))
                                            for a in out]
    assert 100 <= fired[0][2] <= 110

"""What detectors derive from shared inputs is computed once and cannot go stale: the step-time median
and busy time of a block, the job-wide host shift of a state of the job's windows (issue 28)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from stepwatch.detectors import causes
from stepwatch.detectors.base import StepBlock
from stepwatch.detectors.replay import block_slice
from test_causes import NS, ctx_with, host_rows

pytestmark = pytest.mark.unit


def _block(S=3, R=7, seed=0):
    rng = np.random.default_rng(seed)
    f = [rng.uniform(10, 20, (S, R)) for _ in range(6)]
    f[0][1, 2] = np.nan                                     # a rank that did not report a step
    f[4][0, 3] = np.nan                                     # comm wait not reported: busy falls back
    return StepBlock(np.arange(S), np.arange(S) * NS, *f)


def test_step_median_and_busy_once_per_block_read_only():
    b = _block()
    med = b.step_median()
    assert med is b.step_median()                           # computed once
    np.testing.assert_array_equal(med, causes.nanmedian(b.step_ms, axis=1))
    busy = b.busy_ms
    assert busy is b.busy_ms
    want = np.where(np.isnan(b.comm_wait_ms), b.data_ms + b.compute_ms + b.gc_ms, b.step_ms - b.comm_wait_ms)
    np.testing.assert_array_equal(busy, want)
    with pytest.raises(ValueError):
        med[0] = 0.0                                         # shared by every detector: read-only
    with pytest.raises(ValueError):
        busy[0, 0] = 0.0
    one = block_slice(b, 1, 2)                              # another block: its own values
    np.testing.assert_array_equal(one.step_median(), med[1:2])
    b.step_ms = b.step_ms * 2.0                             # a field replaced: computed again
    np.testing.assert_array_equal(b.step_median(), 2.0 * med)


def test_scaled_step_median_is_the_median_of_the_scaled_steps():
    """mfu's step times scaled by the work of each step: their median from the block's shared middle pair
    is bit for bit that of the (S, R) product (ties, NaN, odd and even counts, an all-NaN step)."""
    rng = np.random.default_rng(4)
    for S, R in ((3, 7), (2, 8), (4, 5), (5, 40)):
        b = _block(S, R, seed=R)
        b.step_ms[:, : R // 2] = np.round(b.step_ms[:, : R // 2])              # ties
        b.step_ms[-1] = np.nan if S == 5 else b.step_ms[-1]
        scale = rng.uniform(0.3, 3.0, (S, 1))
        want = causes.nanmedian(b.step_ms * scale, axis=1)
        np.testing.assert_array_equal(b.step_median_scaled(scale), want)
        np.testing.assert_array_equal(b.step_median_scaled(scale[:, 0]), want)


def test_dataloader_rank_medians_of_a_float32_ring_match_nanmedian():
    from stepwatch.detectors.dataloader import _nanmedian_axis0
    rng = np.random.default_rng(5)
    for dt in (np.float32, np.float64):
        a = rng.uniform(0, 1, (20, 300)).astype(dt)
        a[rng.random(a.shape) < 0.2] = np.nan
        a[:, 7] = np.nan                                                       # a rank never reported
        with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
            want = np.nanmedian(a.astype(np.float64), axis=0)
        np.testing.assert_array_equal(_nanmedian_axis0(a), want)


def test_job_host_shift_once_per_window_state(monkeypatch):
    ctx = ctx_with(host=host_rows(t=(1, 2, 3, 4)))
    calls = []
    real = causes._job_host_shift
    monkeypatch.setattr(causes, "_job_host_shift", lambda *a: calls.append(a) or real(*a))
    spans = ((1 * NS, 2 * NS), (3 * NS, 4 * NS), (2, 2))
    a = causes.job_host_shift(ctx, *spans)
    b = causes.job_host_shift(ctx, *spans)                  # changepoint and mfu, the same step
    assert len(calls) == 1 and a == b and a["cpu_util"]["after"] == 10.0
    a["cpu_util"]["after"] = -1.0                           # each caller its own copy
    assert causes.job_host_shift(ctx, *spans)["cpu_util"]["after"] == 10.0
    # a new host batch in the span (every node busy): read again, not the remembered answer
    busy = host_rows(t=(3, 4))
    ctx.host.add(busy.set_column(busy.schema.get_field_index("cpu_util"), "cpu_util",
                                 pa.array([90.0] * busy.num_rows)))
    c = causes.job_host_shift(ctx, *spans)
    assert len(calls) == 2 and c["cpu_util"] == {"before": 10.0, "after": 50.0}


def test_dataloader_ring_counts_follow_the_ring_and_a_new_threshold():
    """The per-rank counts the dataloader keeps as steps enter and leave its ring (issue 28: an evaluation
    at 100k ranks re-read the (window, R) ring) are those of the ring after every block, also after a
    live change of min_data_share, and give the same starved ranks as counting the ring itself."""
    from stepwatch.detectors.dataloader import DataLoader, _median_at_least
    from stepwatch.detectors.settings import retune
    from test_causes import ctx_with
    rng = np.random.default_rng(9)
    R = 40
    dl = DataLoader(window=6, every=2, min_steps=2)
    ctx = ctx_with()
    for i in range(30):
        S = int(rng.integers(2, 5))
        b = _block(S, R, seed=i)
        b.steps = np.arange(S) + 3 * i
        b.data_queue = rng.integers(0, 3, (S, R)).astype(np.float32)
        b.data_queue[rng.random((S, R)) < 0.2] = np.nan
        b.data_ms = b.step_ms * rng.choice([0.05, 0.1, 0.5], (S, R))      # shares on the threshold too
        if i == 15:
            dl = retune(dl, {"window": 6, "every": 2, "min_steps": 2, "min_data_share": 0.3})   # live
        dl.update(ctx, b)
        q, d = dl._q, dl._d.astype(np.float64)
        np.testing.assert_array_equal(dl._nq, np.isfinite(q).sum(axis=0))
        np.testing.assert_array_equal(dl._ne, (q == 0).sum(axis=0))
        np.testing.assert_array_equal(dl._nd, np.isfinite(d).sum(axis=0))
        np.testing.assert_array_equal(dl._nge, (d >= dl.min_data_share).sum(axis=0))
        np.testing.assert_array_equal(_median_at_least(dl._d, dl.min_data_share, dl._nd, dl._nge),
                                      _median_at_least(dl._d, dl.min_data_share))


def test_median_of_whole_numbers_by_counting_is_np_median():
    rng = np.random.default_rng(11)
    for n in (4097, 5000, 20001):
        for off in (0.0, 1500.0):
            a = rng.integers(0, 200, n).astype(np.float64) + off              # clocks, depths: whole numbers
            assert causes._median(a) == float(np.median(a))
            assert causes._median(a + 0.25) == float(np.median(a + 0.25))   # not whole: np.median
    q = rng.integers(0, 4, (20, 300)).astype(np.float32)
    q[0, :5] = np.nan
    v = q[np.isfinite(q)].astype(np.float64)
    assert causes.queue_evidence(q)["depth_p50"] == float(np.median(v))

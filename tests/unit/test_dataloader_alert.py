"""The pieces of a ``dataloader_starved`` alert at 100,000 ranks: the queue's median over the (window x ranks)
ring (float32, not widened first; one value everywhere when every queue is empty) and the starved test on
the candidate ranks' columns without copying them; the same values as numpy's."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from stepwatch.detectors.causes import _median, queue_evidence
from stepwatch.detectors.dataloader import _median_at_least

pytestmark = pytest.mark.unit


def bits(x: float) -> bytes:
    return np.float64(x).tobytes()


def test_median_of_float32_values_is_numpy_median_of_them_widened(monkeypatch):
    rng = np.random.default_rng(5)
    cases = [np.zeros(2_000_000, np.float32), np.full(10_000, 3.0, np.float32), np.full(10_000, 0.5, np.float32),
             rng.integers(0, 5, 100_000).astype(np.float32), rng.random(10_000).astype(np.float32),
             np.r_[np.zeros(5_000), -np.zeros(5_000)].astype(np.float32), rng.random(3).astype(np.float32)]
    for a in cases:
        want = float(np.median(a.astype(np.float64)))
        assert bits(_median(a)) == bits(want)
        assert bits(_median(a.astype(np.float64))) == bits(want)
    # an empty queue on every rank and step: the value itself, no counting pass
    monkeypatch.setattr(np, "bincount", lambda *a, **k: pytest.fail("counted one value"))
    assert bits(_median(np.zeros(2_000_000, np.float32))) == bits(0.0)
    q = np.zeros((20, 100_000), np.float32)
    assert queue_evidence(q) == {"samples": 2_000_000, "empty_share": 1.0, "full_share": 0.0, "depth_p50": 0.0,
                                 "depth_max": 0.0}


def test_median_at_least_reads_the_columns_asked_about():
    rng = np.random.default_rng(9)
    a = rng.random((20, 300)).astype(np.float32)
    a[rng.random(a.shape) < 0.1] = np.nan
    a[:, 7] = np.nan                                             # a column with nothing reported
    cols = np.array([0, 3, 7, 10, 11, 150, 299])
    x = a.astype(np.float64)
    n = x.shape[0] - np.isnan(x).sum(axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)                 # nanmedian of the all-NaN column
        for thr in (0.0, 0.3, 0.5, 0.7):
            c = (x >= thr).sum(axis=0)
            want = np.nan_to_num(np.nanmedian(x[:, cols], axis=0)) >= thr
            assert _median_at_least(a, thr, n[cols], c[cols], cols=cols).tolist() == want.tolist()
            assert _median_at_least(a, thr, cols=cols).tolist() == want.tolist()
            assert _median_at_least(a[:, cols], thr).tolist() == want.tolist()

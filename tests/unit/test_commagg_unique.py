"""comm_bw's distinct (op, group) pairs of a job's first comm batch (issue 28 item 2): 200k rows of a handful
of pairs at 100k ranks are counted, not sorted; the result is ``np.unique``'s."""
from __future__ import annotations

import numpy as np
import pytest

from stepwatch.detectors import commagg
from stepwatch.detectors.commagg import _sorted_unique

pytestmark = pytest.mark.unit


def test_sorted_unique_is_np_unique():
    rng = np.random.default_rng(0)
    for a in (rng.integers(0, 5, 200_000), rng.integers(0, 300_000, 200_000), rng.integers(-5, 5, 5_000),
              np.arange(10**6)[::-1].copy(), rng.integers(0, 2**40, 100_000), np.zeros(3_000, np.int64),
              rng.integers(0, 5, 100), np.array([], np.int64)):
        a = a.astype(np.int64)
        u = _sorted_unique(a)
        assert u.dtype == np.int64 and np.array_equal(u, np.unique(a))


def test_few_pairs_of_many_rows_are_counted_not_sorted(monkeypatch):
    rng = np.random.default_rng(1)
    pairs = rng.integers(0, 2, 200_000) * 12_500 + rng.integers(0, 8, 200_000)
    want = np.unique(pairs)
    monkeypatch.setattr(commagg.np, "sort", lambda *a, **k: pytest.fail("sorted 200k rows"))
    assert np.array_equal(_sorted_unique(pairs), want)

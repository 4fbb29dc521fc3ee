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


def _codes_by_lookup(cols):
    """What _Names gave before: a lookup, the unique new names in order of first sight, a lookup again."""
    import pyarrow as pa
    import pyarrow.compute as pc
    names, out = [], []
    for col in cols:
        vs = pa.array(names, pa.string())
        idx = pc.index_in(col, value_set=vs)
        if idx.null_count:
            names.extend(pc.unique(pc.filter(col, pc.is_null(idx))).to_pylist())
            idx = pc.index_in(col, value_set=pa.array(names, pa.string()))
        out.append(idx.to_numpy().astype(np.int64))
    return names, out


def test_first_batch_names_take_one_hash_pass_and_the_same_codes(monkeypatch):
    import pyarrow as pa
    import pyarrow.compute as pc
    rng = np.random.default_rng(2)
    ops = np.array(["all_reduce", "barrier", "all_gather", "reduce_scatter"])
    first = pa.chunked_array([pa.array(ops[rng.integers(1, 4, 50_000)]), pa.array(ops[rng.integers(0, 3, 50_000)])])
    later = pa.chunked_array([pa.array(ops[rng.integers(0, 4, 1_000)].tolist() + ["send"])])
    want_names, want = _codes_by_lookup([first, later])
    n = commagg._Names()
    real = pc.index_in
    calls = []
    monkeypatch.setattr(commagg.pc, "index_in", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = [n.codes(first)]
    assert not calls                                      # the first batch: no lookup at all
    got.append(n.codes(later))
    assert n.names == want_names and all(np.array_equal(a, b) for a, b in zip(got, want))

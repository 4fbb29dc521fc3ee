"""The fleet medians of a straggler's host evidence (issue 28 item 2): ``_med_without(a, out)`` is
``_med(a[~out])`` bit for bit — whole numbers counted over the whole array less the suspects' entries,
anything else by ``_med`` itself."""
from __future__ import annotations

import numpy as np
import pytest

from stepwatch.detectors import causes
from stepwatch.detectors.causes import _med, _med_without

pytestmark = pytest.mark.unit


def _cases(rng):
    n = 800_000
    clock = rng.integers(1700, 2000, n).astype(np.float64)
    yield clock, "whole clocks"
    yield rng.integers(40, 90, 9_000).astype(np.float64), "whole temperatures, a short window"
    yield np.full(n, 1980.0), "one value"
    yield rng.normal(60, 5, 300_000), "fractions"
    c = clock.copy(); c[17] = np.nan
    yield c, "a NaN"
    c = clock.copy(); c[5] = -0.0; c[6:9] = 0.0
    yield c, "signed zeros"
    c = clock.copy(); c[99] = 1e6
    yield c, "a range beyond the counting one"
    c = clock.copy(); c[::2] = 1980.5
    yield c, "half not whole"
    yield rng.integers(0, 3, 5_000).astype(np.float64), "few values"


@pytest.mark.parametrize("share", [0.0, 0.00008, 0.01, 0.2, 1.0])
def test_med_without_is_med_of_the_rest(share):
    rng = np.random.default_rng(11)
    for a, what in _cases(rng):
        out = rng.random(len(a)) < share
        want = _med(a[~out])
        got = _med_without(a, out)
        assert (got is None and want is None) or np.float64(got).tobytes() == np.float64(want).tobytes(), what


def test_whole_clocks_are_counted_without_copying_the_others(monkeypatch):
    rng = np.random.default_rng(3)
    a = rng.integers(1700, 2000, 800_000).astype(np.float64)
    out = np.zeros(len(a), dtype=bool)
    out[1000:1064] = True
    want = _med(a[~out])
    monkeypatch.setattr(causes, "_med", lambda *x: pytest.fail("took the copying path"))
    assert _med_without(a, out) == want


def test_median_of_fractions_skips_the_whole_number_pass_and_keeps_the_value(monkeypatch):
    rng = np.random.default_rng(8)
    a = rng.normal(60, 5, 200_000)
    a -= a.min()                                          # non-negative, in the counting range
    want = float(np.median(a))
    calls = []
    real = np.ndarray.astype

    class Spy(np.ndarray):
        def astype(self, dtype, *x, **k):
            if np.dtype(dtype).kind == "i":
                calls.append(len(self))
            return real(self, dtype, *x, **k)
    assert causes._median(a.view(Spy)) == want
    assert max(calls, default=0) < len(a)                 # no whole-array integer copy of the fractions
    b = rng.integers(0, 500, 200_000).astype(np.float64)  # whole numbers: still counted, the same value
    b[7] = 0.5                                            # but one that the sample does not see
    assert causes._median(b) == float(np.median(b))

"""causes.median1d / nanmedian: the median of a long row from a sampled band is np.median's value, bit for
bit, whatever the data (the band missing the middle falls back to a full partition)."""
import numpy as np
import pytest

from stepwatch.detectors.causes import median1d, nanmedian

pytestmark = pytest.mark.unit


def _cases():
    rng = np.random.default_rng(7)
    yield rng.standard_t(3, 100_000)                            # heavy tails, even length
    yield rng.normal(50.0, 0.5, 40_001)                         # odd length
    yield np.sort(rng.normal(size=30_000))                      # sorted: the strided sample is still even
    yield np.r_[np.zeros(20_000), rng.normal(100.0, 1.0, 20_000)]   # two clusters: the middle between them
    yield rng.integers(0, 3, 50_000).astype(np.float64)         # ties everywhere
    a = rng.normal(size=20_000)
    a[::3] = -0.0
    yield a                                                     # signed zeros in the middle
    b = np.full(70_000, 5.0)
    b[: 34_999] = -1.0
    yield b                                                     # the sample's band holds one value only


@pytest.mark.parametrize("a", list(_cases()))
def test_median1d_is_np_median(a):
    want = np.median(a)
    got = median1d(a.copy())
    assert got.tobytes() == np.float64(want).tobytes()
    rows = np.stack([a, a[::-1]])
    assert np.median(rows, axis=1).tobytes() == nanmedian(rows, axis=1).tobytes()


def test_median1d_leaves_its_input():
    a = np.random.default_rng(1).normal(size=50_000)
    keep = a.copy()
    median1d(a)
    assert np.array_equal(a, keep)

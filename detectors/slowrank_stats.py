"""Slow-rank detection, shared constants and the statistics of its sequential test (the CUSUM's
null-law root theta, the autocorrelation of the pooled residuals); see
:class:`~stepwatch.detectors.slowrank.SlowRank`."""
from __future__ import annotations

import math

import numpy as np


_MAD_TO_SIGMA = 1.4826
_DELAY = 8            # steps by which a rank's own offset lags its z (a new straggler is not absorbed)
_OFFSET_STEPS = 64    # memory of the offset EWMA (steps)
_EVERY = 16           # steps between calibrations of h and of the fleet's offset spread
_SAMPLE_COLS = 2048   # ranks sampled for the null law
_WARMUP = 20          # judged steps before the CUSUM may fire
_KINDS = {"rank": "slow_rank", "node": "slow_node", "group": "slow_group"}
_NULL_MIN = 256       # pooled null values a calibration wants (small jobs: over more steps, at least _NULL_FEW)
_NULL_FEW = 64
_SMALL_DELAY = 16     # small stages: steps by which the learned pairwise baseline and noise lag
_SMALL_LEARN = 16     # small stages: learned steps before a rank is judged
_HOST_SPAN_NS = 1_000_000_000   # least span of the host samples an alert's evidence reads
_SMALL_MAX_BASE = 0.2  # small stages: the most a rank's learned baseline may put it above its peers
_SMALL_HIST = 64      # small stages: learned steps whose median and MAD are a rank's baseline and noise
#: the rank's own phases, each also tested on its own (besides the busy time): a straggler's excess is
#: usually in one of them, and the other phases' noise then only hides it (see the class docs)
OWN_PHASES = ("compute_ms", "data_ms", "host_gap_ms", "gc_ms")
_P = 1 + len(OWN_PHASES)   # tested series per rank: busy time, then OWN_PHASES


def _pooled_phi(samp: np.ndarray, c: float) -> float:
    """The autocorrelation of the ranks' offset-corrected z over the sample ring (rows = consecutive
    steps, oldest first; columns = ranks), as the AR(1) coefficient phi with the same long-run variance
    ratio ``VR = mean over ranks of (sum over the T steps)^2 / (T mean z^2)`` (VR = (1 + phi) / (1 - phi)
    for long blocks): values clipped to [-c, c] and centred on their overall median, not per rank
    (what stays of a rank's drift, or of the error of its learned offset, is exactly what the CUSUM
    accumulates). Clipped to [0, 0.9]."""
    U = np.clip(samp.astype(np.float64), -c, c)
    U = U[np.isfinite(U).any(axis=1)]               # rows of a long (small-job) ring not yet written
    ok = np.isfinite(U).all(axis=0)
    if ok.sum() < 16 and ok.sum() * U.shape[0] < _NULL_MIN or U.shape[0] < 4:
        return 0.0
    U = U[:, ok]
    U = U - float(np.median(U))
    den = float(np.mean(U * U)) * U.shape[0]
    if not den > 0:
        return 0.0
    vr = float(np.mean(np.sum(U, axis=0) ** 2)) / den
    return min(max((vr - 1.0) / (vr + 1.0), 0.0), 0.9)


def _cusum_theta(x: np.ndarray) -> float:
    """The root theta > 0 of ``mean(exp(theta x)) = 1`` (x: CUSUM increments with a negative mean and
    some positive values); inf when no increment is positive (the test can never fire). Bisection on
    log(theta) over a 512-bin histogram of x (bin centres weighted by counts, each bin under 1% of
    the range wide), so each step of the search costs 512 exponentials, not len(x)."""
    if not len(x) or not (x > 0).any():
        return math.inf
    if float(np.mean(x)) >= 0:
        return 1e-3                                  # no drift down: the most conservative theta
    cnt, edges = np.histogram(x, bins=512)
    keep = cnt > 0
    w = cnt[keep] / len(x)
    v = 0.5 * (edges[:-1] + edges[1:])[keep]
    v[-1] = float(np.max(x))                         # the top bin at its largest value (conservative)
    vm = float(v[-1])

    def f(th):                                       # log mean exp(th x), stably
        return th * vm + math.log(float(np.dot(w, np.exp(th * (v - vm)))))
    lo, hi = 1e-3, 50.0
    if f(hi) < 0:
        return hi
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return lo


def _r(x, nd: int = 3):
    x = float(x)
    return None if not np.isfinite(x) else round(x, nd)


def _cumsum_rows(a: np.ndarray) -> np.ndarray:
    """Cumulative sum down axis 0 as int16, one vector add per row (``np.cumsum(axis=0)`` on a wide
    (rows, R) array is an order of magnitude slower)."""
    out = np.empty(a.shape, dtype=np.int16)
    if len(a):
        out[0] = a[0]
        for i in range(1, len(a)):
            np.add(out[i - 1], a[i], out=out[i])
    return out

"""The offline change-point search (:func:`find`) and its noise estimates, used by the streaming
:class:`stepwatch.detectors.changepoint.ChangePoint` and by ``stepwatch bench changepoint``.

:func:`find` is the core search (ruptures, noise-calibrated penalty, spike-robust)."""
from __future__ import annotations

import math

import numpy as np
import ruptures as rpt

#: Default penalty constant: ``penalty = PENALTY_C * sigma**2 * log(n)`` (about 3x the BIC's 2 log n).
#: Calibrated with the default 5-point median pre-filter on 2% Gaussian noise (+1% Student-t(3)) with
#: 40% single-step spikes: no false change in 1,000 series of n=200 and 200 of n=1,000 (c=4: 1 per
#: 1,000 with t noise; c=2: ~2-7%); Student-t(2) noise: 2 per 1,000. Positively autocorrelated noise
#: (AR(1), 0.3) gives 2.5% false changes at n=200, which the streaming detector's effect-size check
#: absorbs. Power: a 5-sigma mean shift with 5 points after it is found in 99% of series (all with 7).
PENALTY_C = 6.0

#: Half-width (points) of the local window on which :func:`find` confirms a change against a linear
#: trend: a line is a local approximation of a drift or a slow curve, and 50 points on each side leave a
#: slope well determined while a seasonal or curved series is still close to a line within it.
LOCAL = 50

#: Standard errors a jump needs in the local-trend confirmation of :func:`find` (as the streaming
#: detector's ``min_t``).
TREND_T = 5.0

_SEARCH = {"bottomup": rpt.BottomUp, "binseg": rpt.Binseg, "pelt": rpt.Pelt}


def _median(a: np.ndarray) -> float:
    """Median of a 1-D finite array (``np.median`` without its per-call overhead)."""
    n = len(a)
    h = n // 2
    if n % 2:
        return float(np.partition(a, h)[h])
    p = np.partition(a, (h - 1, h))
    return 0.5 * float(p[h - 1] + p[h])


def noise_sigma(values) -> float:
    """Robust noise level of a series: ``1.4826 * MAD(first differences) / sqrt(2)``.

    Level shifts and isolated spikes touch few differences, so they barely move the estimate.
    NaNs are ignored; 0.0 for fewer than 3 finite values.
    """
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < 3:
        return 0.0
    d = np.diff(x)
    return 1.4826 * _median(np.abs(d - _median(d))) / math.sqrt(2.0)


#: Largest AR(1) coefficient :func:`noise_scales` reports. Above it the series is treated as nearly
#: integrated (a smooth curve, a random walk): its long-run variance is then inflated (1 + r) / (1 - r)^2
#: = 190-fold over the white estimate, which already makes any change that is not large against the
#: curve's own wandering too expensive.
RHO_MAX = 0.9


def _mad_sd(d: np.ndarray) -> float:
    return 1.4826 * _median(np.abs(d - _median(d))) if len(d) else 0.0


def _wins_var(d: np.ndarray) -> float:
    """Variance of ``d`` about its median with values beyond 4 robust sd (MAD) clipped: as efficient as
    the sample variance on Gaussian data (the MAD alone needs ~2.7x the points for the same precision),
    yet a few spikes or level shifts among the values barely move it."""
    if not len(d):
        return 0.0
    m = _median(d)
    s = _mad_sd(d)
    w = np.clip(d - m, -4.0 * s, 4.0 * s)
    return float(np.mean(w * w))


def block_sigma(values, m: int) -> float:
    """Long-run noise sd seen at the scale of ``m``-point means: ``sqrt(m / 2) * sd(D)`` with ``D`` the
    differences between the means of adjacent ``m``-point blocks at every position (MAD: a spike moves
    the 2m differences whose blocks hold it, so the estimate must tolerate a large share of outliers).
    White noise gives its sd; autocorrelated noise of any form (not only AR(1): a mixture of slow and
    fast wandering) gives what a comparison of ``m``-point means actually sees. NaNs are ignored."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    m = int(m)
    if m < 1 or len(x) < 2 * m + 2:
        return 0.0
    c = np.concatenate(([0.0], np.cumsum(x)))
    mean = (c[m:] - c[:-m]) / m                  # mean of x[t:t+m] for t = 0 .. n-m
    D = mean[m:] - mean[:-m]
    return math.sqrt(m / 2.0) * _mad_sd(D)


def noise_scales(values) -> tuple[float, float, float]:
    """Robust noise of a series that may be autocorrelated: ``(sigma, rho, sigma_lr)``.

    With AR(1) noise of coefficient r and marginal variance g, the first differences have variance
    ``v1 = 2 g (1 - r)`` and the lag-2 differences ``v2 = 2 g (1 - r^2) = v1 (1 + r)``; both are taken
    robustly (winsorized at 4 MAD-sd: level shifts and spikes touch few differences), so
    ``r = v2 / v1 - 1`` (clipped to ``[0, RHO_MAX]``), the marginal sd ``sigma = sqrt(v1 / (2 (1 - r)))``
    and the long-run sd (the sd of a segment mean times sqrt(its length), what a mean-shift test needs)
    ``sigma_lr = sigma * sqrt((1 + r) / (1 - r))``. White noise: r ~ 0 and sigma_lr = sigma =
    :func:`noise_sigma`. Smooth curves (trends, seasonality, random walks) have differences that are
    themselves smooth: r reaches its cap and sigma_lr grows accordingly. NaNs are ignored; zeros for
    fewer than 4 finite values.
    """
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < 4:
        return 0.0, 0.0, 0.0
    v1 = _wins_var(np.diff(x))
    v2 = _wins_var(x[2:] - x[:-2])
    if not v1 > 0:
        return 0.0, 0.0, 0.0
    r = min(max(v2 / v1 - 1.0, 0.0), RHO_MAX)
    g = v1 / (2.0 * (1.0 - r))
    return math.sqrt(g), r, math.sqrt(g * (1.0 + r) / (1.0 - r))


def segment_noise(values, edges, m: int) -> float:
    """Long-run noise sd of a series cut at ``edges`` (0, change points..., n), from within the segments
    only: the larger of the AR(1) long-run sd of :func:`noise_scales` (differences inside segments) and
    :func:`block_sigma` at scale ``m`` (block differences inside segments), pooled over the segments
    (each contributes its differences). 0.0 when no segment is long enough."""
    x = np.asarray(values, dtype=np.float64)
    d1, d2, D = [], [], []
    m = int(m)
    for a, b in zip(edges[:-1], edges[1:]):
        seg = x[a:b]
        seg = seg[np.isfinite(seg)]
        if len(seg) >= 4:
            d1.append(np.diff(seg))
            d2.append(seg[2:] - seg[:-2])
        if m >= 1 and len(seg) >= 2 * m + 2:
            c = np.concatenate(([0.0], np.cumsum(seg)))
            mean = (c[m:] - c[:-m]) / m
            D.append(mean[m:] - mean[:-m])
    lr = 0.0
    if d1:
        v1, v2 = _wins_var(np.concatenate(d1)), _wins_var(np.concatenate(d2))
        if v1 > 0:
            r = min(max(v2 / v1 - 1.0, 0.0), RHO_MAX)
            lr = math.sqrt(v1 / (2.0 * (1.0 - r)) * (1.0 + r) / (1.0 - r))
    blk = math.sqrt(m / 2.0) * _mad_sd(np.concatenate(D)) if D else 0.0
    return max(lr, blk)


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """Running median of odd ``width`` with symmetric edges (``d c b a | a b c d``), so a spike on
    the last point is still outvoted. ``width <= 1`` returns ``x`` unchanged."""
    x = np.asarray(x, dtype=np.float64)
    h = int(width) // 2
    if h < 1 or len(x) < 2:
        return x
    if len(x) >= h:
        padded = np.concatenate((x[h - 1::-1], x, x[:-h - 1:-1]))
    else:
        padded = np.pad(x, h, mode="edge")
    n = len(x)
    win = np.stack([padded[j:j + n] for j in range(2 * h + 1)], axis=1)   # (n, width)
    win.sort(axis=1)
    return win[:, h]


def find(values, *, model: str = "l2", min_size: int = 5, penalty: float | None = None,
         jump: int = 1, c: float = PENALTY_C, smooth: int = 5, search: str = "bottomup",
         refine: bool = True, screen: bool = False, known=(), autocorr: bool = True,
         trend: bool = True, local: int = LOCAL, trend_t: float | None = TREND_T) -> list[int]:
    """Indices where a new segment of ``values`` begins (0 and ``len(values)`` excluded).

    Parameters
    ----------
    values : 1-D array-like of float. NaN/inf are dropped before the search and the returned indices
        refer to the original positions (a segment begins at the first finite value of it).
    model : ruptures cost ("l2" = shifts of the mean). The automatic penalty is calibrated for "l2";
        any other model needs an explicit ``penalty``.
    min_size : minimum segment length (points); a change needs ``min_size`` points on both sides.
        Series shorter than ``2 * min_size`` give ``[]``.
    penalty : cost per change point. Default (None): ``c * sigma_lr**2 * log(n)`` with ``sigma_lr`` the
        long-run noise sd of the raw series from :func:`noise_scales` (robust to spikes and the shifts
        themselves; inflated for autocorrelated noise, so AR(1) noise, seasonality and smooth curves do
        not pay for spurious changes). ``autocorr=False``: the white-noise ``sigma`` of :func:`noise_sigma`
        (the behaviour before the long-run correction).
    jump : grid of candidate positions for the ruptures search (1 = every point). With ``refine`` the
        positions are re-optimised to the exact point afterwards, so ``jump > 1`` costs little accuracy.
    c : penalty constant (default :data:`PENALTY_C` = 6, about 3x the BIC's 2 log n: conservative for
        series of unknown noise, including heavy-tailed noise).
    smooth : width of the running-median pre-filter (odd, default 5; 1 disables). It removes isolated
        spikes (checkpoint steps, single slow steps, up to ``smooth // 2`` in a row) while keeping level
        shifts in place, so the cheap mean-shift ("l2") cost stays robust.
    search : "bottomup" (default, ~0.1 s at n = 5,000), "binseg" (~0.4 s) or "pelt" (quadratic on long
        noisy series; use with ``jump > 1``).
    refine : for "l2": move every change point to its exact best position between its neighbours and
        drop any whose cost gain is below the penalty (fixes the grid positions of bottom-up merging);
        drop a first/last change whose unconstrained best position leaves fewer than ``min_size`` points
        at the edge (outliers on the last points, or a change seen with too few points after it yet).
    screen : for "l2": return ``[]`` at once when no single split of the (filtered) series gains more
        than the penalty — the test binary segmentation starts with. O(n) numpy instead of the search;
        it can only miss a short excursion that begins and ends inside the series without any single
        split paying for itself, which a streaming caller sees earlier, as a single change at the end.
    known : with ``screen``: indices of change points already known (reported before); the screen then
        asks whether any segment *between* them could be split further, so a window holding an
        already-reported change does not pay for a full search on every call.
    trend : for "l2": confirm every change against a local linear trend: on the points within ``local``
        of it (and inside its neighbouring segments), fit level + slope + a jump at the change; the jump
        must be at least ``trend_t`` standard errors, with the noise taken as the larger of ``sigma_lr``
        and the robust sd of that fit's residuals (the series' own wandering around it: a seasonal
        hump, a curve). A trend or a smooth curve cut into steps, which a piecewise-constant search
        does, is dropped; an abrupt shift is kept. Weakest first, repeated.
    local : half-width (points) of the local-trend confirmation (default :data:`LOCAL` = 50).
    trend_t : standard errors the jump needs in that confirmation (default :data:`TREND_T` = 5, the
        streaming detector's ``min_t``: one test at a known place, so no log n for the search; None:
        the jump must pay the whole penalty).

    Constant series, all-NaN and very short series return ``[]``.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    keep = np.flatnonzero(np.isfinite(x))
    y = x[keep]
    n = len(y)
    min_size = max(int(min_size), 1)
    if n < 2 * min_size or n < 3 or np.all(y == y[0]):
        return []
    if search not in _SEARCH:
        raise ValueError(f"unknown search {search!r} (choose from {sorted(_SEARCH)})")
    if penalty is None:
        if model != "l2":
            raise ValueError(f"automatic penalty is calibrated for model='l2'; pass penalty for {model!r}")
        sigma = noise_scales(y)[2] if autocorr else noise_sigma(y)
        # Floor: exactly piecewise-constant data has MAD 0; keep a penalty relative to the level.
        scale = _median(np.abs(y)) or float(np.max(np.abs(y)))
        sigma = max(sigma, 1e-4 * scale, 1e-12)
        penalty = c * sigma * sigma * math.log(n)
    z = median_filter(y, int(smooth) | 1 if smooth > 1 else 1)
    if screen and model == "l2":
        known_clean = np.searchsorted(keep, np.asarray(list(known), dtype=np.int64))
        if _screen_gain(z, min_size, known_clean) < penalty:
            return []
    algo = _SEARCH[search](model=model, min_size=min_size, jump=max(int(jump), 1))
    try:
        bkps = [int(b) for b in algo.fit(z).predict(pen=float(penalty))[:-1]]
    except rpt.exceptions.BadSegmentationParameters:   # no admissible segmentation (jump/min_size)
        return []
    if refine and model == "l2" and bkps:
        bkps = _refine_l2(z, bkps, min_size, float(penalty))
    if trend and model == "l2" and bkps:
        slr = noise_scales(y)[2] if autocorr else noise_sigma(y)
        need = float(penalty) if trend_t is None else trend_t * trend_t * max(slr, 1e-300) ** 2
        bkps = _confirm_jumps(y, z, bkps, need, slr, int(local))
    return [int(keep[b]) for b in bkps]


def _jump_gain(y: np.ndarray, z: np.ndarray, a: int, t: int, b: int, local: int, slr: float) -> float:
    """The l2 gain of a jump at ``t`` once a local level and slope are allowed, in units of the penalty's
    noise: ``jump^2 / var-factor * (slr / s)^2`` with s = max(slr, robust sd of the fit's residuals on the
    raw values), on the points ``[max(a, t - local), min(b, t + local))`` of the filtered series."""
    lo, hi = max(a, t - local), min(b, t + local)
    if hi - lo < 4 or t - lo < 1 or hi - t < 1:
        return math.inf
    i = np.arange(lo, hi, dtype=np.float64)
    X = np.stack((np.ones(hi - lo), (i - t) / (hi - lo), (i >= t).astype(np.float64)), axis=1)
    try:
        inv = np.linalg.inv(X.T @ X)
    except np.linalg.LinAlgError:
        return math.inf
    beta = inv @ (X.T @ z[lo:hi])
    res = y[lo:hi] - X @ beta
    s = max(slr, _mad_sd(res), 1e-300)
    return float(beta[2] ** 2 / inv[2, 2]) * (slr / s) ** 2 if slr > 0 else float(beta[2] ** 2 / inv[2, 2])


def _confirm_jumps(y, z, bkps: list[int], pen: float, slr: float, local: int) -> list[int]:
    """Drop, weakest first, the change points whose jump does not pay ``pen`` against a local trend
    (:func:`_jump_gain` with the neighbouring change points as the window's limits)."""
    n = len(z)
    bk = list(bkps)
    while bk:
        e = [0] + bk + [n]
        g = [_jump_gain(y, z, e[j - 1], e[j], e[j + 1], local, slr) for j in range(1, len(e) - 1)]
        j = int(np.argmin(g))
        if g[j] >= pen:
            break
        del bk[j]
    return bk


def _l2_cost(z: np.ndarray):
    """The l2 segment cost of ``z`` over [a, b) (vectorised over a and/or b), from cumulative sums."""
    c1 = np.concatenate(([0.0], np.cumsum(z)))
    c2 = np.concatenate(([0.0], np.cumsum(z * z)))

    def cost(a, b):
        s = c1[b] - c1[a]
        return (c2[b] - c2[a]) - s * s / (b - a)
    return cost


def _screen_gain(z: np.ndarray, min_size: int, known=()) -> float:
    """Largest l2 cost gain of one more split of ``z`` (the first step of binary segmentation), given
    the change points ``known`` are already there (each first re-placed at its best position within
    ``±min_size``). O(n) numpy."""
    n = len(z)
    cost = _l2_cost(z)
    k = sorted({int(i) for i in known if 0 < i < n})
    for j in range(len(k)):
        a = k[j - 1] if j else 0
        b = k[j + 1] if j + 1 < len(k) else n
        t = np.arange(max(a + 1, k[j] - min_size), min(b - 1, k[j] + min_size) + 1)
        if len(t):
            k[j] = int(t[np.argmin(cost(a, t) + cost(t, b))])
    edges = [0] + k + [n]
    best = 0.0
    for a, b in zip(edges[:-1], edges[1:]):
        t = np.arange(a + min_size, b - min_size + 1)
        if len(t):
            best = max(best, float(np.max(cost(a, b) - cost(a, t) - cost(t, b))))
    return best


def _refine_l2(z: np.ndarray, bkps: list[int], min_size: int, pen: float) -> list[int]:
    """Exact local re-optimisation of mean-shift change points, then backward elimination of those whose
    gain (cost of the merged segment minus the two parts) is below ``pen``. O(n) numpy per point."""
    n = len(z)
    cost = _l2_cost(z)

    def best_in(a, b):  # best single split of [a, b) and its cost, or None
        t = np.arange(a + min_size, b - min_size + 1)
        if len(t) == 0:
            return None, np.inf
        tc = cost(a, t) + cost(t, b)
        k = int(np.argmin(tc))
        return int(t[k]), float(tc[k])

    def ascend(bk):  # coordinate ascent on positions, converges in 1-2 passes
        for _ in range(5):
            moved = False
            for j in range(len(bk)):
                a = bk[j - 1] if j else 0
                b = bk[j + 1] if j + 1 < len(bk) else n
                t, _c = best_in(a, b)
                if t is not None and t != bk[j]:
                    bk[j], moved = t, True
            if not moved:
                break
        return bk

    def edges_short(bk):  # first/last point whose free optimum leaves < min_size at the series edge
        drop = []
        for j in {0, len(bk) - 1}:
            a = bk[j - 1] if j else 0
            b = bk[j + 1] if j + 1 < len(bk) else n
            t = np.arange(a + 1, b)
            u = int(t[np.argmin(cost(a, t) + cost(t, b))])
            if (j == 0 and u < min_size) or (j == len(bk) - 1 and u > n - min_size):
                drop.append(j)
        return drop

    bk = ascend(sorted(set(bkps)))
    while bk:
        # A change whose best free position sits closer than min_size to either end of the series is
        # an edge artefact (outliers in the last points, or a change with too few points after it yet),
        # even though the constrained search had to place it min_size away.
        drop = edges_short(bk)
        if not drop:
            break
        bk = ascend([b for j, b in enumerate(bk) if j not in drop])
    while bk:
        # Improving moves on the penalised cost: drop one point (gain < pen), or merge two neighbours
        # into one re-placed point (fixes pairs that straddle a single change, as bottom-up leaves them).
        edges = [0] + bk + [n]
        best_delta, best_bk = 0.0, None
        for j in range(1, len(edges) - 1):
            a, t, b = edges[j - 1], edges[j], edges[j + 1]
            delta = float(cost(a, b) - cost(a, t) - cost(t, b)) - pen  # objective change of dropping t
            if delta < best_delta:
                best_delta, best_bk = delta, bk[:j - 1] + bk[j:]
            if j + 1 < len(edges) - 1:
                c_ = edges[j + 2]
                u, uc = best_in(a, c_)
                if u is not None:
                    delta = uc - float(cost(a, t) + cost(t, b) + cost(b, c_)) - pen
                    if delta < best_delta:
                        best_delta, best_bk = delta, bk[:j - 1] + [u] + bk[j + 1:]
        if best_bk is None:
            break
        bk = ascend(best_bk)
    return bk

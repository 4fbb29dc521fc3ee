"""What the change-point detector reads of single ranks: per step, the least busy time and the least time
in collectives over the sampled ranks, and whether a change of a small job is one rank's (left to
``slow_rank``). See :class:`~stepwatch.detectors.changepoint.ChangePoint`."""
from __future__ import annotations

import numpy as np

from .cpsearch import _median

#: the most ranks a stage may have for :func:`one_ranks` to judge (what ``slow_rank`` judges pairwise)
SMALL_STAGE = 4


def least_busy(sub) -> np.ndarray:
    """Per step, the least busy time of the sampled ranks (NaN where none reported)."""
    b = sub.busy_ms
    with np.errstate(all="ignore"):
        m = np.where(np.isnan(b), np.inf, b).min(axis=1) if b.shape[1] else np.full(len(b), np.inf)
    return np.where(np.isfinite(m), m, np.nan)


def least_in_collectives(sub) -> np.ndarray:
    """Per step, the least time in collectives (``comm_ms + comm_wait_ms``) over the sampled ranks that
    report comm (NaN where none does): the rank that arrived last waited for nobody."""
    c = sub.comm_ms
    tot = np.where(np.isfinite(c), c + np.nan_to_num(sub.comm_wait_ms), np.nan)
    out = np.full(tot.shape[0], np.nan)
    ok = np.isfinite(tot).any(axis=1)
    if ok.any():
        out[ok] = np.nanmin(tot[ok], axis=1)
    return out


def one_ranks(ctx, lead: dict, ph: np.ndarray, col: int) -> bool:
    """Whether a change (``lead``: its series, segments ``(a, i, b)``, levels before and after) of the step
    time or of a rank's own phase (not the transfer, ``comm_ms``) in a job of small stages (at most
    SMALL_STAGE ranks each) is one rank's: the least busy time (``ph[:, col]``, :func:`least_busy`) moved
    by less than half the change.

    In synchronous training the job's own slowdown (a slower model step, slower reads on every rank, a
    slower machine) moves every rank's busy time; a straggler moves its own, and the others wait for it.
    With 2 ranks the median busy time is their mean and moves by half the straggler's excess, and its
    phase (compute, data, GC) moves the job's median phase with it: a ``regression`` beside the
    ``slow_rank`` that names the rank (measured: ``stepwatch eval --real``'s sleep-r1, a 15 ms sleep in rank
    1's forward: the rank named at step 122 and a job-wide ``regression`` of its compute time, +31.8 %, at
    124, a second alert of the one fault; rank 0's busy time stayed at 25 ms, its wait went 1 -> 17 ms).
    Slower reads on every rank move every rank's busy time and are reported."""
    if lead["series"] == "comm_ms":
        return False
    stages = np.asarray(ctx.stage)
    if stages.size:
        if int(np.unique(stages, return_counts=True)[1].max()) > SMALL_STAGE:
            return False
    elif len(ctx.nodes) > SMALL_STAGE:
        return False
    a, i, b = lead["seg"]
    lb, la = _median(ph[a:i, col]), _median(ph[i:b, col])
    d = float(lead["after"] - lead["before"])             # the step time's or the phase's change (ms)
    if not (np.isfinite(lb) and np.isfinite(la) and np.isfinite(d)) or d == 0:
        return False
    return abs(la - lb) < 0.5 * abs(d)

"""The ``dataloader`` detector (:class:`DataLoader`): the distribution of the DataLoader's ready-batch queue
per rank; mostly empty with a material data wait alerts ``dataloader_starved`` (cause ``io``) with the
concrete remedy."""
from __future__ import annotations

import numpy as np

from .base import Alert, Detector, JobContext, StepBlock
from .settings import Setting
from .causes import DATALOADER_SUGGESTION, queue_evidence
from .effcommon import _Episodes, _r


def _nanmedian_axis0(a: np.ndarray) -> np.ndarray:
    """``np.nanmedian(a.astype(float64), axis=0)``, the same values, for a short axis 0 (steps) and many
    columns (ranks): one sort down the columns in the array's own dtype (NaN sorts last; a float32 ring is
    neither transposed nor widened first: float32 -> float64 is exact and keeps the order, so the two
    middle values are the same) and the mean of the two middle values in float64, instead of numpy's
    masked-array path (~10x slower at 20 x 16,384; at 20 x 100,000 the sort of a transposed float64 copy
    took ~14 ms, this ~8)."""
    if a.shape[1] == 0:
        return np.zeros(0)
    s = np.sort(a if a.dtype in (np.float32, np.float64) else a.astype(np.float64), axis=0)
    n = s.shape[0] - np.isnan(s).sum(axis=0)
    lo = np.maximum((n - 1) // 2, 0)[None, :]
    hi = np.maximum(n // 2, 0)[None, :]
    return ((np.take_along_axis(s, lo, axis=0).astype(np.float64)
             + np.take_along_axis(s, hi, axis=0).astype(np.float64)) / 2.0)[0]


def _median_at_least(a: np.ndarray, thr: float, n: np.ndarray | None = None,
                     c: np.ndarray | None = None, cols: np.ndarray | None = None) -> np.ndarray:
    """Per column, ``np.nan_to_num(np.nanmedian(a, axis=0)) >= thr`` (the same answer) by counting: the
    median (mean of the two middle values) is >= thr when the lower middle is, < thr when the upper middle
    is below; only columns with thr between the two middles need their median. ``n`` / ``c``: the counts of
    values and of values >= thr per column when the caller keeps them (then only ``a[:, amb]`` is read).
    ``cols``: the columns of ``a`` asked about (``a[:, cols]``, not copied for the counts)."""
    if cols is not None and (n is None or c is None):
        a, cols = a[:, cols], None
    if n is None or c is None:
        x = a.astype(np.float64)
        n = x.shape[0] - np.isnan(x).sum(axis=0)
        c = (x >= thr).sum(axis=0)                           # NaN compares False
    lo, hi = np.maximum((n - 1) // 2, 0), n // 2
    out = (n > 0) & (c >= n - lo)                            # the lower middle >= thr
    amb = (n > 0) & ~out & (c >= n - hi)                     # upper middle >= thr > lower middle
    if amb.any():
        out[amb] = _nanmedian_axis0(a[:, amb if cols is None else cols[amb]].astype(np.float64)) >= thr
    if thr <= 0:
        out |= n == 0                                        # an all-NaN median counts as 0
    return out


class DataLoader(Detector):
    """DataLoader queue analysis (``dataloader_starved``, cause ``io``).

    The probe samples the DataLoader's ready batches (``data_queue``) at the start of every step. Over the
    last ``window`` steps (evaluated when the step number enters a new multiple of ``every``), per rank:
    the share of reported steps with an empty queue and the median data wait as a share of the step. A
    rank is *starved* when its queue was empty on at least ``empty_share`` of at least ``min_steps``
    reported steps and its data wait is at least ``min_data_share`` of the step: the workers cannot keep
    up (preprocessing or reading too slow, or a single-process loader, which never prefetches). A queue
    mostly at its fullest (``full_share`` in the evidence) says I/O is not the bottleneck. When at least
    ``job_share`` of the reporting ranks are starved the alert is job-wide (no ranks), otherwise it names
    the ranks and nodes. Resolves after ``clear`` evaluations without. The remedy names the DataLoader
    settings: num_workers, prefetch_factor, pin_memory, persistent_workers.

    Settings: :attr:`SETTINGS` (the list below is made from it).
    """

    name = "dataloader"

    SETTINGS = (
        Setting("window", 20, 1, 100000, "steps", "steps per evaluation (at least 2)", live=False),
        Setting("every", 10, 1, 100000, "steps", "evaluate when the step number enters a new multiple of this"),
        Setting("min_steps", 8, 1, 100000, "steps", "reported steps a rank needs in the window", live=False),
        Setting("empty_share", 0.8, 0.0, 1.0, "share", "share of steps with an empty queue (above 0)"),
        Setting("min_data_share", 0.1, 0.0, 1.0, "share of the step", "data wait as a share of the step time"),
        Setting("job_share", 0.5, 0.0, 1.0, "share of the ranks", "share of starved ranks for a job-wide alert"),
        Setting("clear", 2, 1, 100000, "evaluations", "evaluations without to resolve", live=False),
    )

    def __init__(self, **kw):
        self._bind(kw)
        self._eps = _Episodes(self.clear)
        self._R = -1
        self._q = self._d = None
        # per rank, over the ring: queue depths reported, empty queues, data shares reported, data shares
        # >= _thr (kept as steps enter and leave it: an evaluation reads counts, not the (window, R) ring)
        self._nq = self._ne = self._nd = self._nge = None
        self._thr = None
        self._st = np.full(self.window, -1, dtype=np.int64)
        self._te = np.zeros(self.window, dtype=np.int64)
        self._n = 0
        self._bucket = None

    def _derive(self) -> None:
        if self.window < 2 or self.every < 1 or self.min_steps < 1 or not 0 < self.empty_share <= 1 or \
                self.clear < 1:
            raise ValueError("dataloader: need window >= 2, every >= 1, min_steps >= 1, 0 < empty_share <= 1, "
                             "clear >= 1")

    def _reset(self, R: int) -> None:
        self._R = R
        self._q = np.full((self.window, R), np.nan, dtype=np.float32)    # ready batches
        self._d = np.full((self.window, R), np.nan, dtype=np.float32)    # data wait / step time
        self._st.fill(-1)
        self._n = 0
        self._nq, self._ne, self._nd, self._nge = (np.zeros(R, dtype=np.int32) for _ in range(4))
        self._thr = None

    def _count(self, q: np.ndarray, d: np.ndarray, sign: int) -> None:
        """Add (``sign`` 1) or take out (-1) one ring row's values from the per-rank counts."""
        for acc, m in ((self._nq, np.isfinite(q)), (self._ne, q == 0), (self._nd, np.isfinite(d)),
                       (self._nge, d.astype(np.float64) >= self._thr)):     # the test in float64, as before
            if sign > 0:
                acc += m
            else:
                acc -= m

    def _recount(self) -> None:
        """The counts over the whole ring (a new ``min_data_share``)."""
        self._thr = float(self.min_data_share)
        x = self._d.astype(np.float64)
        self._nq[:] = np.isfinite(self._q).sum(axis=0)
        self._ne[:] = (self._q == 0).sum(axis=0)
        self._nd[:] = x.shape[0] - np.isnan(x).sum(axis=0)
        self._nge[:] = (x >= self._thr).sum(axis=0)

    def prepare(self, ctx: JobContext) -> None:
        """The rings and counts of a job whose width is known before its first block (the counts of the
        empty ring taken now, as the first update would)."""
        R = int(getattr(ctx, "world_size", 0) or 0)
        if R > 0 and R != self._R and self._n == 0:                     # (a block seen: its width rules)
            self._reset(R)
            self._recount()

    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2 or block.step_ms.shape[1] == 0 or block.data_queue is None:
            return []
        R = block.step_ms.shape[1]
        if R != self._R:
            self._reset(R)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = (block.data_ms / block.step_ms).astype(np.float32)
        out = []
        if self._thr != float(self.min_data_share):
            self._recount()
        for s in range(S):
            i = self._n % self.window
            self._count(self._q[i], self._d[i], -1)
            self._q[i], self._d[i] = block.data_queue[s], share[s]
            self._count(self._q[i], self._d[i], 1)
            self._st[i], self._te[i] = block.steps[s], block.t_end[s]
            self._n += 1
            b = int(block.steps[s]) // self.every
            if b != self._bucket:
                self._bucket = b
                out += self._evaluate(ctx, int(block.steps[s]))
        return out

    def _evaluate(self, ctx: JobContext, step_now: int) -> list[Alert]:
        q = self._q
        nrep = self._nq
        t_now = int(self._te[(self._n - 1) % self.window])
        present: set = set()
        alerts: list[Alert] = []
        ok = nrep >= self.min_steps
        if ok.any():
            with np.errstate(invalid="ignore", divide="ignore"):
                empty = self._ne / np.maximum(nrep, 1)
            # median data share >= min_data_share, only where the queue test holds (usually no rank),
            # by counting; the medians themselves only for an alert being assembled
            cand = np.flatnonzero(ok & (empty >= self.empty_share))
            starved = np.zeros(q.shape[1], dtype=bool)
            starved[cand] = _median_at_least(self._d, self.min_data_share, self._nd[cand], self._nge[cand],
                                             cols=cand)
            if starved.any():
                dshare = np.full(q.shape[1], np.nan)
                job_wide = starved.sum() >= self.job_share * ok.sum()
                ranks = [] if job_wide else np.flatnonzero(starved).tolist()
                key = "job" if job_wide else "ranks:" + ",".join(map(str, ranks[:64]))
                present.add(key)
                step_first = int(self._st[self._st >= 0].min())

                def make():
                    dshare[starved] = _nanmedian_axis0(self._d if starved.all() else self._d[:, starved])
                    return self._alert(ctx, q, empty, dshare, starved, ok, ranks, step_first,
                                       step_now, t_now)
                alerts += self._eps.seen(key, make)
        return alerts + self._eps.sweep(present, step_now, t_now)

    def _alert(self, ctx, q, empty, dshare, starved, ok, ranks, step_first, step_now, t_now) -> Alert:
        ev = queue_evidence(q if starved.all() else q[:, starved])        # (job-wide: no copy)
        ds = float(np.nanmedian(dshare[starved]))
        ev.update({"starved_ranks": int(starved.sum()), "reporting_ranks": int(ok.sum()),
                   "data_share_of_step": _r(ds),
                   "others": queue_evidence(q[:, ok & ~starved]) if (ok & ~starved).any() else None})
        who = (f"job {ctx.job}" if not ranks else
               f"rank(s) {', '.join(map(str, ranks[:8]))}{' …' if len(ranks) > 8 else ''} on "
               f"{', '.join(sorted({ctx.node_of(r) for r in ranks})[:4])}")
        return Alert(job=ctx.job, kind="dataloader_starved", status="firing", step_first=step_first,
                     step_detected=step_now, t_detected=t_now, ranks=ranks, nodes=[ctx.node_of(r) for r in ranks],
                     cause="io", evidence=ev, cost_pct=round(100.0 * ds, 3),
                     severity="critical" if ds > 0.2 else "warning",
                     suggestion=(f"Data loader starved ({who}): the prefetch queue was empty on "
                                 f"{100 * ev['empty_share']:.0f}% of steps while waiting for data took "
                                 f"{100 * ds:.0f}% of the step. " + DATALOADER_SUGGESTION))

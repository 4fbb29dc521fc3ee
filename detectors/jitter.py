"""Jitter: the share of steps slower than 1.1x their baseline, isolated spikes, checkpoint cadence, and
what coincided with the slow steps."""
from __future__ import annotations

import math
from collections import Counter, deque

import numpy as np

from .base import Alert, Detector, JobContext, StepBlock
from .settings import Setting
from .causes import PHASE_CAUSE, SUGGESTIONS, host_gap, nanmedian
from .steady import SteadyGate

_PH = ("data_ms", "compute_ms", "comm_ms", "gc_ms", "host_gap_ms")
def swv_pad(x: np.ndarray, w: int) -> np.ndarray:
    """Sliding windows of width ``w`` ending at each element (the first ones shorter, padded with the
    first value)."""
    from numpy.lib.stride_tricks import sliding_window_view
    return sliding_window_view(np.concatenate((np.full(w - 1, x[0]), x)), w)


_CAUSE_WORD = {"io": "data wait", "gc": "GC pause", "cpu": "host CPU gap", "communication": "communication",
               "computation": "computation"}


class Jitter(Detector):
    """Step-time jitter of a job (alert kind ``jitter``): the field's "fluctuation" ratio, the share of
    steps slower than ``threshold`` x their baseline, and what coincided with the slow steps.

    Per closed step the job's step time v (median over ranks) is compared with its baseline
    ``b = max(median of the previous baseline steps, median of the last 5 steps)``: the first term is
    the level before the step, the second follows a level shift within 3 steps (a regression is the
    change-point detector's, not jitter), and neither is moved by isolated spikes. A step is *slow* when
    ``v > threshold * b``; a slow step whose neighbours are not slow is an isolated *spike*.

    Checkpoints: slow steps where most ranks were slower (the median rank's busy time grew by at least
    half the excess; one rank's hiccup only makes the others wait) that fall on a regular lattice
    (``min_periods`` in a row ``P >= min_every`` steps apart, with no other such step in between:
    random job-wide stalls rarely line up like that) are
    checkpoint cadence: reported in the evidence (``checkpoint_every``), not counted, unless
    ``alarm_checkpoints``. The cadence is dropped after two lattice points without a slow step.

    Fires when at least ``ratio`` of the last ``window`` judged steps are slow (default 4 of 20), and
    resolves when at most one of the last ``clear_window`` steps was slow. Evidence: slow steps and
    spikes, the ratio over the window and over the kept history, the checkpoint cadence, and what
    coincided: for each slow step the phase of the rank that gated it (the busiest rank) that grew most
    over that phase's recent median (data wait -> io, GC pause -> gc, host gap -> cpu, comm ->
    communication, compute -> computation); the share of slow steps each explains; the gating rank
    when one rank gated at least 60% of them (then the alert names it); GC records inside the slow vs
    the other steps; the host CPU and iowait of the gating nodes in slow vs other steps. Cause: the
    phase explaining most slow steps (``unknown`` below 40%). Cost: the slow steps' excess over their
    baselines as a share of the window's time.

    Work per step: O(R) for the busiest rank plus medians over at most 256 sampled ranks. State: rings
    of the last ``history`` steps (a few numbers per step).

    Settings: :attr:`SETTINGS` (the list below is made from it).
    """

    name = "jitter"

    SETTINGS = (
        Setting("threshold", 1.1, 1.0, None, "x baseline", "a step is slow above this multiple of its baseline "
                "(above 1)"),
        Setting("window", 20, 1, 100000, "steps", "judged steps the ratio is taken over (at least 2)", live=False),
        Setting("ratio", 0.2, 0.0, 1.0, "share", "fire at this share of slow steps in the window (4 of 20)"),
        Setting("clear_window", 40, 1, 100000, "steps", "resolve when at most one of this many steps was slow "
                "(at least 2)", live=False),
        Setting("baseline", 21, 1, 100000, "steps", "steps of the trailing median baseline (at least 3)",
                live=False),
        Setting("spike", 1.3, 1.0, None, "x baseline", "an isolated slow step above this multiple is reported as "
                "a spike"),
        Setting("min_periods", 4, 2, 1000, "periods", "lattice points in a row that make a checkpoint cadence",
                live=False),
        Setting("min_every", 5, 1, 100000, "steps", "shortest checkpoint period (steps) recognised (at least 2)"),
        Setting("alarm_checkpoints", False, unit="switch", meaning="count checkpoint steps as slow steps"),
        Setting("history", 256, 8, 1000000, "steps", "steps kept for evidence and the long-run ratio (more than "
                "window, clear_window and baseline + 5)", live=False),
        Setting("warmup", 20, 0, 100000, "steps", "the job's first steps seen are not judged nor a baseline: "
                "allocator growth, autotuning, compilation and DDP's bucket rebuild make them no steady state",
                live=False),
        Setting("steady", True, unit="switch", meaning="nothing is judged until the job's step time is steady "
                "(detectors.steady: its own stability says when the warm-up ended); slow steps count from the "
                "stable stretch on", live=False),
        Setting("native_alpha", 1e-3, 0.0, 1.0, "probability", "... and only when that many slow steps in the "
                "window are this unlikely at the job's own long-run rate of slow steps (see _unusual): heavy "
                "tails by nature are not an episode"),
    )

    def __init__(self, **kw):
        self._bind(kw)
        self.warmup, self._seen = max(0, self.warmup), 0
        self._steady = SteadyGate(min_steps=self.warmup) if self.steady else None   # warm-up judged by the data
        H = self.history
        self._n = 0
        self._step = np.full(H, -1, dtype=np.int64)
        self._t = np.zeros(H, dtype=np.int64)
        self._v = np.full(H, np.nan)
        self._b = np.full(H, np.nan)
        self._mb = np.full(H, np.nan)                 # median rank's busy time
        self._slow = np.zeros(H, dtype=bool)
        self._wide = np.zeros(H, dtype=bool)
        self._ckpt = np.zeros(H, dtype=bool)
        self._gate = np.full(H, -1, dtype=np.int64)
        self._gph = np.full((H, len(_PH)), np.nan)    # the gating rank's phases
        self._mph = np.full((H, len(_PH)), np.nan)    # the median rank's phases
        self._wide_steps: list[int] = []              # recent wide slow steps (cadence search)
        self._cad: tuple[int, int] | None = None      # (period, phase)
        self._cad_miss = 0
        self._cad_next = None
        self._open: Alert | None = None
        self._flags: deque = deque()                  # [step, slow, checkpoint] of recent judged steps
        self._keep = max(self.window, self.clear_window)
        self._nat = [0, 0]                            # judged steps and slow ones that left the flags (not firing)

    def _derive(self) -> None:
        if self.threshold <= 1 or not 0 < self.ratio <= 1 or self.window < 2 or self.baseline < 3 or \
                self.min_periods < 2:
            raise ValueError("jitter: need threshold > 1, 0 < ratio <= 1, window >= 2, baseline >= 3, "
                             "min_periods >= 2")
        if self.history < max(self.window, self.clear_window, self.baseline) + 5 or self.clear_window < 2:
            raise ValueError("jitter: history must exceed window, clear_window and baseline")
        self.min_every = max(2, self.settings["min_every"])

    # -- helpers ---------------------------------------------------------------------------------
    def _last(self, m: int) -> np.ndarray:
        """Ring indices of the last m steps pushed, oldest first."""
        m = min(m, self._n)
        return (self._n - m + np.arange(m)) % self.history

    def _counted(self, idx: np.ndarray) -> np.ndarray:
        s = self._slow[idx]
        return s if self.alarm_checkpoints else s & ~self._ckpt[idx]

    # -- streaming -------------------------------------------------------------------------------
    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2 or block.step_ms.shape[1] == 0:
            return []
        g = self._steady
        if g is not None and not g.steady:              # warm-up: the steps fill the history, none is judged
            g.warm(block)
            if g.steady:                                 # judged from the stable stretch on
                self._flags = deque(([int(self._step[i]), bool(self._slow[i]), bool(self._ckpt[i])]
                                     for i in self._last(self.history).tolist()
                                     if np.isfinite(self._b[i]) and self._step[i] >= g.start),
                                    maxlen=None)
                while len(self._flags) > self._keep:
                    self._native(self._flags.popleft())
        if self._seen < self.warmup:                  # the job's first steps (a gate's minimum)
            skip = min(self.warmup - self._seen, S)
            self._seen += skip
            if skip == S:
                return []
            block = block.tail(skip)
            S = len(block)
        R = block.step_ms.shape[1]
        cols = np.arange(0, R, max(1, -(-R // 256)))
        v = nanmedian(block.step_ms[:, cols], axis=1)                              # (S,)
        busy = np.asarray(block.busy_ms, dtype=np.float64)
        has = ~np.all(np.isnan(busy), axis=1)
        gate = np.full(S, -1, dtype=np.int64)
        if has.any():
            gate[has] = np.nanargmax(np.where(np.isnan(busy[has]), -np.inf, busy[has]), axis=1)
        mb = nanmedian(busy[:, cols], axis=1)
        ph = {"data_ms": block.data_ms, "compute_ms": block.compute_ms, "comm_ms": block.comm_ms,
              "gc_ms": block.gc_ms}
        rows = np.arange(S)
        g = np.maximum(gate, 0)
        gph = np.stack([ph[p][rows, g] for p in _PH[:4]]
                       + [host_gap(block.step_ms[rows, g], block.data_ms[rows, g], block.compute_ms[rows, g],
                                   block.comm_ms[rows, g], block.comm_wait_ms[rows, g], block.gc_ms[rows, g])],
                       axis=1)
        sub = {p: a[:, cols] for p, a in ph.items()}
        gap_s = host_gap(block.step_ms[:, cols], sub["data_ms"], sub["compute_ms"], sub["comm_ms"],
                         block.comm_wait_ms[:, cols], sub["gc_ms"])
        mph = np.stack([nanmedian(sub[p], axis=1) for p in _PH[:4]] + [nanmedian(gap_s, axis=1)], axis=1)
        ok = np.flatnonzero(np.isfinite(v) & (gate >= 0))
        if not len(ok):
            return []
        v, mb = v[ok], mb[ok]
        # baselines of the block's steps at once: trailing median of the previous `baseline` steps and
        # median of the last 5 (this one included), from the ring + the block
        nb = self.baseline
        hv = self._v[self._last(nb)]
        hm = self._mb[self._last(nb)]
        ext_v, ext_m = np.concatenate((hv, v)), np.concatenate((hm, mb))
        h0 = len(hv)
        b = np.full(len(v), np.nan)
        mbase = np.full(len(v), np.nan)
        for j in range(len(v)):                       # start-up: fewer than `baseline` steps before
            lo = max(0, h0 + j - nb)
            if h0 + j - lo >= nb:
                break
            if h0 + j - lo >= max(5, nb // 2):
                b[j] = float(np.median(ext_v[lo:h0 + j]))
                mbase[j] = float(np.median(ext_m[lo:h0 + j]))
        full = np.arange(len(v))[np.arange(len(v)) + h0 - nb >= 0]
        if len(full):
            from numpy.lib.stride_tricks import sliding_window_view as swv
            a0 = full[0] + h0 - nb
            b[full] = np.median(swv(ext_v[a0:h0 + full[-1]], nb), axis=1)
            mbase[full] = np.median(swv(ext_m[a0:h0 + full[-1]], nb), axis=1)
        k5 = np.concatenate((self._v[self._last(4)], v))
        off = len(k5) - len(v)
        last5 = np.median(swv_pad(k5, 5)[off:], axis=1)
        b = np.where(np.isfinite(b), np.maximum(b, last5), np.nan)
        with np.errstate(invalid="ignore"):
            slow = np.isfinite(b) & (v > self.threshold * b)
            wide = slow & (mb - mbase >= 0.5 * (v - b))
        alerts: list[Alert] = []
        for j, s in enumerate(ok.tolist()):
            alerts += self._push(ctx, int(block.steps[s]), int(block.t_end[s]), float(v[j]), float(b[j]),
                                 float(mb[j]), bool(slow[j]), bool(wide[j]), int(gate[s]), gph[s], mph[s])
        return alerts

    def _push(self, ctx, step, t_end, v, b, mb, slow, wide, gate, gph, mph) -> list[Alert]:
        i = self._n % self.history
        self._step[i], self._t[i], self._v[i], self._b[i], self._mb[i] = step, t_end, v, b, mb
        self._slow[i], self._wide[i], self._ckpt[i], self._gate[i] = slow, wide, False, gate
        self._gph[i], self._mph[i] = gph, mph
        self._n += 1
        g = self._steady
        if np.isfinite(b) and (g is None or g.steady and step >= g.start):
            self._flags.append([step, slow, False])
            if len(self._flags) > self._keep:
                self._native(self._flags.popleft())
        if wide or self._cad is not None:
            self._cadence(step, wide, i)
        return self._judge(ctx, step, t_end)

    def _cadence(self, step: int, wide: bool, i: int) -> None:
        """Track the checkpoint lattice on wide slow steps."""
        if self._cad is not None:
            P, phase = self._cad
            if (step - phase) % P == 0:
                if wide:
                    self._mark(i, step)
                    self._cad_miss = 0
                else:
                    self._cad_miss += 1
                    if self._cad_miss >= 2:
                        self._cad = None
                        self._cad_miss = 0
        if not wide or self._ckpt[i]:
            if wide:
                self._wide_steps = (self._wide_steps + [step])[-16:]
            return
        ws = self._wide_steps + [step]
        self._wide_steps = ws[-16:]
        m = self.min_periods
        wset = set(ws)
        for y in sorted(ws[:-1], reverse=True):
            P = step - y
            if P < self.min_every:
                continue
            lattice = [step - j * P for j in range(m)]
            if not all(x in wset for x in lattice):
                continue
            lo = lattice[-1]
            others = [x for x in ws if lo < x < step and (step - x) % P]
            if not others:
                self._cad, self._cad_miss = (P, step % P), 0
                idx = self._last(self.history)
                for x in lattice:                       # mark the lattice steps still in the ring
                    for h in idx[self._step[idx] == x].tolist():
                        self._mark(h, x)
                break

    def _mark(self, i: int, step: int) -> None:
        self._ckpt[i] = True
        for f in self._flags:
            if f[0] == step:
                f[2] = True

    def _native(self, f) -> None:
        """A judged step leaves the flags: into the job's own long-run rate of slow steps (not while an
        episode is open: its slow steps are the episode's, not the job's nature)."""
        if self._open is None:
            self._nat[0] += 1
            self._nat[1] += bool(f[1] and (self.alarm_checkpoints or not f[2]))

    def _unusual(self, c: int) -> bool:
        """Whether ``c`` slow steps of the last ``window`` are unlikely (below ``native_alpha``) at the
        job's own long-run rate of slow steps: a job whose steps are heavy-tailed by nature (a clean
        2-rank job with t(2.5) noise of 3%: about 6% of its steps above 1.1x) has 4 of 20 by chance every
        few hundred steps, which is its nature, not an episode. The rate is the slow share of the judged
        steps older than the last ``max(window, clear_window)`` (an episode's own first slow steps are not
        its baseline), with a prior of 2% worth 20 steps: until the job has a history the rule is the
        plain one (4 of 20: P(X >= 4) = 6e-4 at 2%); a job with 6% slow steps by nature needs 7 of 20 once
        it has ~200 steps of history."""
        n, k = self._nat
        p = (k + 0.4) / (n + 20.0)
        W = self.window
        tail = sum(math.comb(W, j) * p ** j * (1.0 - p) ** (W - j) for j in range(c, W + 1))
        return tail < self.native_alpha

    def _count(self, m: int) -> tuple[int, int]:
        """(judged steps, counted slow steps) among the last m judged steps."""
        fl = list(self._flags)[-m:]
        if self.alarm_checkpoints:
            return len(fl), sum(1 for f in fl if f[1])
        return len(fl), sum(1 for f in fl if f[1] and not f[2])

    def _judge(self, ctx, step, t_end) -> list[Alert]:
        if self._open is not None:
            n, c = self._count(self.clear_window)
            if n >= self.clear_window and c <= 1:
                a = self._open
                self._open = None
                return [Alert(job=a.job, kind=a.kind, status="resolved", step_first=a.step_first,
                              step_detected=step, t_detected=t_end, ranks=list(a.ranks), nodes=list(a.nodes),
                              cause=a.cause, severity=a.severity, evidence=a.evidence, cost_pct=a.cost_pct,
                              suggestion=a.suggestion, alert_id=a.alert_id)]
            return []
        n, c = self._count(self.window)
        if n < self.window or c < math.ceil(self.ratio * self.window - 1e-9) or not self._unusual(c):
            return []
        win = self._last(self.history)
        ok = np.isfinite(self._b[win])
        if self._steady is not None and self._steady.start is not None:
            ok &= self._step[win] >= self._steady.start
        win = win[ok][-self.window:]
        a = self._alert(ctx, win, step, t_end)
        self._open = a
        return [a]

    # -- alert -----------------------------------------------------------------------------------
    def _alert(self, ctx, win, step, t_end) -> Alert:
        hist = self._last(self.history)
        hist = hist[np.isfinite(self._b[hist])]
        cnt = self._counted(win)
        slow_idx = win[cnt]
        step_first = int(self._step[slow_idx[0]])
        v, b = self._v[win], self._b[win]
        excess = np.where(cnt, v - b, 0.0)
        cost = float(np.sum(np.maximum(excess, 0.0)) / np.sum(v) * 100.0)
        # what coincided: per slow step, the gating rank's phase that grew most over the phase's median
        base = nanmedian(self._mph[hist], axis=0)                          # recent median-rank phases
        grow = self._gph[slow_idx] - base[None, :]
        dom = [PHASE_CAUSE[_PH[int(j)]] if np.isfinite(row).any() and np.nanmax(row) > 0 else "unknown"
               for row, j in zip(grow, np.argmax(np.where(np.isfinite(grow), grow, -np.inf), axis=1))]
        shares = {c: round(n / len(dom), 3) for c, n in Counter(dom).most_common()}
        top, top_share = next(iter(Counter(dom).most_common(1)))
        cause = top if top_share >= 0.4 and top != "unknown" else "unknown"
        gates = Counter(int(x) for x in self._gate[slow_idx])
        g_rank, g_n = gates.most_common(1)[0]
        ranks = [g_rank] if g_n >= 0.6 * len(slow_idx) and len(slow_idx) >= 3 else []
        wide_share = float(np.mean(self._wide[slow_idx]))
        spikes = []
        for j in slow_idx:
            pos = int(np.flatnonzero(hist == j)[0]) if np.any(hist == j) else -1
            left = pos <= 0 or not self._slow[hist[pos - 1]]
            right = pos < 0 or pos + 1 >= len(hist) or not self._slow[hist[pos + 1]]
            if left and right and self._v[j] >= self.spike * self._b[j]:
                spikes.append(int(self._step[j]))
        ev = {
            "slow_steps": [int(x) for x in self._step[slow_idx]][:20],
            "ratio_window": round(float(np.mean(cnt)), 3), "window": int(len(win)),
            "ratio_history": round(float(np.mean(self._counted(hist))), 3), "history_steps": int(len(hist)),
            "excess_pct_median": round(float(np.median((v[cnt] / b[cnt] - 1.0) * 100.0)), 1),
            "spikes": spikes[:20], "job_wide_share": round(wide_share, 3),
            "coincided": {_CAUSE_WORD.get(c, c): s for c, s in shares.items()},
            "gating_rank": {"rank": g_rank, "node": ctx.node_of(g_rank), "share": round(g_n / len(slow_idx), 3)},
        }
        if self._cad is not None:
            P, phase = self._cad
            ev["checkpoint_every"] = P
            ev["checkpoint_steps_excluded"] = int(np.count_nonzero(self._ckpt[hist] & self._slow[hist]))
        ev.update(self._records(ctx, slow_idx, win[~cnt]))
        cause, reason = self._confirm(cause, ev)
        ev["cause_reason"] = reason
        return Alert(job=ctx.job, kind="jitter", status="firing", step_first=step_first, step_detected=step,
                     t_detected=t_end, ranks=ranks, nodes=[ctx.node_of(r) for r in ranks], cause=cause,
                     severity="warning", evidence=ev, cost_pct=round(cost, 3), suggestion=SUGGESTIONS[cause])

    def _records(self, ctx, slow_idx, calm_idx) -> dict:
        """GC records and host samples in the slow steps vs the other steps of the window."""
        out = {}
        t_end = self._t

        def spans(idx):
            return [(int(t_end[j] - self._v[j] * 1e6), int(t_end[j])) for j in idx]

        w = getattr(ctx, "gc", None)
        if w is not None and len(w) and len(slow_idx):
            both = np.r_[slow_idx, calm_idx]
            lo = int(min(a for a, _ in spans(both)))
            t = w.select(lo, int(t_end[both].max()))
            if t is not None and "rank" in t.column_names:
                tt = t.column("t").cast("int64").to_numpy(zero_copy_only=False)
                rk = t.column("rank").to_numpy(zero_copy_only=False)
                dur = t.column("duration_ms").to_numpy(zero_copy_only=False).astype(float)

                def share(idx):
                    # steps whose gating rank paused for GC for at least 5% of the step inside it
                    if not len(idx):
                        return None
                    hit = 0
                    for (a, b), j in zip(spans(idx), idx):
                        m = (tt >= a) & (tt <= b) & (rk == self._gate[j])
                        hit += bool(m.any() and np.nansum(dur[m]) >= 0.05 * (b - a) / 1e6)
                    return round(hit / len(idx), 3)
                out["gc_records"] = {"slow_steps_gated_by_gc": share(slow_idx), "other_steps": share(calm_idx)}
        h = getattr(ctx, "host", None)
        if h is not None and len(h) and len(slow_idx):
            sl = [(a - 500_000_000, b + 500_000_000) for a, b in spans(slow_idx)]
            ca = [(a - 500_000_000, b + 500_000_000) for a, b in spans(calm_idx)]
            t = h.select(min(a for a, _ in sl + ca), max(b for _, b in sl + ca))
            if t is not None:
                tt = t.column("t").cast("int64").to_numpy(zero_copy_only=False)
                nodes = {ctx.node_of(int(g)) for g in self._gate[slow_idx]}
                nd = np.asarray(t.column("node").to_pylist(), dtype=object)
                on_gate = np.isin(nd, list(nodes))

                def med(col, ivs, mask):
                    if col not in t.column_names:
                        return None
                    x = t.column(col).to_numpy(zero_copy_only=False).astype(float)
                    m = np.zeros(len(tt), dtype=bool)
                    for a, b in ivs:
                        m |= (tt >= a) & (tt <= b)
                    m &= mask
                    return round(float(np.nanmedian(x[m])), 2) if m.any() else None
                allm = np.ones(len(tt), dtype=bool)
                out["host"] = {"gating_nodes_cpu_util": {"slow": med("cpu_util", sl, on_gate),
                                                         "other": med("cpu_util", ca, on_gate)},
                               "iowait": {"slow": med("cpu_iowait", sl, allm), "other": med("cpu_iowait", ca, allm)}}
        return out

    @staticmethod
    def _confirm(cause: str, ev: dict) -> tuple[str, str]:
        """Records that confirm (or name, when the phases do not) the cause."""
        g = ev.get("gc_records") or {}
        gs, go = g.get("slow_steps_gated_by_gc"), g.get("other_steps")
        if gs is not None and gs >= 0.6 and (go or 0.0) <= 0.3:
            return "gc", (f"in {gs:.0%} of the slow steps the gating rank paused for GC (GC records; "
                          f"other steps {go or 0:.0%})")
        hs = (ev.get("host") or {}).get("iowait") or {}
        if cause in ("unknown", "io") and hs.get("slow") is not None and hs.get("other") is not None \
                and hs["slow"] >= hs["other"] + 2.0:
            return "io", f"iowait {hs['slow']}% in slow steps vs {hs['other']}% otherwise"
        share = ev["coincided"].get(_CAUSE_WORD.get(cause, cause))
        return cause, ("phases of the gating rank" + (f" ({share:.0%} of slow steps)" if share else ""))

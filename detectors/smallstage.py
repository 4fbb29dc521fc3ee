"""Stragglers in stages too small for a peer median: each rank against its own recent past.

``slow_rank`` compares a rank's busy time with its stage peers' median and MAD, which needs a few peers
(``min_peers``, 4): with two or three ranks in a stage (a 2-rank DDP job, a small pipeline) the slow rank
*is* half of the median, and nothing is judged. This detector covers exactly those stages, and only them.

In synchronous training a rank that slows down by X makes its peers wait X longer in the next collective:
their step time rises, their busy time (step - comm wait) does not. So, per rank, with its *baseline* (the
median busy time of its last ``window`` unflagged steps, learned while it is not suspected):

    e_r = busy_r / baseline_r - 1            (its relative excess)
    d_r = e_r - median of e over its stage peers

A step flags rank r when ``d_r >= min_effect`` and ``d_r`` is at least ``z_min`` robust standard deviations
of the rank's own recent ``d`` (its noise). ``k`` flagged steps of the last ``n`` fire one ``slow_rank``
alert (kind shared with ``slow_rank``: one kind for one finding, whatever found it); ``clear_steps``
consecutive unflagged steps resolve it. While a rank is suspected its baseline does not learn.

Cause: :func:`~stepwatch.detectors.causes.attribute` of the rank's median phases over its flagged steps
against its own baseline phases (a rank compared with itself: what grew), then
:func:`~stepwatch.detectors.causes.decide` with the host / GC / comm evidence, as ``slow_rank`` does.
Cost: the excess over the baseline divided by the job's median step time (%).

State: (window, R) rings for busy and the phases and (n, R) rings for flags, only for ranks in small
stages; O(R) numpy per step. Settings: see :class:`SmallStage`.
"""
from __future__ import annotations

import numpy as np

from .base import Alert, Detector, JobContext, StepBlock
from .causes import (PHASES, SUGGESTIONS, attribute, comm_evidence, decide, gc_evidence, host_evidence,
                     nanmedian, phase_arrays)

_MAD_TO_SIGMA = 1.4826


class SmallStage(Detector):
    """Slow ranks in stages of 2..``max_stage`` ranks, each against its own baseline (module docstring).

    Settings (keyword arguments, defaults):
        max_stage=3      stages of at most this many reporting ranks are judged here (slow_rank judges larger ones)
        window=32        baseline: median of the rank's last unflagged steps
        warmup=32        steps of baseline a rank needs before it is judged
        k=6, n=13        flagged steps within the last n to fire
        clear_steps=20   consecutive unflagged steps to resolve (a shared core's contention comes and goes)
        min_effect=0.08  relative excess over the peers' (and over the baseline) for a flag
        z_min=4.0        ... in robust standard deviations of the rank's recent relative excess
        critical_pct=10.0  cost above which the alert is critical
    """

    name = "small_stage"

    def __init__(self, *, max_stage: int = 3, window: int = 32, warmup: int = 32, k: int = 6, n: int = 13,
                 clear_steps: int = 20, min_effect: float = 0.08, z_min: float = 4.0, critical_pct: float = 10.0):
        if not (2 <= max_stage and 4 <= warmup <= window and 1 <= k <= n and clear_steps >= 1):
            raise ValueError("small_stage: need max_stage >= 2, 4 <= warmup <= window, 1 <= k <= n, clear_steps >= 1")
        self.max_stage, self.window, self.warmup = int(max_stage), int(window), int(warmup)
        self.k, self.n, self.clear_steps = int(k), int(n), int(clear_steps)
        self.min_effect, self.z_min, self.critical_pct = float(min_effect), float(z_min), float(critical_pct)
        self._R = -1

    def _reset(self, R: int) -> None:
        W, n = self.window, self.n
        self._R = R
        self._busy = np.full((W, R), np.nan)            # baseline ring (unflagged steps only), per rank
        self._ph = {p: np.full((W, R), np.nan) for p in PHASES}
        self._bpos = np.zeros(R, dtype=np.int64)        # next slot per rank
        self._bn = np.zeros(R, dtype=np.int64)          # steps learned
        self._d = np.full((W, R), np.nan)               # recent relative excess vs peers (noise), per rank
        self._dpos = np.zeros(R, dtype=np.int64)
        self._flag = np.zeros((n, R), dtype=bool)
        self._fpos = 0
        self._active = np.zeros(R, dtype=bool)
        self._clean = np.zeros(R, dtype=np.int64)
        self._first = np.full(R, -1, dtype=np.int64)    # first flagged step of the current excursion
        self._open: dict[int, Alert] = {}
        self._hist: dict[int, list] = {}                # rank -> [(step, t_end, busy, cost, phases)] while flagged

    def _stages(self, ctx: JobContext, R: int) -> list[np.ndarray]:
        st = np.asarray(ctx.stage if ctx.stage is not None and len(ctx.stage) == R else np.zeros(R), dtype=np.int64)
        gid = ctx.dp_groups() if hasattr(ctx, "dp_groups") else None
        key = st if gid is None or len(gid) != R else np.asarray(gid, dtype=np.int64)
        _, inv = np.unique(key, return_inverse=True)
        groups = [np.flatnonzero(inv == g) for g in range(inv.max() + 1)] if R else []
        return [g for g in groups if 2 <= len(g) <= self.max_stage]

    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2 or block.step_ms.shape[1] < 2:
            return []
        R = block.step_ms.shape[1]
        if R != self._R:
            self._reset(R)
        groups = self._stages(ctx, R)
        if not groups:
            return []
        busy = np.asarray(block.busy_ms, dtype=np.float64)
        phases = phase_arrays(block)
        job_step = nanmedian(block.step_ms, axis=1)
        alerts: list[Alert] = []
        W = self.window
        for s in range(S):
            b = busy[s]
            with np.errstate(all="ignore"):
                base = nanmedian(self._busy, axis=0)                            # (R,)
                e = b / base - 1.0
            ready = (self._bn >= self.warmup) & np.isfinite(e)
            d = np.full(R, np.nan)
            for g in groups:
                ok = g[ready[g]]
                if len(ok) < 2:
                    continue
                for r in ok.tolist():                                           # 2-3 ranks: a tiny loop
                    peers = ok[ok != r]
                    d[r] = e[r] - float(np.median(e[peers]))
            with np.errstate(all="ignore"):
                med = nanmedian(self._d, axis=0)
                mad = nanmedian(np.abs(self._d - med), axis=0)
                scale = _MAD_TO_SIGMA * np.maximum(mad, 0.01)
                flag = (d >= self.min_effect) & (e >= self.min_effect) & ((d - np.nan_to_num(med)) >= self.z_min * scale)
            flag &= np.isfinite(d)
            step, t_end = int(block.steps[s]), int(block.t_end[s])
            self._flag[self._fpos % self.n] = flag
            self._fpos += 1
            counts = self._flag.sum(axis=0)
            # noise ring: steps that do not flag (a straggler's own excess is not its noise)
            quiet = np.flatnonzero(np.isfinite(d) & ~flag & ~self._active)
            self._d[self._dpos[quiet] % W, quiet] = d[quiet]
            self._dpos[quiet] += 1
            # baseline: learn unflagged steps of ranks that are not suspected
            learn = np.isfinite(b) & ~flag & ~self._active & (counts == 0)
            idx = np.flatnonzero(learn)
            if len(idx):
                slot = self._bpos[idx] % W
                self._busy[slot, idx] = b[idx]
                for p, arr in phases.items():
                    if p in self._ph:
                        self._ph[p][slot, idx] = arr[s, idx]
                self._bpos[idx] += 1
                self._bn[idx] += 1
            for r in np.flatnonzero(flag).tolist():
                if self._first[r] < 0:
                    self._first[r] = step
                h = self._hist.setdefault(r, [])
                cost = max(float(b[r] - base[r]), 0.0) / job_step[s] * 100.0 if job_step[s] > 0 else 0.0
                h.append((step, t_end, float(b[r]), float(base[r]), cost, {p: float(phases[p][s, r]) for p in PHASES}))
                del h[:-self.n]
            self._clean = np.where(flag, 0, self._clean + np.isfinite(b)).astype(np.int64)
            for r in np.flatnonzero(flag & (counts >= self.k) & ~self._active).tolist():
                alerts.append(self._fire(ctx, r, step, t_end))
            for r in np.flatnonzero(self._active & (self._clean >= self.clear_steps)).tolist():
                a = self._resolve(r, step, t_end)
                if a is not None:
                    alerts.append(a)
            for r in np.flatnonzero(~self._active & (counts == 0) & (self._first >= 0)).tolist():
                self._first[r] = -1                   # an excursion that never fired: forgotten
                self._hist.pop(r, None)
        return alerts

    def _fire(self, ctx: JobContext, r: int, step: int, t_end: int) -> Alert:
        h = self._hist.get(r, [])
        step_first = min(int(self._first[r]), step) if self._first[r] >= 0 else step
        busy = float(np.median([x[2] for x in h])) if h else float("nan")
        base = float(np.median([x[3] for x in h])) if h else float("nan")
        cost = float(np.mean([x[4] for x in h])) if h else 0.0
        before = {p: float(nanmedian(self._ph[p][:, r])) for p in PHASES}
        after = {p: float(np.median([x[5][p] for x in h])) if h else float("nan") for p in PHASES}
        phase_cause, ph_ev = attribute(before, after)
        t_lo = int(h[0][1]) - (int(h[1][1] - h[0][1]) if len(h) > 1 else 0) if h else t_end
        node = ctx.node_of(r)
        host = host_evidence(ctx, [node] if node else [], t_lo, t_end)
        gce = gc_evidence(ctx, [r], t_lo, t_end, steps=max(len(h), 1))
        comm = comm_evidence(ctx, [r], step_first, step)
        excess = busy - base if np.isfinite(busy) and np.isfinite(base) else None
        cause, reason = decide(phase_cause, host, gce, comm, excess)
        ev = {"busy_ms": _r(busy), "baseline_ms": _r(base),
              "effect_pct": _r((busy / base - 1.0) * 100.0, 2) if base and np.isfinite(base) else None,
              "flagged": f"{len(h)}/{self.n}", "fired_by": "own baseline (stage of <= "
              f"{self.max_stage} ranks)", "phase": ph_ev["phase"], "phases": ph_ev["phases"],
              "phase_cause": phase_cause, "cause_reason": reason}
        if host:
            ev["host"] = host
        if gce:
            ev["gc"] = gce
        if comm:
            ev["comm"] = comm
        a = Alert(job=ctx.job, kind="slow_rank", status="firing", step_first=step_first, step_detected=step,
                  t_detected=t_end, ranks=[r], nodes=[node], cause=cause,
                  severity="critical" if cost > self.critical_pct else "warning", evidence=ev,
                  cost_pct=round(cost, 3), suggestion=SUGGESTIONS[cause])
        self._active[r] = True
        self._open[r] = a
        return a

    def _resolve(self, r: int, step: int, t_end: int) -> Alert | None:
        self._active[r] = False
        self._first[r] = -1
        self._hist.pop(r, None)
        a = self._open.pop(r, None)
        if a is None:
            return None
        return Alert(job=a.job, kind=a.kind, status="resolved", step_first=a.step_first, step_detected=step,
                     t_detected=t_end, ranks=list(a.ranks), nodes=list(a.nodes), cause=a.cause,
                     severity=a.severity, evidence=dict(a.evidence, clean_steps=int(self._clean[r])),
                     cost_pct=a.cost_pct, suggestion=a.suggestion, alert_id=a.alert_id)


def _r(x, nd: int = 3):
    x = float(x)
    return None if not np.isfinite(x) else round(x, nd)

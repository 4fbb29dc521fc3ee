"""Slow rank (straggler) detection: each rank's busy time against its pipeline-stage peers."""
from __future__ import annotations

import numpy as np

from .base import Alert, Detector, JobContext, StepBlock
from .causes import PHASES, SUGGESTIONS, attribute, nanmedian, phase_arrays

_MAD_TO_SIGMA = 1.4826


class SlowRank(Detector):
    """Ranks persistently slower than their peers in the same pipeline stage (alert kind ``slow_rank``).

    Per closed step, busy time = ``StepBlock.busy_ms`` (step time minus the time blocked waiting for
    peers: in synchronous training all ranks share the step time and the slow rank waits least). Within
    each stage (``ctx.stage``; stages do different work and are never compared with each other) a rank
    is *flagged* on a step when both

    - its robust z-score ``(x - median) / (1.4826 * max(MAD, mad_floor * median)) >= z_min`` (the MAD
      floor keeps clean low-noise data from firing on sub-percent differences), and
    - its effect ``(x - median) / median >= min_effect`` (default 5%: smaller differences cost little and
      are common between healthy devices).

    Persistence: a rank fires when flagged on ``>= k`` of the job's last ``n`` steps; it resolves after
    ``clear_steps`` consecutive reported clean steps (a ``resolved`` alert with the same ``alert_id``);
    flags from before a resolution do not count towards the next firing. Defaults k=5 of n=13 catch a
    rank slow on one step in three (13 consecutive steps starting on a slow one hold 5 slow steps), and
    a persistent straggler fires on its 5th slow step. A healthy rank whose busy time crosses both
    thresholds independently with probability p per step fires with probability ~C(13,5) p^5 =
    1287 p^5 per step: heavy-tailed per-rank noise (the simulator's Student-t compute noise) gives
    p ~ 0.6%, i.e. ~1e-8 per rank-step, about one false alert per 6,000 steps of a 16k-rank job. On the
    simulator (16,384 ranks, 6 runs of 400 clean steps) k=4 of n=10 (210 p^4) gave 5 false alerts,
    k=5 of n=13 none.

    NaN ranks (not reported) are neither flagged nor counted as clean; a stage step with fewer than
    ``min_peers`` reporting ranks is not judged. Cost: the straggler's excess busy time over its stage
    median, divided by the job's median step time, averaged from the first flagged step of the run to
    detection (in %). Cause: :func:`~stepwatch.detectors.causes.attribute` of the rank's median phases
    vs its stage peers' over the flagged steps (compute up -> computation, data -> io, gc -> gc, host gap
    -> cpu, comm -> communication).

    Work per step is O(R) numpy: medians per stage, then window counts and clean runs for the whole
    block with one vector operation per step; alerts are assembled only for ranks with an event.
    State is a few (n, R) rings holding the last n steps.
    A change of the number of ranks resets the state (open alerts are dropped, not resolved).

    Settings (keyword arguments, defaults):
        k=5              flagged steps needed within the last ``n`` to fire
        n=13             persistence window (steps)
        clear_steps=10   consecutive clean steps to resolve
        z_min=4.0        robust z-score threshold
        min_effect=0.05  relative busy-time excess over the stage median
        mad_floor=0.005  MAD floor as a fraction of the stage median
        min_peers=4      reporting ranks a stage needs on a step to be judged
        critical_pct=10  alerts whose cost exceeds this (% throughput) are ``critical``
    """

    name = "slow_rank"

    def __init__(self, *, k: int = 5, n: int = 13, clear_steps: int = 10, z_min: float = 4.0,
                 min_effect: float = 0.05, mad_floor: float = 0.005, min_peers: int = 4,
                 critical_pct: float = 10.0):
        if not (1 <= k <= n):
            raise ValueError(f"slow_rank: need 1 <= k <= n (k={k}, n={n})")
        if clear_steps < 1 or min_peers < 2:
            raise ValueError("slow_rank: clear_steps must be >= 1 and min_peers >= 2")
        self.k, self.n, self.clear_steps = int(k), int(n), int(clear_steps)
        self.z_min, self.min_effect, self.mad_floor = float(z_min), float(min_effect), float(mad_floor)
        self.min_peers, self.critical_pct = int(min_peers), float(critical_pct)
        self._R = -1
        self._stage_key: np.ndarray | None = None
        self._groups: list[np.ndarray | None] = []
        self._group_of = np.zeros(0, dtype=np.int32)
        self._perm: np.ndarray | None = None
        self._slices: list[slice] = []

    # -- state -----------------------------------------------------------------------------------
    def _reset(self, R: int) -> None:
        n = self.n
        self._R = R
        self._pos = 0                                            # steps pushed; ring slot = _pos % n
        self._steps = np.full(n, -1, dtype=np.int64)
        self._flag = np.zeros((n, R), dtype=bool)
        self._clean = np.zeros(R, dtype=np.int32)                # consecutive clean reported steps
        self._active = np.zeros(R, dtype=bool)
        self._resolved_at = np.full(R, np.iinfo(np.int64).min, dtype=np.int64)   # step of last resolution
        self._open: dict[int, Alert] = {}
        nanr = lambda: np.full((n, R), np.nan, dtype=np.float32)  # noqa: E731
        self._busy, self._eff, self._z, self._cost = nanr(), nanr(), nanr(), nanr()
        self._ph = {p: nanr() for p in PHASES}

    def _stages(self, ctx: JobContext, R: int):
        stage = np.asarray(ctx.stage)
        if stage.shape != (R,):
            stage = np.zeros(R, dtype=np.int32)
        if self._stage_key is None or not np.array_equal(stage, self._stage_key):
            self._stage_key = stage.copy()
            uniq, inv = np.unique(stage, return_inverse=True)
            self._group_of = inv.astype(np.int32)
            self._groups = [None] if len(uniq) == 1 else [np.flatnonzero(inv == g) for g in range(len(uniq))]
            # hot path: stages as contiguous column slices of a stage-sorted copy (no copy at all when
            # ranks are laid out stage-major, the usual layout)
            perm = np.argsort(inv, kind="stable")
            self._perm = None if np.array_equal(perm, np.arange(R)) else perm
            cuts = np.flatnonzero(np.diff(inv[perm])) + 1
            self._slices = [slice(a, b) for a, b in zip(np.r_[0, cuts], np.r_[cuts, R])]
        return self._groups

    # -- streaming -------------------------------------------------------------------------------
    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2:
            return []
        R = block.step_ms.shape[1]
        if R == 0:
            return []
        if R != self._R:
            self._reset(R)
        self._stages(ctx, R)

        busy = np.asarray(block.busy_ms, dtype=np.float64)                       # (S, R)
        perm = self._perm
        b_sorted = busy if perm is None else busy[:, perm]
        flags = np.empty((S, R), dtype=bool)
        eff = np.empty((S, R))
        z = np.empty((S, R))
        excess = np.empty((S, R))
        for sl in self._slices:                                                  # few stages
            sub = b_sorted[:, sl]                                                # a view
            med = nanmedian(sub, axis=1)[:, None]                                 # (S, 1)
            dev = sub - med
            mad = nanmedian(np.abs(dev), axis=1)[:, None]
            scale = _MAD_TO_SIGMA * np.maximum(mad, self.mad_floor * np.abs(med))
            with np.errstate(divide="ignore", invalid="ignore"):
                zz = dev / scale
                ee = dev / med
            enough = ((np.count_nonzero(~np.isnan(sub), axis=1) >= self.min_peers)[:, None]
                      & (med > 0))
            ff = (zz >= self.z_min) & (ee >= self.min_effect) & enough               # NaN -> False
            flags[:, sl], eff[:, sl], z[:, sl], excess[:, sl] = ff, ee, zz, dev
        if perm is not None:                                                     # back to rank order
            inv = np.empty_like(perm)
            inv[perm] = np.arange(R)
            flags, eff, z, excess = flags[:, inv], eff[:, inv], z[:, inv], excess[:, inv]
        job_step = nanmedian(block.step_ms, axis=1)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            cost = np.maximum(excess, 0.0) / job_step * 100.0                    # NaN stays NaN
        valid = ~np.isnan(busy)
        n, k = self.n, self.k

        # Persistence over the block at once: history = the last n ring rows (oldest first) + the block.
        order = self._order()
        hist = np.concatenate((self._flag[order], flags))                       # (n + S, R)
        csum = _cumsum_rows(hist)
        counts = csum[n:] - csum[:S]                 # flagged steps in the n steps ending at each step
        fire_m = flags & (counts >= k)               # fire on the flagged step that reaches k
        # consecutive clean reported steps (a flag resets, NaN neither counts nor resets)
        clean = np.empty((S, R), dtype=np.int32)
        prev = self._clean
        for s in range(S):
            prev = clean[s] = np.where(flags[s], 0, prev + valid[s])
        clear_m = clean >= self.clear_steps

        alerts: list[Alert] = []
        may_fire = fire_m.any(axis=0)
        may_clear = clear_m.any(axis=0) & self._active
        cand = np.flatnonzero((may_fire & (~self._active | may_clear)) | may_clear)
        if len(cand):
            events = []                                                          # (s, 0 fire|1 resolve, r)
            hist_steps = np.concatenate((self._steps[order], block.steps))
            for r in cand.tolist():
                fires, clears = np.flatnonzero(fire_m[:, r]), np.flatnonzero(clear_m[:, r])
                active, cur, since = bool(self._active[r]), 0, int(self._resolved_at[r])
                while True:
                    if active:
                        nxt = clears[clears >= cur]
                        if not len(nxt):
                            break
                        s_ = int(nxt[0])
                        since = int(block.steps[s_])
                    else:
                        # flags from before this rank's last resolution do not count again
                        s_ = next((int(f) for f in fires[fires >= cur]
                                   if np.count_nonzero(hist[f + 1:f + n + 1, r]
                                                       & (hist_steps[f + 1:f + n + 1] > since)) >= k), None)
                        if s_ is None:
                            break
                    events.append((s_, int(active), r))
                    active, cur = not active, s_ + 1
            events.sort()
            win = _Window(self, block, flags, busy, eff, z, cost) if events else None
            for s_, kind, r in events:
                step, t_end = int(block.steps[s_]), int(block.t_end[s_])
                if kind == 0:
                    alerts.append(self._fire(ctx, win, s_, r, step, t_end))
                else:
                    alerts.append(self._resolve(r, int(clean[s_, r]), step, t_end))

        # Keep the last n steps in the rings.
        m = min(S, n)
        slots = (self._pos + S - m + np.arange(m)) % n
        self._flag[slots] = flags[S - m:]
        self._steps[slots] = block.steps[S - m:]
        self._busy[slots], self._eff[slots] = busy[S - m:], eff[S - m:]
        self._z[slots], self._cost[slots] = z[S - m:], cost[S - m:]
        tail = _Tail(block, S - m)
        for ph, arr in phase_arrays(tail).items():
            if ph in self._ph:
                self._ph[ph][slots] = arr
        self._pos += S
        self._clean = clean[-1].astype(np.int32)
        return alerts

    # -- alerts ----------------------------------------------------------------------------------
    def _order(self) -> np.ndarray:
        """Ring slots, oldest first (all n; slots never written hold NaN / False / step -1)."""
        return (self._pos + np.arange(self.n)) % self.n

    def _fire(self, ctx: JobContext, win: "_Window", s: int, r: int, step: int, t_end: int) -> Alert:
        w = win.rank(s, r)
        fl = np.flatnonzero(w["flag"] & (w["steps"] > self._resolved_at[r]))   # flagged rows of the window
        run = np.arange(fl[0], len(w["flag"]))         # first flagged step .. detection step
        step_first = int(w["steps"][fl[0]])
        c = w["cost"][run]
        cost = float(np.nanmean(c)) if np.any(~np.isnan(c)) else 0.0
        busy = float(np.median(w["busy"][fl]))
        eff = float(np.median(w["eff"][fl]))
        peer_med = float(np.median(w["busy"][fl] / (1.0 + w["eff"][fl])))
        peers_by_slot = win.stage_phases(s, int(self._group_of[r]))
        peers = {ph: float(nanmedian(peers_by_slot[ph][fl])) for ph in PHASES}
        mine = {ph: float(nanmedian(w[ph][fl])) for ph in PHASES}
        cause, ph_ev = attribute(peers, mine)
        evidence = {
            "busy_ms": round(busy, 3), "peer_median_ms": round(peer_med, 3),
            "effect_pct": round(eff * 100.0, 2), "z": round(float(np.median(w["z"][fl])), 2),
            "flagged": f"{len(fl)}/{self.n}", "stage": int(self._stage_key[r]),
            "phase": ph_ev["phase"], "phases": ph_ev["phases"],
        }
        a = Alert(job=ctx.job, kind="slow_rank", status="firing", step_first=step_first,
                  step_detected=step, t_detected=t_end, ranks=[r], nodes=[ctx.node_of(r)],
                  cause=cause, severity="critical" if cost > self.critical_pct else "warning",
                  evidence=evidence, cost_pct=round(cost, 3), suggestion=SUGGESTIONS[cause])
        self._active[r] = True
        self._open[r] = a
        return a

    def _resolve(self, r: int, clean: int, step: int, t_end: int) -> Alert:
        a = self._open.pop(r)
        self._active[r] = False
        self._resolved_at[r] = step
        ev = dict(a.evidence, clean_steps=clean)
        return Alert(job=a.job, kind=a.kind, status="resolved", step_first=a.step_first,
                     step_detected=step, t_detected=t_end, ranks=list(a.ranks), nodes=list(a.nodes),
                     cause=a.cause, severity=a.severity, evidence=ev, cost_pct=a.cost_pct,
                     suggestion=a.suggestion, alert_id=a.alert_id)


def _cumsum_rows(a: np.ndarray) -> np.ndarray:
    """Cumulative sum down axis 0 as int16, one vector add per row (``np.cumsum(axis=0)`` on a wide
    (rows, R) array is an order of magnitude slower)."""
    out = np.empty(a.shape, dtype=np.int16)
    if len(a):
        out[0] = a[0]
        for i in range(1, len(a)):
            np.add(out[i - 1], a[i], out=out[i])
    return out


class _Tail:
    """The rows ``start:`` of a block, shaped like a StepBlock for :func:`phase_arrays`."""

    def __init__(self, block: StepBlock, start: int):
        for f in ("step_ms", "data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms"):
            setattr(self, f, getattr(block, f)[start:])


class _Window:
    """The last n steps up to a step of the current block (ring rows + block rows), built lazily and
    only when an alert fires, so the common path never copies the rings."""

    def __init__(self, det: SlowRank, block: StepBlock, flags, busy, eff, z, cost):
        self.det, self.n = det, det.n
        order = det._order()
        self.ring = {"flag": det._flag[order], "steps": det._steps[order], "busy": det._busy[order],
                     "eff": det._eff[order], "z": det._z[order], "cost": det._cost[order]}
        self.ring.update({ph: det._ph[ph][order] for ph in PHASES})
        self.blk = {"flag": flags, "steps": block.steps, "busy": busy, "eff": eff, "z": z, "cost": cost}
        self.blk.update(phase_arrays(block))
        self._stage_cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def rank(self, s: int, r: int) -> dict[str, np.ndarray]:
        out = {}
        for key, ring in self.ring.items():
            b = self.blk[key]
            if key == "steps":
                out[key] = np.concatenate((ring, b[:s + 1]))[-self.n:]
            else:
                out[key] = np.concatenate((ring[:, r], b[:s + 1, r]))[-self.n:]
        return out

    def stage_phases(self, s: int, g: int) -> dict[str, np.ndarray]:
        """Per window row, the stage median of each phase (peers of the stage)."""
        if (s, g) not in self._stage_cache:
            groups = self.det._groups
            idx = groups[g] if groups[g] is not None else slice(None)
            self._stage_cache[(s, g)] = {
                ph: nanmedian(np.concatenate((self.ring[ph][:, idx], self.blk[ph][:s + 1, idx]))[-self.n:],
                              axis=1)
                for ph in PHASES}
        return self._stage_cache[(s, g)]

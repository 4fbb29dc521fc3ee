"""Slow rank (straggler) detection: each rank's busy time against its pipeline-stage peers."""
from __future__ import annotations

import math

import numpy as np

from .base import Alert, Detector, JobContext, StepBlock
from .causes import (PHASES, SUGGESTIONS, attribute, comm_evidence, decide, gc_evidence, host_evidence,
                     nanmedian, phase_arrays)

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
_SMALL_HIST = 64      # small stages: learned steps whose median and MAD are a rank's baseline and noise


class SlowRank(Detector):
    """Ranks persistently slower than their peers in the same pipeline stage (alert kinds ``slow_rank``,
    ``slow_node``, ``slow_group``).

    Per closed step, busy time = ``StepBlock.busy_ms`` (step time minus the time blocked waiting for
    peers: in synchronous training all ranks share the step time and the slow rank waits least). Within
    each stage (``ctx.stage``; stages do different work and are never compared with each other) a rank
    is *flagged* on a step when both

    - its robust z-score ``(x - median) / (1.4826 * max(MAD, mad_floor * median)) >= z_min`` (the MAD
      floor keeps clean low-noise data from firing on sub-percent differences), and
    - its effect ``(x - median) / median >= min_effect`` (default 5%).

    Two ways to fire, whichever comes first:

    - *persistence*: flagged on ``>= k`` of the job's last ``n`` steps. Defaults k=5 of n=13 catch a rank
      slow on one step in three (13 consecutive steps starting on a slow one hold 5 slow steps). A
      healthy rank crossing both thresholds independently with probability p per step fires with
      probability ~C(13,5) p^5 = 1287 p^5 per step: heavy-tailed per-rank noise (the simulator's
      Student-t compute noise) gives p ~ 0.6%, ~1e-8 per rank-step.
    - *accumulation*, a sequential test (two CUSUMs per rank) on the rank's robust z-score against its
      stage peers, taken against the rank's **own offset** ``o`` (an EWMA of its z over ~64 steps,
      lagging by 8 steps so a new straggler is not absorbed while it is being confirmed, and clipped to
      the fleet's spread of offsets, median + 5 robust sd: healthy devices that are persistently a bit
      apart, or drift slowly, are judged against themselves; a rank slower than the whole fleet's spread
      is not). With ``u = z - o``: ``S = clip(S + min(u, c) - k, 0, 1.5 h)``, fire at ``S >= h``. The
      small-effect test has ``k = max(ref_z, small_effect / sigma)`` (sigma: the job's relative noise;
      an excess below ``small_effect`` is never accumulated) and ``c = k + span_z``; the large-effect
      test ``k = max(big_ref_z, 2 k_small)``, ``c = k + big_span_z``. The clip makes a heavy-tailed
      single step worth at most ``span``.

      False alarms, from the statistics: for i.i.d. increments ``x = min(u, c) - k`` (negative mean),
      Wald's / Lorden's inequality bounds the probability that an excursion of S reaches h by
      ``exp(-theta h)``, theta > 0 the root of ``E[exp(theta x)] = 1``. The detector solves theta every
      16 steps on the pooled u of up to 2,048 sampled ranks (ranks under an alert left out; the mean of
      the last four solutions), divides it by the autocorrelation's variance inflation ``(1 + phi) /
      (1 - phi)`` (phi from the ratio of 16-step sums to single steps: drift left after the offsets,
      which the CUSUM would accumulate) and sets ``h = max(log(1 / alpha) / theta, 3 span)``: at most
      ``alpha`` false alarms per rank and step whatever the noise law. Heavy tails make theta small and
      h large; light tails the reverse; no two steps, however wild, can fire (the bound rests on
      theta, estimated from ~32k values, which sees a pair of 1e-4 tail events poorly). The tests
      fire from the job's 20th judged step (offsets and h known).

      Measured: with the simulator's noise (Student-t(3) clipped, sigma ~1.1%; theta ~2.2 / 1.9, h ~8 /
      10) a 5% straggler (4.3% busy-time excess, ~3.9 sd) is confirmed in 5-8 steps (median 5.5 over 8
      draws), 10% in 2-3; 0 false alarms in 2.4M clean rank-steps of the simulator, in 1.8M of
      unclipped Student-t(3) noise and in 1.2M with AR(1) per-rank drift (0.9, 0.7%) on 1% noise.
      A drift as large as the per-step noise (AR 0.95 at 1%) fires ~1 per 400k rank-steps. A 3%
      straggler (2.3 sd) takes 11-24 steps, or is missed (3 of 8 draws of 70 steps).

    Resolution (hysteresis): ``clear_steps`` consecutive reported steps that are not flagged and both
    CUSUMs below ``h/2`` (a small straggler seldom crosses the per-step flag; without the CUSUM
    condition it "recovered" between flags and fired again within the same fault); the rank's ``S``
    restarts from 0 and flags from before a resolution do not count towards the next firing. NaN (not
    reported) is neither flagged nor clean.

    Consolidation: when a rank fires and at least ``max(2, node_share * ranks on its node)`` ranks of its
    node are *hot* (>= 2 flags in the window, ``S >= h/2``, or already firing), one ``slow_node`` alert
    names them (CPU contention, a sick host); likewise ``max(3, group_share * group size)`` hot ranks of
    its data-parallel group (:meth:`JobContext.dp_groups`: same stage and tp/cp/ep coordinates, from the
    topology) give one ``slow_group`` alert (a slow collective or link of that group). Later fires of
    ranks on an open node/group are folded into it; it resolves when all its ranks have.

    Cost: the excess busy time over the stage median (the slowest member's for node/group alerts),
    divided by the job's median step time, averaged from the first evidence step to detection (in %).
    Cause: :func:`~stepwatch.detectors.causes.attribute` of the ranks' median phases vs their stage
    peers' (compute -> computation, data -> io, gc -> gc, host gap -> cpu, comm -> communication), then
    :func:`~stepwatch.detectors.causes.decide` with the host samples of the ranks' nodes (a foreign
    process -> cpu; a down-clocked accelerator -> computation), GC records and comm records over the
    same steps; the evidence goes into the alert.

    Work per step is O(R) numpy (medians per stage, a handful of vector updates); alerts are assembled
    only for ranks with an event. State: a few (n, R) rings and (R,) vectors. A change of the number of
    ranks resets the state (open alerts are dropped, not resolved).

    Settings (keyword arguments, defaults):
        k=5              flagged steps needed within the last ``n`` to fire
        n=13             persistence window (steps)
        clear_steps=10   consecutive clean steps to resolve
        z_min=4.0        robust z-score threshold
        min_effect=0.05  relative busy-time excess over the stage median for a flag
        mad_floor=0.005  MAD floor as a fraction of the stage median
        min_peers=4      reporting ranks a stage needs on a step to be judged
        critical_pct=10  alerts whose cost exceeds this (% throughput) are ``critical``
        small_effect=0.02  least relative excess per step the CUSUMs count; 0 disables them
        ref_z=1.5        reference k of the small-effect CUSUM (robust sd), at least small_effect/sigma
        span_z=1.5       its clip above the reference (the most one step adds)
        big_ref_z=3.0    reference of the large-effect CUSUM (at least twice the small one's)
        big_span_z=4.0   its clip above the reference
        alpha=1e-7       false-alarm bound per rank and step that sets h (Wald/Lorden, see above)
        node_share=0.5   share of a node's ranks that must be hot for one ``slow_node`` alert
        group_share=0.5  share of a data-parallel group that must be hot for one ``slow_group`` alert
    """

    name = "slow_rank"

    def __init__(self, *, k: int = 5, n: int = 13, clear_steps: int = 10, z_min: float = 4.0,
                 min_effect: float = 0.05, mad_floor: float = 0.005, min_peers: int = 4,
                 critical_pct: float = 10.0, small_effect: float = 0.02, ref_z: float = 1.5,
                 span_z: float = 1.5, big_ref_z: float = 3.0, big_span_z: float = 4.0,
                 alpha: float = 1e-7, node_share: float = 0.5, group_share: float = 0.5):
        if not (1 <= k <= n):
            raise ValueError(f"slow_rank: need 1 <= k <= n (k={k}, n={n})")
        if clear_steps < 1 or min_peers < 2:
            raise ValueError("slow_rank: clear_steps must be >= 1 and min_peers >= 2")
        if (small_effect < 0 or min(ref_z, span_z, big_ref_z, big_span_z) <= 0 or big_ref_z < ref_z
                or not 0 < alpha < 0.01):
            raise ValueError("slow_rank: need small_effect >= 0, positive ref_z/span_z/big_ref_z/big_span_z, "
                             "big_ref_z >= ref_z, 0 < alpha < 0.01")
        if not (0 < node_share <= 1 and 0 < group_share <= 1):
            raise ValueError("slow_rank: node_share and group_share must be in (0, 1]")
        self.k, self.n, self.clear_steps = int(k), int(n), int(clear_steps)
        self.z_min, self.min_effect, self.mad_floor = float(z_min), float(min_effect), float(mad_floor)
        self.min_peers, self.critical_pct = int(min_peers), float(critical_pct)
        self.small_effect, self.ref_z, self.span_z = float(small_effect), float(ref_z), float(span_z)
        self.big_ref_z, self.big_span_z, self.alpha = float(big_ref_z), float(big_span_z), float(alpha)
        self.node_share, self.group_share = float(node_share), float(group_share)
        self._R = -1
        self._stage_key: np.ndarray | None = None
        self._groups: list[np.ndarray | None] = []
        self._group_of = np.zeros(0, dtype=np.int32)
        self._perm: np.ndarray | None = None
        self._small_rank = np.zeros(0, dtype=bool)
        self._slices: list[slice] = []

    # -- state -----------------------------------------------------------------------------------
    def _reset(self, R: int) -> None:
        n = self.n
        self._R = R
        self._pos = 0                                            # steps pushed; ring slot = _pos % n
        self._steps = np.full(n, -1, dtype=np.int64)
        self._tend = np.zeros(n, dtype=np.int64)
        self._flag = np.zeros((n, R), dtype=bool)
        self._clean = np.zeros(R, dtype=np.int32)                # consecutive clean reported steps
        self._active = np.zeros(R, dtype=bool)
        self._mode = np.zeros(R, dtype=np.int8)                  # 1: fired by accumulation
        self._resolved_at = np.full(R, np.iinfo(np.int64).min, dtype=np.int64)   # step of last resolution
        self._cs = np.zeros(R, dtype=np.float64)                 # CUSUM of the relative excess
        self._cs_from = np.full(R, -1, dtype=np.int64)           # step where the current excursion began
        self._sigma = math.nan                                   # EWMA of the relative noise
        # sequential test (CUSUM in robust z units, see the class docs)
        self._off = np.zeros(R, dtype=np.float64)                # each rank's own offset (delayed EWMA of z)
        self._off_n = np.zeros(R, dtype=np.int32)
        self._off_hi = math.inf                                  # fleet spread of healthy offsets
        self._zring = np.full((_DELAY, R), np.nan, dtype=np.float32)   # z of the last _DELAY steps
        self._cols = np.arange(0, R, max(1, -(-R // _SAMPLE_COLS)))     # ranks sampled for the null law
        # the null law's sample ring: _EVERY steps, or enough steps for _NULL_MIN values on a small job
        rows = max(_EVERY, -(-_NULL_MIN // max(len(self._cols), 1)))
        self._samp = np.full((rows, len(self._cols)), np.nan, dtype=np.float32)
        # small stages (2 .. min_peers - 1 ranks, see _small_z): each rank's learned relative differences
        # to its peers (their median: its baseline, their MAD: its noise), from _SMALL_DELAY steps ago
        self._sm_hist = np.full((_SMALL_HIST, R), np.nan, dtype=np.float64)   # learned values (ring)
        self._sm_n = np.zeros(R, dtype=np.int64)
        self._sm_ring = np.full((_SMALL_DELAY, R), np.nan, dtype=np.float64)
        self._sm_pos = np.zeros(R, dtype=np.int64)
        self._age = 0                                            # steps judged (by the CUSUM)
        self._h = np.full(2, np.nan)                             # thresholds (small, big) from the null law
        self._theta = np.full(2, np.nan)
        self._thetas: list[np.ndarray] = []                      # of the last calibrations (averaged)
        self._phi = 0.0                                          # lag-1 autocorrelation of the ranks' z
        self._csb = np.zeros(R, dtype=np.float64)                # the second CUSUM (large effects)
        self._csb_from = np.full(R, -1, dtype=np.int64)
        self._cs_ready = False
        self._owner: dict[int, tuple] = {}                       # rank -> key of the alert covering it
        self._open: dict[tuple, dict] = {}                       # key -> {"alert", "members"}
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
            self._small_rank = np.zeros(R, dtype=bool)                  # ranks of stages judged by _small_z
            for sl in self._slices:
                if 2 <= sl.stop - sl.start < self.min_peers:
                    self._small_rank[perm[sl]] = True
        return self._groups

    def _refs(self) -> tuple[float, float, float, float]:
        """(k, c) of the two CUSUMs in robust z units: small effects ``k = max(ref_z, small_effect /
        sigma)`` (an excess below 2% is never accumulated, however quiet the job), ``c = k + span_z``;
        large effects ``k = max(big_ref_z, 2 k_small)``, ``c = k + big_span_z``."""
        sig = self._sigma if np.isfinite(self._sigma) else 0.0
        sig = max(sig, _MAD_TO_SIGMA * self.mad_floor)       # the z scale is floored the same way
        k1 = max(self.ref_z, self.small_effect / sig)
        k2 = max(self.big_ref_z, 2.0 * k1)
        return k1, k1 + self.span_z, k2, k2 + self.big_span_z

    def _calibrate(self) -> None:
        """Every _EVERY steps: the thresholds h from the job's own null law and the fleet's offset spread.

        The increments are ``x = min(u, c) - k`` with u the ranks' offset-corrected z. For a CUSUM with
        i.i.d. increments, Wald's / Lorden's bound gives P(a false alarm in one excursion) <=
        exp(-theta h), with theta > 0 the root of ``E[exp(theta x)] = 1``; so ``h = log(1/alpha) /
        theta`` bounds the false-alarm rate by ``alpha`` per rank and step. theta is solved on the
        pooled u of up to 2,048 sampled ranks over the last _EVERY steps (ranks under an alert left
        out), averaged over the last four calibrations: heavy tails (which make theta small) raise h,
        light tails lower it. h is at least three full increments (``3 * span``): no two steps fire.
        """
        k1, c1, k2, c2 = self._refs()
        u = self._samp[np.isfinite(self._samp)].astype(np.float64)
        if len(u) >= (_NULL_MIN if len(self._samp) == _EVERY else _NULL_FEW):
            th = np.array([_cusum_theta(np.minimum(u, c1) - k1), _cusum_theta(np.minimum(u, c2) - k2)])
            # autocorrelated increments (a rank's busy time drifting): the bound holds for the long-run
            # variance, which AR(1) inflates by (1 + phi) / (1 - phi); theta scales inversely
            phi = _pooled_phi(self._samp, c1)
            th = th * (1.0 - phi) / (1.0 + phi)
            self._phi = phi
            self._thetas = (self._thetas + [th])[-4:]
            self._theta = np.mean(np.stack(self._thetas), axis=0)
            lg = math.log(1.0 / self.alpha)
            self._h = np.maximum(lg / self._theta, 3.0 * np.array([self.span_z, self.big_span_z]))
        seasoned = self._off[self._off_n >= 8]
        if len(seasoned) >= self.min_peers:
            med = float(np.median(seasoned))
            self._off_hi = med + 5.0 * _MAD_TO_SIGMA * float(np.median(np.abs(seasoned - med)))

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
        judged = np.empty((S, R), dtype=bool)
        eff = np.empty((S, R))
        z = np.empty((S, R))
        excess = np.empty((S, R))
        sig_parts = []
        for sl in self._slices:                                                  # few stages
            sub = b_sorted[:, sl]                                                # a view
            if 2 <= sub.shape[1] < self.min_peers:                               # a small stage
                cols = np.arange(R)[sl] if perm is None else perm[sl]
                zz, ee, dev, sd, enough = self._small_z(sub, cols)
                flags[:, sl] = (zz >= self.z_min) & (ee >= self.min_effect) & enough
                eff[:, sl], z[:, sl], excess[:, sl] = ee, zz, dev
                judged[:, sl] = enough & ~np.isnan(zz)
                sig_parts.append(sd)
                continue
            med = nanmedian(sub, axis=1)[:, None]                                 # (S, 1)
            dev = sub - med
            mad = nanmedian(np.abs(dev), axis=1)[:, None]
            scale = _MAD_TO_SIGMA * np.maximum(mad, self.mad_floor * np.abs(med))
            with np.errstate(divide="ignore", invalid="ignore"):
                zz = dev / scale
                ee = dev / med
                sig_parts.append((_MAD_TO_SIGMA * mad / med)[:, 0])
            enough = ((np.count_nonzero(~np.isnan(sub), axis=1) >= self.min_peers)[:, None]
                      & (med > 0))
            ff = (zz >= self.z_min) & (ee >= self.min_effect) & enough               # NaN -> False
            flags[:, sl], eff[:, sl], z[:, sl], excess[:, sl] = ff, ee, zz, dev
            judged[:, sl] = enough & ~np.isnan(sub)
        if perm is not None:                                                     # back to rank order
            inv = np.empty_like(perm)
            inv[perm] = np.arange(R)
            flags, eff, z, excess, judged = (flags[:, inv], eff[:, inv], z[:, inv], excess[:, inv],
                                             judged[:, inv])
        with np.errstate(all="ignore"):
            sig_step = nanmedian(np.stack(sig_parts, axis=1), axis=1) if sig_parts else np.full(S, np.nan)
        job_step = nanmedian(block.step_ms, axis=1)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            cost = np.maximum(excess, 0.0) / job_step * 100.0                    # NaN stays NaN
        valid = ~np.isnan(busy)
        n, k = self.n, self.k

        # Persistence counts over the block at once: history = the last n ring rows + the block.
        order = self._order()
        hist = np.concatenate((self._flag[order], flags))                       # (n + S, R)
        csum = _cumsum_rows(hist)
        counts = csum[n:] - csum[:S]                 # flagged steps in the n steps ending at each step
        fire_k = flags & (counts >= k)
        hist_steps = np.concatenate((self._steps[order], block.steps))

        alerts: list[Alert] = []
        win = None
        use_cs = self.small_effect > 0
        for s in range(S):
            # noise level, CUSUM
            if np.isfinite(sig_step[s]):
                self._sigma = sig_step[s] if not np.isfinite(self._sigma) else 0.95 * self._sigma + 0.05 * sig_step[s]
            step = int(block.steps[s])
            if use_cs:
                hot_c, fire_c = self._cusum_step(z[s], judged[s], step)
            else:
                hot_c = fire_c = np.zeros(R, dtype=bool)
            fl, vs = flags[s], valid[s]
            self._clean = np.where(fl, 0, self._clean + vs).astype(np.int32)
            # fires (in rank order), then resolutions
            cand = np.flatnonzero((fire_k[s] | fire_c) & ~self._active)
            fired = []
            for r in cand.tolist():
                since = self._resolved_at[r]
                rows = slice(s + 1, s + n + 1)
                cnt = np.count_nonzero(hist[rows, r] & (hist_steps[rows] > since))
                if cnt >= k:
                    fired.append((r, 0))
                elif fire_c[r]:
                    fired.append((r, 1))             # accumulation (sequential test)
            if fired or self._active.any():
                # with the CUSUM on, every alert also needs the CUSUM back below h/2 after its clean steps:
                # a straggler whose excess seldom crosses min_effect on one step (a 5% rank in 3%
                # noise) would otherwise "recover" between flags and fire again within the same fault
                clear = self._clean >= self.clear_steps
                if use_cs and self._cs_ready:
                    clear &= (self._cs < 0.5 * self._h[0]) & (self._csb < 0.5 * self._h[1])
                gone = np.flatnonzero(clear & self._active)
            else:
                gone = ()
            if not fired and not len(gone):
                continue
            if win is None:
                win = _Window(self, block, flags, busy, eff, z, cost)
            t_end = int(block.t_end[s])
            hot = None
            for r, mode in fired:
                if self._active[r]:                                              # folded into a group
                    continue
                if hot is None:
                    hot = (counts[s] >= 2) | hot_c | self._active
                a = self._fire(ctx, win, s, r, mode, step, t_end, hot)
                if a is not None:
                    alerts.append(a)
            for r in gone.tolist() if len(gone) else ():
                a = self._resolve(r, int(self._clean[r]), step, t_end)
                if a is not None:
                    alerts.append(a)

        # Keep the last n steps in the rings.
        m = min(S, n)
        slots = (self._pos + S - m + np.arange(m)) % n
        self._flag[slots] = flags[S - m:]
        self._steps[slots] = block.steps[S - m:]
        self._tend[slots] = block.t_end[S - m:]
        self._busy[slots], self._eff[slots] = busy[S - m:], eff[S - m:]
        self._z[slots], self._cost[slots] = z[S - m:], cost[S - m:]
        tail = _Tail(block, S - m)
        for ph, arr in phase_arrays(tail).items():
            if ph in self._ph:
                self._ph[ph][slots] = arr
        self._pos += S
        return alerts

    def _small_z(self, sub: np.ndarray, cols: np.ndarray):
        """A stage of 2 .. min_peers - 1 ranks (``sub``: (S, w) busy times, ``cols``: their ranks), where a
        median and MAD across peers mean nothing. In synchronous training the straggler is the rank that
        waits least, so its busy time exceeds the others': each rank is judged on its relative difference
        to the median of the *other* ranks of the stage, ``e = (x - m_others) / m_others``, against that
        difference's own history: ``z = (e - b) / s``, ``b`` the median of the rank's last _SMALL_HIST
        learned values (its baseline offset: a pair that is permanently a bit asymmetric is judged
        against itself), ``s`` 1.4826 x their MAD (floored at ``1.4826 mad_floor``; a median and a MAD,
        so bursts in the history do not inflate it). The values are learned _SMALL_DELAY steps late, and
        not while the rank is under an alert or its CUSUM is above h/2: a new straggler is not absorbed
        while it is being confirmed. A rank is judged once _SMALL_LEARN values were learned; its z then
        feeds the same flags, persistence and sequential test as a large stage's. Returns (z, e, excess
        ms, relative noise per step, judged)."""
        S, w = sub.shape
        oth = np.empty_like(sub)
        for j in range(w):                                                  # w <= 3
            oth[:, j] = nanmedian(np.delete(sub, j, axis=1), axis=1)
        dev = sub - oth
        with np.errstate(divide="ignore", invalid="ignore"):
            ee = np.where(oth > 0, dev / oth, np.nan)
        zz = np.full((S, w), np.nan)
        sd_out = np.full(S, np.nan)
        floor = _MAD_TO_SIGMA * self.mad_floor
        hot = np.zeros(w, dtype=bool)
        if self._cs_ready:
            hot = (self._cs[cols] >= 0.5 * self._h[0]) | (self._csb[cols] >= 0.5 * self._h[1])
        hist = self._sm_hist[:, cols]                                       # (_SMALL_HIST, w), a copy
        n = self._sm_n[cols].copy()
        with np.errstate(all="ignore"):
            b = nanmedian(hist, axis=0)
            sd = np.maximum(_MAD_TO_SIGMA * nanmedian(np.abs(hist - b), axis=0), floor)
        for s in range(S):                                                  # a small stage: w values
            ready = n >= _SMALL_LEARN
            zz[s] = np.where(ready, (ee[s] - b) / sd, np.nan)
            if ready.any():
                sd_out[s] = float(np.median(sd[ready]))
            # learn the value of _SMALL_DELAY steps ago
            slot = self._sm_pos[cols] % _SMALL_DELAY
            old = self._sm_ring[slot, cols]
            self._sm_ring[slot, cols] = ee[s]
            self._sm_pos[cols] += 1
            ok = np.isfinite(old) & ~self._active[cols] & ~hot
            if not ok.any():
                continue
            j = np.flatnonzero(ok)
            hist[n[j] % _SMALL_HIST, j] = old[j]
            n[j] += 1
            with np.errstate(all="ignore"):
                b[j] = nanmedian(hist[:, j], axis=0)
                sd[j] = np.maximum(_MAD_TO_SIGMA * nanmedian(np.abs(hist[:, j] - b[j]), axis=0), floor)
        self._sm_hist[:, cols] = hist
        self._sm_n[cols] = n
        return zz, ee, dev, sd_out, np.isfinite(zz) & (oth > 0)

    def _cusum_step(self, zs: np.ndarray, judged: np.ndarray, step: int):
        """One step of the two sequential tests for every rank; returns (hot, fire) boolean vectors."""
        R = self._R
        k1, c1, k2, c2 = self._refs()
        zz = np.where(judged, zs, np.nan)
        off = np.clip(self._off, -self._off_hi, self._off_hi)
        u = zz - off
        miss = np.isnan(u)
        ready = self._cs_ready
        h1, h2 = (self._h if ready else (math.inf, math.inf))
        for attr, k, c, h in (("_cs", k1, c1, h1), ("_csb", k2, c2, h2)):
            prev = getattr(self, attr)
            # (a small stage's rank also clipped below: the other rank's burst is its negative outlier)
            inc = np.where(miss, 0.0, np.minimum(np.where(self._small_rank, np.maximum(u, -c), u), c) - k)
            new = np.minimum(np.maximum(prev + inc, 0.0), 1.5 * h)
            frm = attr + "_from"
            setattr(self, frm, np.where((prev <= 0) & (new > 0), step, getattr(self, frm)))
            setattr(self, attr, new)
        # the null law's sample (ranks under an alert left out) and the delayed offset update
        # (ranks of a small stage also while their CUSUM is above h/2: there a suspect is a third or half of
        # the sample, and its excess would make the null law's tail, and h, its own)
        out = self._active
        if self._small_rank.any() and ready:
            out = out | (self._small_rank & ((self._cs >= 0.5 * h1) | (self._csb >= 0.5 * h2)))
        self._samp[self._age % len(self._samp)] = np.where(out[self._cols], np.nan, u[self._cols])
        dslot = self._age % _DELAY
        old = self._zring[dslot].astype(np.float64)
        self._zring[dslot] = zz
        if not self._cs_ready:
            old = zz                             # warm-up: learn the offsets from every step at once
        ok = np.isfinite(old) & ~self._active
        self._off_n += ok
        rate = np.maximum(1.0 / np.maximum(self._off_n, 1), 1.0 / _OFFSET_STEPS)
        self._off = np.where(ok, self._off + rate * (np.clip(np.where(ok, old, 0.0), -c1, c1) - self._off),
                             self._off)
        if judged.any():
            self._age += 1
            if self._age % _EVERY == 0:
                self._calibrate()
            if not self._cs_ready and self._age >= _WARMUP and np.isfinite(self._h).all():
                self._cs_ready = True            # accumulate from here on, with offsets and h known
                self._thetas = []                # calibrations of the warm-up (offsets unknown) do not count
                self._calibrate()
                self._cs[:] = 0.0
                self._csb[:] = 0.0
                self._cs_from[:] = -1
                self._csb_from[:] = -1
        if not self._cs_ready:
            no = np.zeros(R, dtype=bool)
            return no, no
        h1, h2 = self._h
        return ((self._cs >= 0.5 * h1) | (self._csb >= 0.5 * h2)), ((self._cs >= h1) | (self._csb >= h2))

    # -- alerts ----------------------------------------------------------------------------------
    def _order(self) -> np.ndarray:
        """Ring slots, oldest first (all n; slots never written hold NaN / False / step -1)."""
        return (self._pos + np.arange(self.n)) % self.n

    def _members(self, ctx: JobContext, r: int, hot: np.ndarray) -> tuple[str, object, np.ndarray]:
        """The scope of a fire of rank ``r``: ("node", node, hot ranks of the node) or ("group", gid,
        hot ranks of its data-parallel group) when enough of them are hot, else ("rank", r, [r])."""
        nodes = np.asarray(ctx.nodes)
        free = ~self._active
        free[r] = True
        if nodes.shape == (self._R,) and str(nodes[r]):
            on = np.flatnonzero(nodes == nodes[r])
            if len(on) >= 2:
                hn = on[hot[on] & free[on]]
                need = max(2, math.ceil(self.node_share * len(on)))
                if len(hn) >= need and r in hn:
                    return "node", str(nodes[r]), hn
        gid = ctx.dp_groups() if hasattr(ctx, "dp_groups") else None
        if gid is not None and gid.shape == (self._R,):
            grp = np.flatnonzero(gid == gid[r])
            stage_n = np.count_nonzero(self._stage_key == self._stage_key[r])
            if 3 <= len(grp) < stage_n:
                hg = grp[hot[grp] & free[grp]]
                need = max(3, math.ceil(self.group_share * len(grp)))
                if len(hg) >= need and r in hg:
                    return "group", int(gid[r]), hg
        return "rank", r, np.array([r])

    def _fire(self, ctx: JobContext, win: "_Window", s: int, r: int, mode: int, step: int, t_end: int,
              hot: np.ndarray) -> Alert | None:
        # an open node / group alert that covers this rank: fold it in
        nodes = np.asarray(ctx.nodes)
        node = str(nodes[r]) if nodes.shape == (self._R,) else ""
        for key, o in self._open.items():
            if (key[0] == "node" and node and key[1] == node) or (key[0] == "group" and r in o["scope"]):
                self._take(r, key, mode)
                return None
        scope, sid, members = self._members(ctx, r, hot)
        M = [int(x) for x in members]
        w = win.ranks(s, M)
        since = self._resolved_at[M][None, :]
        flag = w["flag"] & (w["steps"][:, None] > since)                  # (n, m), after resolutions
        mine = flag[:, M.index(r)]
        if mode == 0 and mine.any():                     # persistence: from the rank's first flagged step
            step_first = int(w["steps"][np.flatnonzero(mine)[0]])
            if len(M) > 1:                               # a node / group: where half of them were flagged
                half = np.flatnonzero(flag.mean(axis=1) >= 0.5)
                if len(half):
                    step_first = int(w["steps"][half[0]])
            ev_rows = np.flatnonzero(flag.any(axis=1)) if len(M) > 1 else np.flatnonzero(mine)
        else:                                            # accumulation: from where the excursion began
            cs_from = int(self._cs_from[r] if self._cs[r] > 0 else self._csb_from[r])
            step_first = cs_from if cs_from >= 0 else step
            ev_rows = np.flatnonzero((w["steps"] >= step_first) & (w["steps"] > self._resolved_at[r]))
        step_first = min(step_first, step)
        if not len(ev_rows):
            ev_rows = np.array([len(w["steps"]) - 1])
        run = np.arange(int(ev_rows[0]), len(w["steps"]))
        with np.errstate(all="ignore"):
            c = np.nanmax(w["cost"][run], axis=1) if len(M) > 1 else w["cost"][run, 0]
        c = c[np.isfinite(c)]
        cost = float(np.mean(c)) if len(c) else 0.0
        with np.errstate(all="ignore"):
            busy = float(nanmedian(w["busy"][ev_rows]))
            eff = float(nanmedian(w["eff"][ev_rows]))
            zz = float(nanmedian(w["z"][ev_rows]))
        if np.isfinite(eff) and eff <= 0:   # over its evidence steps no slower than its peers: no straggler
            return None                     # (a 2-rank stage's healthy rank, judged against the offset it took)
        peer_med = busy / (1.0 + eff) if np.isfinite(eff) and eff > -1 else float("nan")
        peers_by_slot = win.stage_phases(s, int(self._group_of[r]), M)
        peers = {ph: float(nanmedian(peers_by_slot[ph][ev_rows])) for ph in PHASES}
        mine_ph = {ph: float(nanmedian(w[ph][ev_rows])) for ph in PHASES}
        phase_cause, ph_ev = attribute(peers, mine_ph)
        # host / GC / comm evidence over the same steps (from the start of the first evidence step)
        tt = w["t_end"][w["t_end"] > 0]
        dt = int(np.median(np.diff(tt))) if len(tt) > 1 else 0
        t_lo, t_hi = int(w["t_end"][ev_rows[0]]) - dt, t_end
        # a host sample at t averages the node's CPU over the agent's interval before t (1 s by default):
        # a quick confirmation of fast steps (5 steps of 50 ms) may hold none, so the host window spans at
        # least that, and takes the samples that have already arrived whose interval overlaps the steps
        node_names = sorted({ctx.node_of(x) for x in M} - {""})
        host = host_evidence(ctx, node_names, min(t_lo, t_hi - _HOST_SPAN_NS), t_hi + _HOST_SPAN_NS)
        gce = gc_evidence(ctx, M, t_lo, t_hi, steps=len(run))
        comm = comm_evidence(ctx, M, int(w["steps"][ev_rows[0]]), step)
        excess_ms = busy - peer_med if np.isfinite(peer_med) else None
        wait_rise = ph_ev["phases"].get("host_gap_ms", {}).get("delta")
        cause, reason = decide(phase_cause, host, gce, comm, excess_ms, wait_rise)
        evidence = {
            "busy_ms": _r(busy), "peer_median_ms": _r(peer_med), "effect_pct": _r(eff * 100.0, 2),
            "z": _r(zz, 2), "flagged": f"{int(np.count_nonzero(mine))}/{self.n}",
            "fired_by": "accumulation" if mode == 1 else "persistence",
            "stage": int(self._stage_key[r]), "phase": ph_ev["phase"], "phases": ph_ev["phases"],
            "phase_cause": phase_cause, "cause_reason": reason,
        }
        if scope != "rank":
            evidence["scope"] = scope
            evidence["members"] = len(M)
            if scope == "group":
                evidence["group_size"] = int(np.count_nonzero(ctx.dp_groups() == sid))
        if host:
            evidence["host"] = host
        if gce:
            evidence["gc"] = gce
        if comm:
            evidence["comm"] = comm
        a = Alert(job=ctx.job, kind=_KINDS[scope], status="firing", step_first=step_first,
                  step_detected=step, t_detected=t_end, ranks=M, nodes=[ctx.node_of(x) for x in M],
                  cause=cause, severity="critical" if cost > self.critical_pct else "warning",
                  evidence=evidence, cost_pct=round(cost, 3), suggestion=SUGGESTIONS[cause])
        a.host_query = {"nodes": node_names, "t_lo": min(t_lo, t_hi - _HOST_SPAN_NS), "t_hi": t_hi + _HOST_SPAN_NS,
                        "t_end": t_end, "phase_cause": phase_cause, "gc": gce, "comm": comm, "excess_ms": excess_ms,
                        "wait_rise_ms": wait_rise,
                        "measured": bool((getattr(ctx, "info", None) or {}).get("cpu_wait_reported"))}
        key = (scope, sid if scope != "rank" else r, step_first)
        grp = None
        if scope == "group":
            grp = set(np.flatnonzero(ctx.dp_groups() == sid).tolist())
        self._open[key] = {"alert": a, "members": set(), "scope": grp or set(M)}
        for x in M:
            self._take(x, key, mode if x == r else 0)
        return a

    def _take(self, r: int, key: tuple, mode: int) -> None:
        self._active[r] = True
        self._mode[r] = mode
        self._owner[r] = key
        self._open[key]["members"].add(r)

    def _resolve(self, r: int, clean: int, step: int, t_end: int) -> Alert | None:
        self._active[r] = False
        self._mode[r] = 0
        self._resolved_at[r] = step
        self._cs[r] = self._csb[r] = 0.0
        self._cs_from[r] = self._csb_from[r] = -1
        key = self._owner.pop(r, None)
        o = self._open.get(key)
        if o is None:
            return None
        o["members"].discard(r)
        if o["members"]:
            return None
        del self._open[key]
        a = o["alert"]
        ev = dict(a.evidence, clean_steps=clean)
        return Alert(job=a.job, kind=a.kind, status="resolved", step_first=a.step_first,
                     step_detected=step, t_detected=t_end, ranks=list(a.ranks), nodes=list(a.nodes),
                     cause=a.cause, severity=a.severity, evidence=ev, cost_pct=a.cost_pct,
                     suggestion=a.suggestion, alert_id=a.alert_id)


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
        self.ring = {"flag": det._flag[order], "busy": det._busy[order],
                     "eff": det._eff[order], "z": det._z[order], "cost": det._cost[order]}
        self.ring.update({ph: det._ph[ph][order] for ph in PHASES})
        self.ring_steps, self.ring_t = det._steps[order], det._tend[order]
        self.blk = {"flag": flags, "busy": busy, "eff": eff, "z": z, "cost": cost}
        self.blk.update(phase_arrays(block))
        self.blk_steps, self.blk_t = block.steps, block.t_end
        self._stage_cache: dict[tuple, dict[str, np.ndarray]] = {}

    def ranks(self, s: int, M: list[int]) -> dict[str, np.ndarray]:
        """(n, len(M)) arrays of the ranks ``M`` over the window ending at block row ``s``; ``steps``
        and ``t_end`` are (n,)."""
        out = {"steps": np.concatenate((self.ring_steps, self.blk_steps[:s + 1]))[-self.n:],
               "t_end": np.concatenate((self.ring_t, self.blk_t[:s + 1]))[-self.n:]}
        for key, ring in self.ring.items():
            out[key] = np.concatenate((ring[:, M], self.blk[key][:s + 1, M]))[-self.n:]
        return out

    def stage_phases(self, s: int, g: int, exclude=()) -> dict[str, np.ndarray]:
        """Per window row, the median of each phase over the stage's ranks (without ``exclude``)."""
        ex = tuple(sorted(exclude)) if len(exclude) > 1 else ()
        if (s, g, ex) not in self._stage_cache:
            groups = self.det._groups
            idx = groups[g] if groups[g] is not None else np.arange(self.det._R)
            if ex:
                idx = np.setdiff1d(idx, np.asarray(ex))
            if len(idx) > 1024:                          # peers' medians: an even sample is plenty
                idx = idx[::-(-len(idx) // 1024)]
            self._stage_cache[(s, g, ex)] = {
                ph: nanmedian(np.concatenate((self.ring[ph][:, idx], self.blk[ph][:s + 1, idx]))[-self.n:],
                              axis=1)
                for ph in PHASES}
        return self._stage_cache[(s, g, ex)]

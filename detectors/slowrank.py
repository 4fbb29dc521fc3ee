"""Slow rank (straggler) detection: each rank's busy time against its pipeline-stage peers.

Split by responsibility: this module holds the detector (settings, state, the per-block loop);
:mod:`.slowrank_seq` the per-step sequential tests and their calibration, :mod:`.slowrank_alerts` alert
assembly, :mod:`.slowrank_stats` the constants and statistics."""
from __future__ import annotations

import math

import numpy as np

from .base import Alert, Detector, JobContext, StepBlock
from .settings import Setting
from .causes import PHASES, nanmedian, phase_arrays
from .slowrank_alerts import _AlertAssembly, _Window
from .slowrank_seq import _SequentialTests
from .slowrank_stats import _DELAY, _EVERY, _MAD_TO_SIGMA, _NULL_MIN, _P, _SAMPLE_COLS, _SMALL_DELAY, _SMALL_HIST


class SlowRank(_SequentialTests, _AlertAssembly, Detector):
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

      **Per phase.** The small-effect test runs on the busy time *and* on each of the rank's own phases
      (OWN_PHASES: compute, data wait, host gap, GC), each a robust z against the same stage peers (its
      own median and MAD across them, over an even sample of 2,048 ranks in a large stage; the MAD
      floored at ``mad_floor`` of the stage's median *busy time*, so sub-millisecond wobbles of a small
      phase are no straggler), with its own offsets, null law, theta and h; the large-effect test runs
      on the busy time only (a large excess is large there whatever phase holds it). Why: the busy
      time's noise is the sum of every phase's noise, and a straggler's excess is usually in one phase
      (a slow device: compute; contention: host time; a slow disk: data wait). With the independent
      family's noise (a gamma data wait of 25% sd beside t(3) compute noise of 1%) a 5% compute
      straggler is 2.5 sd of the busy time but 4.4 sd of the compute time: confirmed in 4-9 steps (10
      draws, one step per block) instead of 11-17. The series share the false-alarm budget: each gets
      ``alpha / (series judged)``, so a rank still fires falsely at most ``alpha`` per step. Ranks of
      small stages (below) are tested on their busy time only.

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

    Effect-size gate: a fire whose median excess over its evidence steps is below ``min_alert_effect``
    (1%, half the CUSUMs' least counted excess ``small_effect``) of the busy time, or of the job's step
    time, is dropped and the rank's tests restart: the sequential tests bound how often noise crosses
    h, not how large what crossed is, and a 0.1 ms "straggler" is not actionable. Ranks of small stages
    (judged pairwise) need ``small_alert_effect`` (8%): a pair of ranks sharing a machine wanders apart
    for tens of steps by more than its per-step noise, and with one peer nothing tells that from a fault.

    Consolidation: when a rank fires and at least ``max(2, node_share * ranks on its node)`` ranks of its
    node are *hot* (>= 2 flags in the window, ``S >= h/2``, or already firing) *and materially slow* (a
    median excess over the firing rank's evidence steps of at least ``member_share``, half, of the firing
    rank's, then of the median of the ranks that passed, since the rank that fired first is the node's
    slowest: being hot alone is what noise gives a neighbour now and then), one ``slow_node`` alert
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

    Settings: :attr:`SETTINGS` (the list below is made from it).
    """

    name = "slow_rank"

    SETTINGS = (
        Setting("k", 5, 1, 1000, "steps", "flagged steps needed within the last ``n`` to fire"),
        Setting("n", 13, 1, 1000, "steps", "persistence window (sizes the flag rings)", live=False),
        Setting("clear_steps", 10, 1, 100000, "steps", "consecutive clean steps to resolve"),
        Setting("z_min", 4.0, 0.0, None, "robust z", "robust z-score threshold"),
        Setting("min_effect", 0.05, 0.0, 10.0, "share", "relative busy-time excess over the stage median for a flag"),
        Setting("mad_floor", 0.005, 0.0, 1.0, "share", "MAD floor as a fraction of the stage median"),
        Setting("min_peers", 5, 1, None, "ranks", "reporting ranks a stage needs on a step to be judged (narrower "
                "stages: pairwise; at least 2; fixed with the stage layout)", live=False),
        Setting("critical_pct", 10.0, 0.0, 100.0, "%", "alerts whose cost exceeds this (% throughput) are ``critical``"),
        Setting("small_effect", 0.02, 0.0, 1.0, "share", "least relative excess per step the CUSUMs count; 0 disables them"),
        Setting("ref_z", 1.5, 0.0, 100.0, "robust z", "reference k of the small-effect CUSUM (robust sd), at least "
                "small_effect/sigma"),
        Setting("span_z", 1.5, 0.0, 100.0, "robust z", "its clip above the reference (the most one step adds; "
                "fixed at the first step)", live=False),
        Setting("big_ref_z", 3.0, 0.0, 100.0, "robust z", "reference of the large-effect CUSUM (at least the small "
                "one's)"),
        Setting("big_span_z", 4.0, 0.0, 100.0, "robust z", "its clip above the reference (fixed at the first step)",
                live=False),
        Setting("alpha", 1e-7, 1e-15, 0.5, "probability", "false-alarm bound per rank and step that sets h "
                "(Wald/Lorden, see above; below 0.01)"),
        Setting("node_share", 0.5, 0.0, 1.0, "share", "share of a node's ranks that must be hot for one "
                "``slow_node`` alert"),
        Setting("group_share", 0.5, 0.0, 1.0, "share", "share of a data-parallel group that must be hot for one "
                "``slow_group`` alert"),
        Setting("member_share", 0.5, 0.0, 1.0, "share", "a hot co-member joins a node/group alert only with at "
                "least this share of the firing rank's median excess over its evidence steps, then of the "
                "median excess of the members that passed"),
        Setting("min_alert_effect", 0.01, 0.0, 1.0, "share", "least median excess (of the busy time and of the "
                "step time) of any alert"),
        Setting("small_alert_effect", 0.08, 0.0, 1.0, "share", "least median busy-time excess of an alert on a "
                "rank of a small stage (fewer than ``min_peers`` ranks, judged pairwise: see ``_material_effect``)"),
    )

    def __init__(self, **kw):
        self._bind(kw)
        self._R = -1
        self._stage_key: np.ndarray | None = None
        self._groups: list[np.ndarray | None] = []
        self._group_of = np.zeros(0, dtype=np.int32)
        self._perm: np.ndarray | None = None
        self._small_rank = np.zeros(0, dtype=bool)
        self._slices: list[slice] = []
        self._scratch: dict[str, np.ndarray] = {}               # per-step work arrays (see _work)

    def _derive(self) -> None:
        k, n = self.k, self.n
        if not (1 <= k <= n):
            raise ValueError(f"slow_rank: need 1 <= k <= n (k={k}, n={n})")
        if self.clear_steps < 1 or self.min_peers < 2:
            raise ValueError("slow_rank: clear_steps must be >= 1 and min_peers >= 2")
        if (self.small_effect < 0 or min(self.ref_z, self.span_z, self.big_ref_z, self.big_span_z) <= 0
                or self.big_ref_z < self.ref_z or not 0 < self.alpha < 0.01):
            raise ValueError("slow_rank: need small_effect >= 0, positive ref_z/span_z/big_ref_z/big_span_z, "
                             "big_ref_z >= ref_z, 0 < alpha < 0.01")
        if not (0 < self.node_share <= 1 and 0 < self.group_share <= 1 and 0 <= self.member_share <= 1):
            raise ValueError("slow_rank: node_share and group_share must be in (0, 1], member_share in [0, 1]")
        if self.min_alert_effect < 0 or self.small_alert_effect < 0:
            raise ValueError("slow_rank: min_alert_effect and small_alert_effect must be >= 0")

    # -- state -----------------------------------------------------------------------------------
    def _reset(self, R: int) -> None:
        n = self.n
        self._R = R
        self._last_step = -1
        self._pos = 0                                            # steps pushed; ring slot = _pos % n
        self._steps = np.full(n, -1, dtype=np.int64)
        self._tend = np.zeros(n, dtype=np.int64)
        self._flag = np.zeros((n, R), dtype=bool)
        self._fcnt = np.zeros(R, dtype=np.int16)                 # flagged slots of the ring per rank
        self._clean = np.zeros(R, dtype=np.int32)                # consecutive clean reported steps
        self._active = np.zeros(R, dtype=bool)
        self._mode = np.zeros(R, dtype=np.int8)                  # 1: fired by accumulation
        self._resolved_at = np.full(R, np.iinfo(np.int64).min, dtype=np.int64)   # step of last resolution
        # sequential tests: one column per (series, rank), series-major (busy time, then OWN_PHASES):
        # column p * R + r is series p of rank r
        V = _P * R
        self._cs = np.zeros(V, dtype=np.float64)                 # CUSUM of the relative excess
        self._cs_from = np.full(V, -1, dtype=np.int64)           # step where the current excursion began
        self._sigma = math.nan                                   # EWMA of the relative noise (busy time)
        self._sigma_p = np.full(_P, np.nan)                      # ... of each series, relative to busy time
        # sequential test (CUSUM in robust z units, see the class docs)
        self._off = np.zeros(V, dtype=np.float64)                # each rank's own offset (delayed EWMA of z)
        self._off_n = np.zeros(V, dtype=np.int32)
        self._few: list[np.ndarray | None] = [None] * _P     # per series, the columns with off_n < _OFFSET_STEPS
        self._off_hi = np.full(_P, math.inf)                     # fleet spread of healthy offsets, per series
        # z of the last _DELAY steps (uninitialised: every slot is written before the first is read, which
        # is once the tests are ready, after _WARMUP > _DELAY judged steps)
        self._zring = np.empty((_DELAY, V), dtype=np.float32)
        cols = np.arange(0, R, max(1, -(-R // _SAMPLE_COLS)))    # ranks sampled for the null law
        self._ncols = len(cols)
        self._cols = (np.arange(_P)[:, None] * R + cols[None, :]).ravel()   # ... in every series
        # the null law's sample ring: _EVERY steps, or enough steps for _NULL_MIN values on a small job
        rows = max(_EVERY, -(-_NULL_MIN // max(self._ncols, 1)))
        self._samp = np.full((rows, len(self._cols)), np.nan, dtype=np.float32)
        # small stages (2 .. min_peers - 1 ranks, see _small_z): each rank's learned relative differences
        # to its peers (their median: its baseline, their MAD: its noise), from _SMALL_DELAY steps ago
        # (both (_SMALL_HIST or _SMALL_DELAY, R) of NaN, allocated by _small_z when a small stage is judged)
        self._sm_hist: np.ndarray | None = None                  # learned values (ring)
        self._sm_n = np.zeros(R, dtype=np.int64)
        self._sm_ring: np.ndarray | None = None
        self._sm_recent: np.ndarray | None = None                # the last _SMALL_HIST values, all of them
        self._sm_pos = np.zeros(R, dtype=np.int64)
        self._age = 0                                            # steps judged (by the CUSUM)
        self._h = np.full((2, _P), np.nan)                       # thresholds (small, big) per series
        self._theta = np.full((2, _P), np.nan)
        self._thetas: list[np.ndarray] = []                      # of the last calibrations (averaged)
        self._span = np.array([[self.span_z] * _P, [self.big_span_z] * _P])   # clips above k, per series
        self._phi = np.zeros(_P)                                 # lag-1 autocorrelation of the ranks' z
        self._csb = np.zeros(V, dtype=np.float64)                # the second CUSUM (large effects)
        self._csb_from = np.full(V, -1, dtype=np.int64)
        self._cs_ready = False
        self._owner: dict[int, tuple] = {}                       # rank -> key of the alert covering it
        self._open: dict[tuple, dict] = {}                       # key -> {"alert", "members"}
        # the value rings, uninitialised: a slot never written reads as NaN through _Window (slots are
        # written in order from 0, so those are the slots from _pos on while _pos < n); a NaN fill of
        # the ten of them cost the first step ~50 MB of page faults and writes at 100k ranks
        nanr = lambda: np.empty((n, R), dtype=np.float32)  # noqa: E731
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

    def prepare(self, ctx: JobContext) -> None:
        """A job whose width is known before its first block (its topology): the state, the stage layout
        and the per-step work arrays (those of one-step blocks) are allocated now and their pages
        faulted in (written with the values they hold, or, where they are uninitialised, with NaN / 0),
        so the first steps do not pay ~150 MB of first touches at 100k ranks."""
        R = int(getattr(ctx, "world_size", 0) or 0)
        if R <= 0 or R == self._R or (self._R != -1 and self._pos):      # (a block seen: its width rules)
            return
        self._reset(R)
        self._stages(ctx, R)
        for a in (self._flag, self._fcnt, self._clean, self._active, self._mode, self._cs, self._off,
                  self._off_n, self._csb, self._sm_n, self._sm_pos):
            a.fill(0)                                    # np.zeros' pages are mapped on first write
        for a in (self._busy, self._eff, self._z, self._cost, self._zring, *self._ph.values()):
            a.fill(np.nan)                               # uninitialised: any value reads as "not written"
        for name in ("u", "inc", "d"):
            self._work(name).fill(0.0)
        for name in ("nj", "miss", "up", "b", "ok"):
            self._work(name, bool).fill(False)
        zv, jv = np.zeros((1, _P * R)), np.zeros((1, _P * R), dtype=bool)
        zv.fill(0.0)
        jv.fill(False)
        self._scratch["zv"], self._scratch["jv"] = zv, jv

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
        bmeds = {}                                                               # stage -> busy median
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
            mad = nanmedian(np.abs(dev), axis=1, overwrite=True)[:, None]
            scale = _MAD_TO_SIGMA * np.maximum(mad, self.mad_floor * np.abs(med))
            with np.errstate(divide="ignore", invalid="ignore"):
                zz = dev / scale
                ee = dev / med
                sig_parts.append((_MAD_TO_SIGMA * mad / med)[:, 0])
            enough = ((np.count_nonzero(~np.isnan(sub), axis=1) >= self.min_peers)[:, None]
                      & (med > 0))
            bmeds[sl.start] = (med, enough)
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
        phases = phase_arrays(block)
        zv, jv, sig_ph = self._phase_z(phases, z, judged, bmeds)
        job_step = block.step_median()[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            cost = np.maximum(excess, 0.0) / job_step * 100.0                    # NaN stays NaN
        valid = ~np.isnan(busy)
        n, k = self.n, self.k

        # Persistence counts, history = the last n ring rows + the block: the flagged steps in the n
        # steps ending at each step, from the ring's running count (the step leaving the window out, the
        # new one in: two vector operations per step, not a cumulative sum over n + S rows)
        order = self._order()
        hist_row = lambda i: self._flag[order[i]] if i < n else flags[i - n]      # noqa: E731
        counts = np.empty((S, R), dtype=np.int16)
        c = self._fcnt
        for s in range(S):
            c = counts[s] = c - hist_row(s) + flags[s]
        fire_k = flags & (counts >= k)
        hist_steps = np.concatenate((self._steps[order], block.steps))

        alerts: list[Alert] = []
        win = None
        use_cs = self.small_effect > 0
        for s in range(S):
            # noise level, CUSUM
            if np.isfinite(sig_step[s]):
                self._sigma = sig_step[s] if not np.isfinite(self._sigma) else 0.95 * self._sigma + 0.05 * sig_step[s]
            fin = np.isfinite(sig_ph[s])
            self._sigma_p = np.where(fin & ~np.isfinite(self._sigma_p), sig_ph[s],
                                     np.where(fin, 0.95 * self._sigma_p + 0.05 * sig_ph[s], self._sigma_p))
            step = int(block.steps[s])
            if use_cs:
                hot_c, fire_c = self._cusum_step(zv[s], jv[s], step)
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
                hist_r = np.concatenate((self._flag[order, r], flags[:, r]))      # (n + S,)
                cnt = np.count_nonzero(hist_r[rows] & (hist_steps[rows] > since))
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
                    clear &= ((self._cs.reshape(_P, R) < 0.5 * self._h[0][:, None]).all(axis=0)
                              & (self._csb[:R] < 0.5 * self._h[1, 0]))
                gone = np.flatnonzero(clear & self._active)
            else:
                gone = ()
            if not fired and not len(gone):
                continue
            if win is None:
                win = _Window(self, block, flags, busy, eff, z, cost, phases)
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
        self._last_step = int(block.steps[-1])
        m = min(S, n)
        slots = (self._pos + S - m + np.arange(m)) % n
        self._flag[slots] = flags[S - m:]
        self._fcnt = counts[S - 1]                                               # = the ring's flags per rank
        self._steps[slots] = block.steps[S - m:]
        self._tend[slots] = block.t_end[S - m:]
        self._busy[slots], self._eff[slots] = busy[S - m:], eff[S - m:]
        self._z[slots], self._cost[slots] = z[S - m:], cost[S - m:]
        for ph, arr in phases.items():
            if ph in self._ph:
                self._ph[ph][slots] = arr[S - m:]
        self._pos += S
        if self._open:
            self._refresh_queries(block, flags, busy, eff, z, cost, phases)
            alerts += self._superseded(block, flags, busy, eff, z, cost, phases)
        return alerts

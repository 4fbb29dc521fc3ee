"""Change points of a job's step time: the streaming :class:`ChangePoint` (the offline search
:func:`find` it runs on a sliding window of the job's per-step median step time lives in
:mod:`stepwatch.detectors.cpsearch`); candidates are confirmed by effect size and attributed to a phase.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from .base import Alert, Detector, JobContext, StepBlock
from .changepoint_settings import SETTINGS as _SETTINGS
from .causes import (PHASE_CAUSE, PHASES, SUGGESTIONS, attribute, confirm_shift, job_host_shift, nanmedian,
                     phase_arrays)
from .steady import SteadyGate
from .changepoint_ranks import least_busy, least_in_collectives, one_ranks
from .cpsearch import _median, find, noise_scales, segment_noise


#: phases whose job-level value is the mean over the sampled ranks (see ``ChangePoint.update``)
_MEAN_PHASES = ("gc_ms",)


def _nanmean(a: np.ndarray, axis: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        n = np.count_nonzero(~np.isnan(a), axis=axis)
        return np.where(n > 0, np.nansum(a, axis=axis) / np.maximum(n, 1), np.nan)


#: one-sided level of the upper confidence bound on a phase series' long-run noise (:func:`_sigma_upper`)
_Z_UCB = 1.645


def _sigma_upper(x: np.ndarray) -> float:
    """Factor from a series' long-run noise estimate to its one-sided 95 % upper confidence bound.

    The estimate rests on ``n_eff = n (1 - r) / (1 + r)`` effectively independent values (``r`` the AR(1)
    coefficient of :func:`noise_scales`), so its square is ~ chi-square with ``n_eff`` degrees of freedom
    (Wilson-Hilferty for the quantile). 40 steps of AR(1) noise with r = 0.5 (13 effective values) can
    give half the true long-run sd, enough for a 7-step excursion to pass 5 standard errors; with 200
    white steps the factor is 1.13."""
    n = len(x)
    if n < 4:
        return 1.0
    r = noise_scales(x)[1]
    k = max(n * (1.0 - r) / (1.0 + r), 2.0)
    c = 2.0 / (9.0 * k)
    q = k * max(1.0 - c - _Z_UCB * math.sqrt(c), 0.05) ** 3
    return math.sqrt(k / q)


class ChangePoint(Detector):
    """Regressions and recoveries of the job's step time and of each of its phases (kinds
    ``regression`` / ``recovery``).

    Per closed step the detector keeps the median step time over ranks (the only O(R) work per step)
    and the medians of the phases (data wait, compute, comm, comm wait, GC, host gap) over a fixed
    sample of at most ``phase_sample`` ranks, in ring buffers of the last ``window`` steps. Every
    ``every`` steps (by step number; default 1: after each step, also inside a block, so ``step_detected``
    is the step whose evidence sufficed) it runs :func:`find` (``trend=False``) on the step-time series and,
    with ``phases``, on each phase series. A candidate change at window index i of a series is
    confirmed when (once the window holds ``min_steps`` steps)

    - at least ``min_size`` points follow it (the search guarantees it),
    - the shift is large against the series' own noise: ``|Δ| / (s sqrt(1/n_b + 1/n_a)) >= min_t``,
      medians of the raw segments, ``s`` the long-run noise within the segments found
      (:func:`segment_noise`), or within the two segments around the change, or within the regime since
      the last reported change, when that is larger (a noisy regime after a quiet one: its wandering
      is not a change),
    - the effect is large enough: the step time by ``min_effect`` (relative), a phase by
      ``phase_min_effect`` (relative to the lower level) and by ``phase_min_share`` of the median step
      time,
    - persistence: at least ``persist`` of each segment's steps lie on its own side of the midpoint
      between the two medians (a level shift; not noise that takes turns, nor a few slow steps), and
    - step time only: the floor moved with it (the 25th percentile of the segments shifted in the same
      direction by at least ``floor_share`` of the median's effect; intermittent slow steps — DataLoader
      stalls, unsynchronised GC, a straggler one step in three — raise only the upper part: jitter).

    - hysteresis, while a regression of the series is open (reported, not undone, still in the window):
      a recovery only when the level is back near the level before it (within a third of the shift),
      a further regression only when the level rises materially above the open regression's own level
      (:meth:`_open_ok`); one persistent fault whose noisy level wanders is one regression, not
      regression, recovery, regression (a candidate held back is remembered and never reported later),
    - not history: a candidate older than the newest change already reported is not reported (the
      regime it would start has ended; found late as the window slid).

    Each change is reported once: confirmed candidates of all series within ``min_size`` steps of each
    other are one alert, led by the step time when it moved (the other series in ``also_changed``), else
    by the phase that moved most (ms); candidates within ``±min_size`` steps of an already reported
    change are ignored, and reported changes are remembered until they leave the window. Alerts carry
    ``step_first`` = the first step of the new segment, ``evidence.series`` = the leading series,
    ``cost_pct`` = relative step-time increase in % (a phase: its increase as % of the step time; 0 for
    recoveries), ``cause``: a phase's own cause, or for the step time
    :func:`~stepwatch.detectors.causes.attribute` on the median phases before vs after (phases also
    include ``comm_wait_ms`` → parallelism), then confirmed with job-wide host evidence. Steps where
    every rank is NaN are skipped. Alerts are ``firing`` only (a recovery is its own alert).

    Straggler-driven changes: in synchronous training one slow rank makes every step slower, so the
    job's step time shifts when a straggler appears or goes. Such a change shows as the median rank
    *waiting* longer (``comm_wait_ms`` grew most) while no pipeline stage's median busy time (over the
    sampled ranks) moved by half the step-time change (with several stages: the busiest stage's, relative
    to the job's median busy time, so the job's own drift is no stage imbalance). A job-wide phase that
    changed in the same place (unsynchronised GC or data stalls on many ranks) is then reported instead.
    A recovery that undoes an earlier regression of the same series carries ``evidence.transient``. With ``defer_stragglers`` (default) these changes
    are left to the slow-rank detector, which names the rank: they are remembered as reported but not
    alerted. A whole pipeline stage getting slower moves its stage median and is still reported, with
    cause ``parallelism`` (stage imbalance: the other stages wait for it).

    Settings: :attr:`SETTINGS` (the list below is made from it).
    """

    name = "changepoint"
    _PH = PHASES + ("comm_wait_ms",)
    _FIELDS = ("step_ms", "data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms")

    SETTINGS = _SETTINGS                          # declared in detectors/changepoint_settings.py

    def __init__(self, **kw):
        self._bind(kw)
        self._seen = 0
        self._steady = SteadyGate() if self.steady else None    # warm-up judged by the data (detectors.steady)
        self._steady_marked = False
        self._xfer: bool | None = None if self.comm_transfer else False   # comm judged by its transfer (_transfer)
        W = self.window
        self._val = np.full(W, np.nan)                  # median step_ms per step
        self._step = np.zeros(W, dtype=np.int64)
        self._t = np.zeros(W, dtype=np.int64)
        # sampled phase medians, the busiest stage's median busy time, the job's median busy time
        # (+ least busy: the least busy time of a sampled rank; + transfer, busiest stage, median busy)
        self._ph = np.full((W, len(self._PH) + 4), np.nan)
        self._n = 0                                     # steps pushed (ring position = _n % W)
        self._last_bucket: int | None = None
        self._reported: list[int] = []                  # step_first of reported changes still in view
        self._regressions: list[dict] = []              # the last reported regressions (for transients)
        self._deferred: set[int] = set()                # of those, step-time changes left to slow_rank
        # per series, the regression still open: {"base": level before it, "level": level after the newest
        # regression of the chain, "step": that regression's first step} (hysteresis, see _open_ok)
        self._open: dict[str, dict] = {}
        self._held: dict[str, list[int]] = {}          # per series, first steps of candidates it held back
        self._newest: int | None = None

    def _derive(self) -> None:
        if self.window < 4 * self.min_size or self.min_size < 2:
            raise ValueError("changepoint: need min_size >= 2 and window >= 4 * min_size")
        if self.every < 1 or self.phase_sample < 1:
            raise ValueError("changepoint: every and phase_sample must be >= 1")
        if not 0.5 <= self.persist <= 1.0:
            raise ValueError("changepoint: persist must be in [0.5, 1]")
        self.warmup = max(0, self.settings["warmup"])
        # a phase names its cause before the step time moves much, but costs at least half the step time's bar
        cost = self.settings["phase_min_cost"]
        self.phase_min_cost = 50.0 * self.min_effect if cost is None else cost

    # -- streaming ---------------------------------------------------------------------------
    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        return self.update_scaled(ctx, block, None)

    def update_scaled(self, ctx: JobContext, block: StepBlock, scale: np.ndarray | None) -> list[Alert]:
        """:meth:`update` with every duration of ``block`` multiplied by ``scale`` ((S, 1) per step, or
        None): the same result as ``update`` of the scaled block, but only the step times (their median)
        and the sampled ranks' phases are scaled, not all (S, R) arrays of every field (the ``mfu``
        detector's step times normalised by the work of each step)."""
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2 or block.step_ms.shape[1] == 0:
            return []
        if scale is not None and self._steady is not None and not self._steady.steady:
            # (the steadiness gate reads the scaled block itself: only until the job is steady)
            block = StepBlock(block.steps, block.t_end, *(getattr(block, f) * scale for f in self._FIELDS))
            scale = None
        if self._steady is not None and not self._steady.steady:
            self._steady.warm(block)                     # (its steps still fill the window: the stable stretch
        if self._seen < self.warmup:                     # is the first baseline) the job's first steps
            skip = min(self.warmup - self._seen, S)
            self._seen += skip
            if skip == S:
                return []
            block, S = block.tail(skip), S - skip
            scale = None if scale is None else scale[skip:]
        R = block.step_ms.shape[1]
        self._ranks = R                                 # (the ranks the job-level series summarise: evidence)
        if scale is None:
            med = block.step_median()                                            # (S,) O(S*R), once per block
        elif np.all(np.isfinite(scale) & (scale > 0)):
            med = block.step_median_scaled(scale)                                # (the step's partition, shared)
        else:
            med = nanmedian(block.step_ms * scale, axis=1)
        cols = np.arange(0, R, max(1, -(-R // self.phase_sample)))
        sub = StepBlock(block.steps, block.t_end, *(getattr(block, f)[:, cols] if scale is None
                                                    else getattr(block, f)[:, cols] * scale for f in self._FIELDS))
        ph = phase_arrays(sub)
        # a phase's job-level value: the median over the sampled ranks, except for sparse phases (GC: most
        # rank-steps pause a few ms or not at all, a few pause long) where the mean is the time the job
        # spends in it: more long pauses on a quarter of the ranks move the mean, not the median
        phm = np.stack([(_nanmean if k in _MEAN_PHASES else nanmedian)(ph[k], axis=1) for k in self._PH]
                       + [least_busy(sub), least_in_collectives(sub), self._busiest_stage(ctx, sub, cols, R),
                          nanmedian(sub.busy_ms, axis=1)],
                       axis=1)                                                   # (S, 10) O(S*256)
        # communication as its own series, apart from the waiting stragglers cause: the time in collectives
        # of the ranks that waited least (the last to arrive wait for nobody: their time is the transfer)
        xfer = self._transfer(sub)
        if xfer is not None:
            phm[:, self._PH.index("comm_ms")] = xfer
        alerts: list[Alert] = []
        due = False                                     # steps pushed since the last search
        for s in range(S):
            if not np.isfinite(med[s]):
                continue
            i = self._n % self.window
            self._val[i], self._step[i], self._t[i] = med[s], block.steps[s], block.t_end[s]
            self._ph[i] = phm[s]
            self._n += 1
            due = True
            bucket = int(block.steps[s]) // self.every
            if bucket != self._last_bucket:
                self._last_bucket = bucket
                alerts.extend(self._search(ctx))
                due = False
        # a block of several steps is also searched once it is all in: steps delivered together (an
        # agent batching 5 steps per message) are judged together, so a change at a block's first step
        # is seen with the block's other steps after it, not a bucket later
        if due and S > 1:
            alerts.extend(self._search(ctx))
        return alerts

    def _transfer(self, sub: StepBlock) -> np.ndarray | None:
        """The job's communication series where the producer's own split cannot show a slower network:
        when the ranks' ``comm_ms`` is next to nothing beside their ``comm_wait_ms`` (under 5% of the time
        in collectives: a probe whose bandwidth model put a DDP all-reduce's whole tail in the wait, as on
        CPU with gloo), per step the least time in collectives (``comm_ms + comm_wait_ms``) over the sampled
        ranks. In synchronous collectives the ranks that arrive last wait for nobody, so theirs is the
        transfer, measured where the collective ran; a network that got slower moves it on every step,
        the wait a straggler causes moves the others' time, not this. Decided once per job, at its first
        steps with collectives (None: keep the median ``comm_ms``)."""
        c = sub.comm_ms
        if self._xfer is False or not np.isfinite(c).any():
            return None
        tot = np.where(np.isfinite(c), c + np.nan_to_num(sub.comm_wait_ms), np.nan)
        if self._xfer is None:
            med_c, med_t = float(np.nanmedian(c)), float(np.nanmedian(tot))
            self._xfer = bool(med_t > 0 and med_c < 0.05 * med_t)
            if not self._xfer:
                return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)          # (a step no rank reported comm)
            return np.nanmin(tot, axis=1)

    @staticmethod
    def _busiest_stage(ctx: JobContext, sub: StepBlock, cols: np.ndarray, R: int) -> np.ndarray:
        """Per step, the largest median busy time of a pipeline stage (over the sampled ranks ``cols``
        of a block of ``R`` ranks; one stage when the topology does not give stages for R ranks)."""
        busy = sub.busy_ms
        stage = np.asarray(ctx.stage)
        if stage.shape != (R,):
            return nanmedian(busy, axis=1)
        st = stage[cols]
        meds = [nanmedian(busy[:, st == g], axis=1) for g in np.unique(st)]
        return np.fmax.reduce(meds) if len(meds) > 1 else meds[0]

    def _ordered(self):
        """Window contents oldest first (views only when not wrapped)."""
        n, W = self._n, self.window
        if n <= W:
            return self._val[:n], self._step[:n], self._ph[:n]
        i = n % W
        return (np.concatenate((self._val[i:], self._val[:i])),
                np.concatenate((self._step[i:], self._step[:i])),
                np.concatenate((self._ph[i:], self._ph[:i])))

    def _search(self, ctx: JobContext) -> list[Alert]:
        vals, steps, ph = self._ordered()
        n = len(vals)
        if n < 3 * self.min_size:
            return []
        gate = self._steady
        if gate is not None:
            if not gate.steady:
                return []                                # warm-up: nothing judged
            if not self._steady_marked:                  # the warm-up's end is a known break, never alerted
                self._steady_marked = True
                if gate.start is not None and gate.start > int(steps[0]):
                    self._reported.append(int(gate.start))
        # forget reported changes that left the window (they cannot be found again)
        lo = int(steps[0]) - self.min_size
        self._reported = [r for r in self._reported if r >= lo]
        self._deferred = {r for r in self._deferred if r >= lo}
        self._open = {k: o for k, o in self._open.items() if o["step"] >= lo}
        self._held = {k: [r for r in h if r >= lo] for k, h in self._held.items()}
        known = np.searchsorted(steps, np.asarray(self._reported, dtype=np.int64))
        # the newest change alerted before this search: a candidate older than it is history (the regime it
        # would start already ended; found late, as the window slid or a held change left it)
        self._newest = max((r for r in self._reported if r not in self._deferred), default=None)
        cands = self._candidates("step_ms", vals, steps, known, None)
        if self.phases:
            step_level = _median(vals)
            # a step-time change left to slow_rank is no known change of the job's own phases (as in
            # _candidates' ``near``): a phase that moved there, confirmed a step later, is still searched for
            kp = known if not self._deferred else np.searchsorted(
                steps, np.asarray([r for r in self._reported if r not in self._deferred], dtype=np.int64))
            for j, name in enumerate(self._PH):
                cands += self._candidates(name, ph[:, j], steps, known if name == "comm_wait_ms" else kp,
                                          step_level)
        if gate is not None and gate.start is not None:
            # changes inside the warm-up, and inside the stretch the gate judged steady but for its last
            # span: that stretch is the baseline (a bump there that ended before the gate opened is history:
            # CI printed a 9-step compute bump at steps 22-31 of a 2-rank lead-in reported as a regression at
            # step 49, when the gate opened, and its end as a recovery); a change in the last span moved the
            # level too little, too late for the gate to see it, and is judged
            floor = gate.start if gate.forced or gate.opened_at is None else \
                max(gate.start, int(gate.opened_at) - gate.span + 1)
            cands = [c for c in cands if c["step_first"] >= floor]
        if not cands:
            return []
        # one alert per change: candidates of all series within min_size steps of each other are one
        # change; the step time leads when it moved, else the phase that moved most (in ms)
        cands.sort(key=lambda c: c["step_first"])
        clusters: list[list[dict]] = []
        for c in cands:
            if clusters and c["step_first"] - clusters[-1][0]["step_first"] <= self.min_size:
                clusters[-1].append(c)
            else:
                clusters.append([c])
        alerts = []
        t_now = int(self._t[(self._n - 1) % self.window])
        step_now = int(steps[-1])
        for cl in clusters:
            lead = next((c for c in cl if c["series"] == "step_ms"), None)
            if lead is None:
                lead = max(cl, key=lambda c: abs(c["after"] - c["before"]))
            self._reported.append(lead["step_first"])
            alert = self._alert(ctx, lead, [c for c in cl if c is not lead], vals, ph, step_now, t_now, steps)
            own = [c for c in cl if c["series"] not in ("step_ms", "comm_wait_ms")]
            if alert is None and lead["series"] in ("step_ms", "comm_wait_ms") and own \
                    and not self._one_ranks(ctx, lead, ph):
                # the step time's change looked straggler-driven (the others wait longer, no stage's busy
                # median moved), but a phase of the job as a whole moved with it (unsynchronised GC
                # pauses or data stalls on many ranks: each step some rank is slow, none persistently):
                # that phase is the change, not a straggler
                lead = max(own, key=lambda c: abs(c["after"] - c["before"]))
                alert = self._alert(ctx, lead, [c for c in cl if c is not lead], vals, ph, step_now, t_now,
                                    steps)
            if alert is not None and alert.kind == "recovery" and self.recovery_needs_regression and \
                    self._undone(lead, alert) is None:
                continue                    # a speed-up that undoes no reported regression
            if alert is not None:
                self._transient(alert, lead)
                for c in cl:
                    self._chain(c)
                alerts.append(alert)
            elif lead["series"] in ("step_ms", "comm_wait_ms"):
                self._deferred.add(lead["step_first"])
        return alerts

    def _candidates(self, name: str, v: np.ndarray, steps: np.ndarray, known, step_level) -> list[dict]:
        """Confirmed changes of one series of the window (``step_level`` None: the step time, else a phase
        and the window's median step time): the search, then effect size, significance against the
        series' long-run noise, persistence of both segments and (step time) the floor check."""
        fin = np.isfinite(v)
        if np.count_nonzero(fin) < max(3 * self.min_size, self.min_steps):
            return []
        held = self._held.get(name)
        self._refresh_open(name, v, steps, held)
        if held:             # changes held back (hysteresis) stay known: the fault's wandering, never reported
            known = np.union1d(known, np.searchsorted(steps, np.asarray(held, dtype=np.int64)))
        bkps = find(v, min_size=self.min_size, c=self.penalty_c, smooth=self.smooth, screen=True,
                    known=known, trend=False)
        if not bkps:
            return []
        n = len(v)
        edges = [0] + bkps + [n]
        # noise: within the segments found (the changes themselves do not count as noise), the larger of
        # the AR(1) long-run sd and the sd seen by 2*min_size-point means (noise that wanders slowly, or
        # a mixture of slow and fast wandering, which one AR(1) misses)
        sigma = max(segment_noise(v, edges, 2 * self.min_size), 1e-9)
        # a phase has no large materiality floor (its own effect decides): its t-test is the only guard
        # against noise, so it uses an upper bound of the noise, not the estimate (see _sigma_upper)
        ucb = 1.0 if step_level is None else _sigma_upper(v[fin])
        out = []
        for j in range(1, len(edges) - 1):
            a, i, b = edges[j - 1], edges[j], edges[j + 1]
            step_first = int(steps[i])
            # (a step-time change left to slow_rank does not hide a later-confirmed change of the job's
            # own phases at the same place: that phase is then the change)
            near = self._reported if name in ("step_ms", "comm_wait_ms") else \
                [r for r in self._reported if r not in self._deferred]
            if any(abs(step_first - r) <= self.min_size for r in near + (held or [])):
                continue
            xb, xa = v[a:i][fin[a:i]], v[i:b][fin[i:b]]
            if len(xb) < self.min_size or len(xa) < self.min_size:
                continue
            before, after = _median(xb), _median(xa)
            d = after - before
            # the noise around this change: the window's, or that of its two segments alone when they
            # are noisier (a noisy regime after a quiet one: its wandering is not a change)
            loc = segment_noise(np.concatenate((xb, xa)), [0, len(xb), len(xb) + len(xa)], 2 * self.min_size)
            # ... and of the whole regime since the last reported change (short segments say little)
            prior = [r for r in self._reported if r < step_first]
            if prior:
                r0 = min(int(np.searchsorted(steps, max(prior))), a)
                reg = v[r0:b][fin[r0:b]]
                cut = int(np.count_nonzero(fin[r0:i]))
                if len(reg) >= 4 * self.min_size:
                    loc = max(loc, segment_noise(reg, [0, cut, len(reg)], 2 * self.min_size))
            sg = max(sigma, loc) * ucb
            tstat = abs(d) / (sg * math.sqrt(1.0 / len(xb) + 1.0 / len(xa)))
            if tstat < self.min_t or d == 0:
                continue
            if step_level is None:
                if not before > 0:
                    continue
                effect = d / before
                if abs(effect) < self.min_effect:
                    continue
                # a level shift moves the floor of the step times too; intermittent slow steps (stalls,
                # GC pauses, a straggler one step in three) only move the upper part: that is jitter
                q_b, q_a = np.percentile(xb, 25), np.percentile(xa, 25)
                floor = (q_a - q_b) / q_b if q_b > 0 else 0.0
                if floor * np.sign(effect) < self.floor_share * abs(effect):
                    continue
            else:
                low = min(abs(before), abs(after))
                effect = d / low if low > 0 else math.copysign(math.inf, d)
                if not self._phase_material(d, effect, step_level):
                    continue
            if (self._newest is not None and step_first < self._newest - self.min_size) or \
                    not self._open_ok(name, before, after, step_level):
                self._held.setdefault(name, []).append(step_first)
                continue
            if self.decide_steps and d > 0 and int(steps[-1]) - step_first > self.decide_steps:
                self._held.setdefault(name, []).append(step_first)    # confirmed late: it wandered there
                continue
            # persistence: most steps of each segment lie on its own side of the midpoint (a level
            # shift; noise that takes turns, or a few slow steps, does not)
            mid = 0.5 * (before + after)
            sgn = 1.0 if d > 0 else -1.0
            if (np.mean(sgn * (xa - mid) > 0) < self.persist or np.mean(sgn * (mid - xb) > 0) < self.persist):
                continue
            out.append({"series": name, "step_first": step_first, "seg": (a, i, b), "before": before,
                        "after": after, "effect": effect, "tstat": tstat, "sigma": sg})
        return out

    def _material(self, name: str, before: float, after: float, step_level) -> bool:
        """Whether ``before`` -> ``after`` is a change large enough to report on series ``name`` (the
        effect thresholds of :meth:`_candidates`)."""
        d = after - before
        if name == "step_ms":
            return before > 0 and abs(d) / before >= self.min_effect
        low = min(abs(before), abs(after))
        return self._phase_material(d, d / low if low > 0 else math.copysign(math.inf, d), step_level)

    def _phase_material(self, d: float, effect: float, step_level: float) -> bool:
        """A phase's change ``d`` (ms; ``effect`` relative to the lower level) is material: at least
        ``phase_min_effect`` of the phase and ``phase_min_share`` of the step time, and, when below
        ``phase_small_share`` of the step time, at least ``phase_small_effect`` of the phase."""
        if d == 0 or abs(effect) < self.phase_min_effect or not abs(d) >= self.phase_min_share * step_level:
            return False
        return abs(d) >= self.phase_small_share * step_level or abs(effect) >= self.phase_small_effect

    def _open_ok(self, name: str, before: float, after: float, step_level) -> bool:
        """Hysteresis while a regression of ``name`` is open (reported, not yet undone): one persistent
        fault on a noisy real step time (a foreign process taking a core, with its own duty cycle) wanders
        between levels that each pass the tests against its neighbour segment; reported as they come, that
        is regression, recovery, regression, regression within 60 steps of one fault. So, until the
        regression leaves the window:

        - a **recovery** is a candidate only when its new level is back near the level before the
          regression (within a third of the open shift, the ``transient`` rule): the fault went away;
          a dip that stays above it is the same fault wandering;
        - a new **regression** only when its new level is materially above the open regression's own
          level (by the effect thresholds, measured from that level, not from the dip before it): the
          job got slower again.

        Held: the candidate's new segment has ``min_size`` steps and passes the persistence test."""
        o = self._open.get(name)
        if o is None:
            return True
        if after > before:
            return after > o["level"] and self._material(name, o["level"], after, step_level)
        return after <= o["base"] + (o["level"] - o["base"]) / 3.0

    def _refresh_open(self, name: str, v: np.ndarray, steps: np.ndarray, held) -> None:
        """The open regression's level, re-measured on every step of its regime now in view (from its first
        step to the next change of the series reported or held back, or the newest step): at the decision
        it rests on the ``min_size`` steps that sufficed, a noisy level to hold later rises against."""
        o = self._open.get(name)
        if o is None:
            return
        nxt = [r for r in (self._reported + list(held or ())) if r > o["step"]]
        i0 = int(np.searchsorted(steps, o["step"]))
        i1 = int(np.searchsorted(steps, min(nxt))) if nxt else len(v)
        x = v[i0:i1]
        x = x[np.isfinite(x)]
        if len(x) > o.get("n", 0):
            o["level"], o["n"] = _median(x), len(x)

    def _chain(self, c: dict) -> None:
        """A reported change ``c`` of one series opens, raises or (a recovery) closes its open regression."""
        name, o = c["series"], self._open.get(c["series"])
        if c["after"] > c["before"]:
            a, i, b = c["seg"]
            self._open[name] = {"base": c["before"] if o is None else o["base"], "level": c["after"],
                                "step": c["step_first"], "n": b - i}
        elif o is not None:
            del self._open[name]

    def restore_open(self, alerts: list[Alert]) -> None:
        """The job's stored regressions that no later stored recovery of the same series undid are
        remembered as reported (a regression that began before a rebuilt processor's replay window can
        still be recovered from, and its recovery marked transient)."""
        mine = [a for a in alerts if a.kind in ("regression", "recovery") and isinstance(a.evidence, dict)
                and a.evidence.get("series") and "median_before_ms" in a.evidence]
        for a in sorted(mine, key=lambda a: a.step_first):
            ev = a.evidence
            if a.kind == "recovery":
                self._regressions = [r for r in self._regressions if r["series"] != ev["series"]]
                continue
            self._regressions = [r for r in self._regressions if r["alert_id"] != a.alert_id] + [
                {"series": ev["series"], "step_first": int(a.step_first), "before": float(ev["median_before_ms"]),
                 "after": float(ev["median_after_ms"]), "alert_id": a.alert_id}]
        self._regressions = self._regressions[-8:]

    def _transient(self, alert: Alert, lead: dict) -> None:
        """A recovery that undoes a regression reported before on the same series (its level back within
        a third of the regression's shift of where it was) marks both ends: ``evidence.transient`` =
        the regression's first step and alert id, the recovery's first step and the length in steps.
        Regressions are remembered (the last 8) for this."""
        if alert.kind == "regression":
            self._regressions = ([r for r in self._regressions if r["alert_id"] != alert.alert_id]
                                 + [{"series": lead["series"], "step_first": lead["step_first"],
                                     "before": lead["before"], "after": lead["after"],
                                     "alert_id": alert.alert_id}])[-8:]
            return
        r = self._undone(lead, alert)
        if r is not None:
            alert.evidence["transient"] = {"regression_step": int(r["step_first"]),
                                           "regression_alert": r["alert_id"],
                                           "recovery_step": int(lead["step_first"]),
                                           "steps": int(lead["step_first"] - r["step_first"])}
            self._regressions.remove(r)

    def _undone(self, lead: dict, alert: Alert) -> dict | None:
        """The remembered regression (newest first) that a speed-up ``lead`` undoes: one of the same series
        whose level is back within a third of its shift of where it was, or one of the step time that the
        job's step time is back near (a phase-led speed-up that brought the job back). A phase that only
        shrank a little while the fault goes on (CI: comm wait 11.2 -> 9.5 ms seventy steps into a 15 ms
        straggler, the job still 57 ms a step against 43 before) undoes nothing: it is no recovery."""
        step_after = alert.evidence.get("step_median_after_ms", lead["after"] if lead["series"] == "step_ms"
                                        else None)
        for r in reversed(self._regressions):
            d = r["after"] - r["before"]
            if r["step_first"] >= lead["step_first"] or not d > 0:
                continue
            if r["series"] == lead["series"] and abs(lead["after"] - r["before"]) <= d / 3.0:
                return r
            if r["series"] == "step_ms" and step_after is not None and abs(step_after - r["before"]) <= d / 3.0:
                return r
        return None

    def _times(self) -> np.ndarray:
        n, W = self._n, self.window
        if n <= W:
            return self._t[:n]
        i = n % W
        return np.concatenate((self._t[i:], self._t[:i]))

    def _one_ranks(self, ctx, lead: dict, ph) -> bool:
        """A change of one rank of a small job, left to ``slow_rank`` (:func:`.changepoint_ranks.one_ranks`)."""
        return self.defer_stragglers and one_ranks(ctx, lead, ph, len(self._PH))

    def _alert(self, ctx, lead: dict, others: list[dict], vals, ph, step_now, t_now, steps) -> Alert | None:
        a, i, b = lead["seg"]
        series = lead["series"]
        before, after, effect = lead["before"], lead["after"], lead["effect"]
        up = after > before
        kind = "regression" if up else "recovery"
        pb = nanmedian(ph[a:i], axis=0)
        pa = nanmedian(ph[i:b], axis=0)
        b_d = {k: float(pb[j]) for j, k in enumerate(self._PH)}
        a_d = {k: float(pa[j]) for j, k in enumerate(self._PH)}
        cause, phase_ev = attribute(b_d, a_d)
        if kind == "recovery":  # the cause that went away: the phase that shrank most
            cause = attribute(a_d, b_d)[0]
        if series != "step_ms":
            cause = PHASE_CAUSE[series]    # a phase's own change names its cause
        step_b, step_a = _median(vals[a:i]), _median(vals[i:b])
        d_step = step_a - step_b
        d_hi = float(pa[-2] - pb[-2])          # change of the busiest stage's median busy time
        # with pipeline stages, relative to the job's median busy time: a stage imbalance is the busiest
        # stage moving against the rest, the job's own drift moves every stage alike (one stage: the job's
        # median busy time moving, as a two-rank job's does when one of its ranks slows down)
        stages = np.asarray(ctx.stage)
        staged = bool(stages.size and len(np.unique(stages)) > 1)
        d_rel = d_hi - float(pa[-1] - pb[-1]) if staged else d_hi
        d_lead = after - before
        # the least time in collectives over the ranks (comm + wait): the last rank to arrive waits for
        # nobody, so a straggler leaves it where it was; a slower network (or collective) moves it on every
        # rank alike. A wait that grew on every rank is no straggler's doing (measured: a real link cut from
        # 1 Gbit/s to 100 Mbit/s under 2 gloo DDP ranks moved both ranks' wait 0.5 -> 26.5 ms and the
        # least 0.5 -> 26 ms; a straggler moves the others' wait, not the least)
        # Only where the producer puts a collective's whole time in the wait (under 5% of it in comm_ms:
        # gloo on CPU): where it splits transfer from wait, comm_ms is that series, and one slow group's
        # transfer moves every rank's total alike (its members transfer longer, the others wait for them)
        d_xfer = float(pa[-3] - pb[-3])
        c_b, w_b = b_d.get("comm_ms", math.nan), b_d.get("comm_wait_ms", math.nan)
        unsplit = np.isfinite(w_b) and w_b > 0 and not (np.isfinite(c_b) and c_b >= 0.05 * (c_b + w_b))
        shared = unsplit and np.isfinite(d_xfer) and d_lead != 0 and \
            d_xfer * np.sign(d_lead) >= 0.5 * abs(d_lead) and \
            series in ("step_ms", "comm_wait_ms") and cause == "parallelism"
        if shared:
            cause = "communication"
        if cause not in ("communication", "parallelism") and self._one_ranks(ctx, lead, ph):
            return None                     # one rank of a small job: slow_rank names it
        if self.defer_stragglers and cause == "parallelism" and (not staged or not abs(d_rel) >= 0.5 * abs(d_lead)):
            # a few slow ranks: the slow-rank detector names them. Without pipeline stages there is no stage
            # to be imbalanced: ranks waiting longer for each other is stragglers, or each step another rank
            # slowest (jitter), even where the median busy time moved with them (two ranks: one slowing
            # moves the median; real 2-rank runs of a shared host got 3-12 % comm-wait "regressions" so)
            return None
        if series == "step_ms":
            cost = max(effect, 0.0) * 100.0
        else:
            cost = max(d_lead, 0.0) / step_b * 100.0 if step_b > 0 else 0.0
            # the least cost worth a regression: phase_min_cost, or the step time's own step-to-step noise
            # before the change (robust sd, % of the level) when larger: a cost the job's own step-to-step
            # spread hides is not seen in its throughput
            xb = vals[a:i]
            xb = xb[np.isfinite(xb)]
            noise = 100.0 * 1.4826 * float(np.median(np.abs(xb - np.median(xb)))) / step_b \
                if len(xb) >= self.min_size and step_b > 0 else 0.0
            floor = max(self.phase_min_cost, noise)
            # ... unless the phase's own level moved clearly: by phase_clear_sd of its own long-run noise, every
            # step after the change outside the spread of the steps before (GC that tripled, host time up 40 %
            # on every rank: a real change of what the job does, however little of the step it is; a shared
            # host's wandering phases moved by 2-3 of their sd on real 2-rank runs). The step time, whose own
            # noise hides such a change, is then not asked to carry it. Not the comm wait: a straggler's doing
            # nor a change smaller than phase_clear_min_ms (a scheduler's time slice: what the host's scheduling
            # does to any process; real gloo ranks' host time moved by 0.06-0.3 ms at a few us of noise)
            clear = (self.phase_clear_sd > 0 and series != "comm_wait_ms" and d_lead >= self.phase_clear_min_ms
                     and d_lead >= self.phase_clear_sd * float(lead["sigma"]))
            if kind == "regression" and floor > 0 and not clear and not (
                    cost >= floor and d_step >= self.phase_step_share * d_lead):
                # a phase that grew without the step time carrying it (the ranks' other phases took it back:
                # one rank's run-queue wait up while the others wait less for it) or that costs next to nothing
                # (a 0.3% regression) and is no clear change of the phase either: nothing a maintainer would act on
                return None
        ts = self._times()
        host_ev = job_host_shift(ctx, (int(ts[a]), int(ts[i - 1])), (int(ts[i]), int(ts[b - 1])),
                                 (i - a, b - i)) if len(ts) == len(steps) else {}
        cause, reason = confirm_shift(cause, host_ev, kind)
        evidence = {
            "series": series,
            "median_before_ms": round(before, 3), "median_after_ms": round(after, 3),
            "effect_pct": round(effect * 100.0, 2) if math.isfinite(effect) else None,
            "t_stat": round(float(lead["tstat"]), 2),
            "noise_sigma_ms": round(float(lead["sigma"]), 4),
            "segment_before": [int(steps[a]), int(steps[i - 1])],
            "segment_after": [int(steps[i]), int(steps[b - 1])],
            "phase": series if series != "step_ms" else phase_ev["phase"], "phases": phase_ev["phases"],
            "busiest_stage_busy_delta_ms": None if np.isnan(d_hi) else round(d_hi, 3),
            "least_in_collectives_ms": None if not np.isfinite(pb[-3]) else [round(float(pb[-3]), 3),
                                                                            round(float(pa[-3]), 3)],
            "cause_reason": reason,
            "ranks": int(getattr(self, "_ranks", 0)),
        }
        if series != "step_ms":
            evidence["step_median_before_ms"] = round(step_b, 3)
            evidence["step_median_after_ms"] = round(step_a, 3)
            evidence["step_effect_pct"] = round(d_step / step_b * 100.0, 2) if step_b > 0 else None
        if others:
            evidence["also_changed"] = {c["series"]: {"before": round(c["before"], 3),
                                                      "after": round(c["after"], 3)} for c in others}
        if host_ev:
            evidence["host"] = host_ev
        return Alert(job=ctx.job, kind=kind, status="firing", step_first=lead["step_first"],
                     step_detected=step_now, t_detected=t_now, ranks=[], nodes=[], cause=cause,
                     severity="critical" if cost > self.critical_pct else "warning",
                     evidence=evidence, cost_pct=round(cost, 3), suggestion=SUGGESTIONS[cause])

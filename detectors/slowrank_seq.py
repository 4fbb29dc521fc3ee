"""Slow-rank detection, the per-step sequential tests: robust z-scores of the busy time and of each own
phase against the stage peers, small-stage baselines, the two CUSUMs and their calibration from the job's
own null law (mixed into :class:`~stepwatch.detectors.slowrank.SlowRank`; its class docs explain them)."""
from __future__ import annotations

import math
import warnings

import numpy as np

from .causes import median1d, nanmedian
from .slowrank_stats import (_DELAY, _EVERY, _MAD_TO_SIGMA, _NULL_FEW, _NULL_MIN, _OFFSET_STEPS, _P,
                             _SAMPLE_COLS, _SMALL_DELAY, _SMALL_HIST, _SMALL_LEARN, _SMALL_MAX_BASE, _WARMUP,
                             OWN_PHASES, _cusum_theta, _pooled_phi)


#: max(1 / max(n, 1), 1 / _OFFSET_STEPS) for n = 0 .. _OFFSET_STEPS: the offset EWMA's rate after n values
_RATE = np.maximum(1.0 / np.maximum(np.arange(_OFFSET_STEPS + 1), 1), 1.0 / _OFFSET_STEPS)


class _SequentialTests:
    """The per-step statistics of :class:`SlowRank` (state set up by its ``_reset``)."""

    def _refs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(k, c) of the two CUSUMs in robust z units, per series (busy time, then OWN_PHASES): small
        effects ``k = max(ref_z, small_effect / sigma)`` (sigma: the series' relative noise, as a share of
        the busy time; an excess below 2% of the busy time is never accumulated, however quiet the job
        or the phase), ``c = k + span_z``; large effects ``k = max(big_ref_z, 2 k_small)``,
        ``c = k + big_span_z``."""
        sig = self._sig()                                    # the z scale is floored the same way
        k1 = np.maximum(self.ref_z, self.small_effect / sig)
        # the phases' tests are there to confirm a straggler of min_effect sooner: their reference is at
        # least half that shift (Page's choice k = delta / 2 for a design shift delta), so the small
        # excursions that a phase's own noise makes now and then are left to the busy time's test
        k1[1:] = np.maximum(k1[1:], 0.5 * self.min_effect / sig[1:])
        k2 = np.maximum(self.big_ref_z, 2.0 * k1)
        return k1, k1 + self._span[0], k2, k2 + self._span[1]

    def _sig(self) -> np.ndarray:
        """Each series' relative noise (busy time: its own; phases: as a share of the busy time), floored."""
        sig = np.where(np.isfinite(self._sigma_p), self._sigma_p, 0.0)
        if np.isfinite(self._sigma):
            sig[0] = self._sigma
        return np.maximum(sig, _MAD_TO_SIGMA * self.mad_floor)

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
        nc, R = self._ncols, self._R
        th = np.full((2, _P), np.nan)
        phi = np.zeros(_P)
        for p in range(_P):                              # each series its own null law
            samp = self._samp[:, p * nc:(p + 1) * nc]
            u = samp[np.isfinite(samp)].astype(np.float64)
            if len(u) < (_NULL_MIN if len(self._samp) == _EVERY else _NULL_FEW):
                continue
            th[:, p] = (_cusum_theta(np.minimum(u, c1[p]) - k1[p]), _cusum_theta(np.minimum(u, c2[p]) - k2[p]))
            # autocorrelated increments (a rank's busy time drifting): the bound holds for the long-run
            # variance, which AR(1) inflates by (1 + phi) / (1 - phi); theta scales inversely
            phi[p] = _pooled_phi(samp, c1[p])
            th[:, p] *= (1.0 - phi[p]) / (1.0 + phi[p])
        if not np.isnan(th[:, 0]).any():                 # the busy time is judged: a calibration
            self._phi = phi
            self._thetas = (self._thetas + [th])[-4:]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)              # series never judged: NaN
                self._theta = np.nanmean(np.stack(self._thetas), axis=0)
            # every series tested spends alpha / (series judged): at most alpha per rank and step in all
            lg = math.log(max(int((~np.isnan(self._theta[0])).sum()), 1) / self.alpha)
            with np.errstate(all="ignore"):
                self._h = np.maximum(lg / self._theta, 3.0 * self._span)
            self._h[np.isnan(self._theta)] = np.inf      # a series not (yet) judged never fires
        for p in range(_P):
            o, on = self._off[p * R:(p + 1) * R], self._off_n[p * R:(p + 1) * R]
            seasoned = o[on >= 8]                        # a copy: the MAD's deviations overwrite it
            if len(seasoned) >= self.min_peers:
                med = float(median1d(seasoned))
                dev = np.abs(np.subtract(seasoned, med, out=seasoned), out=seasoned)
                self._off_hi[p] = med + 5.0 * _MAD_TO_SIGMA * float(median1d(dev))

    def _small_z(self, sub: np.ndarray, cols: np.ndarray):
        """A stage of 2 .. min_peers - 1 ranks (``sub``: (S, w) busy times, ``cols``: their ranks), where a
        median and MAD across peers mean nothing. In synchronous training the straggler is the rank that
        waits least, so its busy time exceeds the others': each rank is judged on its relative difference
        to the median of the *other* ranks of the stage, ``e = (x - m_others) / m_others``, against that
        difference's own history: ``z = (e - b) / s``, ``b`` the median of the rank's last _SMALL_HIST
        learned values (its baseline offset: a pair that is permanently a bit asymmetric is judged
        against itself, up to _SMALL_MAX_BASE = 20% slower: a rank slower than that from its first step
        on is a straggler, not a trait; 4 real gloo ranks, one 20 ms slower on 50 ms steps from the
        start, were never named once 4-rank stages were judged pairwise), ``s`` 1.4826 x their MAD (floored at ``1.4826 mad_floor``; a median and a MAD,
        so bursts in the history do not inflate it). A rank whose learned level is itself above the
        allowance by z_min standard errors (:meth:`_over_allowance`) gets at least that z on each step
        above the allowance: a noisy straggler from the start (a GC-heavy rank 30-40 % slower, its steps
        +-8 %) is named although no single step is z_min of its own noise above 20 %. The values are learned _SMALL_DELAY steps late, and
        not while the rank is under an alert or its CUSUM is above h/2: a new straggler is not absorbed
        while it is being confirmed. A rank is judged once _SMALL_LEARN values were learned; its z then
        feeds the same flags, persistence and sequential test as a large stage's. Returns (z, e, excess
        ms, relative noise per step, judged)."""
        S, w = sub.shape
        oth = np.empty_like(sub)
        for j in range(w):                                                  # w <= 4
            oth[:, j] = nanmedian(np.delete(sub, j, axis=1), axis=1)
        dev = sub - oth
        with np.errstate(divide="ignore", invalid="ignore"):
            ee = np.where(oth > 0, dev / oth, np.nan)
        zz = np.full((S, w), np.nan)
        sd_out = np.full(S, np.nan)
        floor = _MAD_TO_SIGMA * self.mad_floor
        hot = np.zeros(w, dtype=bool)
        if self._cs_ready:
            hot = (self._cs[cols] >= 0.5 * self._h[0, 0]) | (self._csb[cols] >= 0.5 * self._h[1, 0])
        if self._sm_hist is None:                # allocated at the first small stage (64 MB at 100k ranks)
            self._sm_hist = np.full((_SMALL_HIST, self._R), np.nan, dtype=np.float64)
            self._sm_ring = np.full((_SMALL_DELAY, self._R), np.nan, dtype=np.float64)
            self._sm_recent = np.full((_SMALL_HIST, self._R), np.nan, dtype=np.float32)
        hist = self._sm_hist[:, cols]                                       # (_SMALL_HIST, w), a copy
        n = self._sm_n[cols].copy()
        with np.errstate(all="ignore"):
            b = nanmedian(hist, axis=0)
            sd = np.maximum(_MAD_TO_SIGMA * nanmedian(np.abs(hist - b), axis=0), floor)
            over = self._over_allowance(b, sd, n)
            b = np.minimum(b, _SMALL_MAX_BASE)
        for s in range(S):                                                  # a small stage: w values
            ready = n >= _SMALL_LEARN
            zz[s] = np.where(ready, (ee[s] - b) / sd, np.nan)
            # a rank whose learned level is itself proven above the allowance is a straggler on every
            # step that stays above it, however noisy its steps are (a GC-heavy rank: its own spread)
            zz[s] = np.where(ready & (ee[s] > _SMALL_MAX_BASE), np.fmax(zz[s], over), zz[s])
            if ready.any():
                sd_out[s] = float(np.median(sd[ready]))
            # learn the value of _SMALL_DELAY steps ago
            slot = self._sm_pos[cols] % _SMALL_DELAY
            old = self._sm_ring[slot, cols]
            self._sm_ring[slot, cols] = ee[s]
            self._sm_recent[self._sm_pos[cols] % _SMALL_HIST, cols] = ee[s]
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
                over[j] = self._over_allowance(b[j], sd[j], n[j])
                b[j] = np.minimum(b[j], _SMALL_MAX_BASE)
        self._sm_hist[:, cols] = hist
        self._sm_n[cols] = n
        return zz, ee, dev, sd_out, np.isfinite(zz) & (oth > 0)

    @staticmethod
    def _over_allowance(b: np.ndarray, sd: np.ndarray, n: np.ndarray) -> np.ndarray:
        """How far (in standard errors of a median: 1.2533 sd / sqrt(m), m the values learned, at most
        _SMALL_HIST) a small-stage rank's learned level ``b`` lies above the allowance _SMALL_MAX_BASE; 0
        when it does not. The learned values are a rank's per-step differences to its peers, so this is a
        test of its persistent level, not of one step: a rank 30 % slower than its peers from its first
        step, whose own steps vary by +-8 % (its GC pauses), is 4.5 standard errors above a 20 %
        allowance after 16 learned steps while no single step is 4 sd above it."""
        m = np.minimum(n, _SMALL_HIST).astype(np.float64)
        with np.errstate(all="ignore"):
            z = (b - _SMALL_MAX_BASE) * np.sqrt(m) / (1.2533 * sd)
        return np.where(np.isfinite(z) & (z > 0), z, 0.0)

    def _hv(self) -> tuple[np.ndarray, np.ndarray]:
        """The thresholds (small, big) of every column (series-major, see ``_reset``)."""
        return np.repeat(self._h[0], self._R), np.repeat(self._h[1], self._R)

    def _phase_z(self, phases: dict, z: np.ndarray, judged: np.ndarray, bmeds: dict):
        """The tested series of a block: (S, _P * R) robust z-scores (series-major columns: the busy time's
        ``z``, then each of OWN_PHASES against its stage peers), which of them are judged, and each
        phase's relative noise per step (S, _P; column 0 unused). A phase's scale is its own MAD across
        the stage's ranks, floored at ``mad_floor`` of the stage's median *busy time* (not of the phase:
        a sub-millisecond wobble of a small phase is no straggler). Ranks of small stages (judged by
        ``_small_z``) are tested on their busy time only."""
        S, R = z.shape
        # kept between blocks of the same (small) size, only read within the block: at 100k ranks a fresh
        # 4 MB array per step paid its page faults every step
        zv, jv = self._scratch.get("zv"), self._scratch.get("jv")
        if zv is None or zv.shape != (S, _P * R):
            zv, jv = np.empty((S, _P * R)), np.empty((S, _P * R), dtype=bool)
            if S <= 8:                                   # (a long replayed block's are not kept)
                self._scratch["zv"], self._scratch["jv"] = zv, jv
        perm = self._perm
        if not (perm is None and all(phases.get(name) is not None for name in OWN_PHASES)
                and all(sl.start in bmeds for sl in self._slices)):
            zv.fill(np.nan)                              # some columns are not written below
            jv.fill(False)
        zv[:, :R], jv[:, :R] = z, judged
        sig = np.full((S, _P), np.nan)
        for p, name in enumerate(OWN_PHASES, 1):
            x = phases.get(name)
            if x is None:
                continue
            xs = np.asarray(x, dtype=np.float64)
            xs = xs if perm is None else xs[:, perm]
            # straight into the series' columns when the ranks are stage-major (no permutation)
            zp = zv[:, p * R:(p + 1) * R] if perm is None else np.full((S, R), np.nan)
            jp = jv[:, p * R:(p + 1) * R] if perm is None else np.zeros((S, R), dtype=bool)
            parts = []
            for sl in self._slices:
                got = bmeds.get(sl.start)
                if got is None:                                          # a small stage
                    continue
                bmed, enough = got
                sub = xs[:, sl]
                # the phase's median and MAD over an even sample of a large stage (2,048 ranks place
                # them within ~3% of the whole stage's; the busy time's own use every rank)
                ss = sub[:, ::-(-sub.shape[1] // _SAMPLE_COLS)] if sub.shape[1] > 2 * _SAMPLE_COLS else sub
                med = nanmedian(ss, axis=1)[:, None]
                mad = nanmedian(np.abs(ss - med), axis=1, overwrite=True)[:, None]
                with np.errstate(divide="ignore", invalid="ignore"):
                    dev = np.subtract(sub, med, out=zp[:, sl])
                    np.divide(dev, _MAD_TO_SIGMA * np.maximum(mad, self.mad_floor * np.abs(bmed)), out=dev)
                    parts.append((_MAD_TO_SIGMA * mad / bmed)[:, 0])
                jp[:, sl] = enough                       # & isfinite(z) below (a NaN value has a NaN z)
            if perm is not None:
                inv = np.empty_like(perm)
                inv[perm] = np.arange(R)
                zp, jp = zp[:, inv], jp[:, inv]
                zv[:, p * R:(p + 1) * R], jv[:, p * R:(p + 1) * R] = zp, jp & np.isfinite(zp)
            else:
                jp &= np.isfinite(zp)
            if parts:
                with np.errstate(all="ignore"):
                    sig[:, p] = nanmedian(np.stack(parts, axis=1), axis=1)
        return zv, jv, sig

    def _work(self, name: str, dtype=np.float64) -> np.ndarray:
        """A (_P, R) scratch array of the per-step tests, kept between steps: at 100k ranks each is 4 MB,
        and a fresh one per step and expression costs its page faults on every step."""
        a = self._scratch.get(name)
        if a is None or a.shape != (_P, self._R) or a.dtype != dtype:
            a = self._scratch[name] = np.empty((_P, self._R), dtype=dtype)
        return a

    def _cusum_step(self, zs: np.ndarray, judged: np.ndarray, step: int):
        """One step of the two sequential tests for every column (rank and series); returns (hot, fire)
        boolean vectors per rank (any of its series). Works on (_P, R) views, per-series settings
        broadcast down the columns, in scratch arrays kept between steps (the same arithmetic as the
        plain expressions, element by element: a missing value's increment is computed and then
        replaced by 0, as ``np.where`` did)."""
        R = self._R
        col = lambda v: np.asarray(v, dtype=np.float64)[:, None]      # noqa: E731  (_P,) -> (_P, 1)
        k1, c1, k2, c2 = (col(x) for x in self._refs())
        jr = judged.reshape(_P, R)
        nj = np.logical_not(jr, out=self._work("nj", bool))
        z2 = zs.reshape(_P, R)                            # z (NaN where not judged: zz below)
        hi = col(self._off_hi)
        u = self._work("u")                               # z less the rank's own (clipped) offset
        off2 = self._off.reshape(_P, R)
        for p in range(_P):                               # = maximum(minimum(off, hi), -hi), per series
            if hi[p, 0] >= 0:
                np.clip(off2[p], -hi[p, 0], hi[p, 0], out=u[p])
            else:
                np.maximum(np.minimum(off2[p], hi[p, 0]), -hi[p, 0], out=u[p])
        np.subtract(z2, u, out=u)
        np.copyto(u, np.nan, where=nj)                    # = zz - clipped offset
        miss = np.isnan(u, out=self._work("miss", bool))
        ready = self._cs_ready
        h1, h2 = (col(self._h[0]), col(self._h[1])) if ready else (math.inf, math.inf)
        small = self._small_rank if self._small_rank.any() else None
        active = self._active[None, :]
        inc_all = self._work("inc")
        up_all, miss_b = self._work("up", bool), self._work("b", bool)
        # the small-effect test on every series; the large-effect one on the busy time only (a large
        # excess is large in the busy time whatever phase it is in: the phases are there for small ones)
        for attr, k, c, h, n_ser in (("_cs", k1, c1, h1, _P), ("_csb", k2, c2, h2, 1)):
            prev = getattr(self, attr).reshape(_P, R)[:n_ser]
            if not np.isscalar(h):
                h = h[:n_ser]
            inc = np.minimum(u[:n_ser], c[:n_ser], out=inc_all[:n_ser])
            if small is not None:
                # (a small stage's rank also clipped below: the other rank's burst is its negative outlier)
                inc[0] = np.where(small & ~miss[0], np.maximum(inc[0], -c[0]), inc[0])
            inc -= k[:n_ser]
            np.copyto(inc, 0.0, where=miss[:n_ser])       # a missing value adds nothing
            up = np.less_equal(prev, 0.0, out=up_all[:n_ser])
            prev += inc
            if np.isscalar(h):
                np.clip(prev, 0.0, 1.5 * h, out=prev)    # = minimum(maximum(prev, 0), 1.5 h)
            else:
                for p in range(n_ser):                   # (scalar bounds: numpy's fast clip)
                    np.clip(prev[p], 0.0, 1.5 * h[p, 0], out=prev[p])
            up &= np.greater(prev, 0.0, out=miss_b[:n_ser])
            frm = getattr(self, attr + "_from").reshape(_P, R)[:n_ser]
            np.copyto(frm, step, where=up)               # (a masked copy: ~2x a boolean-index store)
        # the null law's sample (ranks under an alert left out) and the delayed offset update
        # (ranks of a small stage also while their CUSUM is above h/2: there a suspect is a third or half of
        # the sample, and its excess would make the null law's tail, and h, its own)
        out = np.broadcast_to(active, (_P, R))
        if small is not None and ready:
            out = out.copy()
            out[0] |= small & ((self._cs[:R] >= 0.5 * h1[0]) | (self._csb[:R] >= 0.5 * h2[0]))
        uf = u.ravel()
        left_out = (self._active[self._cols % R] if out.base is not None and out.strides[0] == 0
                    else out.ravel()[self._cols])
        self._samp[self._age % len(self._samp)] = np.where(left_out, np.nan, uf[self._cols])
        dslot = self._age % _DELAY
        # the z of _DELAY steps ago, read from the float32 ring as it is (the ufuncs widen each value
        # exactly; no float64 copy of the slot), before this step's z takes the slot
        old = self._zring[dslot].reshape(_P, R)
        if not self._cs_ready:
            old = np.where(jr, z2, np.nan)       # warm-up: learn the offsets from every step at once
        ok = np.isfinite(old, out=self._work("ok", bool))
        ok &= ~active
        off, off_n = self._off.reshape(_P, R), self._off_n.reshape(_P, R)
        off_n += ok
        # off += where(ok, rate * (clip(old, -c1, c1) - off), 0) with rate = max(1 / max(off_n, 1),
        # 1 / _OFFSET_STEPS); what is computed where not ok is replaced by 0, as np.where did
        d = self._work("d")
        for p in range(_P):                              # = maximum(minimum(old, c1), -c1): -c1 < c1
            np.clip(old[p], -c1[p, 0], c1[p, 0], out=d[p])
        zr = self._zring[dslot].reshape(_P, R)           # this step's z where judged, else NaN
        zr[...] = z2
        np.copyto(zr, np.nan, where=nj)
        d -= off
        for p in range(_P):                              # the rate: 1 / _OFFSET_STEPS but for the few ranks
            n_p, d_p = off_n[p], d[p]                    # with fewer values (new, or frozen under an alert)
            # off_n only grows: the ranks below _OFFSET_STEPS are among those that were last step
            few = self._few[p]
            few = np.flatnonzero(n_p < _OFFSET_STEPS) if few is None else few[n_p[few] < _OFFSET_STEPS]
            self._few[p] = few
            if len(few) > len(n_p) // 8:             # many (the first _OFFSET_STEPS steps): one gather of
                d_p *= _RATE[np.minimum(n_p, _OFFSET_STEPS)]     # the rate, not fancy-indexed copies
                continue
            kept = d_p[few]
            d_p *= _RATE[_OFFSET_STEPS]
            if len(few):
                d_p[few] = kept * _RATE[n_p[few]]
        np.logical_not(ok, out=miss_b)
        np.copyto(d, 0.0, where=miss_b)
        off += d
        if judged[:R].any():
            self._age += 1
            if self._age % _EVERY == 0:
                self._calibrate()
            if not self._cs_ready and self._age >= _WARMUP and np.isfinite(self._h[:, 0]).all():
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
        h1, h2 = self._h[0][:, None], self._h[1][:, None]
        cs, csb = self._cs.reshape(_P, R), self._csb[:R]
        hot, fire = csb >= 0.5 * h2[0, 0], csb >= h2[0, 0]
        tmp = self._work("b", bool)[0]
        for p in range(_P):                              # = (cs >= 0.5 h1).any(axis=0) | ..., row by row
            hot |= np.greater_equal(cs[p], 0.5 * h1[p, 0], out=tmp)
            fire |= np.greater_equal(cs[p], h1[p, 0], out=tmp)
        return hot, fire

"""Slow-rank detection, alert assembly: the scope of a fire (rank, node or data-parallel group), its
evidence and cause over the steps that confirmed it, folding into open alerts, resolution (mixed into
:class:`~stepwatch.detectors.slowrank.SlowRank`)."""
from __future__ import annotations

import math

import numpy as np

from .base import Alert, JobContext, StepBlock
from .causes import (PHASE_CAUSE, PHASES, SUGGESTIONS, attribute, comm_evidence, decide, gc_evidence, host_evidence,
                     nanmedian, phase_arrays)
from .slowrank_stats import _HOST_SPAN_NS, _KINDS, _P, _SMALL_HIST, OWN_PHASES, _r


def _longest_run(x: np.ndarray) -> int:
    """The most consecutive True values of a boolean vector."""
    if not x.any():
        return 0
    d = np.diff(np.r_[0, x.astype(np.int8), 0])
    return int((np.flatnonzero(d == -1) - np.flatnonzero(d == 1)).max())


class _AlertAssembly:
    """Alert assembly of :class:`SlowRank` (state set up by its ``_reset``)."""

    def _order(self) -> np.ndarray:
        """Ring slots, oldest first (all n; slots never written hold NaN / False / step -1)."""
        return (self._pos + np.arange(self.n)) % self.n

    def _own_rows(self, w: dict, j: int, r: int, mode: int, step: int) -> np.ndarray:
        """Window rows that are the evidence of rank ``r`` (column ``j`` of ``w``) alone: its flagged
        steps (persistence) or the steps since its test's excursion began (accumulation), after its
        last resolution."""
        steps = w["steps"]
        after = steps > self._resolved_at[r]
        if mode == 0:
            rows = np.flatnonzero(w["flag"][:, j] & after)
            if len(rows):
                return rows
        frm = self._fired_series(r)[0]
        return np.flatnonzero((steps >= (frm if frm >= 0 else step)) & after)

    def _material(self, win: "_Window", s: int, r: int, mode: int, step: int, cand: np.ndarray) -> np.ndarray:
        """Of the hot ranks ``cand`` (with ``r``), those whose own excess is material beside the firing
        rank's: a median relative busy-time excess over ``r``'s evidence steps of at least
        ``member_share`` of ``r``'s (and above 0). A node or group is slow when its members are, each
        by a comparable amount; a neighbour that is merely "hot" (a CUSUM half-way up, two flags in 13:
        what noise alone gives a co-scheduled rank now and then) with a millisecond of excess beside a
        rank 30 ms slow is not part of the fault. The reference excess is ``r``'s, then once the median
        of the ranks that passed against it (so a node's effect is not judged by its slowest member)."""
        cand = np.asarray(cand)
        if len(cand) <= 1:
            return cand
        M = [int(x) for x in cand]
        w = win.ranks(s, M)
        rows = self._own_rows(w, M.index(r), r, mode, step)
        if not len(rows):
            rows = np.array([len(w["steps"]) - 1])
        with np.errstate(all="ignore"):
            e = nanmedian(w["eff"][rows], axis=0)
        j = M.index(r)
        if not np.isfinite(e[j]) or e[j] <= 0:
            return cand

        def judged(ref: float) -> np.ndarray:
            keep = np.isfinite(e) & (e > 0) & (e >= self.member_share * ref)
            keep[j] = True
            return keep
        keep = judged(e[j])
        if keep.sum() >= 2:
            # ``r`` fired first because its excess is the largest (a maximum over the node's ranks is
            # biased upward): the node's effect is re-estimated once as the median excess of the ranks
            # kept, and each member is judged against that
            keep = judged(float(np.median(e[keep])))
        return cand[keep]

    def _members(self, ctx: JobContext, r: int, hot: np.ndarray, win: "_Window" = None, s: int = 0,
                 mode: int = 0, step: int = 0) -> tuple[str, object, np.ndarray]:
        """The scope of a fire of rank ``r``: ("node", node, hot ranks of the node) or ("group", gid,
        hot ranks of its data-parallel group) when enough of them are hot and materially slow
        (:meth:`_material`), else ("rank", r, [r])."""
        nodes = np.asarray(ctx.nodes)
        free = ~self._active
        free[r] = True
        mat = (lambda c: self._material(win, s, r, mode, step, c)) if win is not None else (lambda c: c)
        if nodes.shape == (self._R,) and str(nodes[r]):
            on = np.flatnonzero(nodes == nodes[r])
            if len(on) >= 2:
                hn = mat(on[hot[on] & free[on]])
                need = max(2, math.ceil(self.node_share * len(on)))
                if len(hn) >= need and r in hn:
                    return "node", str(nodes[r]), hn
        gid = ctx.dp_groups() if hasattr(ctx, "dp_groups") else None
        if gid is not None and gid.shape == (self._R,):
            grp = np.flatnonzero(gid == gid[r])
            stage_n = np.count_nonzero(self._stage_key == self._stage_key[r])
            if 3 <= len(grp) < stage_n:
                hg = mat(grp[hot[grp] & free[grp]])
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
        scope, sid, members = self._members(ctx, r, hot, win, s, mode, step)
        M = [int(x) for x in members]
        w = win.ranks(s, M)
        since = self._resolved_at[M][None, :]
        flag = w["flag"] & (w["steps"][:, None] > since)                  # (n, m), after resolutions
        mine = flag[:, M.index(r)]
        series = "busy_ms"
        if mode == 0 and mine.any():                     # persistence: from the rank's first flagged step
            step_first = int(w["steps"][np.flatnonzero(mine)[0]])
            if len(M) > 1:                               # a node / group: where half of them were flagged
                half = np.flatnonzero(flag.mean(axis=1) >= 0.5)
                if len(half):
                    step_first = int(w["steps"][half[0]])
            ev_rows = np.flatnonzero(flag.any(axis=1)) if len(M) > 1 else np.flatnonzero(mine)
        else:                                            # accumulation: from where the excursion began
            cs_from, series = self._fired_series(r)
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
        small = bool(self._small_rank[r])
        if not self._material_effect(eff, w["cost"][ev_rows, M.index(r)], small) or (
                small and len(M) == 1 and self._takes_turns(r)):
            # an immaterial excess (below min_alert_effect of the busy time, or of the step): the test's
            # excursion is dropped and it restarts, so no stale start carries into a later real fault
            cols = r + self._R * np.arange(_P)
            self._cs[cols] = self._csb[cols] = 0.0
            self._cs_from[cols] = self._csb_from[cols] = -1
            return None
        peer_med = busy / (1.0 + eff) if np.isfinite(eff) and eff > -1 else float("nan")
        phase_cause, ph_ev, wait_rise = self._phase_evidence(win, s, r, M, ev_rows)
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
        cause, reason = decide(phase_cause, host, gce, comm, excess_ms, wait_rise)
        evidence = {
            "busy_ms": _r(busy), "peer_median_ms": _r(peer_med), "effect_pct": _r(eff * 100.0, 2),
            "z": _r(zz, 2), "flagged": f"{int(np.count_nonzero(mine))}/{self.n}",
            "fired_by": "accumulation" if mode == 1 else "persistence",
            "tested_series": series,
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
                        "wait_rise_ms": wait_rise, "from_step": int(w["steps"][ev_rows[0]]),
                        "measured": bool((getattr(ctx, "info", None) or {}).get("cpu_wait_reported"))}
        key = (scope, sid if scope != "rank" else r, step_first)
        grp = None
        if scope == "group":
            grp = set(np.flatnonzero(ctx.dp_groups() == sid).tolist())
        self._open[key] = {"alert": a, "members": set(), "scope": grp or set(M), "phase_cause": phase_cause}
        for x in M:
            self._take(x, key, mode if x == r else 0)
        return a

    def _phase_evidence(self, win: "_Window", s: int, r: int, M: list[int], rows: np.ndarray):
        """The phase comparison of ranks ``M`` (firing rank ``r``) over window ``rows``: (phase cause,
        its evidence, the run-queue wait rise in ms: their host gap over their stage peers')."""
        w = win.ranks(s, M)
        peers_by_slot = win.stage_phases(s, int(self._group_of[r]), M)
        with np.errstate(all="ignore"):
            peers = {ph: float(nanmedian(peers_by_slot[ph][rows])) for ph in PHASES}
            mine_ph = {ph: float(nanmedian(w[ph][rows])) for ph in PHASES}
        phase_cause, ph_ev = attribute(peers, mine_ph)
        return phase_cause, ph_ev, ph_ev["phases"].get("host_gap_ms", {}).get("delta")

    def _refresh_queries(self, block: StepBlock, flags, busy, eff, z, cost, phases: dict | None = None) -> None:
        """Open alerts whose host evidence may still be read again (stream/hostwait.py holds an alert's
        row until the host samples that cover its steps come, then decides its cause again with
        :attr:`Alert.host_query`): their query's phase comparison is taken again over the steps from the
        alert's first evidence step to the newest one, for ``n`` steps after it fired. The stepwatch
        probe reads a rank's run-queue wait every ~500 ms and spreads it over that interval's steps, so
        at a contention's onset the wait of the two or three steps that confirmed the alert is not
        reported yet (measured on real DDP: a host-gap rise of 1.2 ms at the fire, 11 ms two steps
        later); the cause decided again with the steps since is the one the evidence supports. Cost:
        nothing while no alert is that young."""
        young = [o["alert"] for o in self._open.values()
                 if o["alert"].host_query is not None and 0 < self._last_step - o["alert"].step_detected <= self.n]
        if not young:
            return
        win = _Window(self, block, flags, busy, eff, z, cost, phases)
        s = len(block) - 1
        for a in young:
            M = [int(x) for x in a.ranks]
            r = M[0]
            steps = win.ranks(s, M[:1])["steps"]
            rows = np.flatnonzero(steps >= int(a.host_query.get("from_step", a.step_first)))
            if not len(rows):
                continue
            phase_cause, _, wait_rise = self._phase_evidence(win, s, r, M, rows)
            a.host_query = dict(a.host_query, phase_cause=phase_cause, wait_rise_ms=wait_rise)

    def _superseded(self, block: StepBlock, flags, busy, eff, z, cost, phases: dict | None = None) -> list[Alert]:
        """A rank's open ``slow_rank`` alert that a second, different fault overtook: resolved (evidence
        ``superseded``), so the rank's tests fire again on the new excess, as a new alert.

        An alert's rank is held until it is clean; meanwhile nothing new is said of it. A rank slowed by
        a foreign process (cause cpu) that then also sleeps 15 ms in its forward (computation) would
        stay one cpu alert (seen in make test's realrun on a machine where another benchmark ran on rank
        1's core first: the sleep got no alert of its own). Once an alert has held ``n`` steps, its
        rank's phase excess over its stage peers across them (median per phase) is its *reference*;
        after that, when over the last ``k`` steps the busy-time excess grew by at least the least
        effect of a fire (``small_alert_effect`` of the peers' busy time for a small stage, else
        ``min_effect``) *and* to at least twice the reference, most of that growth (at least half) in
        one phase whose cause is neither the alert's cause nor its phase's, the alert is resolved and
        its rank's persistence counts from the first of those ``k`` steps: the next flagged step fires
        a new alert, whose evidence and cause are the new fault's. A fault that only worsens in its own
        phase stays one alert. Cost: per block with a rank alert older than ``n`` steps, a window and one
        phase comparison per such alert (at most 32 a block)."""
        now = self._last_step
        old = [(key, o) for key, o in self._open.items()
               if key[0] == "rank" and now - o["alert"].step_detected >= self.n][:32]
        if not old:
            return []
        win = _Window(self, block, flags, busy, eff, z, cost, phases)
        s = len(block) - 1
        out: list[Alert] = []
        for key, o in old:
            r = int(key[1])
            w = win.ranks(s, [r])
            ok = np.isfinite(w["busy"][:, 0]) & np.isfinite(w["eff"][:, 0])
            with np.errstate(all="ignore"):
                dev = w["busy"][:, 0] * w["eff"][:, 0] / (1.0 + w["eff"][:, 0])
                peer = w["busy"][:, 0] / (1.0 + w["eff"][:, 0])
            if "ref" not in o:                        # its first n steps after firing: the settled excess
                rows = np.flatnonzero(ok)
                if len(rows) < self.k:
                    continue
                _, ev, _ = self._phase_evidence(win, s, r, [r], rows)
                o["ref"] = ({ph: (v.get("delta") or 0.0) for ph, v in ev["phases"].items()},
                            float(np.median(dev[rows])))
                continue
            rows = np.flatnonzero(ok)[-self.k:]
            if len(rows) < self.k:
                continue
            ref_ph, ref_dev = o["ref"]
            now_dev, peer_med = float(np.median(dev[rows])), float(np.median(peer[rows]))
            floor = (max(self.min_alert_effect, self.small_alert_effect) if self._small_rank[r]
                     else self.min_effect) * peer_med
            grew = now_dev - ref_dev
            if not (grew >= floor and now_dev >= 2.0 * max(ref_dev, 0.0)):
                continue
            _, ev, _ = self._phase_evidence(win, s, r, [r], rows)
            growth = {ph: (v.get("delta") or 0.0) - ref_ph.get(ph, 0.0) for ph, v in ev["phases"].items()}
            ph = max(growth, key=growth.get)
            a = o["alert"]
            if growth[ph] < 0.5 * grew or PHASE_CAUSE.get(ph) in (a.cause, o.get("phase_cause")):
                continue
            first = int(w["steps"][rows[0]])
            res = self._resolve(r, int(self._clean[r]), now, int(block.t_end[-1]))
            self._resolved_at[r] = first - 1          # the new fault's steps count towards its own alert
            if res is not None:
                res.evidence = dict(res.evidence, superseded={
                    "from_step": first, "phase": ph, "excess_ms": _r(now_dev), "reference_excess_ms": _r(ref_dev),
                    "growth_ms": _r(growth[ph])})
                out.append(res)
        return out

    def _material_effect(self, eff: float, cost: np.ndarray, small: bool = False) -> bool:
        """The effect-size gate of every fire: over the evidence steps, the median relative busy-time
        excess is at least ``min_alert_effect`` *and* so is the median excess as a share of the job's
        step time (``cost``, in %, per evidence step). The sequential tests count no excess below
        ``small_effect`` per step (their reference), so a straggler they confirm has a median excess
        near or above it; a fire whose excess is a fraction of that (0.1 ms on a 60 ms step) is an
        excursion of noise, of a small phase's z (its MAD floored on a sub-ms phase) or of a drifting
        offset, and nobody could act on it.

        A rank of a small stage (judged pairwise, see ``_small_z``) needs ``small_alert_effect`` (8%):
        with one to three peers there is no population to tell that rank's slowdown from its pair's
        wander, and ranks that share a machine wander apart by more than the per-step noise for tens of
        steps (measured on the real 2-rank DDP jobs of tests/test_ddp_real.py on a shared 2-core VM, no
        fault: a rank 6-7% slower than its pair for 10-30 steps in 3 of 10 runs under load)."""
        floor = max(self.min_alert_effect, self.small_alert_effect) if small else self.min_alert_effect
        if np.isfinite(eff) and eff < floor:
            return False
        with np.errstate(all="ignore"):
            c = float(nanmedian(cost)) if len(cost) else float("nan")
        return not (np.isfinite(c) and c < 100.0 * self.min_alert_effect)

    def _takes_turns(self, r: int) -> bool:
        """A rank of a small stage (judged pairwise) whose peers were, over its last _SMALL_HIST steps,
        slower than it about as often as it was slower than them: the steps where the others' median
        exceeds it by ``min_effect`` are at least half as many as those where it exceeds them by as
        much. A straggler is the one slower rank; a pair that takes turns (two ranks sharing one
        accelerator or core, each delayed by the other's work in turn: 2-rank FSDP2 on one H200, each
        rank's busy time ~12 ms below its pair's on one step in three, in runs of several steps on the
        same rank) is contention within the job, and naming either rank points at the wrong thing. A
        straggler, even one slow on one step in three, is seldom the faster rank by as much. The span is
        longer than the persistence window (13 steps), which one rank can hold alone while the pair
        takes turns.

        Turns are alike both ways, in size and in length: a rank now slower by more than twice what its
        peers were when they were the slower (a hog on its core, 18 %, after a lead-in where the machine
        slowed the other by 4-8 % for 8 steps), or slower for more than twice as many steps in a row as
        its peers ever were in the span (CI's hog: rank 1 7-10 % slower on every step from the core's
        taking, after a lead-in where the machine made rank 0 5-6 % slower on 14 of 64 steps, never more
        than 3 in a row), is a fault of its own: a turn ends, a fault holds."""
        if self._sm_recent is None:
            return False
        ring = np.roll(self._sm_recent[:, r], -int(self._sm_pos[r] % _SMALL_HIST))   # oldest first
        e = ring[np.isfinite(ring)]
        own = e[e >= self.min_effect]
        fast = 1.0 / (1.0 + self.min_effect) - 1.0
        peers = 1.0 / (1.0 + e[e <= fast]) - 1.0                                   # the peers' excess over it
        if not len(own) or 2 * len(peers) < len(own):
            return False
        if float(np.median(own)) > 2.0 * float(np.median(peers)):
            return False
        with np.errstate(invalid="ignore"):
            slow, slower_peer = ring >= self.min_effect, ring <= fast               # (NaN: neither)
        held = len(slow) - (int(np.flatnonzero(~slow)[-1]) + 1 if (~slow).any() else 0)   # its run now
        return held <= 2 * _longest_run(slower_peer)

    def _fired_series(self, r: int) -> tuple[int, str]:
        """The series of rank ``r`` whose test is furthest over its threshold: (where its excursion
        began, its name)."""
        cols = r + self._R * np.arange(_P)
        h1, h2 = self._h
        with np.errstate(all="ignore"):
            ratio = np.fmax(self._cs[cols] / h1, self._csb[cols] / h2)
        p = int(np.nanargmax(ratio)) if np.isfinite(ratio).any() else 0
        c = cols[p]
        frm = self._cs_from[c] if self._cs[c] / h1[p] >= self._csb[c] / h2[p] else self._csb_from[c]
        return int(frm), (("busy_ms",) + OWN_PHASES)[p]

    def _take(self, r: int, key: tuple, mode: int) -> None:
        self._active[r] = True
        self._mode[r] = mode
        self._owner[r] = key
        self._open[key]["members"].add(r)

    def _resolve(self, r: int, clean: int, step: int, t_end: int) -> Alert | None:
        self._active[r] = False
        self._mode[r] = 0
        self._resolved_at[r] = step
        cols = r + self._R * np.arange(_P)
        self._cs[cols] = self._csb[cols] = 0.0
        self._cs_from[cols] = self._csb_from[cols] = -1
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



class _Window:
    """The last n steps up to a step of the current block (ring rows + block rows), built lazily and
    only when an alert fires, so the common path never copies the rings."""

    def __init__(self, det, block: StepBlock, flags, busy, eff, z, cost, phases: dict | None = None):
        self.det, self.n = det, det.n
        # the rings are read column first (only the ranks asked for, then their slots in order): a copy
        # of every (n, R) ring in slot order costs ~50 MB of copying at 100k ranks. The window is used
        # while the rings stay as they are (within one update).
        self._order = det._order()
        self._src = {"flag": det._flag, "busy": det._busy, "eff": det._eff, "z": det._z, "cost": det._cost}
        self._src.update({ph: det._ph[ph] for ph in PHASES})
        self.ring_steps, self.ring_t = det._steps[self._order], det._tend[self._order]
        self.blk = {"flag": flags, "busy": busy, "eff": eff, "z": z, "cost": cost}
        self.blk.update(phases if phases is not None else phase_arrays(block))
        self.blk_steps, self.blk_t = block.steps, block.t_end
        self._stage_cache: dict[tuple, dict[str, np.ndarray]] = {}

    def _ring(self, key: str, cols) -> np.ndarray:
        """(n, len(cols)) ring values of columns ``cols``, oldest slot first; NaN (False) in the slots
        never written (the value rings are allocated uninitialised)."""
        r = self._src[key][:, cols]                      # a copy (cols: a list or an index array)
        if self.det._pos < self.n:
            r[self.det._pos:] = False if r.dtype == bool else np.nan
        return r[self._order]

    def ranks(self, s: int, M: list[int]) -> dict[str, np.ndarray]:
        """(n, len(M)) arrays of the ranks ``M`` over the window ending at block row ``s``; ``steps``
        and ``t_end`` are (n,)."""
        out = {"steps": np.concatenate((self.ring_steps, self.blk_steps[:s + 1]))[-self.n:],
               "t_end": np.concatenate((self.ring_t, self.blk_t[:s + 1]))[-self.n:]}
        for key in self._src:
            out[key] = np.concatenate((self._ring(key, M), self.blk[key][:s + 1, M]))[-self.n:]
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
                ph: nanmedian(np.concatenate((self._ring(ph, idx), self.blk[ph][:s + 1, idx]))[-self.n:],
                              axis=1)
                for ph in PHASES}
        return self._stage_cache[(s, g, ex)]

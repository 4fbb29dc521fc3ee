"""Stalls and hangs: ranks, nodes or whole jobs that stop reporting, judged on event time."""
from __future__ import annotations

import numpy as np

from . import hang
from .base import Alert, Detector, JobContext, StepBlock, stable_id
from .causes import HANG_SUGGESTION, STALL_SUGGESTION, nanmedian
from .settings import Setting


class Stall(Detector):
    """Ranks or nodes that stop reporting while their peers go on (``rank_stall``, ``node_stall``) and
    jobs whose steps stop while their nodes' host samples go on (``job_hang``).

    *Rank / node stall* is judged on closed steps: a step closes without a rank only when the job's
    event time (its newest step end) has passed it by the processor's lateness bound, so a rank that is
    merely late is never missing, and a replayed stream closes exactly the same steps as the live one. A
    rank that reported before and is then missing from ``k`` consecutive closed steps that at least
    ``min_reporting`` of the job's ranks reported fires. When every rank of its node is missing, one
    ``node_stall`` alert names the node (evidence says whether the node's host samples still arrive:
    if not, the node itself is down or cut off). Ranks that stop at the same step on different nodes
    are listed in one alert when there are more than ``max_alerts`` of them. The alert names, in
    ``evidence.stopped_first``, the rank(s) whose last reported step is the oldest (ties: the earliest
    last step end). It resolves when all its ranks report again.

    *Job hang* is judged in :meth:`tick`, on every host batch, with one watermark per source: per node,
    the newest host sample and the newest step end of the node's ranks (the agent and its ranks share
    the node's clock, so clock offsets between nodes cancel). The job is silent for as long as its least
    silent node whose host samples still arrive (within the threshold of the median node); it hangs when that
    silence exceeds ``max(hang_s, hang_steps * median step time)``, or when ``hang_quorum`` of those nodes are
    silent past it and none is silent less than half of it (a node's host samples come in batches: its silence
    is known only as far as its last batch). Event time alone cannot tell a hang
    from a steps topic read behind the host topic (Kafka orders nothing across topics and partitions), so
    the alert is raised only once the job's steps source is known to be read to its end
    (``ctx.caught_up()``: the processor compares the consumer's position on the job's steps partition with
    the broker's end offset) and, cheaply before that, not while ``ctx.backlog`` says the consumer lags on
    it. Any interleaving a consumer group can produce thus delays a hang alert but never makes one; a hang
    in progress when a processor restarts is reported as soon as the threshold is passed. The ranks' own
    in-flight reports (the probe's watchdog, the agent) prove a hang without that proof (:meth:`_watchdog`):
    when at least ``min_reporting`` of the ranks say they are inside a step whose end was not read, for at
    least the threshold (by the ``elapsed_ms`` of their own reports), the job hangs whatever the lag of its
    steps topic: within the threshold and one report interval of the in-flight topic's event time. The alert names
    the rank(s) whose last step is older than the rest (the rank that stopped first, the others then
    blocked in the collective waiting for it) when they are fewer than half of the ranks (only when the
    steps were read to their end; else the in-flight states name them); it resolves when a step newer than
    every step known begun (the newest step read, the step the ranks report in progress - 1) arrives.
    Cause: ``communication`` (ranks blocked in a collective); a rank/node stall has no cause in the
    taxonomy (``unknown``) and suggests what to check.

    Cost: O(R) per closed step (a few vector updates); :meth:`tick` is O(1) unless the job's host time has
    run a threshold past its steps (then O(R) per host batch, and one broker round trip to confirm).
    State: (R,) vectors, a ring of the last 64 step times and the open alerts.

    Settings: :attr:`SETTINGS` (the list below is made from it).
    """

    name = "stall"

    SETTINGS = (
        Setting("k", 3, 1, 100000, "steps", "consecutive closed steps a rank must miss while its peers report"),
        Setting("min_reporting", 0.5, 0.01, 1.0, "share", "share of the ranks that must report a closed step for "
                "it to count"),
        Setting("hang_s", 30.0, 0.1, None, "s", "job hang: seconds of host event time without a new step, at "
                "least ..."),
        Setting("hang_steps", 10, 1, 1000000, "step times", "... this many median step times"),
        Setting("hang_quorum", 0.5, 0.01, 1.0, "share", "job hang: share of the nodes whose host samples still "
                "arrive that must be silent past the threshold, while every one of them is silent at least half of "
                "it. A node that stepped shows it in its next host batch (a silence of about a step); one whose batch "
                "is still on the way shows only an older silence: with 1.0 the hang waited for the last node's "
                "batch (an independent producer batching 5 one-second samples per node: 35.09 s for a 30 s "
                "threshold)"),
        Setting("max_alerts", 8, 1, 10000, "alerts", "more newly stalled ranks/nodes than this at one step give "
                "one alert"),
        Setting("hang_first_s", 1800.0, 0.1, None, "s", "job hang: seconds at least while the step in progress is "
                "a process's first"),
        Setting("hang_eval_s", 1800.0, 0.1, None, "s", "... while it contains evaluation"),
        Setting("hang_checkpoint_s", 1800.0, 0.1, None, "s", "... while it contains a checkpoint save (the step's "
                "kinds come from the ranks' in-flight states; see detectors.hang, which also names the ranks the "
                "job waits for)"),
    )

    def __init__(self, **kw):
        self._bind(kw)
        self._R = -1
        self._ms = np.full(64, np.nan)          # median step time of recent steps (ring)
        self._ms_n = 0
        self._hang: Alert | None = None
        self._node_key, self._node_grp = None, None   # ranks grouped by node (job-hang watermarks)
        self._hang_top = -1                      # newest step when the hang fired
        self._wd_key, self._wd = None, None      # the watchdog judgement of the in-flight window (cache)

    def _derive(self) -> None:
        if self.k < 1 or not 0 < self.min_reporting <= 1 or self.hang_s <= 0 or self.hang_steps < 1 or \
                self.max_alerts < 1:
            raise ValueError("stall: need k >= 1, 0 < min_reporting <= 1, hang_s > 0, hang_steps >= 1, "
                             "max_alerts >= 1")
        if min(self.hang_first_s, self.hang_eval_s, self.hang_checkpoint_s) <= 0:
            raise ValueError("stall: need hang_first_s, hang_eval_s, hang_checkpoint_s > 0")
        self.hang_kind_s = {"first": self.hang_first_s, "eval": self.hang_eval_s,
                            "checkpoint": self.hang_checkpoint_s}

    def _reset(self, R: int) -> None:
        self._R = R
        self._seen = np.zeros(R, dtype=bool)
        self._miss = np.zeros(R, dtype=np.int32)
        self._miss_from = np.full(R, -1, dtype=np.int64)
        self._active = np.zeros(R, dtype=bool)
        self._open: dict[str, dict] = {}         # alert_id -> {"alert", "members"}
        self._owner: dict[int, str] = {}

    # -- closed steps: rank / node stalls ------------------------------------------------------------
    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2 or block.step_ms.shape[1] == 0:
            return []
        R = block.step_ms.shape[1]
        if R != self._R:
            self._reset(R)
        rep = ~np.isnan(block.step_ms)
        nrep = rep.sum(axis=1)
        cols = np.arange(0, R, max(1, R // 256))
        med = nanmedian(block.step_ms[:, cols], axis=1)
        alerts: list[Alert] = []
        for s in range(S):
            if np.isfinite(med[s]):
                self._ms[self._ms_n % len(self._ms)] = med[s]
                self._ms_n += 1
            need = max(1, int(np.ceil(self.min_reporting * max(int(self._seen.sum()), 1))))
            if nrep[s] == 0 or nrep[s] < need:
                continue                                   # a step (nearly) nobody reported: not judged
            r_s = rep[s]
            step, t_end = int(block.steps[s]), int(block.t_end[s])
            back = np.flatnonzero(self._active & r_s)
            self._seen |= r_s
            missing = self._seen & ~r_s
            self._miss = np.where(missing, self._miss + 1, 0).astype(np.int32)
            self._miss_from = np.where(missing & (self._miss == 1), step, np.where(missing, self._miss_from, -1))
            fire = np.flatnonzero((self._miss >= self.k) & ~self._active)
            if len(fire):
                alerts += self._fire(ctx, fire, step, t_end)
            for r in back.tolist():
                a = self._back(int(r), step, t_end)
                if a is not None:
                    alerts.append(a)
        return alerts

    def _fire(self, ctx: JobContext, fire: np.ndarray, step: int, t_end: int) -> list[Alert]:
        nodes = np.asarray(ctx.nodes)
        have_nodes = nodes.shape == (self._R,)
        missing = self._miss > 0
        groups: list[tuple[str, list[int], str | None]] = []
        left = set(int(r) for r in fire)
        if have_nodes:
            for node in sorted({str(nodes[r]) for r in fire} - {""}):
                on = np.flatnonzero(nodes == node)
                on = on[self._seen[on]]
                if len(on) >= 2 and missing[on].all():
                    groups.append(("node", [int(x) for x in on], node))
                    left -= set(int(x) for x in on)
        singles = sorted(left)
        if len(singles) > self.max_alerts:
            groups.append(("ranks", singles, None))
        else:
            groups += [("rank", [r], None) for r in singles]
        if len(groups) > self.max_alerts:                  # many nodes at once: one alert
            allr = sorted({r for _, rs, _ in groups for r in rs})
            groups = [("ranks", allr, None)]
        out = []
        for scope, rs, node in groups:
            rs = [r for r in rs if not self._active[r]]
            if not rs:
                continue
            out.append(self._alert(ctx, scope, rs, node, step, t_end))
        return out

    def _alert(self, ctx: JobContext, scope: str, rs: list[int], node, step: int, t_end: int) -> Alert:
        ra = np.asarray(rs)
        mf = self._miss_from[ra]
        first_step = int(mf.min())
        cand = ra[mf == first_step]
        lt = ctx.last_t_end[cand] if ctx.last_t_end is not None and len(ctx.last_t_end) == self._R else None
        if lt is not None and len(cand) > 1:
            cand = cand[lt == lt.min()]
        first = sorted(int(x) for x in cand)[:16]
        ev = {"scope": scope, "missing_steps": int(self._miss[ra].max()), "stopped_at_step": first_step,
              "stopped_first": first, "ranks_stalled": len(rs)}
        if ctx.last_step is not None and len(ctx.last_step) == self._R:
            ev["last_step"] = {str(int(r)): int(ctx.last_step[r]) for r in first[:8]}
        nodes_ = sorted({ctx.node_of(r) for r in rs} - {""})
        ev["host_samples"] = _node_host_state(ctx, nodes_, t_end)
        kind = "node_stall" if scope == "node" else "rank_stall"
        a = Alert(job=ctx.job, kind=kind, status="firing", step_first=first_step, step_detected=step,
                  t_detected=t_end, ranks=list(rs), nodes=[ctx.node_of(r) for r in rs], cause="unknown",
                  severity="critical", evidence=ev, cost_pct=0.0, suggestion=STALL_SUGGESTION)
        self._open[a.alert_id] = {"alert": a, "members": set(rs)}
        for r in rs:
            self._active[r] = True
            self._owner[r] = a.alert_id
        return a

    def _back(self, r: int, step: int, t_end: int) -> Alert | None:
        self._active[r] = False
        aid = self._owner.pop(r, None)
        o = self._open.get(aid)
        if o is None:
            return None
        o["members"].discard(r)
        if o["members"]:
            return None
        del self._open[aid]
        a = o["alert"]
        return Alert(job=a.job, kind=a.kind, status="resolved", step_first=a.step_first, step_detected=step,
                     t_detected=t_end, ranks=list(a.ranks), nodes=list(a.nodes), cause=a.cause,
                     severity=a.severity, evidence=a.evidence, cost_pct=a.cost_pct, suggestion=a.suggestion,
                     alert_id=a.alert_id)

    # -- event time: job hang ------------------------------------------------------------------------
    def threshold_ns(self) -> int:
        ms = self._ms[np.isfinite(self._ms)]
        step_ms = float(np.median(ms)) if len(ms) else 0.0
        return int(max(self.hang_s * 1e9, self.hang_steps * step_ms * 1e6))

    def _silence(self, ctx: JobContext, thr: int) -> tuple[int, dict]:
        """How long the job's steps have been silent in event time, judged per source: per node, the
        newest host sample minus the newest step end of the node's ranks (one clock: a node's agent and
        its ranks share it, so clock offsets between nodes cancel). Only nodes whose host samples still
        arrive (within ``thr`` of the median node's newest sample) count, and the job is silent only as long as its *least*
        silent node is. Without per-node watermarks: the job's newest host sample minus its newest step
        end."""
        host, steps_t = int(ctx.host_event_ns), int(ctx.steps_event_ns)
        glob = host - steps_t
        hn = getattr(ctx, "host_node_ns", None)
        lt, nodes = ctx.last_t_end, np.asarray(ctx.nodes)
        if not hn or lt is None or len(lt) != len(nodes) or len(nodes) == 0:
            return glob, {"judged": "job"}
        if not (lt > 0).any():
            return glob, {"judged": "job"}
        key = (id(ctx.nodes), len(nodes))
        if self._node_key != key:                          # ranks grouped by node, once per topology
            names, inv = np.unique(nodes.astype(str), return_inverse=True)
            order = np.argsort(inv, kind="stable")
            starts = np.flatnonzero(np.r_[True, np.diff(inv[order]) != 0])
            self._node_key, self._node_grp = key, (names, order, starts)
        names, order, starts = self._node_grp
        smax = np.maximum.reduceat(lt[order].astype(np.int64), starts)
        has = smax > 0                                     # nodes with a rank that reported
        names, smax = names[has], smax[has]
        hv = np.array([hn.get(str(n), 0) for n in names], dtype=np.int64)
        # still sampling: within the threshold of the median node (a few nodes with clocks ahead or
        # behind move the median by nothing; a node whose agent stopped falls out)
        live = (hv > 0) & (hv >= int(np.median(hv[hv > 0])) - thr) if (hv > 0).any() else hv > 0
        if not live.any():
            return glob, {"judged": "job"}
        per = hv[live] - smax[live]
        i = int(np.argmin(per))
        how = {"judged": "per_node", "nodes_judged": int(live.sum()), "least_silent_node": str(names[live][i]),
               "least_silent_s": round(int(per[i]) / 1e9, 1)}
        if per[i] * 2 < thr or len(per) == 1:              # a node stepped within half the threshold
            return int(per[i]), how
        # no node stepped lately: the silence a quorum of the nodes shows (the rest wait for their next batch)
        q = np.sort(per)[::-1][max(int(np.ceil(self.hang_quorum * len(per))) - 1, 0)]
        return int(q), how

    def _watchdog(self, ctx: JobContext, thr: int) -> tuple[int, dict, set, int] | None:
        """The ranks' own word on a hang: their newest in-flight rows (the probe's watchdog, the agent)
        say that at least ``min_reporting`` of the ranks that reported steps are inside a step they have
        not ended (a probe row in ``collective`` / ``compute`` / ``data`` for a step newer than the
        rank's last step read; or the agent's ``stopped`` / ``silent``). Returns ``(silence, how, kinds,
        step in progress)``, the silence being the least ``elapsed_ms`` of the stuck probe rows (each
        rank's step has lasted that long at its own report's time), or None. It needs neither the steps
        topic read to its end nor host samples: a report is timestamped by the rank itself and is read
        from the in-flight topic, so a steps topic read behind neither delays it nor fakes it (a rank
        whose steps are merely unread sends no such report; one whose step did end sends ``done``, and
        a report for a step whose end was read is stale)."""
        w = getattr(ctx, "inflight", None)
        if w is None or not len(w):
            return None
        key = (id(w), w.rows, int(w.newest), int(ctx.max_step), int(ctx.steps_event_ns))
        if key == self._wd_key:
            return self._wd
        self._wd_key, self._wd = key, None
        t = hang.latest(ctx, int(ctx.steps_event_ns))
        if t is None or not {"elapsed_ms", "step", "state", "source"} <= set(t.column_names):
            return None
        R = int(ctx.world_size)
        rank = hang._ints(t.column("rank"))
        state, source = hang._str(t, "state"), hang._str(t, "source")
        step = hang._ints(t.column("step"))
        el = t.column("elapsed_ms").to_numpy(zero_copy_only=False).astype(float)   # null: nan
        last = ctx.last_step if ctx.last_step is not None and len(ctx.last_step) == R else None
        ok = (rank >= 0) & (rank < R)
        mine = np.full(len(rank), -1, np.int64)
        if last is not None:
            mine[ok] = np.asarray(last)[rank[ok]]
        probe = ok & (source == "probe") & np.isin(state, ("collective", "compute", "data")) & (step >= 0) \
            & (step > mine) & np.isfinite(el)
        agent = ok & (source == "agent") & np.isin(state, ("stopped", "silent"))
        n_seen = int(np.count_nonzero(np.asarray(last) >= 0)) if last is not None else R
        n_stuck = int(np.count_nonzero(probe | agent))
        if not probe.any() or n_stuck < max(1, int(np.ceil(self.min_reporting * max(n_seen, 1)))):
            return None
        kinds: set[str] = set()
        if "step_kind" in t.column_names:
            for v in set(hang._str(t, "step_kind")[probe].tolist()) - {""}:
                kinds |= {hang.STEP_KINDS.get(k.strip(), k.strip()) for k in v.split(",") if k.strip()}
        silent = int(np.min(el[probe]) * 1e6)
        how = {"judged": "watchdog", "ranks_stuck": n_stuck, "ranks_reporting_steps": n_seen,
               "watchdog_report_t": int(hang._ints(t.column("t"))[probe | agent].max())}
        self._wd = (silent, how, kinds, int(step[probe].max()))
        return self._wd

    def tick(self, ctx: JobContext, now_ns: int) -> list[Alert]:
        top = int(ctx.max_step)
        if top < 0:
            return []
        if self._hang is not None:
            if top > self._hang_top:                       # steps again: the hang is over
                a = self._hang
                self._hang = None
                if getattr(ctx, "life", None) is not None:
                    ctx.life.hung_ns = 0
                return [Alert(job=a.job, kind=a.kind, status="resolved", step_first=a.step_first,
                              step_detected=top, t_detected=int(ctx.steps_event_ns), ranks=list(a.ranks),
                              nodes=list(a.nodes), cause=a.cause, severity=a.severity, evidence=a.evidence,
                              cost_pct=a.cost_pct, suggestion=a.suggestion, alert_id=a.alert_id)]
            return []
        host = int(ctx.host_event_ns)
        steps_t = int(ctx.steps_event_ns)
        if host <= 0 or steps_t <= 0:
            return []
        life = getattr(ctx, "life", None)
        if life is not None and life.holds_hang():         # a rank ended: the job's end or a crash
            return []                                      # (detectors.lifecycle), not a hang
        thr0 = self.threshold_ns()
        caught_up = getattr(ctx, "caught_up", None)
        # the ranks' own reports first: they prove a hang whatever order the topics are read in
        wd = self._watchdog(ctx, thr0)
        if wd is not None:
            silent, how, kinds, _ = wd
            thr = max([thr0] + [int(self.hang_kind_s[k] * 1e9) for k in kinds if k in self.hang_kind_s])
            if silent >= thr:
                read = caught_up is None or bool(caught_up())
                return self._raise(ctx, top, host, steps_t, silent, thr, how, kinds, read,
                                   caught_up is not None and read)
        if ctx.backlog:
            return []
        thr = thr0
        if host - steps_t < thr:                           # necessary for every node to be silent: O(1)
            return []
        silent, how = self._silence(ctx, thr)
        if silent < thr:
            return []
        # event time says the steps stopped; that holds only if the steps source has been read to its end
        # (Kafka orders nothing across topics: host samples may be read far ahead of the steps)
        if caught_up is not None and not caught_up():
            return []
        kinds = hang.kinds_in_progress(ctx, steps_t)       # a long step by design: its kind's threshold
        thr = max([thr] + [int(self.hang_kind_s[k] * 1e9) for k in kinds if k in self.hang_kind_s])
        if silent < thr:
            return []
        return self._raise(ctx, top, host, steps_t, silent, thr, how, kinds, True, caught_up is not None)

    def _raise(self, ctx: JobContext, top: int, host: int, steps_t: int, silent: int, thr: int, how: dict,
               kinds: set, read: bool, proven: bool) -> list[Alert]:
        """The ``job_hang`` alert. ``read``: the job's steps are taken as read to their end (else the
        ranks' last steps read say nothing of who stopped first: only their in-flight states do);
        ``proven``: the processor said so (``ctx.caught_up()``)."""
        life = getattr(ctx, "life", None)
        last = ctx.last_step if ctx.last_step is not None else np.zeros(0, np.int64)
        seen = np.flatnonzero(last >= 0)
        ev = {"silent_s": round(silent / 1e9, 1), "threshold_s": round(thr / 1e9, 1), "newest_step": top,
              "ranks_reporting_before": int(len(seen)), "steps_read_to_end": bool(proven), **how}
        culprit: list[int] = []
        step_first = top + 1
        if len(seen) and not read:
            step_first = int(last[seen].max()) + 1
            ev["stopped_first"] = []
        elif len(seen):
            ls = last[seen]
            lo, hi = int(ls.min()), int(ls.max())
            step_first = lo + 1
            behind = seen[ls == lo]
            if lo < hi and len(behind) <= 0.5 * len(seen):
                lt = ctx.last_t_end[behind] if ctx.last_t_end is not None else None
                if lt is not None and len(behind) > 1:
                    behind = behind[lt == lt.min()]
                culprit = sorted(int(x) for x in behind)[:self.max_alerts]
                ev["stopped_first"] = culprit
                ev["stopped_first_last_step"] = lo
                ev["others_last_step"] = hi
                ev["ranks_behind"] = int(np.count_nonzero(ls < hi))
            else:
                ev["stopped_first"] = []
                ev["all_stopped_at_step"] = hi
        loc = hang.locate(ctx, steps_t, self.max_alerts, now_ns=host)   # the ranks' in-flight states
        if kinds:
            ev["step_kinds"] = sorted(kinds)
        if loc is not None:
            ev.update(loc["evidence"])
            culprit = loc["ranks"] or culprit
        inflight_step = hang.step_in_progress(ctx, steps_t)
        if read and inflight_step is not None and inflight_step > step_first:
            # the ranks' watchdogs say which step they are stuck in: steps finished before the hang may still
            # wait in their probes (sent with the next step end, which does not come)
            ev["stored_steps_up_to"] = step_first - 1
            step_first = inflight_step
        elif not read and inflight_step is not None:
            step_first = inflight_step         # the steps are read behind: the step the ranks say they are in
        nodes_ = sorted({ctx.node_of(r) for r in culprit} - {""})
        if nodes_:
            ev["host_samples"] = _node_host_state(ctx, nodes_, host)
        a = Alert(job=ctx.job, kind="job_hang", status="firing", step_first=step_first,
                  step_detected=max(top, step_first),
                  t_detected=host, ranks=culprit, nodes=[ctx.node_of(r) for r in culprit],
                  cause="communication", severity="critical", evidence=ev, cost_pct=100.0,
                  suggestion=(loc or {}).get("suggestion") or HANG_SUGGESTION,
                  alert_id=stable_id(ctx.job, "job_hang", culprit, step_first))
        # over when a step newer than every step known begun ends (not when older steps read late come)
        self._hang, self._hang_top = a, max(top, (inflight_step or 0) - 1)
        if life is not None:
            life.hung_ns = host                            # ranks that end now end a hung job
        return [a]


def _node_host_state(ctx: JobContext, nodes: list[str], now_ns: int) -> dict:
    """Whether the nodes' host samples still arrive: newest sample age per node (s) vs the job's."""
    out = hang.host_ages(ctx, nodes)
    if not out:
        return {}
    return {"behind_s": out, "still_arriving": all(v is not None and v <= 5.0 for v in out.values())}

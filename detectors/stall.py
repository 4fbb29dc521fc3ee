"""Stalls and hangs: ranks, nodes or whole jobs that stop reporting, judged on event time."""
from __future__ import annotations

import numpy as np

from . import hang
from .base import Alert, Detector, JobContext, StepBlock, stable_id
from .causes import HANG_SUGGESTION, STALL_SUGGESTION, nanmedian


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

    *Job hang* is judged in :meth:`tick`, on every host batch: the job's event time from host samples
    has moved more than ``max(hang_s, hang_steps * median step time)`` past its newest step end (no
    rank finished a step for that long while the node agents keep sampling), beyond the usual lead of
    host time over step time (the median of that lead measured while steps still advanced, so a host
    clock running ahead, or a host topic read ahead of the steps topic in a replay, is not a hang; a
    processor that has not yet seen steps advance, e.g. just after a restart, takes the first lead it
    sees as the usual one, so a hang already in progress is reported a threshold later).
    Host samples and steps are both event time, so a replay at any speed or a stream delayed as a whole
    is judged the same. When the consumer is known to lag on the job's steps partition
    (``ctx.backlog``), the judgement waits. The alert names the rank(s) whose last
    step is older than the rest (the rank that stopped first, the others then blocked in the collective
    waiting for it) when they are fewer than half of the ranks; it resolves when a newer step arrives.
    Cause: ``communication`` (ranks blocked in a collective); a rank/node stall has no cause in the
    taxonomy (``unknown``) and suggests what to check.

    Cost: O(R) per closed step (a few vector updates); :meth:`tick` is O(1) unless it fires (O(R)).
    State: (R,) vectors, a ring of the last 64 step times and the open alerts.

    Settings (keyword arguments, defaults):
        k=3                consecutive closed steps a rank must miss while its peers report
        min_reporting=0.5  share of the ranks that must report a closed step for it to count
        hang_s=30.0        job hang: seconds of host event time without a new step, at least ...
        hang_steps=10      ... this many median step times
        max_alerts=8       more newly stalled ranks/nodes than this at one step give one alert
        hang_first_s=1800.0  job hang: seconds at least while the step in progress is a process's first
        hang_eval_s=1800.0   ... while it contains evaluation
        hang_checkpoint_s=1800.0  ... while it contains a checkpoint save
                           (the step's kinds come from the ranks' in-flight states; see detectors.hang, which
                           also names the ranks the job waits for)
    """

    name = "stall"

    def __init__(self, *, k: int = 3, min_reporting: float = 0.5, hang_s: float = 30.0, hang_steps: int = 10,
                 max_alerts: int = 8, hang_first_s: float = 1800.0, hang_eval_s: float = 1800.0,
                 hang_checkpoint_s: float = 1800.0):
        if k < 1 or not 0 < min_reporting <= 1 or hang_s <= 0 or hang_steps < 1 or max_alerts < 1:
            raise ValueError("stall: need k >= 1, 0 < min_reporting <= 1, hang_s > 0, hang_steps >= 1, "
                             "max_alerts >= 1")
        if min(hang_first_s, hang_eval_s, hang_checkpoint_s) <= 0:
            raise ValueError("stall: need hang_first_s, hang_eval_s, hang_checkpoint_s > 0")
        self.hang_kind_s = {"first": float(hang_first_s), "eval": float(hang_eval_s),
                            "checkpoint": float(hang_checkpoint_s)}
        self.k, self.min_reporting = int(k), float(min_reporting)
        self.hang_s, self.hang_steps, self.max_alerts = float(hang_s), int(hang_steps), int(max_alerts)
        self._R = -1
        self._ms = np.full(64, np.nan)          # median step time of recent steps (ring)
        self._ms_n = 0
        self._hang: Alert | None = None
        self._hang_top = -1                      # newest step when the hang fired
        self._lead = np.zeros(32, dtype=np.int64)   # host time - step time while steps still moved
        self._lead_n = 0
        self._lead_top = -1
        self._first_lead = 0

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

    def tick(self, ctx: JobContext, now_ns: int) -> list[Alert]:
        top = int(ctx.max_step)
        if top < 0:
            return []
        if self._hang is not None:
            if top > self._hang_top:                       # steps again: the hang is over
                a = self._hang
                self._hang = None
                return [Alert(job=a.job, kind=a.kind, status="resolved", step_first=a.step_first,
                              step_detected=top, t_detected=int(ctx.steps_event_ns), ranks=list(a.ranks),
                              nodes=list(a.nodes), cause=a.cause, severity=a.severity, evidence=a.evidence,
                              cost_pct=a.cost_pct, suggestion=a.suggestion, alert_id=a.alert_id)]
            return []
        host = int(ctx.host_event_ns)
        steps_t = int(ctx.steps_event_ns)
        if host <= 0 or steps_t <= 0 or ctx.backlog:
            return []
        if self._lead_top < 0:                             # first look (a new job, or after a restart):
            self._first_lead = host - steps_t              # take the lead seen as the usual one
            self._lead_top = top
        elif top != self._lead_top:                        # steps moved: how far ahead host time runs
            self._lead[self._lead_n % len(self._lead)] = host - steps_t
            self._lead_n += 1
            self._lead_top = top
        lead = self._lead[:min(self._lead_n, len(self._lead))]
        usual = max(float(np.median(lead)) if len(lead) else float(self._first_lead), 0.0)
        silent = host - steps_t
        thr = self.threshold_ns()
        if silent - usual < thr:
            return []
        kinds = hang.kinds_in_progress(ctx, steps_t)       # a long step by design: its kind's threshold
        thr = max([thr] + [int(self.hang_kind_s[k] * 1e9) for k in kinds if k in self.hang_kind_s])
        if silent - usual < thr:
            return []
        last = ctx.last_step if ctx.last_step is not None else np.zeros(0, np.int64)
        seen = np.flatnonzero(last >= 0)
        ev = {"silent_s": round(silent / 1e9, 1), "threshold_s": round(thr / 1e9, 1),
              "usual_host_lead_s": round(usual / 1e9, 1), "newest_step": top,
              "ranks_reporting_before": int(len(seen))}
        culprit: list[int] = []
        step_first = top + 1
        if len(seen):
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
        nodes_ = sorted({ctx.node_of(r) for r in culprit} - {""})
        if nodes_:
            ev["host_samples"] = _node_host_state(ctx, nodes_, host)
        a = Alert(job=ctx.job, kind="job_hang", status="firing", step_first=step_first,
                  step_detected=max(top, step_first),
                  t_detected=host, ranks=culprit, nodes=[ctx.node_of(r) for r in culprit],
                  cause="communication", severity="critical", evidence=ev, cost_pct=100.0,
                  suggestion=(loc or {}).get("suggestion") or HANG_SUGGESTION,
                  alert_id=stable_id(ctx.job, "job_hang", culprit, step_first))
        self._hang, self._hang_top = a, top
        return [a]


def _node_host_state(ctx: JobContext, nodes: list[str], now_ns: int) -> dict:
    """Whether the nodes' host samples still arrive: newest sample age per node (s) vs the job's."""
    w = getattr(ctx, "host", None)
    if w is None or not len(w) or not nodes:
        return {}
    t = w.select(None, None)
    if t is None:
        return {}
    import pyarrow as pa
    import pyarrow.compute as pc
    job_t = int(w.newest)
    out = {}
    for n in nodes[:8]:
        m = pc.equal(t.column("node"), pa.scalar(n, t.column("node").type))
        tt = t.filter(m).column("t")
        newest = pc.max(tt.cast(pa.int64())).as_py() if len(tt) else None
        out[n] = None if newest is None else round((job_t - int(newest)) / 1e9, 1)
    return {"behind_s": out, "still_arriving": all(v is not None and v <= 5.0 for v in out.values())}

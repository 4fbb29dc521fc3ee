"""Incidents: the alerts of one fault grouped into one thing, with one stable id, evidence and a timeline.

A fault is usually seen by several detectors and more than once: a straggler fires ``slow_rank``, the
job's step time rises with it (``regression``, often cause ``communication``: the other ranks wait
longer), its step time jitters (``jitter``), and the straggler may resolve and fire again a few steps
later. An operator wants one incident per fault: the cause, with its consequences inside it.

:class:`Incidents` (one per job, called by the processor for every alert it emits) puts each alert into an
incident by these rules, in order:

1. **The same alert again** (a status change: resolved, or a re-send) goes where it went before.
2. **Same place**: an alert naming ranks joins the incident that names an overlapping rank set (a
   node-scoped kind, :data:`NODE_KINDS`, also the same single node), if that incident is still firing or
   went quiet less than ``cooldown_steps`` steps before the alert's first step: a straggler that resolves
   and fires again, a rank stall after a slow rank, a jitter alert naming the intermittent straggler. A
   resolved incident takes only its own kind re-firing. An incident a :data:`NOISE_KINDS` alert (jitter)
   opened takes nothing else but the fault behind it: a rank-naming cause on the same ranks whose first
   step is within ``lead_steps`` of the noise, which then names it.
3. **Consequence of a localised cause**: a job-wide alert (no ranks: ``regression``, ``recovery``,
   ``jitter``, ``mfu_regression``, …) joins the newest firing (or quiet for less than the cool-down)
   rank/node/group incident when its cause is one a slow rank produces on the whole job
   (``communication``: the others wait; ``computation``; ``unknown``) or the incident's own cause, and it
   began within ``lead_steps`` steps of that incident's onset. A job-wide data-wait or GC regression
   beside a compute straggler stays its own incident: two faults.
   Any other job-wide change that began within ``lead_steps`` of the localised fault's first step and
   whose cause a straggler can produce (not ``io``/``gc``) is its consequence too: a ``regression`` when
   the straggler's excess busy time explains its size (:func:`explains`; a slowdown far larger is another
   fault), a ``recovery`` or ``jitter`` always (four ranks on two cores: the one that sleeps leaves its
   core to the others, whose CPU wait drops at the fault's onset).
   The other way round too: a localised alert that comes within ``lead_steps`` of a job-wide change still
   firing joins that incident as its cause (the incident then reports that alert's kind and cause; its id
   stays), unless the change's cause is one a straggler cannot produce (``io``, ``gc``: two faults). The
   size is not weighed here, nor the localised alert's cause: a straggler's excess is measured over the
   few steps that confirmed it, and its cause is often decided again seconds later when its node's host
   samples come (stream/hostwait.py): neither is final when the alert is placed, and an incident id once
   sent is never changed.
   A localised alert whose cause is a job-wide ``io`` or ``gc`` change still firing (not recovered) is that
   fault on the rank it hit most (every rank reads slower; one of them, slower than its peers, is named
   slow with cause io), however long after the change it comes.
   However long after the onset, a ``regression`` of the job's wait in collectives (``comm_wait_ms``,
   cause ``communication``) while a straggler's incident still fires, by no more than its excess explains,
   is the others waiting for it (:func:`_waits_for`); a network fault lengthens the transfers instead.
   Likewise a job-wide ``cpu``/``computation`` regression while a straggler slowed by CPU contention
   (cause ``cpu``) fires: that contention reaching the other ranks' cores.
   "Onset" is the first step of the localised incident's newest fire (a rank that resolved and fired
   again within the cool-down starts a new episode of the same incident).
4. **The fault it ends**: a ``recovery`` that names the regression it undoes (``evidence.transient``)
   joins that regression's incident, wherever it went (a straggler's job-wide consequence too).
5. **The same job-wide change**: a job-wide alert joins the newest job-wide incident with the same cause
   whose newest alert is less than the cool-down old, or the localised incident (still active) that
   holds such a job-wide alert as a consequence (the job got slower again, the same way, during the
   same fault); a ``recovery`` joins the newest job-wide incident not yet recovered, whatever its cause
   (the change it undoes), and closes it.
6. Otherwise the alert opens a new incident. Its id is derived from the alert that opened it
   (``inc-`` + 16 hex of SHA-1 of job and that alert's stable id), so a processor that rebuilds the job
   from the store (:meth:`Incidents.seed` with the stored alerts) or replays the same steps gets the
   same id.

An incident naming ranks is *firing* while one of its rank-naming alerts is firing and was not resolved
(the job-wide consequences, whose ``regression`` alerts never resolve, do not hold it open); a job-wide
incident is firing until a ``recovery`` closes it; otherwise *resolved*. Each alert is stamped with ``incident_id`` and
``evidence["incident"]``: the incident's id, status, role of this alert (``root`` | ``consequence`` |
``refire`` | ``update``), root alert id, cause, ranks/nodes, and a timeline of its last
``timeline_max`` events (step, kind, status, alert id). Cost: O(open incidents) per alert; state: the
incidents of the last ``keep`` alerts' worth (bounded).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

#: causes a slow rank/node/group produces on the job as a whole (the others wait in collectives)
CONSEQUENCE_CAUSES = {"communication", "computation", "unknown", "parallelism"}
#: causes a straggler's job-wide consequence can never be attributed to (phases it does not move)
OWN_CAUSES = {"io", "gc"}
#: kinds that name a localised cause (a jitter alert naming its gating rank is a symptom of one)
CAUSE_KINDS = {"slow_rank", "slow_node", "slow_group", "rank_stall", "node_stall", "comm_slow_link", "job_hang"}
#: localised kinds that slow the job through one rank/node/group being slower than its peers
STRAGGLER_KINDS = {"slow_rank", "slow_node", "slow_group"}
#: a job-wide step-time shift up to this multiple of a straggler's excess busy time is its consequence
EXPLAINS = 1.5
#: localised kinds whose incident can hold job-wide consequences
LOCAL_KINDS = {"slow_rank", "slow_node", "slow_group", "rank_stall", "node_stall", "comm_slow_link", "jitter",
               "job_hang", "rank_crash"}
#: low-severity observations: an incident they open holds nothing else (unless the fault behind the noise
#: shows itself on the same ranks while the noise is still fresh: then that fault names it)
NOISE_KINDS = {"jitter"}
#: kinds whose scope is a node: only these join another incident by a shared node (all ranks of a one-node
#: job share the node; two ranks' faults there are two faults)
NODE_KINDS = {"slow_node", "node_stall"}


def incident_id(job: str, root_alert_id: str) -> str:
    return "inc-" + hashlib.sha1(f"{job}|{root_alert_id}".encode()).hexdigest()[:16]


def _excess_ms(a) -> float | None:
    """A localised alert's excess busy time per step over its peers (ms), from its evidence."""
    ev = getattr(a, "evidence", None) or {}
    b, p = ev.get("busy_ms"), ev.get("peer_median_ms")
    return float(b) - float(p) if isinstance(b, (int, float)) and isinstance(p, (int, float)) else None


def _shift_ms(a) -> float | None:
    """A job-wide change's size (ms), from its evidence: the shift of the job's step time, or for a change
    led by a phase the larger of the phase's shift and the step time's (a phase can move before the step
    time does: the probe spreads a rank's run-queue wait over the steps of its ~500 ms sample, so a
    host-gap regression can begin a few steps before the straggler slows the job)."""
    ev = getattr(a, "evidence", None) or {}

    def d(kb, ka):
        b, x = ev.get(kb), ev.get(ka)
        return float(x) - float(b) if isinstance(b, (int, float)) and isinstance(x, (int, float)) else None

    if ev.get("series") == "step_ms":
        return d("median_before_ms", "median_after_ms")
    sizes = [x for x in (d("step_median_before_ms", "step_median_after_ms"),
                         d("median_before_ms", "median_after_ms") if ev.get("series") else None) if x is not None]
    return max(sizes) if sizes else None


def explains(excess_ms: float | None, shift_ms: float | None, cause: str) -> bool:
    """Whether a straggler of ``excess_ms`` per step explains a job-wide slowdown of ``shift_ms`` whatever
    cause the job-wide change was given: in synchronous training every step waits for the slowest rank,
    so the job's step time rises by about the straggler's excess (the phase that grew on the median rank,
    and host evidence of the single node, say little then). Not for data wait or GC: a straggler does
    not move them on the other ranks."""
    return (cause not in OWN_CAUSES and excess_ms is not None and shift_ms is not None and excess_ms > 0
            and 0 < shift_ms <= EXPLAINS * excess_ms)


def _waits_for(a, inc) -> bool:
    """Whether job-wide alert ``a`` is the other ranks' wait for the straggler of localised incident
    ``inc``, however long after its onset: a ``regression`` of ``comm_wait_ms`` (the time ranks wait in
    collectives for the slowest one) while the straggler still fires, by no more than its excess busy
    time explains. While one rank is slow, that wait *is* its excess seen from the others, so it moves
    with the straggler (a 2-core machine slowing the sleeping rank a little more, sixty steps in); a
    fault of the network lengthens the transfers (``comm_ms``), not the wait, and stays apart.

    The same for a straggler slowed by CPU contention (cause ``cpu``: a foreign process on its core): a
    job-wide ``cpu`` or ``computation`` regression while it fires, within what its excess explains, is
    that contention reaching the other ranks' cores (a VM's vCPUs share physical CPUs: a real DDP run with
    a hog pinned to rank 1's core from step 101 got a job-wide compute regression, 42.0 -> 50.3 ms, at
    step 172). A compute straggler's job-wide compute change is not taken so: two faults, unless the
    straggler's ranks are at least half of the ranks the job-wide series summarises (its evidence's
    ``ranks``): the job's median then moves with them, and a straggler's own drift is a job-wide change
    (a 2-rank DDP run, rank 1 sleeping 15 ms a step: 116 steps in, the job's compute rose 48.1 -> 54.1 ms
    while rank 1's slow_rank still fired). Likewise for any cause the straggler and the change share
    (eval --real, data-r1: rank 1 reading 15 ms slower per batch, named slow with cause io; 77 steps
    later the 2-rank job's data wait rose 3 % more, cause io)."""
    if a.kind != "regression" or inc.kind not in STRAGGLER_KINDS or inc.status != "firing":
        return False
    ev = a.evidence or {}
    n = ev.get("ranks") or 0
    x, shift = inc.excess_ms, _shift_ms(a)
    if inc.cause == a.cause and 0 < n <= 2 * len(inc.ranks):     # the job's median is half the straggler's
        return x is not None and shift is not None and x > 0 and 0 < shift <= EXPLAINS * x
    return explains(x, shift, a.cause) and (ev.get("series") == "comm_wait_ms" and a.cause == "communication"
                                             or inc.cause == "cpu" and a.cause in ("cpu", "computation"))


@dataclass
class Incident:
    id: str
    job: str
    root: str                       # alert id that opened it
    kind: str                       # the root alert's kind
    cause: str
    ranks: set = field(default_factory=set)
    nodes: set = field(default_factory=set)
    local: bool = False             # names ranks (a rank/node/group fault)
    step_first: int = 0
    step_last: int = 0              # newest step_detected of its alerts
    firing: dict = field(default_factory=dict)    # alert_id -> still firing
    closed: bool = False            # a recovery closed it (job-wide change undone)
    timeline: list = field(default_factory=list)
    members: int = 0

    local_ids: set = field(default_factory=set)   # its alerts that name ranks
    named_by: str = ""                            # the alert whose kind and cause the incident reports
    excess_ms: float | None = None                # localised: largest excess busy time per step of its alerts
    shift_ms: float | None = None                 # job-wide: step-time shift of the alert that opened it
    onset: int | None = None                      # localised: first step of its newest rank-naming fire
    wide: dict = field(default_factory=dict)      # job-wide alerts it holds: cause -> newest step_detected
    noise: bool = False                           # opened by a low-severity observation (NOISE_KINDS)
    quiet: bool = False                           # closed after a quiet period (Incidents.expire)
    noise_ids: set = field(default_factory=set)   # its NOISE_KINDS alerts (they hold no other incident open)
    superseded: bool = False                      # a rank alert of it resolved because another fault overtook it


    @property
    def status(self) -> str:
        """A localised incident fires while one of its rank-naming alerts does (its job-wide consequences,
        whose regression alerts never resolve, do not hold it open); a job-wide one until recovered."""
        if self.closed or self.quiet:
            return "resolved"
        hold = self.local_ids if self.noise else self.local_ids - self.noise_ids
        if self.local and hold:
            return "firing" if any(self.firing.get(i) for i in hold) else "resolved"
        hold = set(self.firing) if self.noise else set(self.firing) - self.noise_ids
        return "firing" if any(self.firing.get(i) for i in hold) else "resolved"

    def active_at(self, step: int, cooldown: int) -> bool:
        """A localised incident is active while firing and ``cooldown`` steps after; a job-wide one (whose
        regression alerts never resolve) for ``cooldown`` steps after its newest alert; neither once closed
        after a quiet period."""
        if self.quiet or self.superseded and self.status == "resolved":
            return False                             # (overtaken: what follows is the new fault's)
        if self.local and self.status == "firing":
            return True
        return step - self.step_last <= cooldown


class Incidents:
    """Groups one job's alerts into incidents (see the module docs)."""

    def __init__(self, cooldown_steps: int = 50, lead_steps: int = 20, timeline_max: int = 24,
                 keep: int = 256, quiet_steps: int = 300):
        self.cooldown, self.lead, self.timeline_max, self.keep = int(cooldown_steps), int(lead_steps), \
            int(timeline_max), int(keep)
        self.quiet_steps = int(quiet_steps)
        self.by_alert: dict[str, str] = {}
        self.incidents: dict[str, Incident] = {}

    # -- assignment ----------------------------------------------------------------------------------
    def _find(self, a) -> tuple[Incident | None, str]:
        iid = self.by_alert.get(a.alert_id)
        if iid is not None and iid in self.incidents:
            return self.incidents[iid], "update"
        undone = ((a.evidence or {}).get("transient") or {}).get("regression_alert") if a.kind == "recovery" else None
        iid = self.by_alert.get(undone) if undone else None
        if iid is not None and iid in self.incidents:         # the regression it undoes: that fault's end
            return self.incidents[iid], "recovery"
        step = int(a.step_first)
        newest = sorted(self.incidents.values(), key=lambda i: i.step_last, reverse=True)
        ranks, nodes = set(int(r) for r in a.ranks), set(a.nodes)
        noise = a.kind in NOISE_KINDS
        if ranks:
            for inc in newest:
                if not inc.local or not inc.active_at(step, self.cooldown):
                    continue
                node_scoped = a.kind in NODE_KINDS or inc.kind in NODE_KINDS
                if not (ranks & inc.ranks or node_scoped and len(nodes) == 1 and nodes <= inc.nodes
                        and len(inc.nodes) == 1):
                    continue
                if inc.noise and not noise:
                    # noise holds nothing; the fault behind it names it when it shows itself on the same
                    # ranks while the noise is fresh (its first step within lead_steps of the noise)
                    if a.kind in CAUSE_KINDS and ranks & inc.ranks and abs(step - inc.step_first) <= self.lead:
                        return inc, "cause"
                    continue
                if a.kind in CAUSE_KINDS and inc.kind not in CAUSE_KINDS:
                    return inc, "cause"
                if inc.status == "resolved" and a.kind != inc.kind and not noise:
                    continue                                 # another fault after the first resolved
                return inc, "refire" if inc.kind == a.kind else "consequence"
            if noise:
                return None, "root"
            for inc in newest:                               # one rank the most hit by a job-wide io/gc fault
                if not inc.local and not inc.noise and inc.status == "firing" and not inc.quiet and \
                        a.cause in OWN_CAUSES and inc.cause == a.cause:
                    return inc, "consequence"
            for inc in newest:                               # the job-wide effect was seen first: its cause
                if not inc.local and not inc.noise and inc.status == "firing" and \
                        inc.active_at(step, self.cooldown) and abs(inc.step_first - step) <= self.lead and (
                            inc.cause not in OWN_CAUSES or inc.cause == a.cause):
                    inc.local = True
                    return inc, "cause"
            return None, "root"
        for inc in newest:                                   # job-wide: a consequence of a local fault?
            if not inc.local or inc.noise or not inc.active_at(step, self.cooldown):
                continue
            onset = inc.step_first if inc.onset is None else inc.onset
            near = abs(step - onset) <= self.lead
            if near and (a.cause in CONSEQUENCE_CAUSES or a.cause == inc.cause or a.cause not in OWN_CAUSES and (
                    a.kind != "regression" or explains(inc.excess_ms, _shift_ms(a), a.cause))):
                return inc, "consequence"
            if _waits_for(a, inc):
                return inc, "consequence"
        for inc in newest:                                   # the same job-wide change
            if inc.noise and not noise or inc.quiet and a.kind != "recovery":
                continue
            if inc.local:                                    # ... held as a consequence of a local fault
                if a.kind != "recovery" and a.cause in inc.wide and step - inc.wide[a.cause] <= self.cooldown \
                        and inc.active_at(step, self.cooldown):
                    return inc, "consequence"
                continue
            if a.kind == "recovery" and not inc.closed:      # undoes the newest change still open
                return inc, "recovery"
            if a.cause == inc.cause and step - inc.step_last <= self.cooldown:
                return inc, "consequence" if a.kind != inc.kind else "refire"
        return None, "root"

    def assign(self, a) -> Incident:
        """Put alert ``a`` into its incident; stamps ``a.incident_id`` and ``a.evidence["incident"]``."""
        inc, role = self._find(a)
        if inc is None:
            inc = Incident(id=incident_id(a.job, a.alert_id), job=a.job, root=a.alert_id, kind=a.kind,
                           cause=a.cause, local=bool(a.ranks), step_first=int(a.step_first),
                           step_last=int(a.step_detected), noise=a.kind in NOISE_KINDS)
            inc.named_by, inc.shift_ms = a.alert_id, _shift_ms(a)
            self.incidents[inc.id] = inc
            self._bound()
        if role == "cause":                                  # the localised cause names the incident
            inc.kind, inc.cause, inc.named_by, inc.noise = a.kind, a.cause, a.alert_id, False
        self._add(inc, a)
        a.incident_id = inc.id
        a.evidence = dict(a.evidence)                        # resolved alerts share the firing one's dict
        a.evidence["incident"] = self.summary(inc, role)
        return inc

    def refresh(self, a) -> None:
        """Alert ``a`` was decided again in place (its host evidence came after it was emitted,
        stream/hostwait.py): its incident takes the new cause when ``a`` names it, and ``a``'s incident
        summary is stamped again (no new timeline event: the same alert, the same status)."""
        inc = self.incidents.get(self.by_alert.get(a.alert_id, ""))
        if inc is None:
            return
        if inc.named_by == a.alert_id:
            inc.cause = a.cause
        a.evidence = dict(a.evidence)
        a.evidence["incident"] = self.summary(inc, (a.evidence.get("incident") or {}).get("role", "update"))

    def _add(self, inc: Incident, a) -> None:
        if a.alert_id not in self.by_alert:
            inc.members += 1
        self.by_alert[a.alert_id] = inc.id
        if a.ranks and a.status == "firing" and a.alert_id not in inc.local_ids:
            inc.onset = int(a.step_first) if inc.onset is None or not any(
                inc.firing.get(i) for i in inc.local_ids) else inc.onset
        if not a.ranks:
            inc.wide[a.cause] = max(inc.wide.get(a.cause, 0), int(a.step_detected))
        if a.kind in NOISE_KINDS:
            inc.noise_ids.add(a.alert_id)
        if a.ranks:
            inc.local_ids.add(a.alert_id)
            x = _excess_ms(a)
            if x is not None and (inc.excess_ms is None or x > inc.excess_ms):
                inc.excess_ms = x
        inc.ranks |= set(int(r) for r in a.ranks)
        inc.nodes |= set(str(n) for n in a.nodes)
        inc.step_first = min(inc.step_first, int(a.step_first))
        inc.step_last = max(inc.step_last, int(a.step_detected))
        if a.kind == "recovery" and not inc.local:
            inc.closed = True
        elif a.status == "firing" and a.kind != "recovery":
            inc.firing[a.alert_id] = True
            if not inc.local and a.kind == "regression":
                inc.closed = False                           # a new regression reopens a recovered change
        elif a.status == "resolved":
            inc.firing[a.alert_id] = False
            if (a.evidence or {}).get("superseded"):
                inc.superseded = True
        inc.timeline.append([int(a.step_detected), a.kind, a.status, a.alert_id])
        del inc.timeline[:-self.timeline_max]

    def expire(self, step: int) -> list[str]:
        """Close the incidents quiet for ``quiet_steps`` steps at ``step`` (no new alert, none of their
        rank-naming alerts still firing): a later alert opens a new incident. Returns their ids."""
        out = []
        for inc in self.incidents.values():
            if not inc.quiet and step - inc.step_last > self.quiet_steps and not (
                    inc.local and inc.status == "firing"):
                inc.quiet = True
                out.append(inc.id)
        return out

    def summary(self, inc: Incident, role: str) -> dict:
        return {"id": inc.id, "status": inc.status, "role": role, "root": inc.root, "kind": inc.kind,
                "cause": inc.cause, "ranks": sorted(inc.ranks)[:16], "nodes": sorted(inc.nodes)[:8],
                "alerts": inc.members, "step_first": inc.step_first, "timeline": [list(x) for x in inc.timeline]}

    def _bound(self) -> None:
        if len(self.incidents) <= self.keep:
            return
        old = sorted(self.incidents.values(), key=lambda i: i.step_last)[:len(self.incidents) - self.keep]
        for inc in old:
            del self.incidents[inc.id]
        live = set(self.incidents)
        self.by_alert = {k: v for k, v in self.by_alert.items() if v in live}

    # -- rebuild -------------------------------------------------------------------------------------
    def seed(self, rows) -> None:
        """Warm from stored alert rows (dicts or objects with the alert columns and ``incident_id``), in
        detection order: the incidents they were put in come back with their ids."""
        for r in rows:
            g = (lambda k, d=None: r.get(k, d)) if isinstance(r, dict) else (lambda k, d=None: getattr(r, k, d))
            iid = g("incident_id")
            if not iid:
                continue
            inc = self.incidents.get(iid)
            ranks = [int(x) for x in (g("ranks") or [])]
            if inc is None:
                inc = Incident(id=iid, job=g("job"), root=g("alert_id"), kind=g("kind"), cause=g("cause") or "unknown",
                               local=bool(ranks), step_first=int(g("step_first") or 0),
                               step_last=int(g("step_detected") or 0), named_by=g("alert_id"))
                self.incidents[iid] = inc

            class _A:                                        # the fields _add reads
                pass
            a = _A()
            a.alert_id, a.kind, a.status, a.ranks, a.nodes = g("alert_id"), g("kind"), g("status"), ranks, \
                list(g("nodes") or [])
            a.step_first, a.step_detected = int(g("step_first") or 0), int(g("step_detected") or 0)
            a.cause = g("cause") or "unknown"
            self._add(inc, a)
        self._bound()

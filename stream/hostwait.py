"""Localised alerts whose host evidence waits, bounded, for the host samples that cover their steps.

A ``slow_rank`` / ``slow_node`` / ``slow_group`` alert decides its cause with the host samples of its
nodes (:func:`stepwatch.detectors.causes.decide`): a foreign process on the node names ``cpu``, and its
name, pid and CPU share are the alert's evidence. Those samples travel on their own topic. A node agent
samples the host *after* the steps it ships with the sample, and the processor handles a poll's steps
before its host rows (a hang is never judged on host time ahead of steps it already fetched); Kafka orders
nothing across topics anyway. So the sample that covers the steps which confirmed an alert is usually read
just after the alert was built, and the alert would go out without the process that caused it.

The processor (:class:`HostWait`, one per job):

- emits the alert at once: notification delay is not the host stream's;
- holds the alert's **store row** while, for one of its nodes, the newest host sample read is older than
  the alert's last step (``t_end``). The wait is bounded by what the processor knows of the host stream:
  once the job's host partition is read to its end, ``wait_s`` (3 s: a few agent intervals) more; a
  host topic read behind the steps (a consumer catching up, a slow fetch) is waited for up to
  ``max_wait_s`` (30 s) of wall time or ``event_wait_s`` (30 s) of the job's step event time past the
  alert's step, and never when the job is closed or evicted or more than ``max_held`` alerts wait (the
  oldest goes);
- when the covering samples are there (or the wait ends), reads the host evidence again with the alert's
  own query (:attr:`~stepwatch.detectors.base.Alert.host_query`, :func:`~stepwatch.detectors.causes.recheck_host`)
  and decides the cause again. The alert is updated **in place**: same alert id, same incident (whose
  cause follows when this alert names it), evidence ``host``, ``cause_reason`` and ``host_wait``
  (``covered``: the samples came; ``waited_s``). When the cause, the foreign processes or a down-clocked
  accelerator named changed, the update is sent again on the alerts topic and to the sinks (Alertmanager updates the alert
  with the same labels); the store gets one row per alert and status, with the final evidence.

Cost: nothing per step while no alert waits; one host-window read per released alert. State: at most
``max_held`` alerts per job.
"""
from __future__ import annotations

import time

from stepwatch.detectors.base import Alert
from stepwatch.detectors.causes import SUGGESTIONS, recheck_host


def _substance(cause: str, ev: dict) -> tuple:
    """What a re-send is for: the cause, the foreign processes (node, name, pid) and a down-clocked
    accelerator named; not the numbers, which move with every sample."""
    host = ev.get("host") or {}
    acc = host.get("accel") or {}
    return (cause, tuple((p.get("node"), p.get("name"), p.get("pid")) for p in host.get("foreign") or []),
            (acc.get("node"), acc.get("index")) if acc.get("down_clocked") else None)


class HostWait:
    """The alerts of one job whose store row waits for host samples (see the module docs)."""

    def __init__(self, wait_s: float = 3.0, max_wait_s: float = 30.0, event_wait_s: float = 30.0,
                 max_held: int = 64):
        self.wait_ns, self.wait_s, self.max_held = int(event_wait_s * 1e9), float(wait_s), int(max_held)
        self.max_wait_s = float(max_wait_s)
        #: [alert, wall time held, nodes waited for, wall time the host source was first seen read to its end]
        self.held: list[list] = []

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, a: Alert, tel, now: float | None = None) -> bool:
        """Whether ``a``'s row waits: a firing alert with a host query, one of whose nodes has no host
        sample read yet at or after the alert's last step."""
        q = a.host_query
        if q is None or a.status != "firing":
            return False
        wm = tel.host_node_ns
        nodes = [n for n in q.get("nodes") or [] if n]
        if not nodes or all(wm.get(n, -1) >= q["t_end"] for n in nodes):
            return False
        self.held.append([a, time.monotonic() if now is None else now, nodes, None])
        return True

    def due(self, tel, steps_ns: int, now: float | None = None, force: bool = False,
            caught_up: bool = True) -> list[tuple[Alert, bool]]:
        """The held alerts whose samples came or whose wait ended, re-decided: ``(alert, changed)`` with
        ``changed`` when the cause, the foreign processes or a down-clocked accelerator named differ from
        what was sent.
        ``caught_up``: the job's host source is read to its end (see the module docs)."""
        if not self.held:
            return []
        now = time.monotonic() if now is None else now
        wm = tel.host_node_ns
        out, keep = [], []
        over = len(self.held) - self.max_held
        for i, h in enumerate(self.held):
            a, t0, nodes, t_cu = h
            if caught_up and t_cu is None:
                h[3] = t_cu = now
            q = a.host_query
            covered = all(wm.get(n, -1) >= q["t_end"] for n in nodes)
            if not (covered or force or i < over or (t_cu is not None and now - t_cu >= self.wait_s)
                    or now - t0 >= self.max_wait_s or steps_ns >= q["t_end"] + self.wait_ns):
                keep.append(h)
                continue
            out.append((a, self._recheck(a, tel, covered, now - t0)))
        self.held = keep
        return out

    @staticmethod
    def _recheck(a: Alert, tel, covered: bool, waited: float) -> bool:
        host, cause, reason = recheck_host(tel.host, a.host_query)
        before = _substance(a.cause, a.evidence)
        ev = dict(a.evidence)
        if host:
            ev["host"] = host
        ev["cause_reason"] = reason
        ev["host_wait"] = {"covered": bool(covered), "waited_s": round(max(waited, 0.0), 3)}
        a.evidence = ev
        if cause != a.cause:
            a.cause, a.suggestion = cause, SUGGESTIONS[cause]
        return before != _substance(a.cause, ev)

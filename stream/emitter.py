"""The alerts a job's detectors hand out, on their way to the sinks (:mod:`stepwatch.stream.sinks`).

One alert, emitted (:meth:`AlertEmitter.emit`): dropped when its (alert id, status) was already emitted or
stored (a replay after a rebuild: it only learns its incident); a lifecycle event (``job_end``) is stored
and said on the console, never sent as an alert, and it closes the job's incidents (what still fires is
resolved); an alert joins the job's firing set (until resolved) and its incident
(:mod:`stepwatch.detectors.incidents`), is counted, goes to the store (its row held while its host samples
are due: :mod:`stepwatch.stream.hostwait`; :meth:`AlertEmitter.settle` releases it) and to the sinks
that tell people (alerts topic, console, notifiers), and a firing one may ask for a profile
(:mod:`stepwatch.stream.profiling`), whose results re-send it with the comparison.
"""
from __future__ import annotations

import logging

import pyarrow as pa

from stepwatch.wire import tables as wire
from stepwatch.detectors.base import Alert
from stepwatch.detectors.lifecycle import EVENT_KINDS
from stepwatch.stream.sinks import AlertOut

log = logging.getLogger("stepwatch.processor")

KEEP = 1024                # alerts and lifecycle events kept in memory (the newest; all are stored)


def resolution(f: Alert, *, step: int, t_detected: int, by: str) -> Alert:
    """The firing alert ``f`` resolved at ``step`` by what no detector said (``evidence.resolved_by``:
    the job's end, an announced change)."""
    ev = dict(f.evidence)
    ev["resolved_by"] = by
    return Alert(job=f.job, kind=f.kind, status="resolved", step_first=f.step_first, step_detected=step,
                 t_detected=t_detected, ranks=list(f.ranks), nodes=list(f.nodes), cause=f.cause,
                 severity=f.severity, evidence=ev, cost_pct=f.cost_pct, suggestion=f.suggestion,
                 alert_id=f.alert_id)


class AlertEmitter:
    """The processor's alert stage, built by it with what it uses: its ``metrics``, ``job_metrics`` (or
    None), ``buffer(table, rows)`` (rows for the store, of the message in hand), ``send(batch)`` (the
    sinks), ``profiling()`` (the profiling issuer now, or None: it exists once the producer does, and a
    reload replaces it) and ``host_caught_up(rt)`` (whether the job's host partition is read to its end).
    ``rt`` is the processor's runtime of one job (``Processor.JobRuntime``).

    ``alerts`` and ``events`` are the newest :data:`KEEP` alerts and lifecycle events emitted (tests and
    tools read them); ``emitted`` counts every alert."""

    def __init__(self, *, metrics, job_metrics, buffer, send, profiling, host_caught_up):
        self.metrics, self.job_metrics, self.buffer, self.send = metrics, job_metrics, buffer, send
        self.profiling, self.host_caught_up = profiling, host_caught_up
        self.alerts: list[Alert] = []
        self.events: list[Alert] = []
        self.emitted = 0

    def emit(self, rt, a: Alert) -> None:
        """One alert of the job ``rt`` (a detector's, or one the processor resolves) to the store and sinks."""
        key = (a.alert_id, a.status)
        if key in rt.alerts_seen:
            if not a.incident_id:                           # replayed: its incident is known (seeded)
                a.incident_id = rt.incidents.by_alert.get(a.alert_id, "")
            return
        rt.alerts_seen.add(key)
        if a.kind in EVENT_KINDS:
            self._event(rt, a)
            return
        if a.status == "firing":
            rt.firing[a.alert_id] = a
        else:
            rt.firing.pop(a.alert_id, None)
        rt.incidents.assign(a)                               # one incident per fault (detectors/incidents.py)
        st = rt.state
        sl = a.step_first % st.capacity
        if "t_first_ns" not in a.evidence and st.slot_step[sl] == a.step_first and st.t_end[sl]:
            a.evidence["t_first_ns"] = int(st.t_end[sl])    # lets Grafana draw the alert as a region
        self.alerts.append(a)
        del self.alerts[:-KEEP]
        self.emitted += 1
        self.metrics.alerts.labels(a.kind, a.status).inc()
        if self.job_metrics is not None:
            self.job_metrics.on_alert(a)
        row = pa.Table.from_pylist([a.row()], schema=wire.ALERTS)
        if rt.replaying or not rt.hostwait.hold(a, rt.telemetry):
            self.buffer("alerts", row)                       # else when its host samples came (settle)
        self.notify(a, row)
        profiling = self.profiling()
        if profiling is not None and a.status == "firing" and not rt.replaying:
            self._profile(profiling, rt, a)

    def _event(self, rt, a: Alert) -> None:
        """A lifecycle event (``job_end``): stored with the alerts (severity info), said on the console,
        never sent as an alert. It closes the job's incidents: alerts still firing are resolved."""
        closed = []
        for f in list(rt.firing.values()):
            self.emit(rt, resolution(f, step=a.step_detected, t_detected=a.t_detected, by="job_end"))
        for inc in rt.incidents.incidents.values():
            if inc.status == "firing" or not inc.closed:
                closed.append(inc.id)
            inc.closed = True
        a.evidence = dict(a.evidence, incidents_closed=closed[:32])
        self.events.append(a)
        del self.events[:-KEEP]
        self.metrics.alerts.labels(a.kind, a.status).inc()
        log.info("%s", a.line())
        self.buffer("alerts", pa.Table.from_pylist([a.row()], schema=wire.ALERTS))

    def notify(self, a: Alert, row: pa.Table | None = None, note: str = "") -> None:
        """The alert to the sinks that tell people (alerts topic, console, notifiers), now."""
        self.send(AlertOut(a, row, note=note))

    def settle(self, rt, force: bool = False) -> None:
        """Alerts whose row waited for the host samples of their steps (stream/hostwait.py): decided again,
        stored, and sent again (same alert id) when their cause or foreign process changed."""
        if not len(rt.hostwait):
            return
        for a, changed in rt.hostwait.due(rt.telemetry, rt.state.max_t_end, force=force,
                                          caught_up=self.host_caught_up(rt)):
            if changed:
                rt.incidents.refresh(a)
            row = pa.Table.from_pylist([a.row()], schema=wire.ALERTS)
            self.buffer("alerts", row)
            if changed:
                self.notify(a, row)

    # ------------------------------------------------------------------ targeted profiling (stream.profiling)
    def _profile(self, profiling, rt, a: Alert) -> None:
        try:
            rows = profiling.on_alert(rt.state, a)
        except Exception:  # noqa: BLE001 - profiling never stops the processor
            log.exception("could not issue profiling commands for alert %s", a.alert_id)
            return
        if rows:
            from stepwatch.stream.profiling import profile_rows_table
            self.buffer("profiles", profile_rows_table(rows))

    def profile_results(self, t: pa.Table) -> None:
        """Suspect + reference summaries in: store the comparison (``profile_diffs`` table) and re-emit
        the alert with a ``profile_diff`` section (on the alerts topic and to the callback; the alerts
        table keeps one row per alert and status)."""
        from stepwatch.stream.profiling import alert_with_diff, diff_rows_table
        for p, d in self.profiling().on_results(t):
            aid = getattr(p.alert, "alert_id", "") or ""
            self.buffer("profile_diffs", diff_rows_table(p.job, aid, p.cmd_id, d))
            if p.alert is None:
                continue
            a = alert_with_diff(p.alert, p.cmd_id, d)
            self.notify(a, None, "profile: " + ", ".join(
                f"{x['name']} +{x['delta_ms']:.2f} ms/step" for x in d["slower"][:3]))

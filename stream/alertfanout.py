"""Alerts from the processor to the places that tell people, as sinks (:mod:`stepwatch.stream.sinks`).

:func:`attach` adds notifiers such as :class:`stepwatch.dashboards.annotations.AnnotationSink` and
:class:`stepwatch.dashboards.alertmanager.AlertmanagerSink` to a
:class:`~stepwatch.stream.processor.Processor`'s sinks (each wrapped in a
:class:`~stepwatch.stream.sinks.NotifierSink`): they get every alert, firing and resolved, as it is emitted,
and every alert still open in the store when the processor rebuilds a job (after a restart or a partition
move). A notifier is any object with ``submit(alert)`` (never blocking); ``restore(alert)`` is optional (the
Alertmanager sink uses it to go on re-sending an open alert, so a restart neither resolves nor repeats it).
The processor's job metrics count restored alerts too (its ``on_alert_restored``). :func:`open_alerts` reads
those open alerts from the store.
"""
from __future__ import annotations

import json
import logging
from typing import Callable, Iterable

from stepwatch.detectors.base import Alert
from stepwatch.stream.sinks import NotifierSink

log = logging.getLogger("stepwatch.alerts")

#: latest row of each alert of a job that has no ``resolved`` row
OPEN_ALERTS_SQL = """
SELECT alert_id, job, kind, severity, status, t_detected, step_first, step_detected, ranks, nodes, cause,
       evidence, cost_pct, suggestion
FROM alerts
WHERE job = ? AND status = 'firing'
  AND alert_id NOT IN (SELECT alert_id FROM alerts WHERE job = ? AND status = 'resolved')
QUALIFY row_number() OVER (PARTITION BY alert_id ORDER BY t_detected DESC) = 1
ORDER BY t_detected"""


def open_alerts(con, job: str) -> list[Alert]:
    """The job's open alerts in the store (DuckDB connection over the views), as :class:`Alert`."""
    t = con.sql(OPEN_ALERTS_SQL, params=[job, job]).to_arrow_table()
    out = []
    for r in t.to_pylist():
        try:
            ev = json.loads(r["evidence"]) if r["evidence"] else {}
        except ValueError:
            ev = {}
        td = r["t_detected"]
        t_ns = int(td.timestamp() * 1e9) if hasattr(td, "timestamp") else int(td)
        out.append(Alert(job=r["job"], kind=r["kind"], status="firing", step_first=int(r["step_first"]),
                         step_detected=int(r["step_detected"]), t_detected=t_ns, ranks=list(r["ranks"] or []),
                         nodes=list(r["nodes"] or []), cause=r["cause"] or "unknown",
                         severity=r["severity"] or "warning", evidence=ev if isinstance(ev, dict) else {},
                         cost_pct=float(r["cost_pct"] or 0.0), suggestion=r["suggestion"] or "",
                         alert_id=r["alert_id"],
                         incident_id=str(((ev if isinstance(ev, dict) else {}).get("incident") or {}).get("id") or "")))
    return out


def attach(processor, sinks: Iterable = (), *, echo: Callable[[Alert], None] | None = None) -> None:
    """Add ``sinks`` (None entries are skipped) to the processor's sinks, each as a
    :class:`~stepwatch.stream.sinks.NotifierSink` after the alerts topic and the console; ``echo`` becomes
    the processor's ``on_alert`` (the console sink calls it first for every emitted alert, e.g. to print
    its line; without it the console sink is quiet: the alert line is not logged)."""
    processor.on_alert = echo if echo is not None else (lambda a: None)
    for s in sinks:
        if s is not None:
            processor.sinks.add(NotifierSink(s))

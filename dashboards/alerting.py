"""Grafana-managed alert rules over the ``alerts`` view: one rule per alert kind.

Grafana has no endpoint to push alerts into its Alertmanager, so stepwatch's alerts reach Grafana's
contact points through rules that *query* the alerts the processor stored. Each rule (one per kind in
:data:`ALERT_KINDS`) runs every minute on the stepwatch DuckDB datasource:

* query ``A`` returns one row per *open* alert of its kind — its latest status is ``firing`` (no
  ``resolved`` row yet) — with string columns ``job``, ``cause``, ``ranks``, ``nodes``,
  ``severity``, ``suggestion`` (Grafana turns them into labels of the alert instance) and the number
  ``firing``;
* expression ``B`` is the threshold ``A > 0``, the rule's condition.

Kinds that are single events with no ``resolved`` row (:data:`POINT_KINDS`: a regression or a
recovery is reported once) count as open while they were detected inside the rule's look-back
window (:data:`WINDOW_S`); the others stay open until the detector resolves them (bounded by the
same look-back, so an alert from a long-dead job does not fire forever). Every rule carries the static
labels ``source=stepwatch`` and ``kind=<kind>``; a maintainer routes on ``kind``, ``cause``,
``severity`` or ``job`` in a notification policy. Each instance also has the label ``incident`` (the
alert's ``incident_id``, see ``detectors/incidents.py``; its alert id when it has none): a notification
policy with ``group_by: [incident]`` sends one notification per fault, however many rules (the straggler,
the regression and jitter it caused) its alerts fire.
"""
from __future__ import annotations

from . import yamlout
from .datasource import DATASOURCE_UID, PLUGIN_ID

#: Every alert kind the detectors emit (docs/detectors.md). One Grafana rule per kind.
ALERT_KINDS: tuple[str, ...] = ("slow_rank", "regression", "recovery", "jitter", "stall")
#: Kinds reported once (no ``resolved`` status follows).
POINT_KINDS: tuple[str, ...] = ("regression", "recovery")
#: Look-back (seconds) of each kind's rule: a point alert fires for this long after detection;
#: a lasting alert stays open until resolved, if it was detected within this window.
WINDOW_S: dict[str, int] = {"slow_rank": 24 * 3600, "regression": 15 * 60, "recovery": 15 * 60,
                            "jitter": 24 * 3600, "stall": 24 * 3600}
TITLES = {"slow_rank": "slow rank (straggler)", "regression": "step-time regression",
          "recovery": "step-time recovery", "jitter": "step-time jitter", "stall": "stalled ranks or job"}
RULE_GROUP = "stepwatch"
RULE_INTERVAL_S = 60
ALERTS_DASHBOARD_UID = "stepwatch-alerts"
ALERTS_TABLE_PANEL_ID = 2


def _lit(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def point_kinds_sql() -> str:
    return ", ".join(_lit(k) for k in POINT_KINDS)


def open_alerts_sql(where: str) -> str:
    """A SELECT of the open alerts among those matching ``where`` (SQL over ``alerts``; may use
    Grafana macros): the latest row of each ``alert_id`` detected up to ``$__timeTo()``, kept if it
    is ``firing`` and, for point kinds, was detected inside the time range."""
    return f"""SELECT alert_id, job, kind, severity, status, t_detected, step_first, step_detected, ranks, nodes,
         cause, evidence, cost_pct, suggestion, coalesce(incident_id, alert_id) AS incident
  FROM (SELECT *, row_number() OVER (PARTITION BY alert_id
                                     ORDER BY CASE status WHEN 'resolved' THEN 0 ELSE 1 END, t_detected DESC) AS rn
        FROM alerts WHERE ({where}) AND t_detected <= $__timeTo())
  WHERE rn = 1 AND status = 'firing' AND (kind NOT IN ({point_kinds_sql()}) OR ($__timeFilter(t_detected)))"""


def rule_sql(kind: str) -> str:
    return f"""WITH open_alerts AS (
  {open_alerts_sql(f"kind = {_lit(kind)}")})
SELECT job, incident, coalesce(cause, 'unknown') AS cause,
       array_to_string(ranks, ',') AS ranks, array_to_string(nodes, ',') AS nodes,
       coalesce(severity, 'warning') AS severity, coalesce(suggestion, '') AS suggestion,
       count(*)::DOUBLE AS firing
FROM open_alerts
GROUP BY ALL
ORDER BY job, ranks"""


def rule_uid(kind: str) -> str:
    return "stepwatch-" + kind.replace("_", "-")


def alert_rule(kind: str, *, folder_uid: str, datasource_uid: str = DATASOURCE_UID, org_id: int = 1) -> dict:
    """The ``ProvisionedAlertRule`` for one alert kind (body of POST/PUT /api/v1/provisioning/alert-rules)."""
    if kind not in ALERT_KINDS:
        raise ValueError(f"unknown alert kind {kind!r} (known: {', '.join(ALERT_KINDS)})")
    q = rule_sql(kind)
    return {
        "uid": rule_uid(kind),
        "orgID": org_id,
        "folderUID": folder_uid,
        "ruleGroup": RULE_GROUP,
        "title": f"stepwatch: {TITLES[kind]}",
        "condition": "B",
        "data": [
            {"refId": "A", "queryType": "", "relativeTimeRange": {"from": WINDOW_S[kind], "to": 0},
             "datasourceUid": datasource_uid,
             "model": {"refId": "A", "datasource": {"type": PLUGIN_ID, "uid": datasource_uid},
                       "editorMode": "code", "format": "table", "rawQuery": True, "rawSql": q,
                       "intervalMs": 1000, "maxDataPoints": 43200}},
            {"refId": "B", "queryType": "", "relativeTimeRange": {"from": 0, "to": 0},
             "datasourceUid": "__expr__",
             "model": {"refId": "B", "type": "threshold", "expression": "A",
                       "datasource": {"type": "__expr__", "uid": "__expr__"},
                       "conditions": [{"evaluator": {"type": "gt", "params": [0]}}]}},
        ],
        "noDataState": "OK",
        "execErrState": "Error",
        "for": "0s",
        "isPaused": False,
        "labels": {"source": "stepwatch", "kind": kind},
        "annotations": {
            "summary": f"stepwatch {TITLES[kind]} in job {{{{ $labels.job }}}}"
                       " (ranks {{ $labels.ranks }} on {{ $labels.nodes }}), cause {{ $labels.cause }}",
            "description": "{{ $labels.suggestion }}",
            "__dashboardUid__": ALERTS_DASHBOARD_UID,
            "__panelId__": str(ALERTS_TABLE_PANEL_ID),
        },
    }


def alert_rules(*, folder_uid: str, datasource_uid: str = DATASOURCE_UID, org_id: int = 1) -> list[dict]:
    return [alert_rule(k, folder_uid=folder_uid, datasource_uid=datasource_uid, org_id=org_id)
            for k in ALERT_KINDS]


def provisioning_doc(*, folder_title: str, folder_uid: str, datasource_uid: str = DATASOURCE_UID,
                     org_id: int = 1) -> dict:
    """Grafana's alerting file-provisioning format (``provisioning/alerting/*.yaml``)."""
    rules = []
    for r in alert_rules(folder_uid=folder_uid, datasource_uid=datasource_uid, org_id=org_id):
        rules.append({k: r[k] for k in ("uid", "title", "condition", "data", "noDataState", "execErrState",
                                        "for", "labels", "annotations", "isPaused")})
    return {"apiVersion": 1, "groups": [{"orgId": org_id, "name": RULE_GROUP, "folder": folder_title,
                                         "interval": f"{RULE_INTERVAL_S}s", "rules": rules}]}


def provisioning_file(**kw) -> str:
    return yamlout.dumps(provisioning_doc(**kw), header=(
        "stepwatch alert rules, one per alert kind (generated by `stepwatch grafana export`; do not edit)."))

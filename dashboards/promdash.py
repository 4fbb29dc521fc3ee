"""The Cluster overview on the Prometheus datasource alone, for teams without the DuckDB plugin.

Same builder as the DuckDB dashboards (:class:`.panels.Dashboard`: layout, stat / time series / table
panels, links, the tag annotation of the alerts the processor posts to Grafana), with PromQL targets
over the processor's per-job metrics (:mod:`stepwatch.stream.jobmetrics`) instead of SQL. The
datasource is a dashboard variable (``datasource``, type ``prometheus``), so it imports into any
Grafana that has a Prometheus scraping the processor (with ``honor_labels: true``, so that the metrics'
``job`` label is the training job; the chart's ServiceMonitor sets ``honorLabels``). Per-job figures
are taken with ``max by (job)`` before they are summed: after a partition moves, the old owner exports
a job's last values until ``--job-metrics-ttl`` passes, next to the new owner's.

``python -m stepwatch.dashboards.build`` writes it next to the DuckDB dashboards
(``dashboards/json/stepwatch-overview-prometheus.json``); the chart ships it as a ConfigMap with
``grafana.prometheusDashboards.enabled``. :func:`promql_checks` lists every PromQL it embeds (tests run
each against a real Prometheus scraping a processor).
"""
from __future__ import annotations

from dataclasses import dataclass

from .panels import Dashboard

UID = "stepwatch-overview-prometheus"
DS = {"type": "prometheus", "uid": "${datasource}"}
J = 'job=~"$job"'
LINK_JOB = "/d/stepwatch-job/stepwatch-job?var-job=${__value.raw}&${__url_time_range}"


@dataclass(frozen=True)
class PromCheck:
    dashboard: str
    where: str
    expr: str
    nonempty: bool = True


def expand(expr: str, job: str = ".*", rate_interval: str = "1m") -> str:
    """``expr`` as Grafana sends it: ``$job`` (a regex of the selected jobs) and ``$__rate_interval``."""
    return expr.replace("$__rate_interval", rate_interval).replace("$job", job)


class PromDashboard(Dashboard):
    """A :class:`Dashboard` whose panels hold PromQL targets (``q``: one expression, or a list of
    ``(expression, legend)`` pairs) and whose variables are ``label_values`` queries."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prom_checks: list[PromCheck] = []

    def query_variable(self, name, label, q, *, multi=False, include_all=False, columns=()):
        self.variables.append({
            "type": "query", "name": name, "label": label, "datasource": dict(DS),
            "query": q,
            "definition": q, "refresh": 2, "sort": 1, "regex": "", "multi": multi, "includeAll": include_all,
            "allValue": ".*" if include_all else None, "options": [],
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if include_all else {},
            "hide": 0, "skipUrlSync": False})

    def panel(self, kind, title, q, columns, *, w=12, h=8, fmt="table", description="", unit=None, options=None,
              defaults=None, overrides=None, panel_id=None, nonempty=True, transformations=None, instant=None):
        exprs = [(q, "")] if isinstance(q, str) else list(q)
        pid = self._take_id(panel_id)
        table = kind in ("table", "stat", "bargauge") if instant is None else instant
        targets = []
        for i, (e, legend) in enumerate(exprs):
            ref = chr(ord("A") + i)
            t = {"refId": ref, "datasource": dict(DS), "editorMode": "code", "expr": e, "range": not table,
                 "instant": table, "legendFormat": legend or "__auto", "format": "table" if kind == "table" else
                 "time_series"}
            targets.append(t)
            self.prom_checks.append(PromCheck(self.uid, f"panel {pid} {title!r} / {ref}", e, nonempty))
        fd = {"custom": {}}
        if unit:
            fd["unit"] = unit
        fd.update(defaults or {})
        p = {"id": pid, "type": kind, "title": title, "description": description, "datasource": dict(DS),
             "gridPos": self._place(w, h), "targets": targets,
             "fieldConfig": {"defaults": fd, "overrides": overrides or []}, "options": options or {}}
        if transformations:
            p["transformations"] = transformations
        self.panels.append(p)
        return p

    def json(self) -> dict:
        d = super().json()
        ds_var = {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
                  "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "regex": "",
                  "refresh": 1, "skipUrlSync": False}
        d["templating"]["list"] = [ds_var] + d["templating"]["list"]
        d["tags"] = d["tags"] + ["prometheus"]
        return d


def overview() -> PromDashboard:
    d = PromDashboard(UID, "stepwatch / Cluster overview (Prometheus)",
                      "Every training job stepwatch sees: step time, throughput, jitter, efficiency and firing "
                      "alerts, from the processor's per-job metrics in Prometheus (no DuckDB plugin needed).")
    d.time_from = "now-3h"
    d.query_variable("job", "Job", "label_values(stepwatch_job_last_step, job)", multi=True, include_all=True)
    d.tag_annotation("stepwatch alerts", ["stepwatch"], "red")

    d.stat("Jobs", f"count(max by (job) (stepwatch_job_last_step{{{J}}}))", "jobs",
           description="Jobs the processors export metrics for (a job leaves after --job-metrics-ttl without data).")
    d.stat("Ranks reporting", f"sum(max by (job) (stepwatch_job_ranks_reporting{{{J}}}))", "ranks",
           description="Ranks that reported each job's newest closed step, summed over the selected jobs.")
    d.stat("Throughput", f"sum(rate(stepwatch_job_tokens_total{{{J}}}[$__rate_interval]))", "tokens/s",
           unit="short", decimals=0, description="Tokens per second summed over the selected jobs.")
    d.stat("Jitter ratio", f"max(stepwatch_job_jitter_ratio{{{J}}})", "jitter", unit="percentunit", decimals=1,
           thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 0.025},
                       {"color": "red", "value": 0.10}],
           description="Worst job: share of recent steps slower than 1.1x the median of the 21 steps up to them "
                       "(the field's 'fluctuation > 10%' ratio).")
    d.stat("Alerts firing", f"sum(max by (job, kind, cause) (stepwatch_job_alerts_firing{{{J}}})) or vector(0)",
           "firing",
           thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}],
           description="Open alerts (regressions/recoveries count for 15 minutes after detection).")
    d.stat("Lowest goodput", f"min(stepwatch_job_goodput_ratio{{{J}}})", "goodput", unit="percentunit", decimals=1,
           thresholds=[{"color": "red", "value": None}, {"color": "orange", "value": 0.9},
                       {"color": "green", "value": 0.97}],
           description="Worst job: productive share of the wall time over its recent steps.")

    d.table("Jobs", [
        (f"max by (job) (stepwatch_job_ranks_reporting{{{J}}})", "ranks"),
        (f"max by (job) (stepwatch_job_last_step{{{J}}})", "last_step"),
        (f'max by (job) (stepwatch_job_step_duration_seconds{{{J},quantile="0.5"}})', "step_p50"),
        (f'max by (job) (stepwatch_job_step_duration_seconds{{{J},quantile="1"}})', "step_max"),
        (f"sum by (job) (rate(stepwatch_job_tokens_total{{{J}}}[$__rate_interval]))", "tokens_per_s"),
        (f"max by (job) (stepwatch_job_jitter_ratio{{{J}}})", "jitter"),
        (f"max by (job) (stepwatch_job_mfu_ratio{{{J}}})", "mfu"),
        (f"sum by (job) (max by (job, kind, cause) (stepwatch_job_alerts_firing{{{J}}}))", "firing_alerts"),
    ], ("job",), w=24, h=7, links={"job": LINK_JOB},
        units={"step p50": "s", "step max": "s", "jitter": "percentunit", "MFU": "percentunit"},   # after renaming
        transformations=[{"id": "merge", "options": {}},
                         {"id": "organize", "options": {"excludeByName": {"Time": True}, "renameByName": {
                             "Value #A": "ranks", "Value #B": "last step", "Value #C": "step p50",
                             "Value #D": "step max", "Value #E": "tokens/s", "Value #F": "jitter",
                             "Value #G": "MFU", "Value #H": "firing alerts"}}}],
        description="One row per job; click a job for its (DuckDB) dashboard where that plugin is installed.")

    d.timeseries("Step time p50 / max", [
        (f'stepwatch_job_step_duration_seconds{{{J},quantile="0.5"}}', "{{job}} p50"),
        (f'stepwatch_job_step_duration_seconds{{{J},quantile="1"}}', "{{job}} max")], ("time",), unit="s",
        description="Per job: the step time (median over ranks) over its recent steps: median and max.")
    d.timeseries("Throughput", [(f"sum by (job) (rate(stepwatch_job_tokens_total{{{J}}}[$__rate_interval]))",
                                 "{{job}}")], ("time",), unit="short",
                 description="Tokens per second per job.")
    d.timeseries("Jitter ratio", [(f"stepwatch_job_jitter_ratio{{{J}}}", "{{job}}")], ("time",),
                 unit="percentunit", description="Share of recent steps slower than 1.1x their local median.")
    d.timeseries("MFU and goodput", [(f"stepwatch_job_mfu_ratio{{{J}}}", "{{job}} MFU"),
                                     (f"stepwatch_job_goodput_ratio{{{J}}}", "{{job}} goodput")], ("time",),
                 unit="percentunit", description="Model FLOPs utilisation of the newest step; productive share "
                                                 "of the wall time over recent steps.")
    d.timeseries("Busy-time spread", [(f"stepwatch_job_busy_spread_ratio{{{J}}}", "{{job}}")], ("time",),
                 unit="percentunit", description="(max - median) / median of the ranks' busy time, median over "
                                                 "recent steps: how far the slowest rank is from the pack.")
    d.timeseries("Bus bandwidth vs link peak", [(f"stepwatch_job_bus_bandwidth_peak_ratio{{{J}}}", "{{job}} {{op}}")],
                 ("time",), unit="percentunit",
                 description="Per collective kind, the worst group's achieved bus bandwidth over its link's peak.")
    d.table("Slowest ranks", [(f"topk by (job) (5, stepwatch_job_slowest_rank_busy_seconds{{{J}}})", "")],
            ("job", "rank", "node"), w=12, h=8, units={"Value": "s"},
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True,
                                                                               "instance": True}}}],
            description="Per job, the ranks with the longest busy time per step (smoothed): a straggler leads.")
    d.table("Firing alerts", [(f"max by (job, kind, cause) (stepwatch_job_alerts_firing{{{J}}}) > 0", "")],
            ("job", "kind", "cause"), w=12, h=8, links={"job": LINK_JOB}, nonempty=False,
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True},
                                                            "renameByName": {"Value": "firing"}}}],
            description="Open alerts by job, kind and cause. Details (ranks, suggestion) are in the alert "
                        "notifications (Alertmanager, Grafana annotations).")
    return d


def build_all() -> dict[str, dict]:
    d = overview()
    return {d.uid: d.json()}


def promql_checks() -> list[PromCheck]:
    return list(overview().prom_checks)

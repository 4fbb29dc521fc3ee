"""The stepwatch Grafana dashboards, as code.

``python -m stepwatch.dashboards.build`` writes ``dashboards/json/<uid>.json`` (checked in; a test
asserts they equal what this module generates); ``--check`` only compares. :func:`build_all`
returns the dashboards as dicts; :func:`sql_checks` lists every SQL they embed with the columns
Grafana reads from it (tests run each one against a simulated store).

Four dashboards, all on the ``motherduck-duckdb-datasource`` datasource (uid ``stepwatch-duckdb``),
tagged ``stepwatch`` and linked to each other:

* **Cluster overview** (``stepwatch-overview``, variable ``job``: multi, All): jobs, step time
  p50/max, throughput, jitter ratio, firing alerts.
* **Job** (``stepwatch-job``, variable ``job``): step time with change points and alerts as
  annotations, per-rank busy-time heatmap (ranks x steps), slowest ranks with node and cost, phase
  breakdown (data / compute / comm / comm wait / GC / host gap), throughput, jitter, alerts.
* **Node** (``stepwatch-node``, variables ``job``, ``node``): host CPU, iowait, steal and load, top
  processes, memory and disk, NIC and RDMA retransmits, accelerators, GC pauses, the node's ranks.
* **Alerts & profiles** (``stepwatch-alerts``, variable ``job``: multi, All): every alert with
  cause, suggestion and cost; alerts over time; open alerts by cause. (There is no ``profiles``
  table in the store yet, so the profile-link column is not there: the panels read ``alerts`` only.)

A fifth, **Cluster overview (Prometheus)** (``stepwatch-overview-prometheus``), is the Overview for
teams without the DuckDB plugin: the same builder with PromQL over the processor's per-job metrics
(:mod:`.promdash`); ``write``/``--check`` cover it too.

Conventions: times are filtered with ``$__timeFilter(<time column>)`` and bucketed on
``$__interval_ms`` (:func:`.panels.bucket`); a single-valued ``job`` is written ``'${job}'`` and a
multi-valued one ``IN (${job})`` (``tests/grafana_macros.py`` expands them as Grafana does). The "jitter
ratio" is the field's: the share of steps slower than 1.1x the median of the 21 steps around them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .alerting import ALERTS_DASHBOARD_UID, ALERTS_TABLE_PANEL_ID, open_alerts_sql
from .panels import Dashboard, SqlCheck, bucket

JSON_DIR = Path(__file__).resolve().parent / "json"

OVERVIEW_UID = "stepwatch-overview"
JOB_UID = "stepwatch-job"
NODE_UID = "stepwatch-node"
ALERTS_UID = ALERTS_DASHBOARD_UID

JOB_VAR_SQL = "SELECT DISTINCT job FROM steps ORDER BY job"
JOB_ONE = "job = '${job}'"
JOB_MANY = "job IN (${job})"
LINK_JOB = f"/d/{JOB_UID}/stepwatch-job?var-job=${{__value.raw}}&${{__url_time_range}}"
LINK_NODE = f"/d/{NODE_UID}/stepwatch-node?var-job=${{__data.fields.job}}&var-node=${{__value.raw}}&${{__url_time_range}}"
MS = "ms"

# Per job and step: the job-wide figures most panels start from (median over ranks, like job_steps,
# but filtered before aggregating so that only the time range's files and row groups are read).
PER_STEP = """SELECT job, step, max(t_end) AS t_end, median(step_ms) AS step_ms, max(step_ms) AS step_ms_max,
         median(step_ms - coalesce(comm_wait_ms, 0)) AS busy_p50, max(step_ms - coalesce(comm_wait_ms, 0)) AS busy_max,
         sum(tokens) AS tokens, sum(samples) AS samples, count(*) AS ranks, count(DISTINCT node) AS nodes,
         median(comm_exposed_ms) AS comm_exposed, median(comm_total_ms) AS comm_total
  FROM steps WHERE {where} AND $__timeFilter(t_end) GROUP BY job, step"""
# Adds local_med: the median step time of the 21 steps around each step (the jitter reference).
LOCAL_MEDIAN = """SELECT *, median(step_ms) OVER (PARTITION BY job ORDER BY step
                                  ROWS BETWEEN 10 PRECEDING AND 10 FOLLOWING) AS local_med FROM s"""
HEATMAP_ROWS = 64


def _per_step(where: str) -> str:
    return PER_STEP.format(where=where)


# ============================================================================ overview
def overview() -> Dashboard:
    d = Dashboard(OVERVIEW_UID, "stepwatch / Cluster overview",
                  "Every training job stepwatch sees: step time, throughput, jitter and firing alerts.")
    d.query_variable("job", "Job", JOB_VAR_SQL, multi=True, include_all=True)
    d.tag_annotation("stepwatch alerts", ["stepwatch"], "red")

    d.stat("Jobs", f"SELECT count(DISTINCT job) AS jobs FROM steps WHERE {JOB_MANY} AND $__timeFilter(t_end)",
           "jobs", description="Jobs that reported steps in the time range.")
    d.stat("Ranks reporting",
           f"SELECT count(DISTINCT job || '/' || rank) AS ranks FROM steps WHERE {JOB_MANY} AND $__timeFilter(t_end)",
           "ranks", description="Distinct (job, rank) pairs that reported steps in the time range.")
    d.stat("Throughput", f"""
        WITH s AS ({_per_step(JOB_MANY)})
        SELECT sum(tps) AS "tokens/s" FROM (SELECT job, sum(tokens) / (sum(step_ms) / 1000) AS tps FROM s GROUP BY job)""",
           "tokens/s", unit="short", decimals=0,
           description="Tokens per second summed over the selected jobs (each job's tokens over its step time in the range).")
    d.stat("Jitter ratio", f"""
        WITH s AS ({_per_step(JOB_MANY)}), w AS ({LOCAL_MEDIAN})
        SELECT 100 * avg(CASE WHEN step_ms > 1.1 * local_med THEN 1 ELSE 0 END) AS jitter_pct FROM w""",
           "jitter_pct", unit="percent", decimals=1,
           thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 2.5},
                       {"color": "red", "value": 10}],
           description="Share of steps slower than 1.1x the median of the 21 steps around them "
                       "(the field's 'fluctuation > 10%' ratio), over all selected jobs.")
    d.stat("Alerts firing", f"""
        WITH o AS ({open_alerts_sql(JOB_MANY)})
        SELECT count(*) AS firing FROM o""", "firing",
           thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}],
           description="Open alerts: latest status firing (regressions/recoveries: detected in the range).")
    d.stat("Worst cost", f"""
        WITH o AS ({open_alerts_sql(JOB_MANY)})
        SELECT coalesce(max(cost_pct), 0) AS cost_pct FROM o""", "cost_pct", unit="percent", decimals=1,
           thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 2},
                       {"color": "red", "value": 10}],
           description="Largest estimated throughput loss among open alerts.")

    d.table("Jobs", f"""
        WITH s AS ({_per_step(JOB_MANY)}), w AS ({LOCAL_MEDIAN}),
        j AS (SELECT job, max(ranks) AS ranks, max(nodes) AS nodes, count(*) AS steps, max(step) AS last_step,
                     max(t_end) AS last_seen, median(step_ms) AS step_p50_ms, max(step_ms_max) AS step_max_ms,
                     sum(tokens) / (sum(step_ms) / 1000) AS tokens_per_s,
                     sum(samples) / (sum(step_ms) / 1000) AS samples_per_s,
                     100 * avg(CASE WHEN step_ms > 1.1 * local_med THEN 1 ELSE 0 END) AS jitter_pct,
                     100 * sum(comm_exposed) / nullif(sum(step_ms) FILTER (WHERE comm_exposed IS NOT NULL), 0)
                         AS comm_exposed_pct,
                     100 - 100 * sum(comm_exposed) / nullif(sum(comm_total), 0) AS comm_hidden_pct
              FROM w GROUP BY job),
        o AS (SELECT job, count(*) AS firing_alerts FROM ({open_alerts_sql(JOB_MANY)}) GROUP BY job)
        SELECT j.job, j.ranks, j.nodes, j.steps, j.last_step, j.last_seen, round(j.step_p50_ms, 1) AS step_p50_ms,
               round(j.step_max_ms, 1) AS step_max_ms, round(j.tokens_per_s) AS tokens_per_s,
               round(j.samples_per_s, 1) AS samples_per_s, round(j.jitter_pct, 2) AS jitter_pct,
               round(j.comm_exposed_pct, 1) AS comm_exposed_pct, round(j.comm_hidden_pct, 1) AS comm_hidden_pct,
               coalesce(o.firing_alerts, 0) AS firing_alerts
        FROM j LEFT JOIN o USING (job) ORDER BY j.job""",
            ("job", "ranks", "nodes", "steps", "last_step", "last_seen", "step_p50_ms", "step_max_ms",
             "tokens_per_s", "samples_per_s", "jitter_pct", "comm_exposed_pct", "comm_hidden_pct", "firing_alerts"),
            w=24, h=7, links={"job": LINK_JOB},
            units={"step_p50_ms": MS, "step_max_ms": MS, "jitter_pct": "percent", "comm_exposed_pct": "percent",
                   "comm_hidden_pct": "percent"},
            description="One row per job in the range; click a job for its dashboard. comm_exposed_pct: the "
                        "share of the step time that communication added (not hidden behind compute); "
                        "comm_hidden_pct: the share of the communication that overlapped compute (DDP's "
                        "buckets during backward). Empty for producers that do not report them.")

    d.timeseries("Step time p50 / max", f"""
        WITH s AS ({_per_step(JOB_MANY)})
        SELECT {bucket('t_end')} AS time, job, median(step_ms) AS p50, max(step_ms_max) AS max
        FROM s GROUP BY ALL ORDER BY time""", ("time", "job", "p50", "max"), unit=MS,
                 description="Per job: median over ranks of the step time, and the slowest rank's step time.")
    d.timeseries("Throughput", f"""
        WITH s AS ({_per_step(JOB_MANY)})
        SELECT {bucket('t_end')} AS time, job, sum(tokens) / (sum(step_ms) / 1000) AS "tokens/s"
        FROM s GROUP BY ALL ORDER BY time""", ("time", "job", "tokens/s"), unit="short",
                 description="Tokens per second per job (sum over ranks of a step's tokens over its step time).")
    d.timeseries("Jitter ratio (last 100 steps)", f"""
        WITH s AS ({_per_step(JOB_MANY)}), w AS ({LOCAL_MEDIAN}),
        r AS (SELECT job, t_end, 100 * avg(CASE WHEN step_ms > 1.1 * local_med THEN 1 ELSE 0 END)
                                     OVER (PARTITION BY job ORDER BY step ROWS BETWEEN 99 PRECEDING AND CURRENT ROW) AS j
              FROM w)
        SELECT {bucket('t_end')} AS time, job, avg(j) AS "jitter %" FROM r GROUP BY ALL ORDER BY time""",
                 ("time", "job", "jitter %"), unit="percent",
                 description="Rolling share of the last 100 steps slower than 1.1x their local median.")
    d.table("Firing alerts", f"""
        WITH o AS ({open_alerts_sql(JOB_MANY)})
        SELECT t_detected AS time, job, kind, severity, array_to_string(ranks, ',') AS ranks,
               array_to_string(nodes, ',') AS nodes, cause, round(cost_pct, 2) AS cost_pct, suggestion
        FROM o ORDER BY cost_pct DESC, time DESC""",
            ("time", "job", "kind", "severity", "ranks", "nodes", "cause", "cost_pct", "suggestion"),
            w=12, h=8, links={"job": LINK_JOB}, units={"cost_pct": "percent"},
            description="Open alerts, costliest first. Cost = estimated share of the job's throughput lost.")
    return d


# ============================================================================ job
def job() -> Dashboard:
    d = Dashboard(JOB_UID, "stepwatch / Job",
                  "One training job: where the step time goes, which ranks are slow, and when it changed.")
    d.query_variable("job", "Job", JOB_VAR_SQL)
    alerts_anno = """
        WITH f AS (SELECT step, max(t_end) AS t_first FROM steps WHERE job = '${job}' AND $__timeFilter(t_end)
                   GROUP BY step)
        SELECT least(coalesce(f.t_first, a.t_detected), a.t_detected) AS time, a.t_detected AS "timeEnd",
               a.kind || ' ' || a.status || ' (' || coalesce(a.cause, 'unknown') || ', cost '
                 || round(coalesce(a.cost_pct, 0), 1) || '%)'
                 || CASE WHEN len(a.ranks) > 0 THEN ': rank ' || array_to_string(a.ranks[1:8], ',')
                         || ' on ' || array_to_string(list_distinct(a.nodes[1:8]), ',') ELSE '' END
                 || ' from step ' || a.step_first || ' (detected at ' || a.step_detected || '). '
                 || coalesce(a.suggestion, '') AS text,
               concat_ws(',', 'stepwatch', 'kind:' || a.kind, 'cause:' || coalesce(a.cause, 'unknown'),
                         'status:' || a.status) AS tags
        FROM alerts a LEFT JOIN f ON f.step = a.step_first
        WHERE a.job = '${job}' AND $__timeFilter(a.t_detected) AND a.kind {op} ('regression', 'recovery')
        ORDER BY time"""
    d.sql_annotation("Change points", alerts_anno.replace("{op}", "IN"), "orange")
    d.sql_annotation("Other alerts", alerts_anno.replace("{op}", "NOT IN"), "red")
    d.tag_annotation("Alert annotations (processor)", ["stepwatch", "job:${job}"], "purple")

    d.stat("Step time p50", f"""
        WITH s AS ({_per_step(JOB_ONE)}) SELECT median(step_ms) AS step_p50_ms FROM s""",
           "step_p50_ms", unit=MS, decimals=1)
    d.stat("Step time max", f"""
        WITH s AS ({_per_step(JOB_ONE)}) SELECT max(step_ms_max) AS step_max_ms FROM s""",
           "step_max_ms", unit=MS, decimals=1)
    d.stat("Throughput", f"""
        WITH s AS ({_per_step(JOB_ONE)}) SELECT sum(tokens) / (sum(step_ms) / 1000) AS "tokens/s" FROM s""",
           "tokens/s", unit="short", decimals=0)
    d.stat("Jitter ratio", f"""
        WITH s AS ({_per_step(JOB_ONE)}), w AS ({LOCAL_MEDIAN})
        SELECT 100 * avg(CASE WHEN step_ms > 1.1 * local_med THEN 1 ELSE 0 END) AS jitter_pct FROM w""",
           "jitter_pct", unit="percent", decimals=1,
           thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 2.5},
                       {"color": "red", "value": 10}])
    d.stat("Ranks / nodes", """
        SELECT count(DISTINCT rank) AS ranks, count(DISTINCT node) AS nodes
        FROM steps WHERE job = '${job}' AND $__timeFilter(t_end)""", "ranks")
    d.stat("Open alerts", f"""
        WITH o AS ({open_alerts_sql(JOB_ONE)}) SELECT count(*) AS firing FROM o""", "firing",
           thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}])

    d.timeseries("Step time (change points and alerts marked)", f"""
        WITH s AS ({_per_step(JOB_ONE)})
        SELECT {bucket('t_end')} AS time, median(step_ms) AS "step p50", max(step_ms_max) AS "step max",
               median(busy_p50) AS "busy p50", max(busy_max) AS "busy max"
        FROM s GROUP BY 1 ORDER BY 1""", ("time", "step p50", "step max", "busy p50", "busy max"),
                 w=24, h=9, unit=MS,
                 description="Step time (median over ranks, slowest rank) and busy time (step time minus "
                             "the wait for peers in collectives). Orange regions: regressions/recoveries "
                             "from their first step to detection; red: other alerts; purple: the "
                             "processor's annotations.")
    d.heatmap("Busy time per rank (ranks x steps)", f"""
        WITH g AS (SELECT greatest(1, ceil((max(rank) + 1) / {HEATMAP_ROWS}.0))::BIGINT AS width
                   FROM steps WHERE job = '${{job}}' AND $__timeFilter(t_end))
        SELECT {bucket('t_end')} AS time,
               lpad(((rank // g.width) * g.width)::VARCHAR, 5, '0') AS ranks,
               max(step_ms - coalesce(comm_wait_ms, 0)) AS busy_ms
        FROM steps, g WHERE job = '${{job}}' AND $__timeFilter(t_end)
        GROUP BY ALL ORDER BY time, ranks""", ("time", "ranks", "busy_ms"), value_name="busy_ms",
              w=24, h=10,
              description=f"Busy time (step time minus comm wait) of every rank, step by step. Rows are "
                          f"ranks, grouped into at most {HEATMAP_ROWS} rows (each row: the slowest rank of "
                          "its group, labelled by its first rank); a straggler is a hot horizontal line.")
    d.table("Slowest ranks", """
        WITH r AS (SELECT rank, any_value(node) AS node, count(*) AS steps,
                          median(step_ms - coalesce(comm_wait_ms, 0)) AS busy_ms, median(step_ms) AS step_ms,
                          median(compute_ms) AS compute_ms, median(data_ms) AS data_ms, median(gc_ms) AS gc_ms,
                          median(comm_wait_ms) AS comm_wait_ms
                   FROM steps WHERE job = '${job}' AND $__timeFilter(t_end) GROUP BY rank),
        t AS (SELECT rank, coalesce(any_value(pp), 0) AS stage FROM topology WHERE job = '${job}' GROUP BY rank),
        a AS (SELECT rank, max(cost_pct) AS alert_cost_pct, arg_max(cause, t_detected) AS alert_cause
              FROM (SELECT unnest(ranks) AS rank, cost_pct, cause, t_detected FROM alerts
                    WHERE job = '${job}' AND kind = 'slow_rank' AND status = 'firing')
              GROUP BY rank),
        x AS (SELECT r.*, coalesce(t.stage, 0) AS stage,
                     median(busy_ms) OVER (PARTITION BY coalesce(t.stage, 0)) AS peer_busy_ms,
                     median(step_ms) OVER () AS job_step_ms
              FROM r LEFT JOIN t USING (rank))
        SELECT x.rank, x.node, x.stage, x.steps, round(x.busy_ms, 1) AS busy_ms,
               round(100 * (x.busy_ms / x.peer_busy_ms - 1), 2) AS slower_pct,
               round(100 * (x.busy_ms - x.peer_busy_ms) / nullif(x.job_step_ms, 0), 2) AS cost_pct,
               round(x.compute_ms, 1) AS compute_ms, round(x.data_ms, 1) AS data_ms, round(x.gc_ms, 2) AS gc_ms,
               round(x.comm_wait_ms, 1) AS comm_wait_ms, a.alert_cause, round(a.alert_cost_pct, 2) AS alert_cost_pct
        FROM x LEFT JOIN a USING (rank)
        ORDER BY x.busy_ms DESC LIMIT 20""",
            ("rank", "node", "stage", "steps", "busy_ms", "slower_pct", "cost_pct", "compute_ms", "data_ms",
             "gc_ms", "comm_wait_ms", "alert_cause", "alert_cost_pct"),
            w=24, h=9, links={"node": LINK_NODE},
            units={"busy_ms": MS, "compute_ms": MS, "data_ms": MS, "gc_ms": MS, "comm_wait_ms": MS,
                   "slower_pct": "percent", "cost_pct": "percent", "alert_cost_pct": "percent"},
            description="Ranks by median busy time. slower_pct: vs the median rank of the same pipeline "
                        "stage; cost_pct: the extra busy time as a share of the job's step time (what "
                        "the job would gain without it); alert_*: the slow-rank detector's finding.")
    d.timeseries("Phase breakdown", f"""
        WITH s AS (SELECT step, max(t_end) AS t_end, median(data_ms) AS data, median(compute_ms) AS compute,
                          median(comm_ms) AS comm, median(comm_wait_ms) AS comm_wait, median(gc_ms) AS gc,
                          median(step_ms - coalesce(data_ms, 0) - coalesce(compute_ms, 0) - coalesce(comm_ms, 0)
                                 - coalesce(comm_wait_ms, 0) - coalesce(gc_ms, 0)) AS host_gap
                   FROM steps WHERE job = '${{job}}' AND $__timeFilter(t_end) GROUP BY step)
        SELECT {bucket('t_end')} AS time, avg(data) AS "data", avg(compute) AS "compute", avg(comm) AS "comm",
               avg(comm_wait) AS "comm wait", avg(gc) AS "GC", avg(host_gap) AS "host gap"
        FROM s GROUP BY 1 ORDER BY 1""", ("time", "data", "compute", "comm", "comm wait", "GC", "host gap"),
                 stack=True, unit=MS, w=12, h=9,
                 description="Median over ranks of each phase of the step (stacked): data-loader wait, "
                             "compute, collective transfer, wait for peers, Python GC, and the host gap "
                             "(what is left: dispatch, Python, CPU contention, checkpoints).")
    d.timeseries("Throughput", f"""
        WITH s AS ({_per_step(JOB_ONE)})
        SELECT {bucket('t_end')} AS time, sum(tokens) / (sum(step_ms) / 1000) AS "tokens/s",
               sum(samples) / (sum(step_ms) / 1000) AS "samples/s"
        FROM s GROUP BY 1 ORDER BY 1""", ("time", "tokens/s", "samples/s"), unit="short", w=12, h=9,
                 overrides=[{"matcher": {"id": "byName", "options": "samples/s"},
                             "properties": [{"id": "custom.axisPlacement", "value": "right"}]}])
    d.timeseries("Jitter", f"""
        WITH s AS ({_per_step(JOB_ONE)}), w AS ({LOCAL_MEDIAN}),
        r AS (SELECT t_end, step_ms / local_med AS spike,
                     100 * avg(CASE WHEN step_ms > 1.1 * local_med THEN 1 ELSE 0 END)
                       OVER (ORDER BY step ROWS BETWEEN 99 PRECEDING AND CURRENT ROW) AS j FROM w)
        SELECT {bucket('t_end')} AS time, avg(j) AS "jitter % (last 100 steps)", max(spike) AS "step / local median"
        FROM r GROUP BY 1 ORDER BY 1""", ("time", "jitter % (last 100 steps)", "step / local median"),
                 w=12, h=8,
                 overrides=[{"matcher": {"id": "byName", "options": "step / local median"},
                             "properties": [{"id": "custom.axisPlacement", "value": "right"},
                                            {"id": "unit", "value": "x"}]},
                            {"matcher": {"id": "byName", "options": "jitter % (last 100 steps)"},
                             "properties": [{"id": "unit", "value": "percent"}]}],
                 description="Rolling jitter ratio and each step's time over the median of the 21 steps "
                             "around it (spikes above 1.1 count as jitter).")
    d.timeseries("GC pauses", f"""
        SELECT {bucket('t_end')} AS time, sum(gc_ms) / count(DISTINCT rank) AS "GC ms per rank",
               max(gc_ms) AS "worst rank GC ms", sum(gc_count) AS "collections"
        FROM steps WHERE job = '${{job}}' AND $__timeFilter(t_end) GROUP BY 1 ORDER BY 1""",
                 ("time", "GC ms per rank", "worst rank GC ms", "collections"), unit=MS, w=12, h=8,
                 overrides=[{"matcher": {"id": "byName", "options": "collections"},
                             "properties": [{"id": "custom.axisPlacement", "value": "right"},
                                            {"id": "unit", "value": "short"},
                                            {"id": "custom.drawStyle", "value": "bars"}]}])
    d.table("Alerts", """
        SELECT t_detected AS time, kind, status, severity, array_to_string(ranks, ',') AS ranks,
               array_to_string(nodes, ',') AS nodes, cause, round(cost_pct, 2) AS cost_pct,
               step_first, step_detected, suggestion, evidence
        FROM alerts WHERE job = '${job}' AND $__timeFilter(t_detected) ORDER BY t_detected DESC""",
            ("time", "kind", "status", "severity", "ranks", "nodes", "cause", "cost_pct", "step_first",
             "step_detected", "suggestion", "evidence"), w=24, h=8, units={"cost_pct": "percent"})
    _efficiency_panels(d)
    return d


def _efficiency_panels(d: Dashboard) -> None:
    """MFU and goodput, bus bandwidth vs peak per group, message sizes, DataLoader queue depth (the
    tables are written by the processor's efficiency detectors, see docs/efficiency.md)."""
    d.row("Efficiency")
    d.timeseries("MFU and goodput", f"""
        SELECT {bucket('t_end')} AS time, 100 * median(mfu) AS "MFU %",
               100 * sum(productive_ms) / nullif(sum(wall_ms), 0) AS "goodput %"
        FROM efficiency WHERE job = '${{job}}' AND $__timeFilter(t_end) GROUP BY 1 ORDER BY 1""",
                 ("time", "MFU %", "goodput %"), unit="percent", w=12, h=8,
                 description="MFU: model FLOPs of the step / (step time x devices x peak FLOPS of the device, "
                             "dtype-aware; see docs/efficiency.md for the peak table and overrides). Goodput: "
                             "share of the wall time in productive steps (gaps between steps and the excess of "
                             "stalled, checkpoint or restart steps over the rolling median are not).")
    d.table("Bus bandwidth vs peak per group", """
        WITH w AS (SELECT * FROM comm_bw WHERE job = '${job}' AND $__timeFilter(t_end)
                   QUALIFY row_number() OVER (PARTITION BY op, "group" ORDER BY step_hi DESC) = 1)
        SELECT op, "group", group_size, link, step_lo, step_hi, round(calls_per_step, 1) AS calls_per_step,
               bytes_per_call, round(busbw_gbps, 2) AS busbw_gbps, round(peak_gbps, 1) AS peak_gbps,
               round(100 * util, 1) AS util_pct, round(100 * wait_share, 1) AS wait_pct, diagnosis
        FROM w ORDER BY util ASC NULLS LAST, op, "group" LIMIT 50""",
            ("op", "group", "group_size", "link", "step_lo", "step_hi", "calls_per_step", "bytes_per_call",
             "busbw_gbps", "peak_gbps", "util_pct", "wait_pct", "diagnosis"), w=12, h=8,
            units={"bytes_per_call": "bytes", "util_pct": "percent", "wait_pct": "percent"},
            description="Latest analysis window per collective kind and group: achieved bus bandwidth "
                        "(nccl-tests factors; transfer time = the last-arriving rank's wall time) against the "
                        "link's peak, share of the collective time spent waiting, and the diagnosis "
                        "(small-messages, slow-link, sync-bound).")
    d.timeseries("Bus bandwidth per group", f"""
        SELECT {bucket('t_end')} AS time, op || ' ' || "group" AS series, avg(busbw_gbps) AS busbw_gbps
        FROM comm_bw WHERE job = '${{job}}' AND $__timeFilter(t_end) GROUP BY 1, 2 ORDER BY 1""",
                 ("time", "series", "busbw_gbps"), w=12, h=8, unit="GBs",
                 transformations=[{"id": "prepareTimeSeries", "options": {"format": "multi"}}],
                 description="Achieved bus bandwidth (GB/s) of every (collective, group) per analysis window: "
                             "a slow link is the line far below its peers.")
    d.bargauge("Message sizes (calls per payload size)", """
        WITH c AS (SELECT count, bytes / nullif(count, 0) AS bpc FROM comm
                   WHERE job = '${job}' AND op NOT IN ('barrier', 'wait') AND count > 0 AND bytes > 0
                     AND step >= (SELECT max(step) - 200 FROM comm WHERE job = '${job}'))
        SELECT CASE WHEN bpc < 4096 THEN '1: < 4 KiB' WHEN bpc < 65536 THEN '2: 4-64 KiB'
                    WHEN bpc < 1048576 THEN '3: 64 KiB-1 MiB' WHEN bpc < 16777216 THEN '4: 1-16 MiB'
                    WHEN bpc < 268435456 THEN '5: 16-256 MiB' ELSE '6: >= 256 MiB' END AS size,
               sum(count) AS calls
        FROM c GROUP BY 1 ORDER BY 1""", ("size", "calls"), w=12, h=8,
               description="Collective calls of the last 200 steps by payload per call (per rank and step "
                           "averages). Most calls far below the link's saturation size (MiBs) mean small "
                           "messages: fuse tensors (bigger buckets).")
    d.bargauge("DataLoader queue depth (ready batches at step start)", """
        SELECT lpad(data_queue::VARCHAR, 3, ' ') AS depth, round(100 * count(*) / sum(count(*)) OVER (), 2) AS pct
        FROM steps WHERE job = '${job}' AND $__timeFilter(t_end) AND data_queue IS NOT NULL
        GROUP BY data_queue ORDER BY data_queue""", ("depth", "pct"), w=12, h=8, unit="percent",
               description="Share of rank-steps by the number of batches ready in the DataLoader's prefetch "
                           "queue when the step started. Mostly 0: the workers cannot keep up (raise "
                           "num_workers / prefetch_factor, pin_memory, persistent_workers); mostly full: I/O "
                           "is not the bottleneck.")


# ============================================================================ node
def node() -> Dashboard:
    d = Dashboard(NODE_UID, "stepwatch / Node",
                  "One node of a job: host CPU and contention, I/O, network, accelerators and GC.")
    d.query_variable("job", "Job", JOB_VAR_SQL)
    d.query_variable("node", "Node", "SELECT DISTINCT node FROM host WHERE job = '${job}' ORDER BY node")
    d.tag_annotation("Alert annotations (processor)", ["stepwatch", "job:${job}", "node:${node}"], "red")
    host = "FROM host WHERE job = '${job}' AND node = '${node}' AND $__timeFilter(t)"

    d.timeseries("Host CPU", f"""
        SELECT {bucket('t')} AS time, avg(cpu_util) AS "cpu util", avg(cpu_iowait) AS "iowait",
               avg(cpu_steal) AS "steal"
        {host} GROUP BY 1 ORDER BY 1""", ("time", "cpu util", "iowait", "steal"), unit="percent",
                 description="Whole-node CPU utilisation, I/O wait and steal (percent of all cores).")
    d.timeseries("I/O wait and load", f"""
        SELECT {bucket('t')} AS time, avg(cpu_iowait) AS "iowait %", avg(load1) AS "load1"
        {host} GROUP BY 1 ORDER BY 1""", ("time", "iowait %", "load1"),
                 overrides=[{"matcher": {"id": "byName", "options": "load1"},
                             "properties": [{"id": "custom.axisPlacement", "value": "right"}]},
                            {"matcher": {"id": "byName", "options": "iowait %"},
                             "properties": [{"id": "unit", "value": "percent"}]}])
    d.table("Top processes (latest sample)", f"""
        WITH last AS (SELECT arg_max(top_procs, t) AS procs, max(t) AS t {host})
        SELECT last.t AS time, p.pid AS pid, p.name AS name, round(p.cpu_pct, 1) AS cpu_pct
        FROM last, (SELECT unnest(procs) AS p FROM last) ORDER BY cpu_pct DESC""",
            ("time", "pid", "name", "cpu_pct"), w=12, h=8, units={"cpu_pct": "percent"},
            description="The node's top CPU processes at the latest sample in the range (cpu_pct: 100 = one "
                        "core). A foreign process here (not the training ranks) is CPU contention.")
    d.timeseries("Top processes over time", f"""
        SELECT {bucket('t')} AS time, p.name AS process, max(p.cpu_pct) AS cpu_pct
        FROM (SELECT t, unnest(top_procs) AS p {host}) GROUP BY ALL ORDER BY time""",
                 ("time", "process", "cpu_pct"), unit="percent", w=12, h=8,
                 description="CPU of each process name among the node's top 5 (max over same-named processes).")
    d.timeseries("Memory", f"""
        SELECT {bucket('t')} AS time, avg(mem_used) AS "used", avg(mem_available) AS "available"
        {host} GROUP BY 1 ORDER BY 1""", ("time", "used", "available"), unit="bytes", w=8)
    d.timeseries("Disk", f"""
        SELECT {bucket('t')} AS time, avg(disk_read_bps) AS "read", avg(disk_write_bps) AS "write"
        {host} GROUP BY 1 ORDER BY 1""", ("time", "read", "write"), unit="Bps", w=8)
    d.timeseries("NIC", f"""
        SELECT {bucket('t')} AS time, avg(net_rx_bps) AS "rx", avg(net_tx_bps) AS "tx",
               sum(rdma_retrans) AS "RDMA retransmits"
        {host} GROUP BY 1 ORDER BY 1""", ("time", "rx", "tx", "RDMA retransmits"), unit="Bps", w=8,
                 overrides=[{"matcher": {"id": "byName", "options": "RDMA retransmits"},
                             "properties": [{"id": "custom.axisPlacement", "value": "right"},
                                            {"id": "unit", "value": "short"},
                                            {"id": "custom.drawStyle", "value": "bars"}]}])
    accel = f"""
        SELECT {bucket('t')} AS time, 'accel ' || a.index AS accel, avg(a.@col@) AS "@name@"
        FROM (SELECT t, unnest(accel) AS a {host}) GROUP BY ALL ORDER BY time"""
    for col, name, unit in (("util", "util", "percent"), ("temp_c", "temperature", "celsius"),
                            ("power_w", "power", "watt"), ("clock_mhz", "clock", "rotmhz")):
        d.timeseries(f"Accelerator {name}", accel.replace("@col@", col).replace("@name@", name), ("time", "accel", name),
                     unit=unit, w=6, min0=(col != "clock_mhz"))
    d.timeseries("GC pauses", """
        SELECT t AS time, 'rank ' || rank AS rank, duration_ms
        FROM gc WHERE job = '${job}' AND node = '${node}' AND $__timeFilter(t) ORDER BY t""",
                 ("time", "rank", "duration_ms"), points=True, unit=MS, w=12,
                 description="Every Python garbage collection on the node's ranks (one point per pause).")
    d.table("GC by rank", """
        SELECT rank, count(*) AS collections, round(sum(duration_ms), 1) AS total_ms,
               round(max(duration_ms), 2) AS max_ms, max(generation) AS max_generation
        FROM gc WHERE job = '${job}' AND node = '${node}' AND $__timeFilter(t)
        GROUP BY rank ORDER BY total_ms DESC""",
            ("rank", "collections", "total_ms", "max_ms", "max_generation"), w=12,
            units={"total_ms": MS, "max_ms": MS})
    d.timeseries("Busy time of this node's ranks vs the job", f"""
        WITH j AS (SELECT step, median(step_ms - coalesce(comm_wait_ms, 0)) AS job_busy
                   FROM steps WHERE job = '${{job}}' AND $__timeFilter(t_end) GROUP BY step),
        n AS (SELECT step, t_end, rank, step_ms - coalesce(comm_wait_ms, 0) AS busy
              FROM steps WHERE job = '${{job}}' AND node = '${{node}}' AND $__timeFilter(t_end))
        SELECT {bucket('n.t_end')} AS time, 'rank ' || n.rank AS rank, avg(n.busy - j.job_busy) AS "busy - job median"
        FROM n JOIN j USING (step) GROUP BY ALL ORDER BY time""", ("time", "rank", "busy - job median"),
                 unit=MS, w=24, min0=False,
                 description="Each rank's busy time minus the job's median rank: a slow rank stands out above 0.")
    return d


# ============================================================================ alerts & profiles
def alerts() -> Dashboard:
    d = Dashboard(ALERTS_UID, "stepwatch / Alerts & profiles",
                  "Every alert with its cause, cost and what to try.", time_from="now-24h")
    d.query_variable("job", "Job", JOB_VAR_SQL, multi=True, include_all=True)
    d.tag_annotation("stepwatch alerts", ["stepwatch"], "red")
    d.stat("Open alerts", f"""
        WITH o AS ({open_alerts_sql(JOB_MANY)}) SELECT count(*) AS firing FROM o""", "firing", w=6,
           thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}], panel_id=1)
    d.table("Alerts", """
        SELECT a.t_detected AS time, a.job, a.kind, a.status, a.severity,
               array_to_string(a.ranks, ',') AS ranks, array_to_string(a.nodes, ',') AS nodes, a.cause,
               round(a.cost_pct, 2) AS cost_pct, a.suggestion, a.step_first, a.step_detected, a.evidence,
               a.alert_id
        FROM alerts a
        WHERE a.job IN (${job}) AND $__timeFilter(a.t_detected)
        ORDER BY a.t_detected DESC""",
            ("time", "job", "kind", "status", "severity", "ranks", "nodes", "cause", "cost_pct", "suggestion",
             "step_first", "step_detected", "evidence", "alert_id"),
            w=18, h=10, panel_id=ALERTS_TABLE_PANEL_ID, links={"job": LINK_JOB}, units={"cost_pct": "percent"},
            description="Every alert row in the range (firing and resolved), newest first, with the "
                        "likely cause, the estimated throughput cost and the suggested remedy. Profile "
                        "links: the store has no profiles table yet, so this panel reads alerts only.")
    d.piechart("Open alerts by cause", f"""
        WITH o AS ({open_alerts_sql(JOB_MANY)})
        SELECT coalesce(cause, 'unknown') AS cause, count(*) AS alerts FROM o GROUP BY 1 ORDER BY 2 DESC""",
               ("cause", "alerts"), w=6, h=6, nonempty=False)
    d.timeseries("Alerts over time", f"""
        SELECT {bucket('t_detected')} AS time, kind, count(*) AS alerts
        FROM alerts WHERE job IN (${{job}}) AND status = 'firing' AND $__timeFilter(t_detected)
        GROUP BY ALL ORDER BY time""", ("time", "kind", "alerts"), bars=True, w=12, h=8,
                 description="New firing alerts per interval, by kind.")
    d.bargauge("Cost by cause (open alerts)", f"""
        WITH o AS ({open_alerts_sql(JOB_MANY)})
        SELECT coalesce(cause, 'unknown') AS cause, round(sum(cost_pct), 2) AS cost_pct
        FROM o GROUP BY 1 ORDER BY 2 DESC""", ("cause", "cost_pct"), w=12, h=8, unit="percent",
               nonempty=False,
               description="Estimated throughput lost, summed over open alerts, per cause (the field's "
                           "taxonomy: io, cpu, gc, communication, computation, parallelism).")
    return d


BUILDERS = (overview, job, node, alerts)


def _build() -> list[Dashboard]:
    return [b() for b in BUILDERS]


def build_all() -> dict[str, dict]:
    """All dashboards as Grafana JSON, keyed by uid."""
    return {d.uid: d.json() for d in _build()}


def sql_checks() -> list[SqlCheck]:
    """Every SQL embedded in the dashboards, with the columns Grafana reads from it."""
    return [c for d in _build() for c in d.checks]


def render(dash: dict) -> str:
    return json.dumps(dash, indent=2, sort_keys=False, ensure_ascii=False) + "\n"


def _all_json() -> dict[str, dict]:
    """The DuckDB dashboards and the Prometheus-only Overview (:mod:`.promdash`), keyed by uid."""
    from . import promdash
    return {**build_all(), **promdash.build_all()}


def write(out_dir: Path = JSON_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for uid, dash in _all_json().items():
        p = out_dir / f"{uid}.json"
        p.write_text(render(dash), encoding="utf-8")
        paths.append(p)
    return paths


def stale(out_dir: Path = JSON_DIR) -> list[str]:
    """Names of checked-in JSON files that differ from (or are missing for) the generator's output,
    plus stray files the generator no longer produces."""
    want = {f"{uid}.json": render(d) for uid, d in _all_json().items()}
    bad = [n for n, text in want.items()
           if not (out_dir / n).exists() or (out_dir / n).read_text(encoding="utf-8") != text]
    bad += sorted(p.name for p in out_dir.glob("*.json") if p.name not in want)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stepwatch.dashboards.build",
                                 description="Generate the stepwatch Grafana dashboards (JSON).")
    ap.add_argument("--out", type=Path, default=JSON_DIR)
    ap.add_argument("--check", action="store_true", help="only compare with the files in --out")
    a = ap.parse_args(argv)
    return check_or_write(a.check, lambda: stale(a.out), lambda: write(a.out), "dashboards",
                          "python -m stepwatch.dashboards.build")


def check_or_write(check: bool, stale_fn, write_fn, what: str, command: str) -> int:
    """The end of a generator's ``main`` (here and :mod:`.helmfiles`): with ``check``, exit status 1
    and the stale names when the generated files differ from what ``stale_fn`` compares them with,
    else (re)write them with ``write_fn`` and print their paths."""
    if check:
        bad = stale_fn()
        if bad:
            print(f"{what} out of date: {', '.join(bad)} (run {command})", file=sys.stderr)
            return 1
        print(f"{what} up to date")
        return 0
    for p in write_fn():
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())

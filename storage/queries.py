"""Canned post-mortem queries: named, documented SQL over the views of :mod:`storage.views`.

Each query takes named parameters: ``$job`` (always), ``$t_from`` / ``$t_to`` (TIMESTAMPTZ; default
the whole job), and some take ``$step`` (a step number, e.g. an alert's ``step_first``), ``$window``
(steps on each side) or ``$minutes``. ``stepwatch sql --list`` prints them; ``stepwatch sql --run
NAME --job J [--from T --to T --step S]`` runs one.

Written for thousands of ranks over hours: every query filters on ``job`` and on ``t_end``/``step``
(the catalog's per-file min/max statistics skip the files that cannot match, and files are sorted by
job then step, so row groups outside the range are skipped by their statistics), reads the derived
per-rank-minute (``rank_minutes``) and per-step (``step_summary``) tables where the question allows,
and aggregates with sums/averages rather than exact per-group medians where the group is a rank
over millions of rows.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Query:
    name: str
    description: str
    sql: str
    params: tuple[str, ...] = ("job", "t_from", "t_to")
    #: optional first query; ``sql`` then runs once per row it returns, with that row's columns as
    #: extra parameters (constants, so DuckDB prunes files and row groups with them), and the
    #: results are concatenated
    each: str | None = None


_RANGE = "job = $job AND t_end BETWEEN $t_from AND $t_to"
_MINUTES = "job = $job AND minute BETWEEN date_trunc('minute', $t_from) AND $t_to"

QUERIES: dict[str, Query] = {q.name: q for q in [
    Query("slowest_ranks",
          "Ranks with the highest busy time (step time minus comm wait) in the range, with their node, "
          "how much slower than the median rank they were, and the throughput that cost. Reads the "
          "per-rank minute summaries (ranges are whole minutes).",
          f"""
WITH r AS (
  SELECT rank, any_value(node) AS node, sum(steps) AS steps,
         sum(busy_ms) / sum(steps) AS busy_ms, sum(step_ms) / sum(steps) AS step_ms,
         sum(compute_ms) / sum(steps) AS compute_ms, sum(data_ms) / sum(steps) AS data_ms,
         sum(gc_ms) / sum(steps) AS gc_ms, sum(comm_wait_ms) / sum(steps) AS comm_wait_ms
  FROM rank_minutes WHERE {_MINUTES} GROUP BY rank)
SELECT rank, node, steps, round(busy_ms, 1) AS busy_ms,
       round(100 * (busy_ms / median(busy_ms) OVER () - 1), 2) AS slower_pct,
       round(100 * (busy_ms - median(busy_ms) OVER ()) / nullif(avg(step_ms) OVER (), 0), 2) AS cost_pct,
       round(compute_ms, 1) AS compute_ms, round(data_ms, 1) AS data_ms, round(gc_ms, 2) AS gc_ms,
       round(comm_wait_ms, 1) AS comm_wait_ms
FROM r ORDER BY busy_ms DESC LIMIT 20"""),
    Query("change_points",
          "Regressions and recoveries of the job's step time: where each began, when it was detected, "
          "the cause and evidence, and what it cost.",
          """
SELECT kind, status, step_first, step_detected, t_detected, cause, round(cost_pct, 2) AS cost_pct,
       evidence, suggestion
FROM alerts WHERE job = $job AND kind IN ('regression', 'recovery')
  AND t_detected BETWEEN $t_from AND $t_to
ORDER BY step_first, status"""),
    Query("jitter_per_hour",
          "Per hour: steps, median step time, and the jitter ratio (share of steps slower than 1.1x the "
          "median of the 21 steps around them) and the worst spike. A step's time is its slowest rank's; "
          "reads the per-step summaries (one row per step, not per rank and step).",
          f"""
WITH s AS (SELECT step, max(t_end) AS t_end, max(step_ms_max) AS step_ms FROM step_summary WHERE {_RANGE}
           GROUP BY step),
w AS (SELECT *, median(step_ms) OVER (ORDER BY step ROWS BETWEEN 10 PRECEDING AND 10 FOLLOWING) AS local_med FROM s)
SELECT date_trunc('hour', t_end) AS hour, count(*) AS steps, round(median(step_ms), 1) AS step_ms_p50,
       round(100 * avg(CASE WHEN step_ms > 1.1 * local_med THEN 1 ELSE 0 END), 2) AS jitter_pct,
       round(max(step_ms / local_med), 2) AS worst_spike_x
FROM w GROUP BY ALL ORDER BY hour"""),
    Query("host_contention",
          "Host samples of the nodes named by the job's alerts, from $minutes before to $minutes after "
          "each alert: CPU, iowait, steal, load and the top process.",
          """
SELECT $kind AS kind, $alert_id AS alert_id, node, t, round(cpu_util, 1) AS cpu_util,
       round(cpu_iowait, 1) AS iowait, round(cpu_steal, 1) AS steal, round(load1, 1) AS load1,
       top_procs[1].name AS top_proc, round(top_procs[1].cpu_pct, 0) AS top_proc_cpu_pct
FROM host WHERE job = $job AND t BETWEEN $lo AND $hi AND list_contains($nodes, node)
ORDER BY node, t""",
          params=("job", "t_from", "t_to", "minutes"),
          each="""
SELECT kind, alert_id, t_detected - to_minutes(CAST($minutes AS BIGINT)) AS lo,
       t_detected + to_minutes(CAST($minutes AS BIGINT)) AS hi, nodes
FROM alerts WHERE job = $job AND status = 'firing' AND t_detected BETWEEN $t_from AND $t_to AND len(nodes) > 0
ORDER BY t_detected"""),
    Query("gc_share_per_rank",
          "Share of each rank's step time spent in Python GC pauses, with collection counts (top 20).",
          f"""
SELECT rank, any_value(node) AS node, sum(gc_count) AS collections, round(sum(gc_ms), 1) AS gc_ms,
       round(100 * sum(gc_ms) / nullif(sum(step_ms), 0), 3) AS gc_pct_of_step_time
FROM rank_minutes WHERE {_MINUTES} GROUP BY rank ORDER BY gc_pct_of_step_time DESC NULLS LAST LIMIT 20"""),
    Query("card_hours_lost",
          "Accelerator-hours lost per cause: each firing alert's cost share times the job's cards times "
          "the time from its first step until it resolved (or the end of the range).",
          f"""
WITH ws AS (SELECT max(world_size) AS cards FROM topology WHERE job = $job),
f AS (SELECT alert_id, any_value(cause) AS cause, any_value(kind) AS kind, any_value(cost_pct) AS cost_pct,
             min(step_first) AS step_first,
             max(CASE WHEN status = 'resolved' THEN step_detected END) AS step_resolved
      FROM alerts WHERE job = $job AND kind <> 'recovery' GROUP BY alert_id),
st AS (SELECT step, max(t_end) AS t_end FROM step_summary WHERE {_RANGE} GROUP BY step),
span AS (SELECT f.alert_id, f.cause, f.kind, f.cost_pct,
                (SELECT epoch(max(t_end) - min(t_end)) FROM st
                 WHERE st.step >= f.step_first AND (f.step_resolved IS NULL OR st.step <= f.step_resolved)) AS seconds
         FROM f)
SELECT cause, count(*) AS alerts, round(sum(seconds) / 3600, 2) AS hours_affected,
       round(sum(cost_pct / 100 * coalesce(seconds, 0) / 3600 * (SELECT cards FROM ws)), 2) AS card_hours_lost
FROM span GROUP BY cause ORDER BY card_hours_lost DESC"""),
    Query("before_after",
          "Phase breakdown (median over ranks, averaged over steps) for $window steps before and after "
          "step $step — e.g. an alert's step_first, or the step a fix was deployed.",
          """
WITH s AS (SELECT step, CASE WHEN step < $step THEN 'before' ELSE 'after' END AS side,
                  median(step_ms) AS step_ms, median(data_ms) AS data_ms, median(compute_ms) AS compute_ms,
                  median(comm_ms) AS comm_ms, median(comm_wait_ms) AS comm_wait_ms, median(gc_ms) AS gc_ms
           FROM steps WHERE job = $job AND step BETWEEN $step - $window AND $step + $window - 1
           GROUP BY step)
SELECT side, count(*) AS steps, round(avg(step_ms), 1) AS step_ms, round(avg(data_ms), 1) AS data_ms,
       round(avg(compute_ms), 1) AS compute_ms, round(avg(comm_ms), 1) AS comm_ms,
       round(avg(comm_wait_ms), 1) AS comm_wait_ms, round(avg(gc_ms), 2) AS gc_ms,
       round(avg(step_ms - coalesce(data_ms, 0) - coalesce(compute_ms, 0) - coalesce(comm_ms, 0)
                 - coalesce(comm_wait_ms, 0) - coalesce(gc_ms, 0)), 1) AS host_gap_ms
FROM s GROUP BY side ORDER BY side DESC""",
          params=("job", "step", "window")),
]}

DEFAULTS = {"t_from": "1970-01-01 00:00:00+00", "t_to": "2200-01-01 00:00:00+00", "minutes": 5, "window": 30}


def run(con, name: str, **params):
    """Run a canned query; returns (columns, rows). Unknown name or missing parameter -> ValueError."""
    q = QUERIES.get(name)
    if q is None:
        raise ValueError(f"unknown query {name!r} (stepwatch sql --list shows them: {', '.join(QUERIES)})")
    args = {}
    for p in q.params:
        v = params.get(p)
        if v is None:
            v = DEFAULTS.get(p)
        if v is None:
            raise ValueError(f"query {name!r} needs --{p.replace('t_', '')}")
        args[p] = v
    for p in ("t_from", "t_to"):
        if p in args:
            args[p] = str(args[p])
    from stepwatch.storage.views import query

    def cast_times(sql):
        for p in ("t_from", "t_to"):
            sql = sql.replace(f"${p}", f"CAST(${p} AS TIMESTAMPTZ)")
        return sql
    if q.each is None:
        return query(con, cast_times(q.sql), args)
    pcols, prows = query(con, cast_times(q.each), args)
    cols, out = [], []
    used = {p: args[p] for p in args if f"${p}" in q.sql}
    for r in prows:
        cols, rows = query(con, q.sql, dict(used, **dict(zip(pcols, r))))
        out += rows
    if not cols:   # no alerts: still return the column names
        cols, _ = query(con, f"SELECT * FROM ({q.sql}) LIMIT 0",
                        dict(used, **{c: None for c in pcols}))
    return cols, out


def format_table(cols: list[str], rows: list[tuple], max_width: int = 60) -> str:
    """Query results as aligned text columns (numbers right-aligned, cells cut at ``max_width``):
    ``stepwatch sql`` and the demo print them."""
    def cell(v):
        if isinstance(v, float):
            s = f"{v:,.3f}" if abs(v) < 1e6 else f"{v:,.0f}"
        else:
            s = "NULL" if v is None else str(v)
        return s if len(s) <= max_width else s[: max_width - 1] + "…"
    body = [[cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in body]) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    sep = "  ".join("-" * w for w in widths)
    out = [line, sep] + ["  ".join(v.rjust(w) if _num(v) else v.ljust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join(out)


def _num(s: str) -> bool:
    return bool(s) and (s[0].isdigit() or s[0] == "-") and s.replace(",", "").replace(".", "").lstrip("-").isdigit()

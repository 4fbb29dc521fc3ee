"""The one source of truth for DuckDB view definitions over the Parquet store.

``view_sql(root)`` returns the ``CREATE VIEW`` statements used by ``stepwatch sql``, the demo's
post-mortem, the tests and (as ``initSql``) the Grafana DuckDB datasource. The seed files the store
writes (``job=_seed``, zero rows) keep every glob non-empty; the views filter them out.
"""
from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import tenacity

from stepwatch.schema import SCHEMAS

from stepwatch.storage.store import SEED_JOB, TABLES


def _lit(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def view_sql(root: str | Path) -> str:
    root = Path(root).absolute()
    stmts = []
    for t in TABLES:
        glob = str(root / t / "*" / "*" / "*.parquet")
        # Stored times are ns (Arrow timestamp[ns, UTC]); DuckDB's TIMESTAMPTZ_NS lacks interval
        # arithmetic and most time functions, so the views expose microsecond TIMESTAMPTZ.
        ts = [f.name for f in SCHEMAS[t] if pa.types.is_timestamp(f.type)]
        sel = "*" if not ts else "* REPLACE (" + ", ".join(f"CAST({c} AS TIMESTAMPTZ) AS {c}" for c in ts) + ")"
        stmts.append(
            f"CREATE OR REPLACE VIEW {t} AS SELECT {sel} FROM read_parquet({_lit(glob)}, "
            f"hive_partitioning = true, union_by_name = true) WHERE job <> {_lit(SEED_JOB)};")
    # Per-step job summary: what most panels and the post-mortem start from.
    stmts.append("""CREATE OR REPLACE VIEW job_steps AS
SELECT job, step, min(t_start) AS t_start, max(t_end) AS t_end, count(*) AS ranks_reported,
       median(step_ms) AS step_ms, max(step_ms) AS step_ms_max,
       median(step_ms - coalesce(comm_wait_ms, 0)) AS busy_ms_p50,
       max(step_ms - coalesce(comm_wait_ms, 0)) AS busy_ms_max,
       median(data_ms) AS data_ms, median(compute_ms) AS compute_ms, median(comm_ms) AS comm_ms,
       median(comm_wait_ms) AS comm_wait_ms, median(gc_ms) AS gc_ms,
       sum(samples) AS samples, sum(tokens) AS tokens
FROM steps GROUP BY job, step;""")
    stmts.append("""CREATE OR REPLACE VIEW rank_busy AS
SELECT job, rank, any_value(node) AS node, count(*) AS steps,
       median(step_ms - coalesce(comm_wait_ms, 0)) AS busy_ms, median(comm_wait_ms) AS comm_wait_ms,
       median(compute_ms) AS compute_ms, median(data_ms) AS data_ms, median(gc_ms) AS gc_ms
FROM steps GROUP BY job, rank;""")
    return "\n".join(stmts)


def connect(root: str | Path, threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the views defined (reads only Parquet)."""
    con = duckdb.connect(":memory:")
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    # binding a view opens files: compaction may swap them meanwhile
    _retrying(RETRIES, binding=True)(con.execute, view_sql(root))
    return con


RETRIES, BACKOFF_S = 5, 0.05     # waits 0.05 .. 0.8 s, 1.55 s in all: longer than a compaction fence stands


def _retrying(retries: int, binding: bool = False) -> tenacity.Retrying:
    """Retry up to ``retries`` times, waiting ``BACKOFF_S`` doubling, while the error is :func:`_swapped`."""
    return tenacity.Retrying(retry=tenacity.retry_if_exception(lambda e: _swapped(e, binding)),
                             stop=tenacity.stop_after_attempt(retries + 1),
                             wait=tenacity.wait_exponential(multiplier=BACKOFF_S), reraise=True)


def _swapped(e: Exception, binding: bool = False) -> bool:
    """The error a query gets when compaction or retention changed the files under it: a listed file
    was gone when it was opened, or it was a compaction *fence* (an empty file standing for a merged
    one for a fraction of a second; see :mod:`stepwatch.storage.compact`). Either way the same query
    a moment later reads a consistent set. ("Cannot open file" only while binding the views: that
    message once came with a read of a partial listing, before fences existed.)"""
    if not isinstance(e, duckdb.Error):
        return False
    msg = str(e)
    if "too small to be a Parquet file" in msg or "file size: 0" in msg:
        return True           # a fence: at listing, or when a file listed before the swap is re-opened
    if not isinstance(e, duckdb.IOException):
        return False
    return ("No such file" in msg or "Could not open" in msg or "not found" in msg.lower()
            or (binding and "Cannot open" in msg))


def query(con: duckdb.DuckDBPyConnection, sql: str, params=None, retries: int = RETRIES):
    """Run a query and fetch all rows, retrying (with a growing wait) when compaction or retention
    changed the files under it: a file vanished between DuckDB listing the folder and opening it, or
    a compaction fence stood in for a merged file. Returns (columns, rows)."""
    def once():
        cur = con.execute(sql, params) if params is not None else con.execute(sql)
        cols = [d[0] for d in cur.description] if cur.description else []
        return cols, (cur.fetchall() if cols else [])
    return _retrying(retries)(once)

"""The one source of truth for DuckDB view definitions over the Parquet store.

``view_sql(root)`` returns the ``CREATE VIEW`` statements used by ``stepwatch sql``, the demo's
post-mortem, the tests and (as ``initSql``) the Grafana DuckDB datasource. The seed files the store
writes (``job=_seed``, zero rows) keep every glob non-empty; the views filter them out.
"""
from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa

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
    for attempt in range(4):
        try:                             # binding a view opens a file: compaction may swap it meanwhile
            con.execute(view_sql(root))
            return con
        except duckdb.IOException as e:
            if attempt == 3 or not _vanished(e):
                raise
    return con


def _vanished(e: Exception) -> bool:
    """A file listed by DuckDB was gone when it opened it (a compaction swap or a retention delete);
    used when binding the views, which reads no rows."""
    msg = str(e)
    return "No such file" in msg or "Could not open" in msg or "Cannot open" in msg or "not found" in msg.lower()


def query(con: duckdb.DuckDBPyConnection, sql: str, params=None, retries: int = 3):
    """Run a query and fetch all rows, retrying when a file vanished under it (compaction swapped
    or retention removed a partition between DuckDB listing the folder and opening the file).
    Returns (columns, rows)."""
    for attempt in range(retries + 1):
        try:
            cur = con.execute(sql, params) if params is not None else con.execute(sql)
            cols = [d[0] for d in cur.description] if cur.description else []
            return cols, (cur.fetchall() if cols else [])
        except duckdb.IOException as e:
            msg = str(e)       # (not "Cannot open file": a retry after it was once seen reading a partial listing)
            if attempt == retries or not ("No such file" in msg or "Could not open" in msg
                                          or "not found" in msg.lower()):
                raise

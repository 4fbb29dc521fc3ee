"""The one source of truth for DuckDB view definitions over the lake.

``view_sql(root)`` returns the statements used by ``stepwatch sql``, the demo's post-mortem, the
tests and (as ``initSql``, with ``lockdown=True``) the Grafana DuckDB datasource: load the
extensions, attach the lake **read-only** as ``lake``, and define one view per table (same names
as the lake's tables, so ``SELECT … FROM steps`` reads ``lake.steps``) plus the summary views.
A query sees one whole snapshot of the lake: compaction and writers never change what it reads.
"""
from __future__ import annotations

import duckdb
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from stepwatch.storage.lake import InstanceCache, lake_of
from stepwatch.storage.store import JOBS, OFFSETS, STORED_TYPES, TABLES


#: Views over the table views, shared with the Grafana snapshot (:mod:`stepwatch.dashboards.snapshot`).
DERIVED_VIEWS = [
    # Per-step job summary: what most panels and the post-mortem start from.
    """CREATE OR REPLACE VIEW job_steps AS
SELECT job, step, min(t_start) AS t_start, max(t_end) AS t_end, count(*) AS ranks_reported,
       median(step_ms) AS step_ms, max(step_ms) AS step_ms_max,
       median(step_ms - coalesce(comm_wait_ms, 0)) AS busy_ms_p50,
       max(step_ms - coalesce(comm_wait_ms, 0)) AS busy_ms_max,
       median(data_ms) AS data_ms, median(compute_ms) AS compute_ms, median(comm_ms) AS comm_ms,
       median(comm_wait_ms) AS comm_wait_ms, median(gc_ms) AS gc_ms,
       sum(samples) AS samples, sum(tokens) AS tokens
FROM steps GROUP BY job, step;""",
    """CREATE OR REPLACE VIEW rank_busy AS
SELECT job, rank, any_value(node) AS node, count(*) AS steps,
       median(step_ms - coalesce(comm_wait_ms, 0)) AS busy_ms, median(comm_wait_ms) AS comm_wait_ms,
       median(compute_ms) AS compute_ms, median(data_ms) AS data_ms, median(gc_ms) AS gc_ms
FROM steps GROUP BY job, rank;""",
]


def view_sql(root, ext_dir=None, lockdown: bool = False, s3_keys_from_env: bool = False) -> str:
    """``root``: a data dir, a :class:`~stepwatch.storage.lake.Lake` or a store. ``ext_dir``: the
    extension folder as the reader sees it (default: this machine's, see :mod:`.extensions`)."""
    lake = lake_of(root)
    stmts = lake.attach_sql(read_only=True, ext_dir=ext_dir, lockdown=lockdown, s3_keys_from_env=s3_keys_from_env)
    return "\n".join(stmts + _view_stmts())


def _view_stmts() -> list[str]:
    """The views over the attached lake's tables, then the derived ones."""
    return [f"CREATE OR REPLACE VIEW {t} AS SELECT {_select(t)} FROM lake.main.{t};"
            for t in TABLES + (OFFSETS, JOBS)] + DERIVED_VIEWS


def _select(table: str) -> str:
    """A table view's select list: every column, those the lake stores narrower
    (:data:`~stepwatch.storage.store.STORED_TYPES`: steps' durations as FLOAT) read back as DOUBLE, so
    every query and panel computes in float64 as the wire does (``round(x, 1)`` of a FLOAT gives
    1106.9000244140625)."""
    narrow = STORED_TYPES.get(table)
    if not narrow:
        return "*"
    return "* REPLACE (" + ", ".join(f'CAST("{c}" AS DOUBLE) AS "{c}"' for c in narrow) + ")"


_DBS = InstanceCache()                       # Lake -> the instance with the lake attached read-only and the views


def connect(root, threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the lake attached read-only and the views defined: a new connection
    to the one in-memory instance kept per lake and process (:class:`stepwatch.storage.lake.InstanceCache`),
    so each query reads the newest snapshot."""
    lake = lake_of(root)

    def setup(db: duckdb.DuckDBPyConnection) -> None:
        for attempt in _retrying():
            with attempt:
                db.execute(view_sql(lake))
        _COLS[lake] = _columns(db)
    cur = _DBS.cursor(lake, setup, threads)
    cols = _columns(cur)                 # (~10 ms) the instance's views were bound to the tables as they were
    if cols != _COLS.get(lake):
        refresh_views(cur)
        _COLS[lake] = cols
    return cur


_COLS: dict = {}                         # Lake -> the lake's columns when its instance's views were defined


def _columns(con: duckdb.DuckDBPyConnection) -> tuple:
    for attempt in _retrying():
        with attempt:
            return tuple(con.execute("SELECT table_name, column_name FROM duckdb_columns() "
                                     "WHERE database_name = 'lake' ORDER BY ALL").fetchall())


def refresh_views(con: duckdb.DuckDBPyConnection) -> None:
    """Define the views again over the lake's tables as they are now. A writer may have added a column
    to a table since the views were defined (a producer's extra column); DuckDB then refuses a view
    bound to the old columns ('Contents of view were altered'). The views are the instance's, so this
    mends every connection to it."""
    for attempt in _retrying():
        with attempt:
            con.execute("\n".join(_view_stmts()))


def _altered(e: BaseException) -> bool:
    return isinstance(e, duckdb.Error) and "Contents of view were altered" in str(e)


def _busy(e: BaseException) -> bool:
    """A SQLite catalog busy for a moment (a writer checkpointing its WAL), or a query that took
    longer than compaction's grace period and found its snapshot expired: the same query succeeds a
    moment later on the newest snapshot. (Compaction never removes a catalog row a live snapshot
    needs, and expires a snapshot only ``--grace`` after a newer one replaced it: see
    :mod:`stepwatch.storage.compact` for why that matters to readers of a SQLite catalog.)"""
    return isinstance(e, duckdb.Error) and ("database is locked" in str(e) or "database table is locked" in str(e)
                                            or "No snapshot found" in str(e))


def _retrying(attempts: int = 6) -> Retrying:
    return Retrying(retry=retry_if_exception(_busy), stop=stop_after_attempt(attempts),
                    wait=wait_random_exponential(multiplier=0.05, max=1.0), reraise=True)


def query(con: duckdb.DuckDBPyConnection, sql: str, params=None, retries: int = 5):
    """Run a query and fetch all rows. Returns (columns, rows)."""
    for attempt in _retrying(retries + 1):
        with attempt:
            try:
                cur = con.execute(sql, params) if params is not None else con.execute(sql)
            except duckdb.Error as e:
                if not _altered(e):
                    raise
                refresh_views(con)            # a table gained a column since the views were bound
                cur = con.execute(sql, params) if params is not None else con.execute(sql)
            cols = [d[0] for d in cur.description] if cur.description else []
            return cols, (cur.fetchall() if cols else [])

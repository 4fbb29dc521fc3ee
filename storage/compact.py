"""Compaction and retention of the lake, safe while processors write, readers query, and another
pass runs.

One pass (``stepwatch compact``, the chart's CronJob):

1. **retention**: ``DELETE`` of whole ``date`` partitions older than the window (DuckLake
   ends the files in the next snapshot; no delete files);
2. **compaction**: each partition's small files are rewritten in groups of up to ``target_mb``, one
   DuckLake transaction per group: ``INSERT INTO t SELECT * FROM t WHERE filename IN (group) ORDER BY
   <sort columns>`` then ``DELETE FROM t WHERE filename IN (group)``, which *ends* the old files (their
   ``end_snapshot`` is set); ``kafka_offsets``, whose rows every flush replaces, the same way;
3. **expiry**: ``ducklake_expire_snapshots`` of every snapshot a newer one replaced more than
   ``grace_s`` ago, then ``ducklake_cleanup_old_files`` (files scheduled for deletion more than
   ``grace_s`` ago) and ``ducklake_delete_orphaned_files`` (files of flushes killed before their
   commit, after an hour).

Why not DuckLake's ``ducklake_merge_adjacent_files``: it writes one file for all the snapshots of the
files it merges and *removes* their catalog rows. DuckDB 1.4.4's ``sqlite`` extension scans the
tables of a read-only transaction through a new SQLite connection per scan, limited to the rowid
range read when the query was planned (``SELECT ... WHERE ROWID BETWEEN ? AND ?``), so a reader's
catalog reads are not one SQLite snapshot: a merge committing between them had removed the old
files' rows while the merged file's row lay beyond the range, and the query returned 0 rows with no
error (``tests/test_compact.py``, 4 runs in 7). With rows only ever added (beyond the range, and
after the reader's snapshot anyway) or ended in place, every catalog row a reader's snapshot needs is
in its range and unchanged. (A PostgreSQL reader reads the catalog in one ``REPEATABLE READ``
transaction; the rewrite is used there too, so both catalogs run the code that was tested.)

Expiry also removes catalog rows, but only rows no live snapshot needs, and a snapshot is expired
only ``grace_s`` after a newer one replaced it (not ``grace_s`` after it was made: in a lake idle for
longer the newest snapshot is old, and a query that starts on it just before a write must still
find it). So a query has ``grace_s`` to read its snapshot's file list, and the files stay on disk
``grace_s`` longer. Keep ``grace_s`` above the longest query (default 300 s).

Every step is one catalog transaction: a reader sees the snapshot before or after it, never a mix.
Two passes at once rewrite each file once: on PostgreSQL the second ``DELETE`` of the same files is a
DuckLake conflict and that group is done again from a fresh snapshot (it then moves no rows); on
SQLite writers take turns (:meth:`~stepwatch.storage.lake.Lake.write_lock`), so the second pass lists
the files after the first committed. Other conflicts and a busy catalog are retried with
:func:`~stepwatch.storage.store.retry_conflicts`.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from urllib.parse import unquote

import duckdb

from stepwatch.storage.lake import lake_of, lit
from stepwatch.storage.store import OFFSETS, SORT_COLUMNS, TABLES, retry_conflicts

log = logging.getLogger("stepwatch.compact")
ORPHAN_AGE_S = 3600.0
AUTHOR = "stepwatch compact"


@dataclass
class CompactResult:
    partitions: int = 0          # tables whose files this pass merged
    files_in: int = 0            # data files of the tables merged, before the pass (writers may add some meanwhile)
    files_out: int = 0           # ... after it
    rows: int = 0                # rows in the tables merged
    bytes_in: int = 0
    bytes_out: int = 0
    expired: list[str] = field(default_factory=list)       # table/job=J/date=D removed by retention
    skipped: list[str] = field(default_factory=list)
    snapshots_expired: int = 0
    files_deleted: int = 0


def _rollback(con) -> None:
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass


def _retry1(lake, con, sql: str, params=None):
    for attempt in retry_conflicts(attempts=20, max_wait_s=5.0):
        with attempt, lake.write_lock():
            return con.execute(sql, params).fetchall() if params is not None else con.execute(sql).fetchall()


def _retry(lake, con, sql: str, params=None):
    """Run one maintenance call in its own transaction, retried on conflicts. DuckLake deletes
    replaced files, then commits; when that commit loses a race, the next try finds a file it
    scheduled already gone and fails: such an entry is forgotten (its file is deleted, which was
    the point) and the call runs again."""
    for _ in range(100):
        try:
            return _retry1(lake, con, sql, params)
        except duckdb.IOException as e:
            m = re.search(r'file "([^"]+)"', str(e))
            if not m or "scheduled for deletion" not in str(e) or not re.search(
                    r"No such file|404|Not Found|does not exist", str(e)):
                raise
            log.info("forgetting a file already deleted by an earlier try: %s", m.group(1))
            _retry1(lake, con, "DELETE FROM __ducklake_metadata_lake.ducklake_files_scheduled_for_deletion "
                         "WHERE ends_with(?, path)", [m.group(1)])
    return _retry1(lake, con, sql, params)


def _transaction(lake, con, fn, label: str):
    """``fn(con)`` in one transaction labelled ``label`` (snapshots show who did what), retried on
    conflicts from scratch."""
    for attempt in retry_conflicts(attempts=20, max_wait_s=5.0):
        with attempt, lake.write_lock():
            con.execute("BEGIN")
            try:
                con.execute(f"CALL lake.set_commit_message({lit(AUTHOR)}, {lit(label)})")
                out = fn(con)
                con.execute("COMMIT")
            except BaseException:
                _rollback(con)
                raise
            return out


# ------------------------------------------------------------------ rewriting groups of files
def _partition_filter(path: str) -> tuple[str, list]:
    """``date = ?`` (and ``job = ?`` in a lake partitioned by job too) from a data file's path
    (DuckLake's hive folders, values URL-encoded), so a rewrite reads only that partition's files."""
    parts = dict(p.split("=", 1) for p in path.split("/")[-3:-1] if "=" in p)
    if "date" not in parts or not set(parts) <= {"job", "date"}:
        return "", []
    where = (" AND job = ?" if "job" in parts else "") + " AND date = CAST(? AS DATE)"
    return where, ([unquote(parts["job"])] if "job" in parts else []) + [unquote(parts["date"])]


def _groups(con, table: str, target: int) -> list[list[str]]:
    """Groups of one partition's small files (each up to ``target`` bytes together) worth rewriting:
    at least two files, or one with deleted rows."""
    rows = con.execute("SELECT data_file, data_file_size_bytes, delete_file FROM ducklake_list_files('lake', ?)",
                       [table]).fetchall()
    by_dir: dict[str, list] = {}
    for path, size, delete in rows:
        if size < target:
            by_dir.setdefault(path.rsplit("/", 1)[0], []).append((path, int(size), delete is not None))
    out = []
    for files in by_dir.values():
        group, total = [], 0
        for f in files + [None]:
            if f is None or (group and total + f[1] > target):
                if len(group) > 1 or (group and group[0][2]):
                    out.append([g[0] for g in group])
                group, total = [], 0
            if f is not None:
                group.append(f)
                total += f[1]
    return out


def _rewrite_group(con, table: str, files: list[str]) -> int:
    """Copy the rows of ``files`` into one new file and delete them from ``files`` (which ends those
    files); returns the rows moved (0 when another pass rewrote them since they were listed)."""
    where, params = _partition_filter(files[0])
    order = ", ".join(f'"{c}"' for c in SORT_COLUMNS.get(table, ()))     # the flush's sort order, across files
    n_in = con.execute(f"INSERT INTO lake.{table} SELECT * FROM lake.{table} WHERE list_contains(?, filename){where}"
                       + (f" ORDER BY {order}" if order else ""), [files] + params).fetchone()[0]
    n_out = con.execute(f"DELETE FROM lake.{table} WHERE list_contains(?, filename){where}",
                        [files] + params).fetchone()[0]
    if n_in != n_out:      # (a file outside the partition filter: never commit a changed row count)
        raise RuntimeError(f"rewrite of {table}: copied {n_in} rows but deleted {n_out}; nothing committed")
    return n_in


def _rewrite_table(lake, con, table: str, target: int) -> bool:
    """Rewrite ``table``'s groups of small files, one transaction each; True when any rows moved.
    (A group another pass rewrote meanwhile moves 0 rows: its files are no longer in the snapshot.)"""
    moved = 0
    for files in _groups(con, table, target):
        moved += _transaction(lake, con, lambda c, f=files: _rewrite_group(c, table, f), f"merge {table}")
    return moved > 0


def _info(con) -> dict[str, tuple[int, int]]:
    return {r[0]: (int(r[1]), int(r[2])) for r in con.execute(
        "SELECT table_name, file_count, file_size_bytes FROM ducklake_table_info('lake')").fetchall()}


def expire(root, retention_days: float, today: date | None = None, res: CompactResult | None = None,
           con=None) -> list[str]:
    """Remove date partitions strictly older than the retention window (whole days, UTC): a
    partition ``date=D`` goes when ``D + 1 day <= today - retention_days``."""
    res = res or CompactResult()
    lake = lake_of(root)
    con = con or lake.connect()
    today = today or datetime.now(timezone.utc).date()
    cutoff = datetime.combine(today, datetime.min.time(), tzinfo=timezone.utc) - timedelta(days=retention_days)
    last = cutoff.date() - timedelta(days=1)          # the newest day removed

    def delete(c, t):
        parts = c.execute(f"SELECT DISTINCT job, date FROM lake.{t} WHERE date <= ? ORDER BY 1, 2", [last]).fetchall()
        if parts:
            c.execute(f"DELETE FROM lake.{t} WHERE date <= ?", [last])
        return parts
    for t in TABLES:
        parts = _transaction(lake, con, lambda c, t=t: delete(c, t), f"retention {t}")
        res.expired += [f"{t}/job={j}/date={d}" for j, d in parts]
    return res.expired


def expirable(con, grace_s: float) -> list[int]:
    """Snapshots a newer one replaced more than ``grace_s`` ago (never the newest)."""
    return [r[0] for r in con.execute(
        "SELECT snapshot_id FROM (SELECT snapshot_id, lead(snapshot_time) OVER (ORDER BY snapshot_id) AS replaced "
        "FROM lake.snapshots()) WHERE replaced < now() - to_microseconds(?) ORDER BY 1",
        [int(grace_s * 1e6)]).fetchall()]


def run(root, target_mb: float = 256, min_age_s: float = 30.0, retention_days: float | None = None,
        grace_s: float = 300.0, tables=TABLES) -> CompactResult:
    """One maintenance pass (see the module doc). ``min_age_s`` is accepted for compatibility:
    files are merged under a snapshot, so young files need no waiting."""
    lake = lake_of(root)
    con = lake.connect()
    res = CompactResult()
    if retention_days is not None:
        expire(lake, retention_days, res=res, con=con)
    before = _info(con)
    target = int(target_mb * (1 << 20))
    merged = {t for t in tables if _rewrite_table(lake, con, t, target)}
    _rewrite_table(lake, con, OFFSETS, target)
    after = _info(con)
    for t in tables:
        b, a = before.get(t, (0, 0)), after.get(t, (0, 0))
        if t in merged:
            res.partitions += 1
            res.files_in += b[0]
            res.files_out += a[0]
            res.bytes_in += b[1]
            res.bytes_out += a[1]
            res.rows += con.execute(f"SELECT count(*) FROM lake.{t}").fetchone()[0]
    versions = expirable(con, grace_s)
    for i in range(0, len(versions), 2000):
        chunk = ", ".join(str(v) for v in versions[i:i + 2000])
        res.snapshots_expired += len(_retry(lake, con, f"CALL ducklake_expire_snapshots('lake', versions => [{chunk}])"))
    older = f"now() - to_microseconds({int(grace_s * 1e6)})"
    res.files_deleted = len(_retry(lake, con, f"CALL ducklake_cleanup_old_files('lake', older_than => {older})"))
    # an orphan is a file no commit references: a writer killed mid-flush, or one still writing now,
    # so only files far older than any flush
    orphan = f"now() - to_microseconds({int(max(grace_s, ORPHAN_AGE_S) * 1e6)})"
    res.files_deleted += len(_retry(lake, con, f"CALL ducklake_delete_orphaned_files('lake', older_than => {orphan})"))
    con.close()
    return res

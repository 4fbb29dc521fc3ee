"""Compaction and retention of the lake: DuckLake's own operations, safe while processors write,
readers query, and another pass runs.

One pass (``stepwatch compact``, the chart's CronJob):

1. **retention**: ``DELETE`` of whole ``(job, date)`` partitions older than the window (DuckLake
   drops the files from the next snapshot; no delete files);
2. **compaction**: ``ducklake_merge_adjacent_files`` per table (small files of a partition merged
   up to ``target_mb``) and ``ducklake_rewrite_data_files`` for the offsets table (its rows are
   replaced on every flush, leaving delete files);
3. **expiry**: ``ducklake_expire_snapshots`` older than ``grace_s``, then
   ``ducklake_cleanup_old_files`` (files no live snapshot references, replaced more than ``grace_s``
   ago) and ``ducklake_delete_orphaned_files`` (files of flushes killed before their commit).

Every step is one catalog transaction: a reader sees the snapshot before or after it, never a mix,
and keeps reading the files of its snapshot for ``grace_s`` after they were replaced. A step that
loses a race (a writer or a second pass committed first: DuckLake reports a conflict, a SQLite
catalog is busy) is retried from scratch with :func:`~stepwatch.storage.store.retry_conflicts`, so
two passes at once merge each file once.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone

import duckdb

from stepwatch.storage.lake import lake_of, lit
from stepwatch.storage.store import OFFSETS, TABLES, retry_conflicts

log = logging.getLogger("stepwatch.compact")
ORPHAN_AGE_S = 3600.0


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


def _retry1(con, sql: str, params=None):
    for attempt in retry_conflicts(attempts=20, max_wait_s=5.0):
        with attempt:
            return con.execute(sql, params).fetchall() if params is not None else con.execute(sql).fetchall()


def _retry(con, sql: str, params=None):
    """Run one maintenance call in its own transaction, retried on conflicts. DuckLake deletes
    replaced files, then commits; when that commit loses a race, the next try finds a file it
    scheduled already gone and fails: such an entry is forgotten (its file is deleted, which was
    the point) and the call runs again."""
    for _ in range(100):
        try:
            return _retry1(con, sql, params)
        except duckdb.IOException as e:
            m = re.search(r'file "([^"]+)"', str(e))
            if not m or "scheduled for deletion" not in str(e) or not re.search(
                    r"No such file|404|Not Found|does not exist", str(e)):
                raise
            log.info("forgetting a file already deleted by an earlier try: %s", m.group(1))
            _retry1(con, "DELETE FROM __ducklake_metadata_lake.ducklake_files_scheduled_for_deletion "
                         "WHERE ends_with(?, path)", [m.group(1)])
    return _retry1(con, sql, params)


AUTHOR = "stepwatch compact"


def _merge(con, table: str, call: str) -> None:
    """One merge in its own transaction, labelled (snapshots show who merged what)."""
    for attempt in retry_conflicts(attempts=20, max_wait_s=5.0):
        with attempt:
            con.execute("BEGIN")
            try:
                con.execute(f"CALL lake.set_commit_message({lit(AUTHOR)}, {lit('merge ' + table)})")
                con.execute(call)
                con.execute("COMMIT")
            except BaseException:
                try:
                    con.execute("ROLLBACK")
                except Exception:  # noqa: BLE001
                    pass
                raise


def _info(con) -> dict[str, tuple[int, int]]:
    return {r[0]: (int(r[1]), int(r[2])) for r in con.execute(
        "SELECT table_name, file_count, file_size_bytes FROM ducklake_table_info('lake')").fetchall()}


def expire(root, retention_days: float, today: date | None = None, res: CompactResult | None = None,
           con=None) -> list[str]:
    """Remove date partitions strictly older than the retention window (whole days, UTC): a
    partition ``date=D`` goes when ``D + 1 day <= today - retention_days``."""
    res = res or CompactResult()
    con = con or lake_of(root).connect()
    today = today or datetime.now(timezone.utc).date()
    cutoff = datetime.combine(today, datetime.min.time(), tzinfo=timezone.utc) - timedelta(days=retention_days)
    last = cutoff.date() - timedelta(days=1)          # the newest day removed
    for t in TABLES:
        for attempt in retry_conflicts(attempts=20, max_wait_s=5.0):
            with attempt:
                con.execute("BEGIN")
                try:
                    parts = con.execute(f"SELECT DISTINCT job, date FROM lake.{t} WHERE date <= ? ORDER BY 1, 2",
                                        [last]).fetchall()
                    if parts:
                        con.execute(f"DELETE FROM lake.{t} WHERE date <= ?", [last])
                    con.execute("COMMIT")
                except BaseException:
                    try:
                        con.execute("ROLLBACK")
                    except Exception:  # noqa: BLE001
                        pass
                    raise
        res.expired += [f"{t}/job={j}/date={d}" for j, d in parts]
    return res.expired


def run(root, target_mb: float = 256, min_age_s: float = 30.0, retention_days: float | None = None,
        grace_s: float = 300.0, tables=TABLES) -> CompactResult:
    """One maintenance pass (see the module doc). ``min_age_s`` is accepted for compatibility: DuckLake
    merges files under a snapshot, so young files need no waiting."""
    lake = lake_of(root)
    con = lake.connect()
    res = CompactResult()
    if retention_days is not None:
        expire(lake, retention_days, res=res, con=con)
    before = _info(con)
    target = int(target_mb * (1 << 20))
    start = con.execute("SELECT max(snapshot_id) FROM lake.snapshots()").fetchone()[0]
    for t in tables:
        _merge(con, t, f"CALL ducklake_merge_adjacent_files('lake', {lit(t)}, max_file_size => {target})")
    merged = {r[0] for r in con.execute(
        "SELECT DISTINCT commit_message FROM lake.snapshots() WHERE snapshot_id > ? AND author = ? "
        "AND commit_message LIKE 'merge %'", [start, AUTHOR]).fetchall()}
    _retry(con, f"CALL ducklake_merge_adjacent_files('lake', {lit(OFFSETS)})")
    _retry(con, f"CALL ducklake_rewrite_data_files('lake', {lit(OFFSETS)}, delete_threshold => 0.0)")
    _retry(con, f"CALL ducklake_merge_adjacent_files('lake', {lit(OFFSETS)})")
    after = _info(con)
    for t in tables:
        b, a = before.get(t, (0, 0)), after.get(t, (0, 0))
        if f"merge {t}" in merged:
            res.partitions += 1
            res.files_in += b[0]
            res.files_out += a[0]
            res.bytes_in += b[1]
            res.bytes_out += a[1]
            res.rows += con.execute(f"SELECT count(*) FROM lake.{t}").fetchone()[0]
    older = f"now() - to_microseconds({int(grace_s * 1e6)})"
    res.snapshots_expired = len(_retry(con, f"CALL ducklake_expire_snapshots('lake', older_than => {older})"))
    res.files_deleted = len(_retry(con, f"CALL ducklake_cleanup_old_files('lake', older_than => {older})"))
    # an orphan is a file no commit references: a writer killed mid-flush, or one still writing now,
    # so only files far older than any flush
    orphan = f"now() - to_microseconds({int(max(grace_s, ORPHAN_AGE_S) * 1e6)})"
    res.files_deleted += len(_retry(con, f"CALL ducklake_delete_orphaned_files('lake', older_than => {orphan})"))
    con.close()
    return res

"""Compaction of small files and retention by age, safe while readers query and writers write.

The streaming writer leaves one file per table, job and flush (one a second). Compaction merges the
small files of a partition (``<table>/job=J/date=D``) into one file sorted for pruning, and
retention removes whole date partitions older than the retention window.

Safety:

* **Writers**: the store's writer holds the partition's lock (``_state/locks/…``, ``flock``) from
  its first temporary file to its rename; compaction takes the same lock only for its final swap,
  and hard-links into the new set any file that arrived meanwhile. A partition holding a
  temporary file under the lock (a writer died mid-flush) is left alone until recovery.
* **Readers**: the new set of files is built in a staging folder and *exchanged* with the
  partition folder in one atomic ``renameat2(RENAME_EXCHANGE)``: a query sees either the old files
  or the compacted one, never both. The old set is kept for a grace period (queries that already
  opened files keep reading them); a query that listed the folder before the swap and opens a file
  after it gets "file not found" and is retried by :func:`stepwatch.storage.views.query`.
* **Fences**: DuckDB lists a folder through its handle but then ``stat``-s each entry *by path*
  and silently skips an entry that is gone. A query whose listing straddles the swap would read the
  old names in the new folder, find the merged ones missing, skip them and return too few rows
  without an error. So the new folder also holds, under each merged file's name, an empty file
  (a *fence*): DuckDB stats it, opens it and fails with "too small to be a Parquet file", which
  :func:`~stepwatch.storage.views.query` retries after a short wait. The fences are removed
  ``fence_s`` (0.25 s) after the swap; queries on that table in that window are retried (a Grafana
  panel refreshed then shows the error once). A pass removes fences a crashed pass left behind.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stepwatch.storage.store import SEED_JOB, SORT_COLUMNS, TABLES, _is_sorted, _write_options, partition_lock

log = logging.getLogger("stepwatch.compact")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def exchange(a: Path, b: Path) -> None:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE)."""
    if not hasattr(_libc, "renameat2"):
        raise OSError("renameat2 is not available: compaction needs Linux >= 3.15 with glibc >= 2.28")
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(e)}")


@dataclass
class CompactResult:
    partitions: int = 0
    files_in: int = 0
    files_out: int = 0
    rows: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    expired: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    fences: int = 0


def _partitions(root: Path, tables=TABLES):
    for t in tables:
        for jd in sorted((root / t).glob("job=*")):
            if jd.name == f"job={SEED_JOB}":
                continue
            for dd in sorted(jd.glob("date=*")):
                if dd.is_dir():
                    yield t, dd


FENCE_S = 0.25      # how long the fences stand after a swap: far longer than a DuckDB listing takes


def compact_partition(root: Path, table: str, part: Path, target_bytes: int = 256 << 20,
                      min_age_s: float = 30.0, min_files: int = 2, res: CompactResult | None = None,
                      fences: list[Path] | None = None, fence_s: float = FENCE_S) -> bool:
    """Merge the small, settled files of one partition. Returns True when it swapped.

    The fences (see the module doc) are appended to ``fences`` for the caller to remove
    ``fence_s`` after the swap (:func:`run` waits once for a whole pass); without a list they are
    removed here, after waiting."""
    res = res or CompactResult()
    now = time.time()
    files = sorted(f for f in part.glob("*.parquet"))
    small = []
    for f in files:
        st = f.stat()
        if 0 < st.st_size < target_bytes and now - st.st_mtime >= min_age_s:     # (size 0: a fence)
            small.append(f)
    if len(small) < min_files:
        return False
    # merge in batches so one output file stays near target_bytes
    groups, cur, size = [], [], 0
    for f in small:
        cur.append(f)
        size += f.stat().st_size
        if size >= target_bytes:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    groups = [g for g in groups if len(g) >= min_files] or []
    if not groups:
        return False
    stage = root / "_state" / "compact" / uuid.uuid4().hex
    stage.mkdir(parents=True)
    merged: set[str] = set()
    sort_cols = SORT_COLUMNS[table]
    try:
        for i, g in enumerate(groups):
            t = pa.concat_tables([pq.read_table(f) for f in g], promote_options="permissive")
            # hive columns are in the path, not in the files; keep files self-contained as written
            cols = [c for c in sort_cols if c in t.column_names]
            if cols and not _is_sorted(t, cols):
                t = t.take(pc.sort_indices(t, [(c, "ascending") for c in cols]))
            out = stage / f"compact-{int(now)}-{uuid.uuid4().hex[:8]}-{i}.parquet"
            pq.write_table(t, out, **{"compression": "zstd", "row_group_size": 1 << 20,
                                      **_write_options(table, t.schema)})
            res.rows += t.num_rows
            res.files_out += 1
            res.bytes_out += out.stat().st_size
            merged.update(f.name for f in g)
            res.files_in += len(g)
            res.bytes_in += sum(f.stat().st_size for f in g)
        with partition_lock(root, part):
            if any(part.glob(".part-*.tmp")):
                res.skipped.append(f"{part} (a flush is unfinished: run recovery first)")
                shutil.rmtree(stage)
                return False
            for f in part.glob("*.parquet"):
                if f.name not in merged:
                    os.link(f, stage / f.name)      # arrived after we listed, or not merged
            for name in merged:                     # fences: see the module doc
                (stage / name).touch()
            exchange(stage, part)
        swapped_at = time.monotonic()
        new_fences = [part / name for name in sorted(merged)]
        # `stage` now holds the old files: keep them for the grace period (see purge_trash)
        trash = root / "_state" / "trash" / f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.replace(stage, trash)
        res.partitions += 1
        if fences is not None:
            fences.extend(new_fences)
        else:
            time.sleep(max(0.0, swapped_at + fence_s - time.monotonic()))
            remove_fences(new_fences)
        return True
    except BaseException:
        if stage.exists() and not any(stage.glob("*.tmp")):
            shutil.rmtree(stage, ignore_errors=True)
        raise


def remove_fences(fences) -> int:
    """Unlink fences by path (a later swap may have linked one into a newer folder: same path)."""
    n = 0
    for f in fences:
        try:
            if os.stat(f).st_size == 0:
                os.unlink(f)
                n += 1
        except FileNotFoundError:
            pass
    return n


def stale_fences(root: Path, older_than_s: float, tables=TABLES) -> list[Path]:
    """Fences a crashed pass left behind (empty ``*.parquet`` files older than ``older_than_s``):
    every query of their table would fail until they are gone."""
    now = time.time()
    out = []
    for _, part in _partitions(Path(root), tables):
        for f in part.glob("*.parquet"):
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            if st.st_size == 0 and now - st.st_mtime >= older_than_s:
                out.append(f)
    return out


def purge_trash(root: Path, grace_s: float = 300.0) -> int:
    n = 0
    tdir = Path(root) / "_state" / "trash"
    for d in tdir.glob("*") if tdir.exists() else ():
        try:
            stamp = int(d.name.split("-", 1)[0])
        except ValueError:
            continue
        if time.time() - stamp >= grace_s:
            shutil.rmtree(d, ignore_errors=True)
            n += 1
    return n


def expire(root: Path, retention_days: float, today: date | None = None, res: CompactResult | None = None) -> list[str]:
    """Remove date partitions strictly older than the retention window (whole days, UTC).

    A partition ``date=D`` is removed when every row in it is older than ``retention_days``:
    ``D + 1 day <= today - retention_days``. Removal swaps the folder out under the partition lock,
    so writers never write into a folder being removed."""
    res = res or CompactResult()
    today = today or datetime.now(timezone.utc).date()
    cutoff = datetime.combine(today, datetime.min.time(), tzinfo=timezone.utc) - timedelta(days=retention_days)
    for table, part in list(_partitions(Path(root))):
        try:
            d = date.fromisoformat(part.name.split("=", 1)[1])
        except ValueError:
            continue
        end = datetime.combine(d + timedelta(days=1), datetime.min.time(), tzinfo=timezone.utc)
        if end <= cutoff:
            trash = Path(root) / "_state" / "trash" / f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
            trash.parent.mkdir(parents=True, exist_ok=True)
            with partition_lock(Path(root), part):
                os.replace(part, trash)
            res.expired.append(str(part.relative_to(root)))
    return res.expired


def run(root: str | Path, target_mb: float = 256, min_age_s: float = 30.0, retention_days: float | None = None,
        grace_s: float = 300.0, tables=TABLES, fence_s: float = FENCE_S) -> CompactResult:
    """One maintenance pass: retention, then compaction of every partition, then (``fence_s``
    after the last swap) removal of the pass's fences, then trash purge."""
    root = Path(root)
    res = CompactResult()
    left = stale_fences(root, max(fence_s, 1.0) * 4, tables)
    if left:
        log.warning("removing %d fences a crashed compaction left (queries of their tables failed)", len(left))
        remove_fences(left)
    if retention_days is not None:
        expire(root, retention_days, res=res)
    fences: list[Path] = []
    last_swap = 0.0
    for table, part in list(_partitions(root, tables)):
        if compact_partition(root, table, part, int(target_mb * (1 << 20)), min_age_s, res=res, fences=fences):
            last_swap = time.monotonic()
    if fences:
        time.sleep(max(0.0, last_swap + fence_s - time.monotonic()))
        res.fences = remove_fences(fences)
    purge_trash(root, grace_s)
    return res

"""The Parquet store: the system of record (docs/tables.md).

Layout: ``<root>/<table>/job=<job>/date=YYYY-MM-DD/part-<flush>-<n>.parquet``, zstd, rows sorted
by (time, rank) within a file so DuckDB can prune on row-group statistics.

Exactly-once in effect. A processor flushes everything it buffered in one *flush*:

1. every piece is written to a hidden temporary file (``.part-….parquet.tmp``: no view sees it);
2. an *intent* (``_state/intents/<flush>.json``) lists the renames and the new consumer positions;
3. the files are renamed into place, the per-partition *markers*
   (``_state/offsets/<topic>-<partition>.json``) are replaced atomically, the intent is deleted;
4. only then are offsets committed to Kafka.

A processor killed anywhere in this sequence is recovered by :meth:`ParquetStore.recover`, which
rolls every intent forward (the temporary files were complete before the intent was written), so
the markers always say exactly which messages are in the store. On (re)assignment a processor seeks
each partition to its marker and skips the messages the marker lists as done, so nothing is lost
and nothing is stored twice.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
from contextlib import ExitStack, contextmanager
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stepwatch import schema as wire
from stepwatch.catalog import SORT_COLUMNS, TABLES, TIME_COLUMN  # noqa: F401 - the one table catalog

log = logging.getLogger("stepwatch.store")


def rank_minutes(steps: pa.Table) -> pa.Table:
    """Per (job, rank, minute of t_end) partial sums of a batch of step rows (hash aggregation in
    Arrow's C++; no per-row Python)."""
    ns = steps.column("t_end").cast(pa.int64()).to_numpy(zero_copy_only=False)
    minute = pa.array(ns // 60_000_000_000 * 60_000_000_000).cast(wire.TS)
    busy = pc.subtract(steps.column("step_ms"), pc.fill_null(steps.column("comm_wait_ms"), 0.0))
    t = pa.table({"job": steps.column("job"), "rank": steps.column("rank"), "node": steps.column("node"),
                  "minute": minute, "step": steps.column("step"), "step_ms": steps.column("step_ms"),
                  "busy_ms": busy, "data_ms": steps.column("data_ms"), "compute_ms": steps.column("compute_ms"),
                  "comm_ms": steps.column("comm_ms"), "comm_wait_ms": steps.column("comm_wait_ms"),
                  "gc_ms": steps.column("gc_ms"), "gc_count": steps.column("gc_count")})
    sums = ["step_ms", "busy_ms", "data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms", "gc_count"]
    g = t.group_by(["job", "rank", "minute"]).aggregate(
        [("node", "min"), ("step", "count"), ("step", "min"), ("step", "max")] + [(c, "sum") for c in sums])
    cols = {"job": g.column("job"), "rank": g.column("rank"), "node": g.column("node_min"),
            "minute": g.column("minute"), "steps": g.column("step_count"), "step_min": g.column("step_min"),
            "step_max": g.column("step_max")}
    for c in sums:
        cols[c] = g.column(f"{c}_sum")
    out = pa.table(cols)
    return pa.Table.from_arrays([out.column(f.name).cast(f.type) for f in wire.RANK_MINUTES],
                                schema=wire.RANK_MINUTES)
SEED_JOB = "_seed"


@dataclass
class Marker:
    """Consumer position of one partition: every offset < ``next`` is done, plus ``done`` above it."""

    next: int = 0
    done: list[list[int]] | None = None   # sorted, disjoint inclusive ranges above next

    def is_done(self, offset: int) -> bool:
        if offset < self.next:
            return True
        for a, b in self.done or ():
            if a <= offset <= b:
                return True
        return False

    def to_json(self) -> dict:
        return {"next": self.next, "done": self.done or []}


def ranges(offsets: list[int]) -> list[list[int]]:
    """Sorted offsets -> inclusive ranges."""
    out: list[list[int]] = []
    for o in sorted(set(offsets)):
        if out and o == out[-1][1] + 1:
            out[-1][1] = o
        else:
            out.append([o, o])
    return out


def _atomic_write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def lock_path(root: Path, part_dir: Path) -> Path:
    rel = Path(part_dir).relative_to(root)
    return Path(root) / "_state" / "locks" / (str(rel).replace(os.sep, "__") + ".lock")


@contextmanager
def partition_lock(root: Path, part_dir: Path):
    """Exclusive lock of one partition folder, held by the writer from its first temporary file to
    its rename and by compaction/retention for their swap (see :mod:`stepwatch.storage.compact`)."""
    p = lock_path(Path(root), Path(part_dir))
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_options(table_name: str, schema: pa.Schema) -> dict:
    """Dictionary-encode strings only and keep statistics for the columns queries filter on:
    dictionary pages and min/max for every float column cost 3x the write time and gain nothing."""
    keys = set(wire.NATURAL_KEYS.get(table_name, ())) | {TIME_COLUMN[table_name], "step", "t", "t_start", "t_end",
                                                            "node", "kind", "status"}
    return {"use_dictionary": [f.name for f in schema if pa.types.is_string(f.type)],
            # host rows are read per node (dashboards, post-mortems): node-sorted row groups of 16k
            # rows let a node filter skip the rest of a file
            **({"row_group_size": 16384} if table_name == "host" else {}),
            "write_statistics": [f.name for f in schema if f.name in keys],
            # float columns: byte-stream-split lets zstd find the shared exponents (-10% size)
            "use_byte_stream_split": [f.name for f in schema if pa.types.is_floating(f.type)],
            "compression_level": 3}


def _is_sorted(t: pa.Table, cols: list[str]) -> bool:
    """Whether rows are already in lexicographic order of ``cols`` (producers usually send them so:
    then the sort, the costliest part of a flush, is skipped)."""
    if t.num_rows < 2:
        return True
    ok_so_far = np.ones(t.num_rows - 1, dtype=bool)   # rows still tied on all earlier columns
    for c in cols:
        col = t.column(c)
        if col.null_count:
            return False
        v = col.to_numpy()
        if v.dtype.kind not in "iufM":
            return False
        d = np.diff(v.astype(np.int64) if v.dtype.kind == "M" else v)
        if (ok_so_far & (d < 0)).any():
            return False
        ok_so_far &= d == 0
        if not ok_so_far.any():
            return True
    return True


class ParquetStore:
    def __init__(self, root: str | Path, compression: str = "zstd", fsync: bool = True,
                 row_group_size: int = 1 << 20):
        self.root = Path(root)
        self.compression = compression
        self.fsync = fsync
        self.row_group_size = row_group_size
        self.state = self.root / "_state"
        self.member = uuid.uuid4().hex[:8]
        self.cluster = "default"    # Kafka cluster id: markers are kept per cluster
        self._seq = 0
        self.bytes_written = 0
        self.files_written = 0

    # ------------------------------------------------------------------ layout
    def init(self) -> "ParquetStore":
        """Create the table folders and an empty seed file per table, so that the views (and a
        Grafana datasource started before any data arrived) always have something to read."""
        for t in TABLES:
            d = self.root / t / f"job={SEED_JOB}" / "date=1970-01-01"
            f = d / "seed.parquet"
            if not f.exists():
                d.mkdir(parents=True, exist_ok=True)
                schema = wire.SCHEMAS[t]
                pq.write_table(schema.empty_table(), d / ".seed.parquet.tmp", compression=self.compression)
                os.replace(d / ".seed.parquet.tmp", f)
        (self.state / "offsets").mkdir(parents=True, exist_ok=True)
        (self.state / "intents").mkdir(parents=True, exist_ok=True)
        return self

    def glob(self, table: str) -> str:
        return str(self.root / table / "*" / "*" / "*.parquet")

    # ------------------------------------------------------------------ markers
    def _marker_path(self, topic: str, partition: int) -> Path:
        # offsets only mean something on the cluster that assigned them
        return self.state / "offsets" / self.cluster / f"{topic}-{partition}.json"

    def load_marker(self, topic: str, partition: int) -> Marker | None:
        p = self._marker_path(topic, partition)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            return None
        return Marker(int(d["next"]), [list(r) for r in d.get("done") or []])

    # ------------------------------------------------------------------ writing
    def _split(self, table_name: str, t: pa.Table, received_ns: int) -> list[tuple[str, str, pa.Table]]:
        """Split rows by (job, date) and sort each piece; returns (job, date, piece).

        Integer work only: days since the epoch from the time column, job codes from a dictionary
        encoding; strings are formatted for the distinct (job, day) pairs alone."""
        n = t.num_rows
        tcol = TIME_COLUMN[table_name]
        day_ns = 86_400_000_000_000
        if tcol == "_received":
            day = np.full(n, received_ns // day_ns, dtype=np.int64)
        else:
            col = t.column(tcol)
            ns = col.cast(pa.int64()).to_numpy(zero_copy_only=False)
            if col.null_count:
                ns = np.where(np.isnan(ns), 0, ns)
            day = ns.astype(np.int64) // day_ns
        jobs = pc.fill_null(t.column("job"), "_unknown").combine_chunks().dictionary_encode()
        code = jobs.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        key = code * 1_000_000 + day
        uniq = np.unique(key)
        sort_cols = [c for c in SORT_COLUMNS[table_name] if c in t.column_names]
        out = []
        names = jobs.dictionary.to_pylist()
        for k in uniq:
            piece = t if len(uniq) == 1 else t.filter(pa.array(key == k))
            if sort_cols and not _is_sorted(piece, sort_cols):
                piece = piece.take(pc.sort_indices(piece, [(c, "ascending") for c in sort_cols]))
            job = names[int(k // 1_000_000)]
            date = time.strftime("%Y-%m-%d", time.gmtime(int(k % 1_000_000) * 86400))
            out.append((job, date, piece))
        return out

    def write_flush(self, tables: dict[str, list[pa.Table]], markers: dict[tuple[str, int], Marker],
                    received_ns: int | None = None) -> list[Path]:
        """Durably store one flush (see module doc). ``tables`` maps table name to row batches."""
        received_ns = received_ns or time.time_ns()
        self._seq += 1
        flush_id = f"{int(time.time())}-{self.member}-{self._seq:06d}"
        renames: list[tuple[str, str]] = []
        pieces = []
        tables = dict(tables)
        steps = [p for p in tables.get("steps", ()) if p.num_rows]
        if steps and "rank_minutes" not in tables:
            tables["rank_minutes"] = [rank_minutes(pa.concat_tables(steps, promote_options="permissive")
                                                   if len(steps) > 1 else steps[0])]
        for name, parts in tables.items():
            parts = [p for p in parts if p.num_rows]
            if not parts:
                continue
            t = pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]
            for job, date, piece in self._split(name, t, received_ns):
                pieces.append((name, self.root / name / f"job={job}" / f"date={date}", piece))
        locks = ExitStack()
        for d in sorted({str(d) for _, d, _ in pieces}):
            Path(d).mkdir(parents=True, exist_ok=True)
            locks.enter_context(partition_lock(self.root, Path(d)))
        with locks:
            for i, (name, d, piece) in enumerate(pieces):
                d.mkdir(parents=True, exist_ok=True)     # retention may have removed it before we locked
                final = d / f"part-{flush_id}-{i}.parquet"
                tmp = d / f".part-{flush_id}-{i}.parquet.tmp"
                pq.write_table(piece, tmp, **{"compression": self.compression, "row_group_size": self.row_group_size,
                                              **_write_options(name, piece.schema)})
                if self.fsync:
                    fd = os.open(tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                self.bytes_written += tmp.stat().st_size
                self.files_written += 1
                renames.append((str(tmp), str(final)))
            self._commit(flush_id, renames, markers)
        return [Path(f) for _, f in renames]

    def _commit(self, flush_id: str, renames, markers) -> None:
        intent = {"flush": flush_id, "renames": renames, "cluster": self.cluster,
                  "markers": [[t, p, m.to_json()] for (t, p), m in markers.items()]}
        ipath = self.state / "intents" / f"{flush_id}.json"
        _atomic_write_json(ipath, intent)
        if os.environ.get("STEPWATCH_FAILPOINT") == "after-intent":   # crash tests: die mid-flush
            os._exit(137)
        self._apply(intent)
        ipath.unlink(missing_ok=True)

    def _apply(self, intent: dict) -> None:
        for tmp, final in intent["renames"]:
            try:
                os.replace(tmp, final)
            except FileNotFoundError:
                if not os.path.exists(final):
                    raise
        saved, self.cluster = self.cluster, intent.get("cluster", self.cluster)
        try:
            for topic, part, m in intent["markers"]:
                cur = self.load_marker(topic, part)
                if cur is None or cur.next <= m["next"]:
                    _atomic_write_json(self._marker_path(topic, part), m)
        finally:
            self.cluster = saved

    def recover(self, stale_tmp_s: float = 600.0) -> int:
        """Roll forward interrupted flushes; remove temporary files older than ``stale_tmp_s``
        that no intent names (a writer died before its intent). Returns intents recovered."""
        idir = self.state / "intents"
        n = 0
        for ipath in sorted(idir.glob("*.json")) if idir.exists() else ():
            try:
                intent = json.loads(ipath.read_text())
            except (ValueError, FileNotFoundError):
                continue
            with ExitStack() as locks:
                for d in sorted({str(Path(final).parent) for _, final in intent["renames"]}):
                    if Path(d).exists():
                        locks.enter_context(partition_lock(self.root, Path(d)))
                self._apply(intent)
            ipath.unlink(missing_ok=True)
            n += 1
            log.warning("recovered interrupted flush %s (%d files)", intent["flush"], len(intent["renames"]))
        now = time.time()
        for tmp in self.root.glob("*/*/*/.part-*.parquet.tmp"):
            try:
                if now - tmp.stat().st_mtime > stale_tmp_s:
                    tmp.unlink()
            except FileNotFoundError:
                pass
        return n

"""The Parquet store: the system of record (DESIGN §7).

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

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stepwatch import schema as wire

log = logging.getLogger("stepwatch.store")

#: The event-time column that gives each table's date partition and sort order.
TIME_COLUMN = {"steps": "t_end", "host": "t", "gc": "t", "alerts": "t_detected", "deadletter": "t_received",
               "topology": "_received", "comm": "_received"}
SORT_COLUMNS = {"steps": ["step", "rank"], "host": ["t", "node"], "gc": ["t", "rank"], "comm": ["step", "rank"],
                "topology": ["rank"], "alerts": ["t_detected"], "deadletter": ["t_received"]}
TABLES = ("steps", "topology", "host", "gc", "comm", "alerts", "deadletter")
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
        """Split rows by (job, date) and sort each piece; returns (job, date, piece)."""
        tcol = TIME_COLUMN[table_name]
        if tcol == "_received":
            dates = pa.array(np.full(t.num_rows, time.strftime("%Y-%m-%d", time.gmtime(received_ns / 1e9))))
        else:
            col = t.column(tcol)
            dates = pc.fill_null(pc.strftime(col, format="%Y-%m-%d"), "1970-01-01")
        jobs = pc.fill_null(t.column("job"), "_unknown")
        key = pc.binary_join_element_wise(jobs, dates, "\x00")
        uniq = pc.unique(key)
        sort_cols = [c for c in SORT_COLUMNS[table_name] if c in t.column_names]
        out = []
        for k in uniq.to_pylist():
            piece = t.filter(pc.equal(key, k)) if len(uniq) > 1 else t
            if sort_cols:
                piece = piece.take(pc.sort_indices(piece, [(c, "ascending") for c in sort_cols]))
            job, date = k.split("\x00")
            out.append((job, date, piece))
        return out

    def write_flush(self, tables: dict[str, list[pa.Table]], markers: dict[tuple[str, int], Marker],
                    received_ns: int | None = None) -> list[Path]:
        """Durably store one flush (see module doc). ``tables`` maps table name to row batches."""
        received_ns = received_ns or time.time_ns()
        self._seq += 1
        flush_id = f"{int(time.time())}-{self.member}-{self._seq:06d}"
        renames: list[tuple[str, str]] = []
        for name, parts in tables.items():
            parts = [p for p in parts if p.num_rows]
            if not parts:
                continue
            t = pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]
            for i, (job, date, piece) in enumerate(self._split(name, t, received_ns)):
                d = self.root / name / f"job={job}" / f"date={date}"
                d.mkdir(parents=True, exist_ok=True)
                final = d / f"part-{flush_id}-{i}.parquet"
                tmp = d / f".part-{flush_id}-{i}.parquet.tmp"
                pq.write_table(piece, tmp, compression=self.compression, row_group_size=self.row_group_size)
                if self.fsync:
                    fd = os.open(tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                self.bytes_written += tmp.stat().st_size
                self.files_written += 1
                renames.append((str(tmp), str(final)))
        intent = {"flush": flush_id, "renames": renames, "cluster": self.cluster,
                  "markers": [[t, p, m.to_json()] for (t, p), m in markers.items()]}
        ipath = self.state / "intents" / f"{flush_id}.json"
        _atomic_write_json(ipath, intent)
        if os.environ.get("STEPWATCH_FAILPOINT") == "after-intent":   # crash tests: die mid-flush
            os._exit(137)
        self._apply(intent)
        ipath.unlink()
        return [Path(f) for _, f in renames]

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
            self._apply(intent)
            try:
                ipath.unlink()
            except FileNotFoundError:
                pass
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

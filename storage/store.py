"""The store: a DuckLake, the system of record (docs/tables.md).

Every table of :mod:`stepwatch.wire.tables` is a DuckLake table of the same name, plus a ``date`` column
(UTC day of the table's event time, see :data:`TIME_COLUMN`) and partitioned by ``date`` only:
data files land under ``<data path>/main/<table>/date=<day>/`` (zstd Parquet, rows sorted within a
file as :data:`SORT_COLUMNS` says, the job first), one file per table per flush however many jobs it
holds; the catalog's per-file min/max statistics find a job's files. DuckLake writes the files
(``INSERT``), except those of :data:`DIRECT_TABLES`: the store writes them and adds them with
``ducklake_add_data_files`` in the flush's transaction. Times are stored as
``TIMESTAMPTZ`` (microseconds). The table ``jobs`` names every job stored.

Exactly-once. A processor flushes everything it buffered in **one DuckLake transaction**: the row
batches of every table *and* the consumed Kafka positions (table ``kafka_offsets``: per Kafka
cluster, topic and partition the next offset, the done ranges above it, and the consumer-group
generation of the writer). Either all of it is in the catalog's next snapshot or none of it is; a
processor killed at any moment leaves at most unreferenced Parquet files (removed by ``stepwatch
compact``). On assignment a processor *claims* its partitions (writes its generation into their
rows) and seeks to the stored positions.

Fencing. A commit (or claim) whose generation is older than the stored one raises :class:`Fenced`
and changes nothing. Two commits touching the same partition row cannot both succeed: each replaces
that row (a DuckLake delete + insert), DuckLake rejects the second commit as a conflict, the loser
retries and then sees the newer generation. A partition's first row is created together with an
update of one sentinel row, so two first commits of a partition conflict too. Kafka's own offset
commit stays a convenience.

Conflicts (another transaction committed first: DuckLake's "Transaction conflict", a busy SQLite
catalog) are retried with :mod:`tenacity` (:func:`retry_conflicts`).
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from stepwatch.wire import tables as wire
from stepwatch.wire import catalog
from stepwatch.storage.lake import Lake, lake_of, lit

log = logging.getLogger("stepwatch.store")

#: The event-time column that gives each table's date partition (the table catalog's).
TIME_COLUMN = catalog.TIME_COLUMN
#: Row order within a data file (the catalog's: the job first, so a job's rows are contiguous and
#: row-group statistics skip other jobs)
SORT_COLUMNS = catalog.SORT_COLUMNS
#: Lake-level partitioning of every table: the UTC day only. A flush writes one data file per table
#: (per day it spans), however many jobs it holds; DuckLake finds a job's files by the per-file
#: min/max statistics of ``job`` and the event time it keeps in the catalog. (Partitioning by job
#: wrote a file per job per table per flush: a flush of 1,000 new jobs took 95 s.)
PARTITION_BY = ("date",)
TABLES = catalog.TABLES
OFFSETS = "kafka_offsets"
OFFSETS_DDL = (f"CREATE TABLE IF NOT EXISTS lake.{OFFSETS} (cluster VARCHAR, topic VARCHAR, \"partition\" INTEGER, "
               "next BIGINT, done VARCHAR, generation BIGINT, member VARCHAR, group_id VARCHAR, committed_at TIMESTAMPTZ)")
#: Every job the lake holds rows of (a row per job per writer start; read by :meth:`LakeStore.has_history`)
JOBS = "jobs"
JOBS_DDL = f"CREATE TABLE IF NOT EXISTS lake.{JOBS} (job VARCHAR, first_stored TIMESTAMPTZ)"
#: Parquet settings of the lake's data files (DuckLake options, stored in the catalog)
LAKE_OPTIONS = {"parquet_compression": "zstd", "parquet_compression_level": "3", "parquet_version": "2",
                "parquet_row_group_size": str(1 << 20)}
#: Tables whose flushes the store writes itself (one file per day the batch spans, in DuckLake's
#: folder ``date=<day>/``, without the ``date`` column: DuckLake reads it from the folder) and hands
#: to DuckLake with ``ducklake_add_data_files`` in the flush's transaction. On a local data path
#: Arrow's Parquet writer writes them with the encodings of :func:`_encodings`: for ``steps`` 0.25 CPU-s
#: per million rows where DuckDB's ``COPY`` of the same batch took 0.70-0.81 (DuckLake's own
#: partitioned ``INSERT``, which tried a dictionary on every float column, 0.75 plus its buffering),
#: at 12.1 B a row instead of 11.0 (Arrow's default encodings: 15.7). Elsewhere (object stores)
#: DuckDB's ``COPY`` with the options given here. On a SQLite catalog only (see
#: :meth:`LakeStore.write_flush`). ``host`` stays with DuckLake's ``INSERT``: Arrow's writer took 0.36
#: CPU-s per 122,880 host rows where ``COPY`` took 0.46-0.60, but its file was 34 % larger (90 B a host
#: row, 67; DuckDB picks dictionary, delta or byte-stream-split per column, nested ones included).
DIRECT_TABLES = {"steps": "DICTIONARY_SIZE_LIMIT 1"}
#: Columns the lake stores in a smaller type than the wire's: the step durations (ms) as FLOAT
#: (float32: 7 significant digits, 8 ns at 100 ms, 0.25 ms at an hour). A duration measured with a
#: nanosecond clock has a full float64 mantissa that no Parquet encoding compresses (BYTE_STREAM_SPLIT
#: + zstd kept 6.2 B a row of each: 26 B a step row, 25 of them these columns); as FLOAT a step row
#: takes 11 B. Only tables the store creates get them; a lake made before keeps its DOUBLE columns
#: (:attr:`LakeStore._narrow` holds what the lake has). The wire, the detectors, ``rank_minutes``
#: and ``step_summary`` keep float64. (A duration beyond FLOAT's range, 3.4e38 ms, which the wire's
#: checks let through as finite, is stored as infinity.)
STORED_TYPES = {"steps": {c: pa.float32() for c in (
    "step_ms", "data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms", "cpu_ms", "cpu_wait_ms",
    "comm_total_ms", "comm_exposed_ms")}}


def stored_schema(name: str) -> pa.Schema:
    """The wire schema of table ``name`` with the lake's :data:`STORED_TYPES`."""
    schema, narrow = wire.SCHEMAS[name], STORED_TYPES.get(name, {})
    return pa.schema([f.with_type(narrow[f.name]) if f.name in narrow else f for f in schema])


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


def step_summary(steps: pa.Table) -> pa.Table:
    """Per (job, step) aggregates over the ranks of a batch of step rows (Arrow's hash aggregation)."""
    g = steps.group_by(["job", "step"]).aggregate(
        [("rank", "count"), ("t_start", "min"), ("t_end", "max"), ("step_ms", "min_max"), ("step_ms", "sum")])
    mm = g.column("step_ms_min_max")
    out = {"job": g.column("job"), "step": g.column("step"), "ranks": g.column("rank_count"),
           "t_start": g.column("t_start_min"), "t_end": g.column("t_end_max"),
           "step_ms_min": pc.struct_field(mm, "min"), "step_ms_max": pc.struct_field(mm, "max"),
           "step_ms_sum": g.column("step_ms_sum")}
    return pa.Table.from_arrays([out[f.name].cast(f.type) for f in wire.STEP_SUMMARY], schema=wire.STEP_SUMMARY)


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


class Fenced(RuntimeError):
    """A commit or claim from a consumer-group generation older than the one stored for a partition."""

    def __init__(self, partitions: dict, generation):
        self.partitions = partitions            # (topic, partition) -> stored generation
        self.generation = generation
        super().__init__(f"fenced: generation {generation} is older than the stored one for "
                         + ", ".join(f"{t}[{p}] (generation {g})" for (t, p), g in sorted(partitions.items())))


def is_conflict(e: BaseException) -> bool:
    """Another transaction committed first: retry the whole transaction."""
    if not isinstance(e, duckdb.Error):
        return False
    m = str(e)
    return ("Transaction conflict" in m or "database is locked" in m or "database table is locked" in m
            or "could not serialize" in m or "duplicate key value" in m or "maximum retry count" in m)


def retry_conflicts(attempts: int = 12, max_wait_s: float = 2.0) -> Retrying:
    """The retry policy for lake transactions: conflicts only, jittered exponential wait."""
    return Retrying(retry=retry_if_exception(is_conflict), stop=stop_after_attempt(attempts),
                    wait=wait_random_exponential(multiplier=0.02, max=max_wait_s), reraise=True)


def _sort_codes(col) -> np.ndarray | None:
    """Integer codes of a sort column in its order (strings: rank of their value among the batch's
    distinct values), or None where the fast path does not apply (nulls, other types)."""
    if col.null_count:
        return None
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        d = pc.dictionary_encode(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
        order = np.argsort(np.asarray(d.dictionary.to_pylist(), dtype=object))
        rank = np.empty(len(order), np.int64)
        rank[order] = np.arange(len(order))
        return rank[d.indices.to_numpy()]
    if pa.types.is_integer(col.type) or pa.types.is_timestamp(col.type):
        return col.cast(pa.int64()).to_numpy()
    return None


#: batches up to this many rows are written as one chunk, so their file keeps the sort order exactly
_ONE_SCAN_ROWS = 1 << 17


def _sort_order(t: pa.Table, cols: list[str]) -> np.ndarray | pa.Table | None:
    """Row order that sorts ``t`` by ``cols``, or None when it is sorted already (producers send runs
    in order: a stable sort of one integer key then costs little; Arrow's multi-key sort with a
    string key cost ~20x more). When ``t``'s chunks (one a message) are each sorted and their key
    ranges do not overlap (messages of several partitions interleaved), the table with its chunks
    in order instead: no row is copied (a ``take`` of every column cost ~3x the sort)."""
    if t.num_rows < 2:
        return None
    codes = [_sort_codes(t.column(c)) for c in cols]
    if any(c is None for c in codes):
        return np.asarray(pc.sort_indices(t, [(c, "ascending") for c in cols]))
    key, span = None, 1
    for c in codes:
        lo, hi = int(c.min()), int(c.max())
        if hi == lo:
            continue
        rng = hi - lo + 1
        if span * rng >= 1 << 62:          # does not fit one int64 key: sort by all of them
            order = np.lexsort(codes[::-1])
            return None if (order == np.arange(len(order))).all() else order
        key = (c - lo) if key is None else key * rng + (c - lo)
        span *= rng
    if key is None or (np.diff(key) >= 0).all():
        return None
    return _chunks_in_order(t, key) or np.argsort(key, kind="stable")


def _chunks_in_order(t: pa.Table, key: np.ndarray) -> pa.Table | None:
    """``t`` with its chunks reordered so ``key`` is non-decreasing, or None when that takes more than
    a reordering of chunks (a chunk out of order inside, two chunks' key ranges overlapping)."""
    if not t.num_columns or t.column(0).num_chunks < 2:
        return None
    lens = [len(c) for c in t.column(0).chunks]
    if any([len(c) for c in t.column(i).chunks] != lens for i in range(1, t.num_columns)):
        return None
    ends = np.cumsum(lens)
    starts = ends - np.asarray(lens)
    drop = np.diff(key) < 0
    drop[starts[1:] - 1] = False        # a drop of the key only where a chunk starts: each chunk is a sorted run
    if drop.any():
        return None
    first, last = key[starts], key[ends - 1]
    order = np.argsort(first, kind="stable")
    if (first[order][1:] < last[order][:-1]).any():
        return None
    batches = t.to_batches()
    if len(batches) != len(lens):
        return None
    return pa.Table.from_batches([batches[i] for i in order], schema=t.schema)


def _encodings(schema: pa.Schema) -> tuple[list[str], dict[str, str]]:
    """Arrow Parquet writer settings for a directly written table: the string columns dictionary-
    encoded (job, node: a few distinct values), integer and time columns delta-encoded (ranks, steps,
    timestamps: runs and small differences), float columns byte-stream-split (durations: random-looking
    mantissas a dictionary never shrinks, whose exponent bytes zstd then packs). Nested columns keep
    Arrow's default (plain)."""
    dictionary, encoding = [], {}
    for f in schema:
        if pa.types.is_string(f.type) or pa.types.is_large_string(f.type):
            dictionary.append(f.name)
        elif pa.types.is_integer(f.type) or pa.types.is_timestamp(f.type):
            encoding[f.name] = "DELTA_BINARY_PACKED"
        elif pa.types.is_float32(f.type) or pa.types.is_float64(f.type):
            encoding[f.name] = "BYTE_STREAM_SPLIT"
    return dictionary, encoding


def _threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


class LakeStore:
    """Writer side of the lake. ``root`` is a data dir (embedded default, or with the
    ``STEPWATCH_LAKE_*`` environment) or a :class:`~stepwatch.storage.lake.Lake`."""

    def __init__(self, root: str | Path | Lake, compression: str = "zstd", fsync: bool = True,
                 row_group_size: int = 1 << 20, threads: int | None = None):
        self.lake = lake_of(root)
        self.fsync = fsync      # directly written data files are fsynced before the commit that adds them
        self.threads = threads or _threads()
        self.cluster = "default"    # Kafka cluster id: offsets are kept per cluster
        self.group = ""
        self.member = ""
        self.takeover_s = 300.0     # a newer generation idle this long: the group was reset (see claim)
        self._con: duckdb.DuckDBPyConnection | None = None
        self._columns: dict[str, list[str]] = {}
        self._narrow: dict[str, set[str]] = {}  # table -> its columns stored as FLOAT (STORED_TYPES), as the lake has them
        self._paths: dict[str, str] = {}        # table -> folder of its data files (_table_path)
        self._jobs: set[str] | None = None     # jobs the lake holds rows of (table ``jobs``), as last read
        self._jobs_read = 0.0

    @property
    def root(self) -> Lake:
        """What :func:`stepwatch.storage.views.connect` takes to read this store."""
        return self.lake

    # ------------------------------------------------------------------ layout
    def connection(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            self._con = self.lake.connect(threads=self.threads)
        return self._con

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None

    def init(self) -> "LakeStore":
        """Create the lake's tables (or add columns the schema gained); idempotent, safe when several
        processors start at once (a losing CREATE is a conflict, retried)."""
        con = self.connection()
        for attempt in retry_conflicts():
            with attempt, self.lake.write_lock():
                self._init(con)
        return self

    def _init(self, con) -> None:
        rows = con.execute(
            "SELECT table_name, list(column_name), list(data_type) FROM duckdb_columns() WHERE database_name = 'lake' "
            "AND schema_name = 'main' GROUP BY table_name").fetchall()
        have = {r[0]: r[1] for r in rows}
        self._narrow = {r[0]: {c for c, ty in zip(r[1], r[2]) if ty == "FLOAT" and c in STORED_TYPES.get(r[0], {})}
                        for r in rows}
        if all(t in have for t in TABLES + (OFFSETS, JOBS)) and all(
                set(wire.SCHEMAS[t].names) <= set(have[t]) for t in TABLES):
            self._columns = {t: have[t] for t in TABLES}
            return
        con.execute("BEGIN")
        try:
            opts = dict(con.execute("SELECT option_name, value FROM lake.options()").fetchall())
            for k, v in LAKE_OPTIONS.items():
                if opts.get(k) != v:
                    con.execute(f"CALL lake.set_option({lit(k)}, {lit(v)})")
            for t in TABLES:
                if t not in have:
                    con.register("_empty", stored_schema(t).empty_table())
                    con.execute(f"CREATE TABLE lake.{t} AS SELECT *, NULL::DATE AS date FROM _empty LIMIT 0")
                    con.unregister("_empty")
                    con.execute(f"ALTER TABLE lake.{t} SET PARTITIONED BY ({', '.join(PARTITION_BY)})")
                else:
                    con.register("_empty", wire.SCHEMAS[t].empty_table())
                    types = dict((r[0], r[1]) for r in con.execute("DESCRIBE SELECT * FROM _empty").fetchall())
                    con.unregister("_empty")
                    for c in wire.SCHEMAS[t].names:
                        if c not in have[t]:       # the wire schema gained a column
                            con.execute(f'ALTER TABLE lake.{t} ADD COLUMN "{c}" {types[c]}')
            if OFFSETS not in have:
                con.execute(OFFSETS_DDL)
                con.execute(f"INSERT INTO lake.{OFFSETS} VALUES ('', '', -1, -1, '[]', -1, '', '', now())")
            if JOBS not in have:
                con.execute(JOBS_DDL)
            con.execute("COMMIT")
        except BaseException:
            _rollback(con)
            raise
        self._columns = {}
        for t in TABLES:
            if t not in have:
                self._narrow[t] = set(STORED_TYPES.get(t, ()))

    # ------------------------------------------------------------------ offsets
    def _offsets(self, con) -> dict[tuple[str, int], tuple]:
        rows = con.execute(f'SELECT topic, "partition", next, done, generation, committed_at FROM lake.{OFFSETS} '
                           f'WHERE cluster = ? AND "partition" >= 0', [self.cluster]).fetchall()
        return {(t, int(p)): (n, d, g, ts) for t, p, n, d, g, ts in rows}

    def load_marker(self, topic: str, partition: int) -> Marker | None:
        cur = self._offsets(self.connection()).get((topic, partition))
        if cur is None or cur[0] < 0:
            return None
        return Marker(int(cur[0]), json.loads(cur[1] or "[]"))

    def _write_offsets(self, con, cur: dict, rows: dict[tuple[str, int], tuple[int, list, int]]) -> None:
        """Replace the rows of ``rows`` ((topic, partition) -> (next, done, generation)) inside the
        caller's transaction."""
        old = [k for k in rows if k in cur]
        if old:
            keys = [f"{t}\x00{p}" for t, p in old]
            con.execute(f"DELETE FROM lake.{OFFSETS} WHERE cluster = ? AND list_contains(?, "
                        f"topic || chr(0) || CAST(\"partition\" AS VARCHAR))", [self.cluster, keys])
        if len(old) < len(rows):    # a partition's first row: serialize creations on the sentinel row
            con.execute(f'UPDATE lake.{OFFSETS} SET committed_at = now() WHERE "partition" = -1')
        ks = list(rows)
        t = pa.table({"cluster": [self.cluster] * len(ks), "topic": [k[0] for k in ks],
                      "partition": pa.array([k[1] for k in ks], pa.int32()),
                      "next": pa.array([rows[k][0] for k in ks], pa.int64()),
                      "done": [json.dumps(rows[k][1] or []) for k in ks],
                      "generation": pa.array([rows[k][2] for k in ks], pa.int64()),
                      "member": [self.member] * len(ks), "group_id": [self.group] * len(ks)})
        con.register("_offs", t)
        con.execute(f"INSERT INTO lake.{OFFSETS} SELECT *, now() FROM _offs")
        con.unregister("_offs")

    def _check(self, cur: dict, keys, generation, claiming: bool = False) -> None:
        if generation is None:
            return
        newer = {k: cur[k][2] for k in keys if k in cur and cur[k][2] is not None and cur[k][2] > generation}
        if claiming and newer:
            # only a reset consumer group (generations start again) leaves a newer generation idle
            # for long: the coordinator just gave us these partitions, so take them over
            now = time.time()
            idle = {k for k in newer if cur[k][3] is not None and now - cur[k][3].timestamp() > self.takeover_s}
            for k in idle:
                log.warning("taking over %s[%d]: stored generation %s idle for over %.0fs (consumer group reset?)",
                            k[0], k[1], newer[k], self.takeover_s)
            newer = {k: g for k, g in newer.items() if k not in idle}
        if newer:
            raise Fenced(newer, generation)

    def claim(self, partitions, generation: int | None) -> dict[tuple[str, int], Marker | None]:
        """Take ``partitions`` ((topic, partition) pairs) for ``generation``: one transaction that
        writes the generation into their rows (so a processor of an older generation can no longer
        commit them) and returns their stored positions. Raises :class:`Fenced` when a newer
        generation holds one of them."""
        keys = [(t, int(p)) for t, p in partitions]
        if generation is None:
            cur = self._offsets(self.connection())
            return {k: self.load_marker(*k) for k in keys} if cur else {k: None for k in keys}
        con = self.connection()
        for attempt in retry_conflicts():
            with attempt, self.lake.write_lock():
                con.execute("BEGIN")
                try:
                    cur = self._offsets(con)
                    self._check(cur, keys, generation, claiming=True)
                    rows = {k: (cur[k][0], json.loads(cur[k][1] or "[]"), generation) if k in cur else
                            (-1, [], generation) for k in keys}
                    if keys:
                        self._write_offsets(con, cur, rows)
                    con.execute("COMMIT")
                except BaseException:
                    _rollback(con)
                    raise
        return {k: (Marker(int(rows[k][0]), rows[k][1]) if rows[k][0] >= 0 else None) for k in keys}

    # ------------------------------------------------------------------ writing
    def _prepare(self, name: str, t: pa.Table, received_ns: int) -> pa.Table:
        """The batch as the lake stores it: in sort order, times in microseconds, plus its ``date``
        column (UTC day of the event time; integer arithmetic here, a DuckDB cast costs 10x more)."""
        sort_cols = [c for c in SORT_COLUMNS[name] if c in t.column_names]
        order = _sort_order(t, sort_cols) if sort_cols else None
        if isinstance(order, pa.Table):                 # its chunks in order: sorted, nothing copied
            t, order = order, None
        if order is not None:
            if t.num_columns and t.column(0).num_chunks > 8:
                t = t.combine_chunks()      # take() over many small chunks costs several times more
            t = t.take(pa.array(order))
        elif t.num_columns and t.num_rows <= _ONE_SCAN_ROWS and t.column(0).num_chunks > 1:
            # already in order but in several chunks: DuckDB scans chunks on several threads and its
            # partitioned write keeps no order across them (a flush of jobs a then b was stored b first
            # under load); a small batch goes as one chunk, one scan. A large one keeps its chunks, each
            # a sorted run, for the parallel write.
            t = t.combine_chunks()
        tcol = TIME_COLUMN[name]
        day_ns = 86_400_000_000_000
        if tcol == "_received":
            day = pa.array(np.full(t.num_rows, received_ns // day_ns, dtype=np.int32)).cast(pa.date32())
        else:
            col = t.column(tcol)
            ns = col.cast(pa.int64()).to_numpy(zero_copy_only=False)
            if col.null_count:
                ns = np.where(np.isnan(ns), 0, ns)
            day = pa.array((ns.astype(np.int64) // day_ns).astype(np.int32)).cast(pa.date32())
        # a column of the table's schema that no row of the batch has (cpu_ms of a producer that does not
        # measure it) is left out: INSERT BY NAME stores NULL for it without scanning it (~8% of a steps
        # INSERT whose 5 optional columns are all null)
        known = wire.SCHEMAS[name].names if name in wire.SCHEMAS else ()
        names, cols = [], []
        narrow = self._narrow.get(name, ())
        for n, c in zip(t.column_names, t.columns):
            if c.null_count == len(c) and n in known:
                continue
            names.append(n)
            if pa.types.is_timestamp(c.type):
                c = c.cast(pa.timestamp("us", tz="UTC"), safe=False)
            elif n in narrow and pa.types.is_floating(c.type):
                c = c.cast(pa.float32(), safe=False)
            cols.append(c)
        return pa.Table.from_arrays(cols + [day], names=names + ["date"])

    def write_flush(self, tables: dict[str, list[pa.Table]], markers: dict[tuple[str, int], Marker],
                    received_ns: int | None = None, generation: int | None = None) -> int:
        """Commit one flush: the row batches of ``tables`` (name -> batches) and the positions
        ``markers`` in one transaction (see module doc). Returns the rows written. Raises
        :class:`Fenced` (and writes nothing) when ``generation`` is older than a stored one."""
        received_ns = received_ns or time.time_ns()
        tables = dict(tables)
        steps = [p for p in tables.get("steps", ()) if p.num_rows]
        if steps and ("rank_minutes" not in tables or "step_summary" not in tables):
            all_steps = pa.concat_tables(steps, promote_options="permissive") if len(steps) > 1 else steps[0]
            if "rank_minutes" not in tables:
                tables["rank_minutes"] = [rank_minutes(all_steps)]
            if "step_summary" not in tables:
                tables["step_summary"] = [step_summary(all_steps)]
        batches = []
        for name, parts in tables.items():
            parts = [p for p in parts if p.num_rows]
            if parts:
                t = pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]
                batches.append((name, self._prepare(name, t, received_ns)))
        if not batches and not markers:
            return 0
        con = self.connection()
        # the tables written directly: files first, outside the lock (a conflict's retry adds them again).
        # SQLite catalog only: on PostgreSQL, where writers commit concurrently and DuckLake retries a
        # commit with fresh ids, readers then failed on the added files ("Unknown name map id")
        direct = self.lake.kind == "sqlite"
        files = {name: self._write_files(con, name, t) for name, t in batches if direct and name in DIRECT_TABLES}
        keys = list(markers)
        jobs: set[str] = set()
        for _, t in batches:
            if "job" in t.column_names:
                jobs.update(j for j in pc.unique(t.column("job")).to_pylist() if j is not None)
        new_jobs: set[str] = set()
        for attempt in retry_conflicts():
            with attempt, self.lake.write_lock():
                con.execute("BEGIN")
                try:
                    cur = self._offsets(con) if keys else {}
                    self._check(cur, keys, generation)
                    for name, t in batches:       # one INSERT per table: one data file per table (per day)
                        con.register("_batch", t)
                        self._add_columns(con, name, t.column_names)
                        if name in files:
                            for path in files[name]:
                                con.execute("CALL ducklake_add_data_files('lake', ?, ?, hive_partitioning => true, "
                                            "allow_missing => true)", [name, path])
                        else:
                            con.execute(f"INSERT INTO lake.{name} BY NAME SELECT * FROM _batch")
                        con.unregister("_batch")
                    new_jobs = jobs - self._known_jobs(con)
                    if new_jobs:
                        con.register("_jobs", pa.table({"job": sorted(new_jobs)}))
                        con.execute(f"INSERT INTO lake.{JOBS} SELECT job, now() FROM _jobs")
                        con.unregister("_jobs")
                    if keys:
                        gen = {k: generation if generation is not None else (cur[k][2] if k in cur else -1)
                               for k in keys}
                        self._write_offsets(con, cur, {k: (m.next, m.done, gen[k]) for k, m in markers.items()})
                    if os.environ.get("STEPWATCH_FAILPOINT") == "before-commit":   # crash tests
                        os._exit(137)
                    con.execute("COMMIT")
                except BaseException:
                    _rollback(con)
                    raise
        self._jobs |= new_jobs
        return sum(t.num_rows for _, t in batches)

    def _table_path(self, con, name: str) -> str:
        """Where DuckLake keeps ``name``'s data files: the data path, the schema's and the table's
        folders (as the catalog has them; DuckLake's default when it cannot be read)."""
        path = self._paths.get(name)
        if path is None:
            path = f"{self.lake.data_path}main/{name}/"
            try:
                row = con.execute(
                    f"SELECT s.path, s.path_is_relative, t.path, t.path_is_relative "
                    f"FROM __ducklake_metadata_lake.ducklake_table t JOIN __ducklake_metadata_lake.ducklake_schema s "
                    f"USING (schema_id) WHERE t.table_name = ? AND s.schema_name = 'main' "
                    f"AND t.end_snapshot IS NULL AND s.end_snapshot IS NULL", [name]).fetchone()
            except duckdb.Error:
                row = None
            if row and row[0] and row[2]:
                spath = (self.lake.data_path + row[0]) if row[1] else row[0]
                path = (spath + row[2]) if row[3] else row[2]
            self._paths[name] = path
        return path

    def _write_files(self, con, name: str, t: pa.Table) -> list[str]:
        """``t`` (a prepared batch) as Parquet files in ``name``'s folder, one per ``date`` it holds
        (``date=<day>/``, the column itself left out), with the lake's Parquet settings and the
        table's :data:`DIRECT_TABLES` options. Returns their paths. A file no commit adds (a flush
        killed or fenced after this) is an orphan ``stepwatch compact`` deletes."""
        days = t.column("date")
        lo, hi = pc.min_max(days).values()
        parts = [(lo.as_py(), t)] if lo == hi else [
            (d, t.filter(pc.equal(days, pa.scalar(d, pa.date32())))) for d in pc.unique(days).to_pylist()]
        base = self._table_path(con, name)
        if self.lake.local_data:
            return self._write_arrow(base, parts)
        opts = (f"FORMAT parquet, COMPRESSION {LAKE_OPTIONS['parquet_compression']}, "
                f"COMPRESSION_LEVEL {LAKE_OPTIONS['parquet_compression_level']}, "
                f"PARQUET_VERSION v{LAKE_OPTIONS['parquet_version']}, "
                f"ROW_GROUP_SIZE {LAKE_OPTIONS['parquet_row_group_size']}")
        if DIRECT_TABLES.get(name):
            opts += ", " + DIRECT_TABLES[name]
        out = []
        with self.lake.umask():
            for day, part in parts:
                folder = f"{base}date={day.isoformat()}/"        # (an object store: no folders to make)
                path = f"{folder}ducklake-{uuid.uuid4()}.parquet"
                con.register("_file", part.drop_columns(["date"]))
                try:
                    con.execute(f"COPY _file TO {lit(path)} ({opts})")
                finally:
                    con.unregister("_file")
                out.append(path)
        return out

    def _write_arrow(self, base: str, parts: list) -> list[str]:
        """:meth:`_write_files` on a local data path: each day's rows with Arrow's Parquet writer (the
        lake's compression, level and row-group size; :func:`_encodings`), fsynced before the commit
        that adds it names it."""
        out = []
        with self.lake.umask():
            for day, part in parts:
                folder = f"{base}date={day.isoformat()}/"
                os.makedirs(folder, mode=self.lake.dir_mode, exist_ok=True)
                path = f"{folder}ducklake-{uuid.uuid4()}.parquet"
                t = part.drop_columns(["date"])
                dictionary, encoding = _encodings(t.schema)
                with open(path, "wb") as f:
                    pq.write_table(t, f, compression=LAKE_OPTIONS["parquet_compression"],
                                   compression_level=int(LAKE_OPTIONS["parquet_compression_level"]),
                                   row_group_size=int(LAKE_OPTIONS["parquet_row_group_size"]),
                                   data_page_version="2.0", use_dictionary=dictionary,
                                   column_encoding=encoding)
                    f.flush()
                    if self.fsync:
                        os.fsync(f.fileno())
                out.append(path)
        return out

    def _add_columns(self, con, name: str, names: list[str]) -> None:
        """Columns a batch has beyond the table's (extra producer columns the ingress kept) are added
        to the lake table in the same transaction (DuckLake schema evolution; older rows read NULL)."""
        cols = self._columns.get(name)
        if cols is not None and set(names) <= set(cols):
            return
        have = set(con.execute("SELECT list(column_name) FROM duckdb_columns() WHERE database_name = 'lake' "
                               "AND schema_name = 'main' AND table_name = ?", [name]).fetchone()[0])
        added = False
        for c, typ in con.execute("SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM _batch)").fetchall():
            if c not in have:
                con.execute(f'ALTER TABLE lake.{name} ADD COLUMN "{c}" {typ}')
                added = True
        if added:
            self._columns.pop(name, None)     # re-read next time (a rolled-back transaction drops them)
        else:
            self._columns[name] = sorted(have)

    def _known_jobs(self, con=None, refresh: bool = False) -> set[str]:
        if self._jobs is None or refresh:
            con = con or self.connection()
            self._jobs = {r[0] for r in con.execute(f"SELECT DISTINCT job FROM lake.{JOBS}").fetchall()}
            self._jobs_read = time.monotonic()
        return self._jobs

    #: an unknown job re-reads the ``jobs`` table at most this often (a burst of made-up job ids
    #: costs one read, not one per id; a job another processor stored meanwhile is found after this)
    JOBS_REFRESH_S = 5.0

    def has_history(self, job: str) -> bool:
        """Whether the lake holds rows of ``job``: the ``jobs`` table (a row for each job written,
        in the transaction of the rows), as read at most :attr:`JOBS_REFRESH_S` ago."""
        known = self._known_jobs()
        if job not in known and time.monotonic() - self._jobs_read > self.JOBS_REFRESH_S:
            known = self._known_jobs(refresh=True)
        return job in known

    def recover(self, *_a, **_kw) -> int:
        """Nothing to roll forward: a flush is one catalog transaction. (Parquet files of a killed,
        uncommitted flush are unreferenced; ``stepwatch compact`` deletes them.) Returns 0."""
        return 0


def _rollback(con) -> None:
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass

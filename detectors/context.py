"""Bounded windows of a job's host, GC and comm rows: the context detectors use as evidence.

The processor keeps one :class:`JobTelemetry` per job. Every decoded ``host``/``gc``/``comm`` batch of the
job is appended (as the Arrow table it arrived in, no per-row work); old rows leave the window by event
time (``host``/``gc``: ``t``; ``comm``: ``step``) and by a row cap, so memory stays bounded whatever the
stream does. Detectors read the windows only when they explain an alert (rarely), with
:meth:`Window.select`.

Defaults: host and GC rows of the last 600 s of event time, at most 100,000 rows each (at 2,048 nodes
sending a host sample per second that is the last ~50 s; at 128 nodes the whole 600 s); comm rows of the
last 64 steps, at most 400,000 rows.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .lifecycle import JobLife

#: the host columns kept (others are dropped on arrival to keep the window small)
HOST_COLUMNS = ("node", "t", "cpu_util", "cpu_iowait", "cpu_steal", "load1", "rdma_retrans",
                "top_procs", "accel")
GC_COLUMNS = ("node", "rank", "t", "generation", "duration_ms")
COMM_COLUMNS = ("node", "rank", "step", "op", "group", "time_ms", "wait_ms", "bytes", "count", "group_size")
INFLIGHT_COLUMNS = ("node", "rank", "t", "source", "state", "step", "step_kind", "elapsed_ms", "since", "op",
                    "group", "seq", "group_size", "stack", "pid", "exit_code", "signal", "error")


def _as_int(col) -> np.ndarray:
    if pa.types.is_timestamp(col.type):
        col = col.cast(pa.int64())
    return col.to_numpy(zero_copy_only=False).astype(np.int64)


class Window:
    """Recent rows of one table of one job, ordered by arrival; bounded by ``span`` (in units of the
    ``key`` column: ns for times, steps for ``step``) behind the newest key seen, and by ``max_rows``."""

    def __init__(self, key: str, span: int, max_rows: int, columns: tuple[str, ...] | None = None):
        self.key, self.span, self.max_rows, self.columns = key, int(span), int(max_rows), columns
        self._parts: deque[tuple[int, int, pa.Table]] = deque()    # (key min, key max, rows)
        self.rows = 0
        self.newest = np.iinfo(np.int64).min                      # newest key seen (ever)
        self.version = 0                                          # rows added so far (batches)
        #: what readers derived from the rows as they are now (see causes.job_host_shift); emptied by add
        self.memo: dict = {}

    def __len__(self) -> int:
        return self.rows

    def add(self, t: pa.Table) -> None:
        if t.num_rows == 0 or self.key not in t.column_names:
            return
        self.version += 1
        self.memo.clear()
        if self.columns is not None:
            t = t.select([c for c in self.columns if c in t.column_names])
        if t.num_rows > self.max_rows:          # one huge batch (a rebuild): keep its newest rows
            t = t.slice(t.num_rows - self.max_rows)
        k = _as_int(t.column(self.key))
        lo, hi = int(k.min()), int(k.max())
        self._parts.append((lo, hi, t))
        self.rows += t.num_rows
        self.newest = max(self.newest, hi)
        floor = self.newest - self.span
        while self._parts and (self._parts[0][1] < floor or (self.rows > self.max_rows and len(self._parts) > 1)):
            self.rows -= self._parts.popleft()[2].num_rows

    def select(self, lo: int | None = None, hi: int | None = None) -> pa.Table | None:
        """Rows with ``lo <= key <= hi`` (either bound optional), or None when there are none."""
        parts = [t for a, b, t in self._parts if (lo is None or b >= lo) and (hi is None or a <= hi)]
        if not parts:
            return None
        t = pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]
        if lo is not None or hi is not None:
            k = _as_int(t.column(self.key))
            m = np.ones(len(k), dtype=bool)
            if lo is not None:
                m &= k >= lo
            if hi is not None:
                m &= k <= hi
            if not m.all():
                t = t.filter(pa.array(m))
        return t if t.num_rows else None


class JobTelemetry:
    """The host, GC and comm windows of one job, plus its newest host sample time (event time that
    goes on when steps stop)."""

    def __init__(self, span_s: float = 600.0, max_rows: int = 100_000, comm_steps: int = 64,
                 comm_rows: int = 400_000):
        ns = int(span_s * 1e9)
        self.host = Window("t", ns, max_rows, HOST_COLUMNS)
        self.gc = Window("t", ns, max_rows, GC_COLUMNS)
        self.comm = Window("step", comm_steps, comm_rows, COMM_COLUMNS)
        self.host_node_ns: dict[str, int] = {}      # newest host sample per node: a watermark per source
        # in-flight states of ranks in an overlong step (detectors.hang): the last 10 minutes
        self.inflight = Window("t", ns, 4 * max_rows, INFLIGHT_COLUMNS)
        self.life = JobLife()                       # how its ranks ended (detectors.lifecycle)

    @property
    def host_event_ns(self) -> int:
        """Event time that goes on while steps stop: the newest host sample, or the newest in-flight row
        (a watchdog's report in a hang, an agent's word on a rank) when that is newer: a hang is judged
        even when host samples are sparse (an agent replaying its spool)."""
        return max(int(self.host.newest), int(self.inflight.newest), 0)

    def add(self, kind: str, t: pa.Table) -> None:
        w = {"host": self.host, "gc": self.gc, "comm": self.comm, "inflight": self.inflight}.get(kind)
        if kind == "inflight":
            self.life.add(t)
            if "source" in t.column_names and pc.any(pc.equal(t.column("source"), "slurm")).as_py():
                t = t.filter(pc.invert(pc.fill_null(pc.equal(t.column("source"), "slurm"), False)))
                # (the scheduler's word on the job is the lifecycle's; the window holds the ranks' states)
        if w is not None and t.num_rows:
            w.add(t)
        if kind in ("host", "inflight") and t.num_rows and "node" in t.column_names and "t" in t.column_names:
            tv = _as_int(t.column("t"))
            nd = pc.dictionary_encode(t.column("node").combine_chunks())
            names = nd.dictionary.to_pylist()
            if len(names) == 1:
                top = [int(tv.max())]
            else:
                top = np.full(len(names), np.iinfo(np.int64).min, dtype=np.int64)
                np.maximum.at(top, nd.indices.to_numpy(zero_copy_only=False).astype(np.int64), tv)
                top = top.tolist()
            wm = self.host_node_ns
            for n, v in zip(names, top):
                if n is not None and v > wm.get(n, 0):
                    wm[n] = int(v)

    def attach(self, ctx) -> None:
        """Put the windows and the host event time on a :class:`~stepwatch.detectors.base.JobContext`."""
        ctx.host, ctx.gc, ctx.comm = self.host, self.gc, self.comm
        ctx.inflight = self.inflight
        ctx.life = self.life
        ctx.host_event_ns = self.host_event_ns
        ctx.host_node_ns = self.host_node_ns

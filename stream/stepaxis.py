"""A job's step and time axis, decided by its ranks, never by one row (docs/limits.md).

A job's position is where **its ranks** are, not where the newest row says it is. Each rank's
report (the step of its newest row in time, and that row's ``t_end``) is kept; the job's *anchor* is the upper quartile of
its reporting ranks' last steps (``ANCHOR_Q``; the anchor time likewise). So:

- a step row more than ``max_step_jump`` ahead of the anchor is deadlettered (naming the field and
  the value), and only the rows taken become their ranks' reports; rows ahead of the anchor by more than half the alignment window (``window_steps // 2``)
  but within ``max_step_jump`` are stored and not aligned (the job's ranks have not got there);
- a timestamp is bounded by ``max_future_skew_s`` ahead of the later of the receive time and the
  job's anchor time (a simulation replayed faster than real time moves its own anchor; one row
  cannot);
- to move a job's anchor forward a sender must speak for more than a quarter of the job's reporting
  ranks, and ranks that stopped reporting (up to three quarters of them) do not hold it back. A
  job's first message has nothing to be judged against and is taken as sent; once the job's ranks
  report elsewhere, the anchor follows them and, if the alignment window was placed by rows the
  ranks do not confirm, it is **re-anchored**: the ring forgets those steps, and their rows still
  buffered (not yet flushed) that lie more than ``max_step_jump`` ahead of the anchor are moved to
  the deadletter table (one record per source message). Such rows that were already flushed stay
  stored (counted, logged); a rebuild from the store takes the job's position from the same
  quantile of its ranks' newest stored steps, so they never place the window again.

Cost: a per-rank array of two int64 per job (16 bytes per reporting rank) and one ``lexsort`` of
each batch; the O(ranks) quantile is recomputed only when the job has moved by a quarter of the
alignment window since the last one, or a batch lies far from it.
"""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.wire import tables as wire
from stepwatch.wire.encode import encode_arrow
from stepwatch.stream.ingress_deadletter import MessageDeadletter
from stepwatch.stream.sinks import Message

log = logging.getLogger("stepwatch.processor")


ANCHOR_Q = 0.75


def _quantile(v: np.ndarray) -> int:
    """The value at index floor(ANCHOR_Q * (n - 1)) of sorted ``v``: of 2 values the lower, of 4 the
    third; so a single rank of a job of 2 or more cannot move it forward."""
    k = int(ANCHOR_Q * (len(v) - 1))
    return int(np.partition(v, k)[k])


class JobAxis:
    """Per rank: the last reported step and its ``t_end``; the job's anchor (:func:`_quantile`)."""

    __slots__ = ("step", "t_end", "anchor", "anchor_t", "dirty", "seen_hi", "seen_lo", "seen_t")

    def __init__(self):
        self.step = np.full(0, -1, np.int64)
        self.t_end = np.zeros(0, np.int64)
        self.anchor: int | None = None      # upper quartile of the ranks' last steps
        self.anchor_t = 0                   # upper quartile of the ranks' last t_end (ns)
        self.dirty = False                  # ranks reported since the anchor was computed
        self.seen_hi = self.seen_lo = 0     # step range observed since then
        self.seen_t = 0                     # newest t_end observed since then

    def reporting(self) -> int:
        """Ranks that reported a step."""
        return int((self.step >= 0).sum())

    def seed(self, state, min_t_end: int = 0) -> None:
        """A job rebuilt from the store: its ranks' newest steps are what the replay left (unless
        that history ends before ``min_t_end``: a job back after a long silence starts afresh)."""
        if len(self.step) or not len(state.last_step) or state.last_step.max() < 0:
            return
        if state.last_t_end.max() < min_t_end:
            return
        self.step = state.last_step.copy()
        self.t_end = state.last_t_end.copy()
        self.dirty = True
        self.compute()

    def observe(self, rank: np.ndarray, step: np.ndarray, t_end: np.ndarray) -> None:
        """A rank's report is its newest row **in time** (highest ``t_end``, then step): rows that
        arrive late or out of order (another producer, a spool replayed after an outage) do not
        move it back; a rank restarted from a checkpoint (newer rows, lower steps) does."""
        if not len(rank):
            return
        if len(rank) == 1 or bool((rank[1:] > rank[:-1]).all()):     # one row per rank, in order: no sort
            ur, us, ut = rank, step, t_end
        else:
            order = np.lexsort((step, t_end, rank))
            r = rank[order]
            last = np.empty(len(r), dtype=bool)
            last[:-1] = r[1:] != r[:-1]
            last[-1] = True
            ur, us, ut = r[last], step[order][last], t_end[order][last]
        top = int(ur[-1]) + 1
        if top > len(self.step):
            s = np.full(top, -1, np.int64)
            s[:len(self.step)] = self.step
            t = np.zeros(top, np.int64)
            t[:len(self.t_end)] = self.t_end
            self.step, self.t_end = s, t
        newer = (self.step[ur] < 0) | (ut > self.t_end[ur]) | ((ut == self.t_end[ur]) & (us > self.step[ur]))
        if not newer.all():
            ur, us, ut = ur[newer], us[newer], ut[newer]
            if not len(ur):
                return
        self.step[ur] = us
        self.t_end[ur] = ut
        lo, hi = int(us.min()), int(us.max())
        if not self.dirty:
            self.seen_lo, self.seen_hi, self.seen_t = lo, hi, int(ut.max())
        else:
            self.seen_lo, self.seen_hi = min(self.seen_lo, lo), max(self.seen_hi, hi)
            self.seen_t = max(self.seen_t, int(ut.max()))
        self.dirty = True

    def compute(self) -> None:
        rep = self.step >= 0
        if rep.any():
            self.anchor = _quantile(self.step[rep])
            t = self.t_end[rep]
            t = t[t > 0]
            self.anchor_t = _quantile(t) if len(t) else 0
        self.dirty = False

    def refresh(self, lead: int, skew_ns: int, state_max: int = -1) -> None:
        """Recompute the anchor if the job moved far enough from it to matter."""
        if not self.dirty:
            return
        a = self.anchor
        if (a is None or self.seen_hi > a + max(1, lead // 2) or self.seen_lo < a - lead
                or state_max > a + lead or self.seen_t > self.anchor_t + skew_ns // 2):
            self.compute()


def _steps_reason(job: str, step: np.ndarray, bad: np.ndarray, anchor: int, limit: int) -> str:
    v = int(step[bad].max())
    return (f"field 'step': value {v:,} is {v - anchor:,} steps ahead of job {job!r}'s position (step {anchor:,}, "
            f"where its ranks are); max_step_jump={limit:,}")


def _batch_anchor(rank: np.ndarray, step: np.ndarray) -> int:
    """The anchor of a batch alone: the quantile over its ranks of each rank's highest step."""
    if not len(step):
        return 0
    order = np.lexsort((step, rank))
    r = rank[order]
    last = np.empty(len(r), dtype=bool)
    last[:-1] = r[1:] != r[:-1]
    last[-1] = True
    return _quantile(step[order][last])


class StepAxisGate:
    """The processor's step-axis stage, built by it with the collaborators it uses: the ingress
    ``limits``, the processor's ``metrics`` and rate-limited log ``rlog``, the ``lake`` sink (its
    buffered step and deadletter rows: a re-anchor purges and amends them), ``new_detectors(job)`` (a
    fresh set: a re-anchored job's detectors saw steps that are forgotten), ``buffer(table, rows, src)``
    (rows for the store, of the source message ``src``), ``send(batch)`` (the sinks: the deadletter
    topic) and ``evict()`` (hold the jobs' state budget now)."""

    def __init__(self, *, limits, metrics, rlog, lake, new_detectors, buffer, send, evict):
        self.limits, self.metrics, self.rlog, self.lake = limits, metrics, rlog, lake
        self.new_detectors, self.buffer, self.send, self.evict = new_detectors, buffer, send, evict

    def admit(self, rt, job: str, part: pa.Table, dl, src) -> pa.Table:
        """Judge a job's step rows against its ranks' position before they are aligned; called by
        ``Processor._route`` for the message in hand (``src``: (topic, partition, offset); ``dl``: its
        deadletter record, :class:`~stepwatch.stream.ingress_deadletter.MessageDeadletter`). Rows too
        far ahead are noted on ``dl`` and dropped; the alignment window is limited to where the ranks
        are, and re-anchored when it was placed by rows the ranks do not confirm. Returns the rows to
        align and store."""
        lim = self.limits
        ax: JobAxis = rt.axis
        st = rt.state
        step_all = part.column("step").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        step = step_all
        rank = part.column("rank")
        rank = (pc.fill_null(rank, 0) if rank.null_count else rank).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        t_end = part.column("t_end").cast(pa.int64()).to_numpy(zero_copy_only=False)
        ax.seed(st, int(t_end.max()) - int(lim.job_idle_evict_s * 1e9) if len(t_end) else 0)
        lead = max(1, st.capacity // 2)
        skew = int(lim.max_future_skew_s * 1e9)
        if st.topology_known:                       # ranks outside the topology are refused by the ring
            inside = rank < st.expected
            if inside.all():
                inside = None
            else:
                rank, step, t_end = rank[inside], step[inside], t_end[inside]
        else:
            inside = None
        # judge against where the ranks were; a job without reports against its first batch's own ranks
        ax.refresh(lead, skew, st.max_step)
        anchor = ax.anchor if ax.anchor is not None else _batch_anchor(rank, step)
        if len(step_all) and int(step_all.max()) > anchor + lim.max_step_jump:
            bad_all = step_all > anchor + lim.max_step_jump
            n = int(bad_all.sum())
            dl.add(_steps_reason(job, step_all, bad_all, anchor, lim.max_step_jump), n=n,
                   keep=lim.deadletter_reasons)
            self.metrics.rows_rejected.labels("steps").inc(n)
            part = part.filter(pa.array(~bad_all))
            ok = ~(bad_all[inside] if inside is not None else bad_all)
            rank, step, t_end = rank[ok], step[ok], t_end[ok]
        # then the rows taken are reports of their ranks, and the anchor follows; only ranks with a column
        # in the ring (stream.align: one row at rank 99,999 of an 8-rank job has none) hold a report
        st.place(rank)
        if len(rank) and int(rank.max()) >= st.world_size:
            m = rank < st.world_size
            rank, step, t_end = rank[m], step[m], t_end[m]
        ax.observe(rank, step, t_end)
        ax.refresh(lead, skew, st.max_step)
        if ax.anchor is not None:
            anchor = ax.anchor
        if st.max_step > anchor + lead:
            self.reanchor(rt, job, anchor, src)
        st.ahead_limit = anchor + lead
        return part

    def reanchor(self, rt, job: str, anchor: int, src=None) -> None:
        """The job's alignment window lies beyond where its ranks are: forget it, and move the rows
        still buffered (but those of the message in hand, ``src``) that lie more than ``max_step_jump``
        ahead of the ranks to the deadletter."""
        lim = self.limits
        st = rt.state
        lead = max(1, st.capacity // 2)
        fed = st.next_close is not None and st.next_close > anchor + lead    # detectors saw those steps
        old = st.max_step
        st.reset_steps(anchor + lead)
        rt.pending = [b for b in rt.pending if not len(b.steps) or int(b.steps.max()) <= anchor + lead]
        if fed:
            rt.detectors = self.new_detectors(job)
        purged = self.purge_buffered(job, anchor + lim.max_step_jump, src)
        self.metrics.step_axis.labels("reanchor").inc()
        self.rlog.warning("job %s: alignment window at step %d re-anchored to its ranks' position (step %d); "
                          "%d buffered row(s) beyond max_step_jump moved to the deadletter", job, old, anchor,
                          sum(t.num_rows for _, t in purged))
        for psrc, rows in purged:
            step = rows.column("step").to_numpy(zero_copy_only=False).astype(np.int64)
            reason = _steps_reason(job, step, np.ones(len(step), bool), anchor, lim.max_step_jump)
            self.deadletter_later(psrc, rows, reason + " (found when the job's ranks reported)")

    def purge_buffered(self, job: str, above: int, skip_src=None) -> list[tuple[object, pa.Table]]:
        """Remove buffered step rows of ``job`` with a step above ``above`` (but those of the source
        message ``skip_src``); [(source, rows)]."""
        lake = self.lake
        pieces, srcs = lake.buffers.get("steps", []), lake.buffer_src.get("steps", [])
        out: dict = {}
        for i, t in enumerate(pieces):
            if not t.num_rows or srcs[i] == skip_src:
                continue
            m = pc.and_(pc.equal(t.column("job"), job), pc.greater(t.column("step"), above))
            m = pc.fill_null(m, False)
            if not pc.any(m).as_py():
                continue
            pieces[i] = t.filter(pc.invert(m))
            gone = t.filter(m)
            lake.rows -= gone.num_rows
            out[srcs[i]] = pa.concat_tables([out[srcs[i]], gone]) if srcs[i] in out else gone
            self.metrics.step_axis.labels("purged").inc(gone.num_rows)
        return list(out.items())

    def deadletter_later(self, src, rows: pa.Table, reason: str) -> None:
        """A deadletter record for an earlier message (``src``) whose rows were buffered: amend its
        record if it has one in this flush (still one per message), else add one, with the rows (Arrow)
        as the payload."""
        if src is None:
            return
        dl, dsrc = self.lake.buffers.get("deadletter", []), self.lake.buffer_src.get("deadletter", [])
        for i, s in enumerate(dsrc):
            if s == src and dl[i].num_rows == 1:
                t = dl[i]
                k = t.schema.get_field_index("reason")
                was = t.column(k)[0].as_py() or ""
                dl[i] = t.set_column(k, t.schema.field(k), pa.array([(was + "; " + reason)[:4000]], t.schema.field(k).type))
                return
        topic, part, off = src
        msg = SimpleNamespace(topic=topic, partition=part, offset=off, key=None, value=encode_arrow(rows),
                              headers=[])
        d = MessageDeadletter()
        d.add(reason, n=rows.num_rows)
        r = d.record(msg, job_of(rows), None, self.limits, time.time_ns())
        r["row"] = None
        self.buffer("deadletter", pa.Table.from_pylist([r], schema=wire.DEADLETTER), src)
        self.metrics.dropped.labels("deadletter").inc()
        self.send(Message("deadletter", r["payload"], None, [("error", r["reason"][:1000].encode()),
                                                             ("source", f"{topic}/{part}/{off}".encode())]))

    def check_budget(self, rt, old_width: int) -> None:
        """After a job's ring widened by more than 64 MiB (one row can widen it to its rank), hold the
        ``max_state_bytes`` budget at once instead of at the next flush: a poll of 2,000 such rows would
        otherwise allocate 2,000 rings before any eviction."""
        st = rt.state
        if st.world_size <= old_width or not st.world_size:
            return
        if (st.world_size - old_width) * (st.state_bytes() // st.world_size) >= WIDEN_CHECK_BYTES:
            self.evict()


def job_of(rows: pa.Table) -> str | None:
    j = rows.column("job")[0].as_py() if rows.num_rows else None
    return j if isinstance(j, str) else None


SPARSE_MIN_WIDTH = 4096
SPARSE_FACTOR = 64


def sparse(rt) -> bool:
    """Whether a job's alignment ring is far wider than the ranks that report steps into it: a ring
    is as wide as the highest rank seen (≈6.8 KB per rank at a 128-step window), so one row at rank
    131,071 of a made-up job holds 848 MiB. Such jobs are evicted first when ``max_jobs`` or
    ``max_state_bytes`` is exceeded, so they cannot push real jobs out of memory."""
    w = rt.state.world_size
    return w > SPARSE_MIN_WIDTH and rt.axis.reporting() * SPARSE_FACTOR < w


WIDEN_CHECK_BYTES = 64 << 20


def time_base(jobs: dict, table: pa.Table, limits):
    """Per row, the job's anchor time (ns; 0 when unknown): timestamps may be ``max_future_skew_s``
    ahead of the later of it and the receive time (see :func:`stepwatch.stream.ingress.row_bounds`).

    Returned as a callable (None when no job is known): row_bounds asks for it only when a
    timestamp lies beyond the receive time's bound, which live data never does."""
    if not jobs or "job" not in table.column_names or not table.num_rows:
        return None
    return lambda: _time_base(jobs, table, limits)


def _time_base(jobs: dict, table: pa.Table, limits) -> np.ndarray | int | None:
    col = table.column("job")
    keys = pc.unique(col)
    skew = int(limits.max_future_skew_s * 1e9)
    base = np.zeros(len(keys), np.int64)
    for i, j in enumerate(keys.to_pylist()):
        rt = jobs.get(j)
        ax = getattr(rt, "axis", None)
        if ax is None:
            continue
        ax.refresh(max(1, rt.state.capacity // 2), skew, rt.state.max_step)
        base[i] = ax.anchor_t
    if not base.any():
        return None
    if len(keys) == 1:
        return int(base[0])
    idx = pc.fill_null(pc.index_in(col, value_set=keys), 0).to_numpy(zero_copy_only=False)
    return base[idx]

"""Step alignment across the ranks of one job, on columns.

``JobState`` keeps a ring of the last ``capacity`` steps x ``world_size`` ranks (float64 per phase,
NaN = not reported). A batch of step rows (Arrow) is scattered into it with numpy in one go; the
ring doubles as the deduplication index for the natural key ``(job, rank, step)``. A step *closes*
when every rank of the topology reported it, or when the job's event time (latest ``t_end`` seen)
has moved ``lateness_ns`` past it, or when the ring needs the room; closed steps are handed to the
detectors in order as a :class:`~stepwatch.detectors.base.StepBlock`.

Memory: 6 float64 planes + 1 bool plane + 1 float32 plane (DataLoader queue) x capacity x ranks, e.g. 16,384
ranks x 128 steps ≈ 111 MB; tokens and samples are kept as per-step sums. The CPU-starvation columns
(``cpu_ms``, ``cpu_wait_ms``) get a float32 plane each once a producer sends them (+17 MB there).

Column ``r`` of the ring is rank ``r`` (what every detector assumes), so the ring is as wide as the
highest rank *placed*. A rank is placed (given its column) when it is below ``COLUMN_FLOOR``, or when
at least one in ``COLUMN_DENSITY`` of the ranks up to it have reported (step or topology rows): one
row at rank 99,999 of an 8-rank job holds 8 columns, not 100,000. Rows of a rank not placed are
stored but not aligned (:attr:`IngestResult.unplaced`); its topology row is held and applied once it
is placed. So the ring holds at most ``max(COLUMN_FLOOR, COLUMN_DENSITY x ranks reporting)`` columns.
The world size a step needs to be complete (``expected``) is the one its ranks declare: the upper
quartile of the topology rows' ``world_size`` over the distinct ranks that sent one (one row
declaring 100,000 among 8 declaring 8 does not make the job wait for 100,000).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.detectors.base import JobContext, StepBlock

FIELDS = ("step_ms", "data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms")
COUNTS = ("tokens", "samples")
CPU = ("cpu_ms", "cpu_wait_ms")           # optional: float32 planes made when first reported
#: ranks below this always get their column (≈ 6.8 MB at a 128-step window)
COLUMN_FLOOR = 1024
#: above it, a rank gets its column once one in this many of the ranks up to it have reported
COLUMN_DENSITY = 8
#: the declared world size a job's ranks agree on: this quantile of their topology rows' world_size
WORLD_Q = 0.75
INFO = ("device_type", "dtype", "model_flops_per_token", "model_flops_per_sample", "flops_source")
COORDS = ("dp", "tp", "cp", "ep")


@dataclass
class IngestResult:
    keep: np.ndarray          # bool per input row: store it (not a duplicate, valid rank)
    duplicates: int
    bad_rank: np.ndarray      # indices of rows whose rank is outside the topology
    late: int                 # rows older than the ring (stored, not aligned)
    ahead: int = 0            # rows above ``JobState.ahead_limit`` (stored, not aligned: stream.stepaxis)
    unplaced: int = 0         # rows of ranks without a column yet (stored, not aligned: JobState.place)
    unplaced_rank: int = -1   # the highest such rank (for the log line)


def _held(a: np.ndarray) -> int:
    """Bytes of the buffer ``a`` views (``a``'s own when it is no view)."""
    return a.base.nbytes if isinstance(a.base, np.ndarray) else a.nbytes


def _quantile(v: np.ndarray) -> int:
    k = int(WORLD_Q * (len(v) - 1))
    return int(np.partition(v, k)[k])


class JobState:
    def __init__(self, job: str, world_size: int = 0, capacity: int = 128, lateness_ns: int = 10_000_000_000):
        self.job = job
        self.capacity = capacity
        self.lateness_ns = lateness_ns
        # whether the job's step numbering has gaps of its own (a gap waited the lateness bound and nothing
        # came): until then a gap is taken for steps still on their way (close_ready)
        self.gaps_real = False
        self.topology_known = False
        self.world_size = 0       # ranks with state (columns of the ring): the highest rank placed + 1
        self.expected = 0         # world size its ranks' topology rows declare (a step is complete with this many)
        self.seen = np.zeros(0, dtype=bool)          # per column: the rank reported (steps or topology)
        self.declared = np.zeros(0, dtype=np.int64)  # per column: world_size of the rank's topology row (0: none)
        self.pending = np.empty(0, dtype=np.int64)   # ranks that reported but have no column yet (sorted)
        self.held: pa.Table | None = None            # their topology rows (one per rank), applied when placed
        self.nodes = np.empty(0, dtype=object)
        self.stage = np.empty(0, dtype=np.int32)
        # other parallel coordinates (-1 unknown) and, per rank, the newest step reported and its t_end
        self.coords = {c: np.empty(0, dtype=np.int32) for c in COORDS}
        self.last_step = np.empty(0, dtype=np.int64)
        self.last_t_end = np.empty(0, dtype=np.int64)
        self.planes = {f: np.empty((capacity, 0)) for f in FIELDS}
        # efficiency inputs: per slot sums of tokens/samples (and ranks reporting them), DataLoader
        # ready batches per rank (float32: 4 bytes x capacity x ranks, NaN = not reported)
        self.sums = {c: np.zeros(capacity) for c in COUNTS}
        self.sum_n = {c: np.zeros(capacity, dtype=np.int64) for c in COUNTS}
        self.queue = np.empty((capacity, 0), dtype=np.float32)
        self.queue_seen = False
        self.cpu: dict[str, np.ndarray] = {}
        self.params = np.empty(0)                 # model_params per rank (NaN unknown)
        self.info: dict = {}
        self.filled = np.zeros((capacity, 0), dtype=bool)
        self.count = np.zeros(capacity, dtype=np.int64)
        self.t_end = np.zeros(capacity, dtype=np.int64)
        self.slot_step = np.full(capacity, -1, dtype=np.int64)   # which step a slot holds
        self.lo = None            # lowest step kept in the ring
        self.next_close = None    # first step not yet closed
        self.max_step = -1
        self.max_t_end = 0
        # rows of a step above this are stored but neither aligned nor counted as the rank's newest step:
        # the job's ranks have not reached it (set per batch by stream.stepaxis; None: no limit)
        self.ahead_limit: int | None = None
        self._room = 0            # columns the per-rank arrays' buffers hold (_resize): world_size <= _room
        if world_size:
            self._resize(world_size)

    # ------------------------------------------------------------------ topology
    #: per-rank arrays (attribute, fill value, dtype; 2-D: a row per ring slot) whose columns _resize grows
    _PER_RANK = (("filled", False, bool, 2), ("queue", np.nan, np.float32, 2), ("params", np.nan, np.float64, 1),
                 ("nodes", "", object, 1), ("stage", 0, np.int32, 1), ("last_step", -1, np.int64, 1),
                 ("last_t_end", 0, np.int64, 1), ("seen", False, bool, 1), ("declared", 0, np.int64, 1))

    def _resize(self, n: int) -> None:
        """Give the ring ``n`` columns (ranks). The arrays are views of wider buffers that grow
        geometrically (at least doubling, but not past the world size the topology declares while
        ``n`` is within it), so a job whose ranks arrive a few at a time (topology per node) costs
        O(ranks) copying in all, not O(ranks^2); the columns beyond ``n`` hold their fill values."""
        old = self.world_size
        if n <= old:
            return
        if n > self._room:
            room = max(n, 2 * self._room)
            if self.expected >= n:
                room = min(room, self.expected)
            for f in FIELDS:
                self.planes[f] = self._regrow(self.planes[f], room, np.nan, np.float64)
            for name, fill, dtype, _ in self._PER_RANK:
                setattr(self, name, self._regrow(getattr(self, name), room, fill, dtype))
            for c in COORDS:
                self.coords[c] = self._regrow(self.coords[c], room, -1, np.int32)
            for c in list(self.cpu):
                self.cpu[c] = self._regrow(self.cpu[c], room, np.nan, np.float32)
            self._room = room
        for f in FIELDS:
            self.planes[f] = self.planes[f].base[..., :n]
        for name, _, _, _ in self._PER_RANK:
            setattr(self, name, getattr(self, name).base[..., :n])
        for c in COORDS:
            self.coords[c] = self.coords[c].base[..., :n]
        for c in list(self.cpu):
            self.cpu[c] = self.cpu[c].base[..., :n]
        self.world_size = n

    def _regrow(self, a: np.ndarray, room: int, fill, dtype) -> np.ndarray:
        """A buffer ``room`` columns wide (filled with ``fill``) holding ``a``'s columns; returns the
        view of its first ``a``'s width (``view.base`` is the buffer)."""
        buf = np.full(a.shape[:-1] + (room,), fill, dtype=dtype)
        w = a.shape[-1]
        buf[..., :w] = a
        return buf[..., :w]

    def _per_rank(self, fill, dtype) -> np.ndarray:
        """A new ring-shaped (slots x ranks) array in the same layout as the others (a view of a buffer
        ``_room`` columns wide)."""
        return np.full((self.capacity, max(self._room, self.world_size)), fill, dtype=dtype)[:, :self.world_size]

    def place(self, rank: np.ndarray) -> None:
        """Note that ``rank`` (int64, >= 0) reported, and give columns to the ranks that may have one:
        below ``COLUMN_FLOOR``, or where one in ``COLUMN_DENSITY`` of the ranks up to them reported.
        O(batch) when every rank has its column; otherwise O(columns + ranks waiting), numpy only."""
        if not len(rank):
            return
        w = self.world_size
        if int(rank.max()) < w:
            self.seen[rank] = True
            return
        inside = rank < w
        self.seen[rank[inside]] = True
        pend = np.union1d(self.pending, rank[~inside])
        # placing pend[i] gives columns to every rank up to it: the reported ranks below it are the
        # columns' reported ranks plus pend[:i + 1]
        cnt = int(np.count_nonzero(self.seen)) + np.arange(1, len(pend) + 1)
        ok = (pend < COLUMN_FLOOR) | (cnt * COLUMN_DENSITY >= pend + 1)
        if ok.any():
            k = int(np.flatnonzero(ok)[-1]) + 1
            self._resize(int(pend[k - 1]) + 1)
            self.seen[pend[:k]] = True
            pend = pend[k:]
        self.pending = pend
        if self.held is not None and self.world_size > w:
            self._release_held()

    def _release_held(self) -> None:
        r = self.held.column("rank").to_numpy(zero_copy_only=False).astype(np.int64)
        now = r < self.world_size
        if now.any():
            self._apply_topology(self.held.filter(pa.array(now)), r[now])
            rest = self.held.filter(pa.array(~now))
            self.held = rest if rest.num_rows else None

    def set_topology(self, topo: pa.Table) -> None:
        """Apply topology rows (job, rank, node, world_size, pp …) of this job.

        Memory follows the ranks that report, not the declared world size nor one row's rank (see the
        module docs): a row declaring 100,000 ranks sent by rank 0 alone allocates one rank of state;
        a row of rank 99,999 of an 8-rank job is held (not given a column) and does not move the
        job's world size."""
        for c in INFO:
            if c in topo.column_names:
                vals = [v for v in topo.column(c).to_pylist() if v is not None]
                if vals:
                    self.info[c] = max(vals) if isinstance(vals[0], float) else vals[0]
        ranks = pc.fill_null(topo.column("rank"), -1).to_numpy(zero_copy_only=False).astype(np.int64)
        ws = pc.fill_null(topo.column("world_size"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        ok = (ranks >= 0) & (ranks < ws)
        if not ok.all():
            topo, ranks, ws = topo.filter(pa.array(ok)), ranks[ok], ws[ok]
        if not len(ranks):
            return
        # one row per rank (the last): ranks with a column take it now, the others are held
        _, last = np.unique(ranks[::-1], return_index=True)
        if len(last) < len(ranks):
            idx = np.sort(len(ranks) - 1 - last)
            topo, ranks, ws = topo.take(pa.array(idx)), ranks[idx], ws[idx]
        now = ranks < self.world_size
        if now.any():
            self._apply_topology(topo.filter(pa.array(now)) if not now.all() else topo, ranks[now])
        if not now.all():
            self._hold(topo.filter(pa.array(~now)) if now.any() else topo)
        # the world size the ranks declare, then columns for the held ranks inside it
        decl = self.declared[self.declared > 0]
        if self.held is not None:
            decl = np.concatenate([decl, self.held.column("world_size").to_numpy(zero_copy_only=False)
                                   .astype(np.int64)])
        self.expected = _quantile(decl) if len(decl) else 0
        self.topology_known = self.expected > 0
        if self.held is not None:
            hr = self.held.column("rank").to_numpy(zero_copy_only=False).astype(np.int64)
            self.place(hr[hr < self.expected])

    def _hold(self, rows: pa.Table) -> None:
        """Keep the topology rows of ranks without a column (the last per rank)."""
        t = rows if self.held is None else pa.concat_tables([self.held, rows], promote_options="permissive")
        r = t.column("rank").to_numpy(zero_copy_only=False).astype(np.int64)
        _, last = np.unique(r[::-1], return_index=True)
        if len(last) < len(r):
            t = t.take(pa.array(np.sort(len(r) - 1 - last)))
        self.held = t

    def _apply_topology(self, topo: pa.Table, ranks: np.ndarray) -> None:
        """Topology rows of ranks that have their column (``ranks``: their rank column, int64)."""
        self.seen[ranks] = True
        self.declared[ranks] = topo.column("world_size").to_numpy(zero_copy_only=False).astype(np.int64)
        self.nodes[ranks] = np.asarray(topo.column("node").to_pylist(), dtype=object)
        if "pp" in topo.column_names:
            pp = topo.column("pp").to_numpy(zero_copy_only=False)
            pp = np.where(np.isnan(pp.astype(float)), 0, pp).astype(np.int32) if len(pp) else pp
            self.stage[ranks] = pp
        for c in COORDS:
            if c in topo.column_names:
                v = topo.column(c).to_numpy(zero_copy_only=False).astype(float)
                self.coords[c][ranks] = np.where(np.isnan(v), -1, v).astype(np.int32)
        if "model_params" in topo.column_names:
            v = topo.column("model_params").to_numpy(zero_copy_only=False).astype(float)
            self.params[ranks[np.isfinite(v)]] = v[np.isfinite(v)]

    def job_info(self) -> dict:
        """Job-level facts for the efficiency analyses (see :attr:`JobContext.info`)."""
        info = dict(self.info)
        p = self.params[np.isfinite(self.params)] if len(self.params) else self.params
        if len(p):
            info["model_params"] = float(p.mean())
        tp = self.coords.get("tp")
        info["tp_size"] = int(tp.max()) + 1 if tp is not None and len(tp) and tp.max() >= 0 else 1
        info["pp_size"] = int(self.stage.max()) + 1 if len(self.stage) else 1
        if "cpu_wait_ms" in self.cpu:
            info["cpu_wait_reported"] = True       # ranks measure their run-queue wait (causes.decide)
        return info

    def context(self) -> JobContext:
        return JobContext(self.job, self.world_size, self.nodes, self.stage, coords=self.coords,
                          last_step=self.last_step, last_t_end=self.last_t_end, max_step=self.max_step,
                          steps_event_ns=self.max_t_end, info=self.job_info())

    # ------------------------------------------------------------------ ingest
    def ingest(self, t: pa.Table) -> tuple[IngestResult, list[StepBlock]]:
        """Scatter a batch of step rows; returns which rows to store and the steps that closed.

        A batch spanning more steps than the ring holds (a replay, a catch-up) is taken in
        step-ordered slices so every step is aligned before the ring moves past it."""
        if t.num_rows:
            step = t.column("step").to_numpy(zero_copy_only=False)
            lo, hi = int(step.min()), int(step.max())
            span = max(1, self.capacity // 2)
            if hi - lo >= span:
                keep = np.zeros(t.num_rows, dtype=bool)
                bad, dups, late, ahead, far, far_rank, blocks = [], 0, 0, 0, 0, -1, []
                # only the slices that hold rows: steps 0 and 10**12 are two slices, not 10**10
                chunk = (step.astype(np.int64) - lo) // span
                for c in np.unique(chunk):
                    idx = np.flatnonzero(chunk == c)
                    res, b = self._ingest(t.take(pa.array(idx)))
                    keep[idx] = res.keep
                    bad.append(idx[res.bad_rank])
                    dups += res.duplicates
                    late += res.late
                    ahead += res.ahead
                    far += res.unplaced
                    far_rank = max(far_rank, res.unplaced_rank)
                    blocks += b
                return IngestResult(keep, dups, np.concatenate(bad) if bad else np.empty(0, np.int64), late,
                                    ahead, far, far_rank), blocks
        return self._ingest(t)

    def _ingest(self, t: pa.Table) -> tuple[IngestResult, list[StepBlock]]:
        n = t.num_rows
        rank = t.column("rank").to_numpy(zero_copy_only=False).astype(np.int64)
        step = t.column("step").to_numpy(zero_copy_only=False).astype(np.int64)
        keep = np.ones(n, dtype=bool)
        blocks: list[StepBlock] = []
        if n == 0:
            return IngestResult(keep, 0, np.empty(0, np.int64), 0), blocks
        if self.topology_known:
            bad = np.flatnonzero(rank >= self.expected)
            keep[bad] = False
            self.place(rank[keep] if len(bad) else rank)
        else:
            bad = np.empty(0, np.int64)
            self.place(rank)
        # rows of ranks without a column: stored (keep stays True) but not aligned
        n_far, far_rank = 0, -1
        if len(rank) and int(rank.max()) >= self.world_size:
            far = keep & (rank >= self.world_size)
            n_far = int(far.sum())
            if n_far:
                far_rank = int(rank[far].max())
                keep[far] = False
        if not self.topology_known:
            nodes = t.column("node")
            if n_far:
                cand = np.flatnonzero(keep)
                unknown = cand[self.nodes[rank[cand]] == ""]
            else:
                unknown = np.flatnonzero(self.nodes[rank] == "")
            if len(unknown):
                self.nodes[rank[unknown]] = np.asarray(nodes.take(pa.array(unknown)).to_pylist(), dtype=object)
        t_end = t.column("t_end").cast(pa.int64()).to_numpy(zero_copy_only=False)
        n_ahead = 0
        if self.ahead_limit is not None:
            over = keep & (step > self.ahead_limit)
            n_ahead = int(over.sum())
            if n_ahead:                    # stored (keep stays True) but not aligned
                keep[over] = False
        # newest step (and its t_end) per rank, over every row kept (also rows too late to align)
        kr, ks = rank[keep], step[keep]
        if len(kr):
            np.maximum.at(self.last_step, kr, ks)
            np.maximum.at(self.last_t_end, kr, t_end[keep])
        if self.lo is None:
            self.lo = int(step[keep].min()) if keep.any() else 0
            self.next_close = self.lo
        # make room: steps beyond the ring force-close the oldest
        top = int(step[keep].max()) if keep.any() else self.max_step
        if top >= self.lo + self.capacity:
            new_lo = top - self.capacity + 1
            if new_lo > self.next_close:
                blocks += self._close_upto(new_lo)
            self._evict_below(new_lo)
        late = keep & (step < self.lo)
        n_late = int(late.sum())
        inwin = keep & ~late
        idx = np.flatnonzero(inwin)
        s = step[idx]
        r = rank[idx]
        slot = s % self.capacity
        # duplicates: already in the ring, or repeated inside this batch
        dup = self.filled[slot, r]
        lin = slot * self.world_size + r
        _, first = np.unique(lin, return_index=True)
        once = np.zeros(len(idx), dtype=bool)
        once[first] = True
        dup |= ~once
        n_dup = int(dup.sum())
        keep[idx[dup]] = False
        idx, s, r, slot = idx[~dup], s[~dup], r[~dup], slot[~dup]
        # rows for steps already closed (arrived after the lateness bound) are stored but not re-aligned
        if self.next_close is not None:
            open_ = s >= self.next_close
        else:
            open_ = np.ones(len(s), dtype=bool)
        # a slot reused for a newer step: reset (only happens for slots evicted above)
        self.slot_step[slot[open_]] = s[open_]
        for f in FIELDS:
            col = t.column(f)
            v = col.to_numpy(zero_copy_only=False).astype(np.float64) if col.null_count < len(col) else None
            if v is None:
                continue
            self.planes[f][slot, r] = v[idx]
        self.filled[slot, r] = True
        for c in COUNTS:
            col = t.column(c)
            if col.null_count < len(col):
                v = col.to_numpy(zero_copy_only=False).astype(np.float64)[idx]
                ok = np.isfinite(v)
                np.add.at(self.sums[c], slot[ok], v[ok])
                np.add.at(self.sum_n[c], slot[ok], 1)
        col = t.column("data_queue") if "data_queue" in t.column_names else None
        if col is not None and col.null_count < len(col):
            self.queue_seen = True
            self.queue[slot, r] = col.to_numpy(zero_copy_only=False).astype(np.float32)[idx]
        for c in CPU:
            col = t.column(c) if c in t.column_names else None
            if col is not None and col.null_count < len(col):
                if c not in self.cpu:
                    self.cpu[c] = self._per_rank(np.nan, np.float32)
                self.cpu[c][slot, r] = col.to_numpy(zero_copy_only=False).astype(np.float32)[idx]
        self.count += np.bincount(slot[open_], minlength=self.capacity)
        np.maximum.at(self.t_end, slot, t_end[idx])
        if len(s):
            self.max_step = max(self.max_step, int(s.max()))
            self.max_t_end = max(self.max_t_end, int(t_end[idx].max()))
        blocks += self.close_ready()
        if n_ahead:
            keep |= over
        if n_far:
            keep |= far
        return IngestResult(keep, n_dup, bad, n_late, n_ahead, n_far, far_rank), blocks

    # ------------------------------------------------------------------ closing
    def _evict_below(self, new_lo: int) -> None:
        for st in range(self.lo, min(new_lo, self.lo + self.capacity)):
            sl = st % self.capacity
            for f in FIELDS:
                self.planes[f][sl].fill(np.nan)
            self.filled[sl].fill(False)
            self.queue[sl].fill(np.nan)
            for v in self.cpu.values():
                v[sl].fill(np.nan)
            for c in COUNTS:
                self.sums[c][sl] = 0.0
                self.sum_n[c][sl] = 0
            self.count[sl] = 0
            self.t_end[sl] = 0
            self.slot_step[sl] = -1
        self.lo = new_lo

    def _block(self, a: int, b: int) -> StepBlock | None:
        """Steps [a, b) as a block, skipping steps nobody reported."""
        steps = np.arange(a, b, dtype=np.int64)
        slots = steps % self.capacity
        present = self.count[slots] > 0
        if not present.any():
            return None
        steps, slots = steps[present], slots[present]
        p = {f: self.planes[f][slots] for f in FIELDS}
        n_tok, n_smp = self.sum_n["tokens"][slots], self.sum_n["samples"][slots]
        return StepBlock(steps=steps, t_end=self.t_end[slots].copy(), **p,
                         tokens=self.sums["tokens"][slots] if n_tok.any() else None, tokens_ranks=n_tok,
                         samples=self.sums["samples"][slots] if n_smp.any() else None, samples_ranks=n_smp,
                         data_queue=self.queue[slots] if self.queue_seen else None,
                         **{c: self.cpu[c][slots] if c in self.cpu else None for c in CPU})

    def _close_upto(self, b: int) -> list[StepBlock]:
        a = self.next_close
        if b <= a:
            return []
        self.next_close = b
        blk = self._block(a, min(b, self.lo + self.capacity))
        return [blk] if blk is not None else []

    def close_ready(self, now_event_ns: int | None = None, force: bool = False) -> list[StepBlock]:
        """Close, in order, steps that are complete or past the lateness bound."""
        if self.lo is None or self.max_step < self.next_close:
            return []
        horizon = (now_event_ns if now_event_ns is not None else self.max_t_end) - self.lateness_ns
        s = self.next_close
        end = self.max_step + 1
        steps = np.arange(s, end, dtype=np.int64)
        slots = steps % self.capacity
        cnt = self.count[slots]
        # complete: every rank of the world size its ranks declare (without a topology: every column)
        complete = cnt >= (self.expected if self.topology_known else self.world_size)
        if force:
            closable = np.ones(len(steps), dtype=bool)
        else:
            past = (cnt > 0) & (self.t_end[slots] <= horizon)
            # an empty step (a gap in numbering) may be steps still on their way: one node's messages can
            # arrive out of order (an agent's retry or spool; the held-out producer delays each message at
            # random), and a gap closed at once made the late steps miss every detector (2-rank jobs
            # of 24 ms steps in 4-step messages: half their steps). It closes once a later step is past
            # the lateness bound; once one gap has waited that long in vain, the job numbers its steps
            # with gaps, and a gap closes as soon as a later step is complete or late
            later = (complete | past) if self.gaps_real else past
            later_done = np.flip(np.logical_or.accumulate(np.flip(later)))
            closable = complete | past | ((cnt == 0) & later_done)
        if closable.all():
            k = len(steps)
        else:
            k = int(np.argmin(closable))
        if k == 0:
            return []
        if not force and not self.gaps_real and (cnt[:k] == 0).any():
            self.gaps_real = True
        return self._close_upto(s + k)

    def reset_steps(self, above: int) -> None:
        """Forget the ring's steps (the window was placed by rows its ranks do not confirm: a
        re-anchor, stream.stepaxis). Ranks whose newest step is above ``above`` forget it too;
        topology and rank columns are kept."""
        for f in FIELDS:
            self.planes[f].fill(np.nan)
        self.filled.fill(False)
        self.queue.fill(np.nan)
        for v in self.cpu.values():
            v.fill(np.nan)
        for c in COUNTS:
            self.sums[c].fill(0.0)
            self.sum_n[c].fill(0)
        self.count.fill(0)
        self.t_end.fill(0)
        self.slot_step.fill(-1)
        self.lo = self.next_close = None
        bad = self.last_step > above
        self.last_step[bad] = -1
        self.last_t_end[bad] = 0
        self.max_step = -1
        self.max_t_end = 0

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        """Bytes of the per-rank ring (what grows with the ranks that report), as allocated: the
        buffers, up to twice the columns in use (_resize)."""
        return sum(_held(p) for p in (*self.planes.values(), self.filled, self.queue))

    def open_steps(self) -> int:
        return 0 if self.lo is None else max(0, self.max_step + 1 - self.next_close)

"""The bit-packed columnar aggregator of a job's comm rows (:class:`_CommAggregate`): folds the rows as they
arrive into per-step accumulators, so that the ``comm_bw`` detector's analysis (:mod:`.commbw`) never reads
the raw rows again."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.agents.probe.collectives import LINK_GBPS, SATURATE_BYTES, link_type

from .busbw import bus_bandwidth

_HIST_EDGES = np.array([4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20], dtype=np.float64)
_HIST_NAMES = ["<4KiB", "4KiB-64KiB", "64KiB-1MiB", "1MiB-16MiB", "16MiB-256MiB", ">=256MiB"]
_RANK_BITS = 31                      # member codes: key << 31 | rank (ranks < 2**31)
_LOC_SHIFT = 52                      # per-batch sort key: step offset << 52 | key << 31 | rank
_MAX_KEYS = 1 << (_LOC_SHIFT - _RANK_BITS)
_MAX_SLOTS = 2048                    # step offsets of one batch fit in the 11 bits above _LOC_SHIFT


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique`` of an int64 array by sorting (numpy 2's hash-based ``np.unique`` is ~10x slower at
    the sizes here), or by counting when the values are non-negative and few beside the array's length
    (a job's first comm batch: 200k rows of a handful of (op, group) pairs at 100k ranks; the same array)."""
    if len(a) > 1024:
        lo, hi = int(a.min()), int(a.max())
        if lo >= 0 and hi < 4 * len(a) + 1024:
            return np.flatnonzero(np.bincount(a, minlength=hi + 1)).astype(a.dtype, copy=False)
    s = np.sort(a)
    return s[np.r_[True, s[1:] != s[:-1]]] if len(s) > 1 else s


def _col_f64(t: pa.Table, name: str, fill: float) -> np.ndarray:
    """A numeric column as float64, nulls (and a missing column) as ``fill``."""
    if name not in t.column_names:
        return np.full(t.num_rows, fill)
    c = t.column(name)
    if c.null_count:
        return pc.fill_null(c.cast(pa.float64()), fill).to_numpy()
    return c.to_numpy().astype(np.float64, copy=False)


def _col_i64(t: pa.Table, name: str, fill: int) -> np.ndarray:
    c = t.column(name)
    if pa.types.is_timestamp(c.type):
        c = c.cast(pa.int64())
    if c.null_count:
        return pc.fill_null(c.cast(pa.int64()), fill).to_numpy()
    return c.to_numpy().astype(np.int64, copy=False)


class _Names:
    """Strings -> dense integer codes in order of first sight, by pyarrow hash lookups (no Python work
    per row; only a name never seen before costs a Python step)."""

    def __init__(self):
        self.names: list[str] = []
        self._vs = pa.array([], pa.string())
        self._prev = (None, None)                            # (last column, its codes)

    def codes(self, col) -> np.ndarray:
        if not pa.types.is_string(col.type):
            col = col.cast(pa.string())
        prev, codes = self._prev
        if prev is not None and len(prev) == len(col) and prev.equals(col):
            return codes                                    # the same layout as the last batch (a memcmp)
        if not self.names and not col.null_count:
            # the first batch: one hash pass (its dictionary holds the names in order of first sight, its
            # indices are their codes: what a lookup, the unique new names and a second lookup gave)
            d = pc.dictionary_encode(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
            self.names.extend(d.dictionary.to_pylist())
            self._vs = pa.array(self.names, pa.string())
            codes = d.indices.to_numpy().astype(np.int64)
            self._prev = (col, codes)
            return codes
        idx = pc.index_in(col, value_set=self._vs)
        if idx.null_count:
            new = pc.unique(pc.filter(col, pc.is_null(idx))).to_pylist()
            self.names.extend(new)
            self._vs = pa.array(self.names, pa.string())
            idx = pc.index_in(col, value_set=self._vs)
        codes = idx.to_numpy().astype(np.int64)
        self._prev = (col, codes)
        return codes


class _Layout:
    """What a batch's layout decides in :meth:`_CommAggregate.ingest`, made once and reused while batches
    keep it (a job's steady state: every step the same ranks report the same collectives): its steps
    (``li``, offsets from its first), the payload rows (``sel``: a slice when evenly spaced, so no gather) and
    their (step, key) ``code``; the parts of the sums that depend on the layout only (rows, bytes, calls,
    largest group size, message-size histogram, per step and key) and the members. Only the times and waits
    are folded per batch. ``raw`` (set by :meth:`keep`) holds the columns a later batch is compared with."""

    def __init__(self, agg: "_CommAggregate", li, rank, key, nbytes, count, gs):
        self.nloc = nloc = int(li.max()) + 1
        self.present = np.zeros(1, dtype=np.int64) if nloc == 1 else np.flatnonzero(np.bincount(li, minlength=nloc))
        self.kc, self.R = kc, R = agg._kc, agg.rw.shape[1]
        self.li, self.rank = li, rank
        self.raw = None
        if nloc == 1:
            self.seen = np.zeros((1, R), dtype=bool)
            self.seen[0, rank] = True
        else:
            self.cell = li * R + rank
            # the per-step time and wait totals share one bincount (rows interleaved, the waits in bins
            # nloc + step: each bin adds its rows in order, as the bincount of each would)
            self.loc2 = np.empty(2 * len(li), dtype=np.int64)
            self.loc2[0::2], self.loc2[1::2] = li, li + nloc
            self.buf = np.empty((len(li), 2))
            if nloc * R <= 1 << 24:
                self.seen = np.zeros((nloc, R), dtype=bool)
                self.seen.reshape(-1)[self.cell] = True
            else:
                self.seen = None
                self.rsi = np.searchsorted(self.present, li)  # row -> its step's place in ``present``
        pi = np.flatnonzero(agg._pay[key] & (count > 0) & (nbytes > 0))
        self.sel = None
        if not len(pi):
            return
        d = int(pi[1] - pi[0]) if len(pi) > 1 else 1
        even = d > 0 and bool((np.diff(pi) == d).all())
        self.sel = sel = slice(int(pi[0]), int(pi[-1]) + 1, d) if even else pi
        pk, pli, prank = key[sel], li[sel], rank[sel]
        pcount, pbytes = count[sel], nbytes[sel]
        self.code = code = pk if nloc == 1 else pli * kc + pk
        self.M = M = nloc * kc
        present = self.present
        # time and wait share one bincount: rows interleaved, the wait of code c in bin M + c (each bin
        # still adds its rows in order, as a bincount of its own would)
        self.code2 = np.empty(2 * len(code), dtype=np.int64)
        self.code2[0::2], self.code2[1::2] = code, code + M
        self.pbuf = np.empty((len(code), 2))

        def per_key(w=None):
            return np.bincount(code, weights=w, minlength=M).reshape(nloc, kc)[present]
        self.kbytes, self.kcount, self.krows = per_key(pbytes), per_key(pcount), per_key()
        kgs = np.full(M, np.nan)
        np.fmax.at(kgs, code, gs[sel])
        self.kgs = kgs.reshape(nloc, kc)[present]
        b = np.searchsorted(_HIST_EDGES, pbytes / np.maximum(pcount, 1), side="right")
        nh = len(_HIST_NAMES)
        self.hist = np.bincount(b if nloc == 1 else pli * nh + b, weights=pcount,
                                minlength=nloc * nh).reshape(nloc, nh)[present]
        # the least time per code: a min per run of the rows sorted by code (no ufunc.at)
        order = np.argsort(code, kind="stable")
        self.order = None if bool((order == np.arange(len(order))).all()) else order
        cs = code[order]
        self.starts = np.flatnonzero(np.r_[True, cs[1:] != cs[:-1]])
        self.codes = cs[self.starts]
        # members: sorted unique key << 31 | rank per step, one array per step (equal ones shared)
        raw = (pk << _RANK_BITS) | prank
        if nloc > 1:
            raw |= pli << _LOC_SHIFT
        u = _sorted_unique(raw)
        cut = np.searchsorted(u >> _LOC_SHIFT, np.arange(nloc + 1))
        mask = (np.int64(1) << _LOC_SHIFT) - 1
        self.members, last = [None] * nloc, None
        for p in present.tolist():
            m = u[cut[p]:cut[p + 1]] & mask
            if not len(m):
                continue
            if last is not None and len(last) == len(m) and np.array_equal(last, m):
                m = last
            self.members[p] = last = m

    def keep(self, t: pa.Table, key: np.ndarray, rmin: int, rmax: int) -> None:
        """Mark the layout reusable by the next batch like ``t`` (all of whose rows it holds): keep the
        columns to compare with, unless ``t`` has nulls in them (the fills are not compared)."""
        names = t.column_names
        if "op" not in names or "group" not in names or t.column("op").null_count or t.column("group").null_count:
            return
        raw = {}
        for name in ("rank", "count", "bytes", "group_size"):
            if name in names:
                c = t.column(name)
                if c.null_count:
                    return
                raw[name] = c
        self.raw, self.names, self.n, self.key0 = raw, names, t.num_rows, key
        self.rmin, self.rmax = rmin, rmax

    def least(self, ptime: np.ndarray) -> np.ndarray:
        """The least of ``ptime`` per (step, key), as ``np.minimum.at`` from inf gives it (that where a min
        is zero or NaN, whose sign or payload could depend on the order)."""
        x = ptime if self.order is None else ptime[self.order]
        mins = np.minimum.reduceat(x, self.starts)
        tmp = np.full(self.M, np.inf)
        if (mins == 0).any() or np.isnan(mins).any():
            np.minimum.at(tmp, self.code, ptime)
        else:
            tmp[self.codes] = mins
        return tmp.reshape(self.nloc, self.kc)[self.present]


class _CommAggregate:
    """The comm rows of a job folded, as they arrive, into per-step accumulators: per (step, rank) the wait
    and whether the rank reported, per (step, (op, group) key) the sums :func:`comm_analysis` needs (min and
    sum of the time, wait, bytes, calls, rows, max group size), the message-size histogram and
    the sorted (key, rank) members. ``(op, group)`` are dictionary-encoded to integer keys; steps live in a
    ring of ``slots`` (a step's slot is reclaimed by the step ``slots`` later; rows older than the newest
    step seen minus ``slots`` are dropped). :meth:`analyse` then reads only these small arrays: the same
    result as :func:`comm_analysis` over the rows of the window, at a cost independent of the rows.
    Memory: ``slots`` x (ranks x 9 + keys x 64) bytes."""

    def __init__(self, slots: int):
        self.W = int(min(max(slots, 2), _MAX_SLOTS))
        self.ops, self.groups = _Names(), _Names()
        self._lut = np.full((0, 0), -1, dtype=np.int64)       # (op code, group code) -> key
        self.key_op: list[int] = []                          # op code per key
        self.key_group: list[int] = []
        self._pay = np.zeros(0, dtype=bool)                   # key carries payload (not barrier / wait)
        self.K = 0
        self.slot_step = np.full(self.W, np.iinfo(np.int64).min, dtype=np.int64)
        self.newest = None
        W = self.W
        self.any = np.zeros(W, dtype=bool)
        self.tt, self.tw = np.zeros(W), np.zeros(W)
        self.rw = np.zeros((W, 0))                            # wait per slot and rank
        self.rs = np.zeros((W, 0), dtype=bool)                # rank reported in the slot
        self._kalloc(0)
        self.hist = np.zeros((W, len(_HIST_NAMES)))
        self.members: list[np.ndarray | None] = [None] * W    # sorted key << 31 | rank, payload rows
        self._prev_members = None
        self._prev_keys = (None, None, None)                  # (op codes, group codes, keys) of the last batch
        self._layout: _Layout | None = None                   # the last clean batch's layout
        self._nodes = (None, None, None)                      # (array seen, its copy, codes)
        self._mem_cache = (None, None, None, np.zeros(0), None)  # (members, node codes, (keys, ranks), ranks, nodes)

    # -- storage
    def _kalloc(self, kc: int) -> None:
        W = self.W
        new = {"kmin": np.inf, "ktime": 0.0, "kwait": 0.0, "kbytes": 0.0, "kcount": 0.0, "krows": 0.0,
               "kgs": np.nan}
        old = getattr(self, "_kc", 0)
        for name, fill in new.items():
            a = np.full((W, kc), fill)
            if old:
                a[:, :old] = getattr(self, name)
            setattr(self, name, a)
        self._kc = kc

    def _ralloc(self, rc: int) -> None:
        old = self.rw.shape[1]
        rw, rs = np.zeros((self.W, rc)), np.zeros((self.W, rc), dtype=bool)
        rw[:, :old], rs[:, :old] = self.rw, self.rs
        self.rw, self.rs = rw, rs

    def _reset_slot(self, i: int, step: int) -> None:
        self.slot_step[i] = step
        self.any[i] = False
        self.tt[i] = self.tw[i] = 0.0
        self.rw[i] = 0.0
        self.rs[i] = False
        for name in ("ktime", "kwait", "kbytes", "kcount", "krows"):
            getattr(self, name)[i] = 0.0
        self.kmin[i] = np.inf
        self.kgs[i] = np.nan
        self.hist[i] = 0.0
        self.members[i] = None

    def _keys(self, opc: np.ndarray, grc: np.ndarray) -> np.ndarray:
        po, pg, pk = self._prev_keys
        if po is opc and pg is grc:                         # the codes of the last batch again
            return pk
        key = self._lookup(opc, grc)
        self._prev_keys = (opc, grc, key)
        return key

    def _lookup(self, opc: np.ndarray, grc: np.ndarray) -> np.ndarray:
        no, ng = len(self.ops.names), len(self.groups.names)
        if self._lut.shape != (no, ng):
            lut = np.full((no, ng), -1, dtype=np.int64)
            lut[:self._lut.shape[0], :self._lut.shape[1]] = self._lut
            self._lut = lut
        key = self._lut[opc, grc]
        miss = key < 0
        if miss.any():
            pairs = _sorted_unique(opc[miss] * ng + grc[miss])
            o, g = pairs // ng, pairs % ng
            if self.K + len(pairs) > _MAX_KEYS:
                raise OverflowError("too many (op, group) keys")
            self._lut[o, g] = np.arange(self.K, self.K + len(pairs))
            self.key_op.extend(o.tolist())
            self.key_group.extend(g.tolist())
            self._pay = np.r_[self._pay, [self.ops.names[i] not in ("barrier", "wait") for i in o]]
            self.K += len(pairs)
            if self.K > self._kc:
                self._kalloc(max(self.K, 2 * self._kc, 16))
            key = self._lut[opc, grc]
        return key

    # -- ingest
    def ingest(self, t: pa.Table, rank_limit: int) -> None:
        """Fold a batch of comm rows (any steps, any order) into the accumulators. A batch laid out like the
        last clean one (the same steps relative to its first, ranks, ops, groups, counts, bytes and group
        sizes: a job's steady state) reuses that batch's :class:`_Layout` and folds only its times and waits."""
        n = t.num_rows
        if n == 0 or "step" not in t.column_names or "rank" not in t.column_names:
            return
        lay = self._layout
        if lay is not None and self._fold_same(lay, t, rank_limit):
            return
        self._layout = None
        lo_int = np.iinfo(np.int64).min
        step, rank = _col_i64(t, "step", lo_int), _col_i64(t, "rank", -1)
        time_ms, wait_ms = _col_f64(t, "time_ms", 0.0), _col_f64(t, "wait_ms", 0.0)
        nbytes, count, gs = _col_f64(t, "bytes", 0.0), _col_f64(t, "count", 1.0), _col_f64(t, "group_size", np.nan)
        op = t.column("op") if "op" in t.column_names else pa.nulls(n, pa.string())
        opc = self.ops.codes(pc.fill_null(op, "?") if op.null_count else op)
        if "group" in t.column_names:
            grp = t.column("group")
            grc = self.groups.codes(pc.fill_null(grp, "") if grp.null_count else grp)
        else:
            grc = np.full(n, self.groups.codes(pa.array([""]))[0], dtype=np.int64)
        ok = (step != lo_int) & (rank >= 0) & (rank < rank_limit)
        all_ok = bool(ok.all())
        if not all_ok and not ok.any():
            return
        top = int(step.max() if all_ok else step[ok].max())
        self.newest = top if self.newest is None else max(self.newest, top)
        ok &= step > self.newest - self.W
        clean = bool(ok.all())
        if not clean:
            if not ok.any():
                return
            step, rank, time_ms, wait_ms, nbytes, count, gs, opc, grc = (
                a[ok] for a in (step, rank, time_ms, wait_ms, nbytes, count, gs, opc, grc))
        key = self._keys(opc, grc)
        rc = int(rank.max()) + 1
        if rc > self.rw.shape[1]:
            self._ralloc(max(rc, self.rw.shape[1] + self.rw.shape[1] // 4))
        smin = int(step.min())
        lay = _Layout(self, step - smin, rank, key, nbytes, count, gs)
        if clean:
            lay.keep(t, key, int(rank.min()), rc - 1)
            self._layout = lay if lay.raw is not None else None
        self._fold(lay, smin, time_ms, wait_ms)

    def _fold_same(self, lay: "_Layout", t: pa.Table, rank_limit: int) -> bool:
        """Fold ``t`` by ``lay`` if ``t`` is laid out like the batch ``lay`` was made of (and every row is
        kept); False (nothing folded) otherwise."""
        if t.num_rows != lay.n or t.column_names != lay.names:
            return False
        if lay.rmax >= rank_limit or lay.rmin < 0 or self._kc != lay.kc or self.rw.shape[1] != lay.R:
            return False
        sc = t.column("step")
        if sc.null_count:
            return False
        step = _col_i64(t, "step", 0)
        smin, smax = int(step.min()), int(step.max())
        if smax - smin + 1 != lay.nloc or (lay.nloc > 1 and not np.array_equal(step - smin, lay.li)):
            return False
        if smin <= max(self.newest, smax) - self.W:
            return False
        for name, prev in lay.raw.items():
            c = t.column(name)
            if c.null_count or not c.equals(prev):
                return False
        op, grp = t.column("op"), t.column("group")
        if op.null_count or grp.null_count or self._keys(self.ops.codes(op), self.groups.codes(grp)) is not lay.key0:
            return False
        self.newest = max(self.newest, smax)
        self._fold(lay, smin, _col_f64(t, "time_ms", 0.0), _col_f64(t, "wait_ms", 0.0))
        return True

    def _fold(self, lay: "_Layout", smin: int, time_ms: np.ndarray, wait_ms: np.ndarray) -> None:
        """Add a batch to the accumulators: its layout's parts as ``lay`` has them, its times and waits."""
        nloc, present, R = lay.nloc, lay.present, lay.R
        slots = (smin + present) % self.W
        for p, i in zip(present.tolist(), slots.tolist()):
            if self.slot_step[i] != smin + p:
                self._reset_slot(i, smin + p)
        # every row: time and wait totals, per-rank wait and presence
        self.any[slots] = True
        if nloc == 1:                                       # the usual batch: one step
            self.tt[slots] += time_ms.sum()
            self.tw[slots] += wait_ms.sum()
            self.rw[slots[0]] += np.bincount(lay.rank, weights=wait_ms, minlength=R)
            np.logical_or(self.rs[slots[0]], lay.seen[0], out=self.rs[slots[0]])
        else:
            buf = lay.buf
            buf[:, 0], buf[:, 1] = time_ms, wait_ms
            sums = np.bincount(lay.loc2, weights=buf.reshape(-1), minlength=2 * nloc)
            self.tt[slots] += sums[:nloc][present]
            self.tw[slots] += sums[nloc:][present]
            self.rw[slots] += np.bincount(lay.cell, weights=wait_ms, minlength=nloc * R).reshape(nloc, R)[present]
            if lay.seen is not None:
                self.rs[slots] |= lay.seen[present]
            else:
                self.rs.reshape(-1)[slots[lay.rsi] * R + lay.rank] = True
        # payload rows: per (step, key)
        if lay.sel is None:
            return
        sel, code, M, kc = lay.sel, lay.code, lay.M, lay.kc
        pb = lay.pbuf
        pb[:, 0], pb[:, 1] = time_ms[sel], wait_ms[sel]
        sums = np.bincount(lay.code2, weights=pb.reshape(-1), minlength=2 * M)
        self.ktime[slots] += sums[:M].reshape(nloc, kc)[present]
        self.kwait[slots] += sums[M:].reshape(nloc, kc)[present]
        ptime = pb[:, 0]
        self.kbytes[slots] += lay.kbytes
        self.kcount[slots] += lay.kcount
        self.krows[slots] += lay.krows
        self.kmin[slots] = np.minimum(self.kmin[slots], lay.least(ptime))
        self.kgs[slots] = np.fmax(self.kgs[slots], lay.kgs)
        self.hist[slots] += lay.hist
        # members: sorted unique key << 31 | rank per step
        for p, i in zip(present.tolist(), slots.tolist()):
            m = lay.members[p]
            if m is None:
                continue
            old = self.members[i]
            if old is not None:
                m = _sorted_unique(np.concatenate([old, m]))
            prev = self._prev_members
            if prev is not None and prev is not m and len(prev) == len(m) and np.array_equal(prev, m):
                m = prev                                    # the same members as before: share the array
            self.members[i] = self._prev_members = m

    # -- analysis
    def _node_codes(self, nodes) -> np.ndarray | None:
        if nodes is None or not len(nodes):
            return None
        seen, copy, codes = self._nodes
        if not (seen is nodes and len(copy) == len(nodes) and np.array_equal(copy, nodes)):
            arr = np.asarray(nodes, dtype=object)
            try:                                            # hash encoding (only equality matters here)
                d = pa.array(arr, pa.string(), from_pandas=True).dictionary_encode()
                codes = pc.fill_null(d.indices, len(d.dictionary)).to_numpy()
            except (pa.ArrowException, TypeError):
                _, codes = np.unique(arr.astype(str), return_inverse=True)
            self._nodes = (nodes, arr.copy(), codes.astype(np.int64))
            codes = self._nodes[2]
        return codes

    def analyse(self, lo: int, hi: int, nodes, family: str | None, step_ms: float,
                link_gbps: dict | None = None, link: str | None = None) -> dict:
        """:func:`comm_analysis` of the rows of steps ``lo..hi``, from the accumulators; the groups in
        the order their (op, group) was first seen, with their ``key``; ``members`` (key and rank of the
        window's payload members) for naming a group's ranks."""
        sl = np.flatnonzero((self.slot_step >= lo) & (self.slot_step <= hi) & self.any)
        if not len(sl):
            return {}
        peaks = dict(LINK_GBPS, **(link_gbps or {}))
        n_steps = len(sl)
        rows_sl = sl.tolist()
        seen, rwait = self.rs[rows_sl[0]].copy(), self.rw[rows_sl[0]].copy()
        for i in rows_sl[1:]:                               # a few (steps) vector ops, no (steps x ranks) copy
            seen |= self.rs[i]
            rwait += self.rw[i]
        n_ranks = max(int(seen.sum()), 1)
        tot_time, tot_wait = float(self.tt[sl].sum()), float(self.tw[sl].sum())
        out = {"wait_share": tot_wait / tot_time if tot_time > 0 else None,
               "comm_share": tot_time / (n_steps * n_ranks) / step_ms if step_ms and step_ms > 0 else None,
               "steps": n_steps, "ranks": n_ranks}
        rk = np.flatnonzero(seen)
        out["rank_wait"] = (rk, rwait[rk] / n_steps)
        # each step's least per-rank wait (what every rank waited: the collective's own latency)
        out["floor_wait"] = sum(float(self.rw[i][self.rs[i]].min()) if self.rs[i].any() else 0.0
                                for i in rows_sl) / n_steps
        K = self.K
        krows = self.krows[sl, :K]
        P = krows > 0
        nst = P.sum(axis=0)
        keys = np.flatnonzero(nst)
        if not len(keys):
            out["groups"] = None
            out["hist"] = {}
            return out
        rows = krows.sum(axis=0)[keys]
        nst = nst[keys].astype(float)
        calls = self.kcount[sl, :K].sum(axis=0)[keys]
        byts = self.kbytes[sl, :K].sum(axis=0)[keys]
        xfer = np.where(P, self.kmin[sl, :K], 0.0).sum(axis=0)[keys]
        tsum = self.ktime[sl, :K].sum(axis=0)[keys]
        wsum = self.kwait[sl, :K].sum(axis=0)[keys]
        gsz = np.fmax.reduce(self.kgs[sl, :K], axis=0)[keys]
        # distinct ranks and nodes per key over the window: union of the steps' members
        distinct: list[np.ndarray] = []
        for i in sl.tolist():
            m = self.members[i]
            if m is None or any(m is d for d in distinct):
                continue
            if distinct and len(distinct[-1]) == len(m) and np.array_equal(distinct[-1], m):
                continue
            distinct.append(m)
        mem = distinct[0] if len(distinct) == 1 else _sorted_unique(np.concatenate(distinct))
        codes = self._node_codes(nodes)
        cm = self._mem_cache
        if cm[0] is mem and cm[1] is codes and len(cm[3]) >= K:
            mk, mr, nrk_all, nnd_all = cm[2][0], cm[2][1], cm[3], cm[4]     # the same members as last time
        else:
            mk, mr = mem >> _RANK_BITS, mem & ((1 << _RANK_BITS) - 1)
            nrk_all = np.bincount(mk, minlength=K).astype(float)
            if codes is None:
                nnd_all = np.ones(K)
            else:
                nc = np.where(mr < len(codes), codes[np.minimum(mr, len(codes) - 1)], -1) + 1
                span = int(codes.max()) + 2 if len(codes) else 1
                nnd_all = np.bincount(_sorted_unique(mk * span + nc) // span, minlength=K).astype(float)
            self._mem_cache = (mem, codes, (mk, mr), nrk_all, nnd_all)
        nrk, nnd = nrk_all[keys], nnd_all[keys]
        gsz = np.where(np.isfinite(gsz) & (gsz > 0), gsz, nrk)
        calls_rank_step = calls / np.maximum(rows, 1)
        bpc = byts / np.maximum(calls, 1)
        xfer_per_call = xfer / np.maximum(nst * calls_rank_step, 1e-12)
        opk = np.asarray(self.key_op, dtype=np.int64)[keys]
        alg = np.full(len(keys), np.nan)
        bus = np.full(len(keys), np.nan)
        for o in np.unique(opk).tolist():
            m = opk == o
            alg[m], bus[m] = bus_bandwidth(self.ops.names[o], gsz[m], bpc[m], xfer_per_call[m])
        if link:
            kinds = [link]
            li = np.zeros(len(keys), dtype=np.int64)
        else:
            kinds = [link_type(family, 1), link_type(family, 2)]
            li = (nnd > 1).astype(np.int64)
        peak = np.array([peaks.get(k, np.nan) for k in kinds], dtype=float)[li]
        sat = np.array([SATURATE_BYTES.get(k, 4 * 2**20) for k in kinds], dtype=float)[li]
        names_k = np.array(kinds, dtype=object)[li]
        out["groups"] = {
            "op": [self.ops.names[o] for o in opk.tolist()],
            "group": [self.groups.names[self.key_group[k]] for k in keys.tolist()],
            "group_size": gsz.astype(np.int64), "ranks": nrk.astype(np.int64), "link": names_k.tolist(),
            "calls_per_step": calls_rank_step, "bytes_per_call": bpc, "xfer_ms_per_step": xfer / np.maximum(nst, 1),
            "time_ms_per_step": tsum / np.maximum(rows, 1),
            "wait_share": np.where(tsum > 0, wsum / np.maximum(tsum, 1e-12), np.nan),
            "algbw_gbps": alg, "busbw_gbps": bus, "peak_gbps": peak,
            "util": bus / peak, "saturate_bytes": sat, "calls": calls, "time_sum": tsum, "rows": rows,
            "key": keys,
        }
        out["members"] = (mk, mr)
        h = self.hist[sl].sum(axis=0)
        out["hist"] = {_HIST_NAMES[i]: int(h[i]) for i in range(len(_HIST_NAMES))}
        return out

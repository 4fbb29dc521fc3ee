"""The node agent's columnar decoder of the probe's datagrams.

The probe's frames (layout: :mod:`stepwatch.wire.datagram`) are fixed-size records, so the agent reads
them as numpy structured arrays over the same bytes (:data:`STEP_DT`, :data:`PHASE_DT`, :data:`COMM_DT`,
:data:`GCREC_DT`, checked against the structs at import) instead of a dict per row:

- :func:`stepwatch.wire.datagram.scan` (the one walk over the frame headers, which
  :func:`~stepwatch.wire.datagram.decode` also uses) validates each datagram as it arrives, without
  unpacking a record;
- :class:`BatchColumns` keeps the scanned datagrams of each job until the agent's tick, then gathers every
  record of the tick with one fancy index per record type and builds the ``steps``, ``comm`` and ``gc``
  Arrow record batches column by column (:func:`steps_table`, :func:`comm_table`, :func:`gc_table`) with
  nanoarrow (:mod:`stepwatch.wire.lite`: the agent loads no pyarrow).

Rows are the same as :func:`stepwatch.agents.agent.rows_from_batch` gives (tests/unit/test_wirecols.py checks
it, value for value).
"""
from __future__ import annotations

import collections

import nanoarrow as na
import numpy as np

from stepwatch.wire import datagram
from stepwatch.wire import lite
from stepwatch.wire.lite import Batch

HDR_DT = np.dtype([("magic", "<u2"), ("version", "u1"), ("type", "u1"), ("instance", "<i4"), ("rank", "<i4"),
                   ("n_step", "u1"), ("n_comm", "u1"), ("n_gc", "u1"), ("n_phase", "u1")])
STEP_DT = np.dtype([("step", "<i8"), ("t_start", "<i8"), ("t_end", "<i8"), ("step_ns", "<f8"), ("data_ns", "<f8"),
                    ("compute_ns", "<f8"), ("comm_ns", "<f8"), ("comm_wait_ns", "<f8"), ("gc_ns", "<f8"),
                    ("gc_count", "<i4"), ("data_queue", "<i4"), ("samples", "<i8"), ("tokens", "<i8"),
                    ("probe_dropped", "<u4"), ("_pad", "V4"), ("cpu_ns", "<f8"), ("cpu_wait_ns", "<f8"),
                    ("comm_total_ns", "<f8"), ("comm_exposed_ns", "<f8")])
#: the fields an older STEP record lacks (null: -1), per wire version
_LACKS = {1: ("cpu_ns", "cpu_wait_ns", "comm_total_ns", "comm_exposed_ns"), 2: ("comm_total_ns", "comm_exposed_ns")}
PHASE_DT = np.dtype([("name", "<u2"), ("_pad", "V6"), ("ns", "<f8")])
COMM_DT = np.dtype([("op", "<u2"), ("group", "<u2"), ("_pad", "V4"), ("calls", "<i8"), ("bytes", "<i8"),
                    ("time_ns", "<f8"), ("wait_ns", "<f8")])
GCREC_DT = np.dtype([("t_end", "<i8"), ("duration_ns", "<f8"), ("generation", "u1"), ("_pad", "V7"),
                     ("collected", "<i8"), ("uncollectable", "<i8")])
assert (HDR_DT.itemsize, STEP_DT.itemsize, PHASE_DT.itemsize, COMM_DT.itemsize, GCREC_DT.itemsize) == (
    datagram.HDR.size, datagram.STEP.size, datagram.PHASE.size, datagram.COMM.size, datagram.GCREC.size)
assert tuple(n for n in STEP_DT.names if n != "_pad") == datagram.STEP_FIELDS

KINDS = ("steps", "comm", "gc")  # the tables :func:`tables` returns, in this order
F64, I32, I64, TS = na.float64(), na.int32(), na.int64(), na.timestamp("ns", "UTC")
_WIDTH = {"g": 8, "i": 4, "l": 8, "tsn:UTC": 8}     # bytes per value of each column type used here
_MAP = list(na.c_schema(lite.SCHEMAS["steps"]).children)[15]   # phases: map<string, double>
assert _MAP.name == "phases"


def last_dropped(data: bytes, frames: list[tuple]) -> int | None:
    """The probe's own drop counter from the last step record of a scanned datagram (None: no step)."""
    for off, _, _, n_step, *_ in reversed(frames):
        if n_step:
            return datagram.STEP_V1.unpack_from(data, off + datagram.HDR.size)[13]
    return None


def _gather(u8: np.ndarray, offsets: list[int], dt: np.dtype, size: int | None = None) -> np.ndarray:
    """The records of type ``dt`` at byte ``offsets`` of ``u8``, as one structured array (one fancy index).
    ``size`` < itemsize: shorter (older) records, the rest zero."""
    size = dt.itemsize if size is None else size
    if not offsets:
        return np.zeros(0, dt)
    idx = np.asarray(offsets, np.int64)[:, None] + np.arange(size, dtype=np.int64)
    raw = u8[idx]
    if size < dt.itemsize:
        raw = np.concatenate([raw, np.zeros((len(offsets), dt.itemsize - size), np.uint8)], axis=1)
    return np.ascontiguousarray(raw).view(dt).ravel()


def _keys(own: np.ndarray, ids: np.ndarray) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The distinct (probe, name id) pairs of records and, per record, the index of its pair."""
    key = own.astype(np.int64) << 16 | ids.astype(np.int64)
    uniq, inv = np.unique(key, return_inverse=True)
    return [(k >> 16, k & 0xFFFF) for k in uniq.tolist()], inv.astype(np.int32).ravel()


def _strings(inv: np.ndarray, strs: list[str]):
    """``strs[inv]`` as a string column."""
    return na.c_array([strs[i] for i in inv.tolist()], na.string())


def _names(idents: list, own: np.ndarray, ids: np.ndarray):
    """Name strings of ``ids`` (interned by the probe of ``idents[own]``; ``#id`` when unknown): each
    distinct (probe, id) is looked up once."""
    if not len(ids):
        return na.c_array([], na.string())
    pairs, inv = _keys(own, ids)
    return _strings(inv, [idents[o].names.get(i, f"#{i}") for o, i in pairs])


def _valid(null: np.ndarray | None) -> tuple[bytes | None, int]:
    """The validity bitmap (LSB first; None: no null) and null count of the mask ``null``."""
    n_null = int(np.count_nonzero(null)) if null is not None else 0
    return (np.packbits(~null, bitorder="little").tobytes() if n_null else None), n_null


def _arr(a: np.ndarray, t, null: np.ndarray | None = None):
    """numpy values ``a`` as an Arrow array of type ``t`` of their width (a timestamp: int64 ns), ``null``
    where ``null`` is True: Arrow's layout of a fixed-width column is the values' buffer and a validity
    bitmap (LSB first), so the values' buffer is the column's (``c_array_from_buffers``)."""
    a = np.ascontiguousarray(a)
    if a.dtype.itemsize != _WIDTH[na.c_schema(t).format] or a.dtype.kind not in "iuf":
        raise TypeError(f"_arr: numpy {a.dtype} is not the layout of {t}")
    valid, n_null = _valid(null)
    return na.c_array_from_buffers(t, len(a), [valid, a], null_count=n_null)


def _opt(a: np.ndarray, t):
    """Negative = null (the probe's -1)."""
    return _arr(a, t, a < 0)


class BatchColumns:
    """Scanned batch datagrams per job, until the tick turns them into tables."""

    def __init__(self):
        self.pending: dict[str, list] = collections.defaultdict(list)    # job -> [(ident, data, frames)]

    def add(self, ident, data: bytes, frames: list[tuple]) -> tuple[int, int, int]:
        """Keep one scanned datagram of ``ident``'s probe; returns its (steps, comm, gc) record counts as
        the rows will have them (comm records of a frame without a step are not rows)."""
        self.pending[ident.job].append((ident, bytes(data), frames))
        n_s = n_c = n_g = 0
        for _, _, _, n_step, _, n_comm, n_gc in frames:
            n_s += n_step
            n_c += n_comm if n_step else 0
            n_g += n_gc
        d = last_dropped(data, frames)
        if d is not None:
            ident.dropped = d
        return n_s, n_c, n_g

    def take(self) -> dict[str, list[tuple]]:
        """Per job, ``(steps, comm, gc)`` tables (None where no record) of everything kept, in groups of
        datagrams of at most :data:`~stepwatch.wire.lite.MAX_ROWS` rows of each kind (one message each);
        then empty."""
        per_job, self.pending = self.pending, collections.defaultdict(list)
        out = {}
        for job, chunks in per_job.items():
            groups, cur, n = [], [], 0
            for c in chunks:
                k = sum(f[3] + f[5] + f[6] for f in c[2])        # a bound of its rows of any one kind
                if cur and n + k > lite.MAX_ROWS:
                    groups.append(cur)
                    cur, n = [], 0
                cur.append(c)
                n += k
            if cur:
                groups.append(cur)
            out[job] = [tables(g) for g in groups]
        return out


def tables(chunks: list[tuple]) -> tuple[Batch | None, Batch | None, Batch | None]:
    """The ``steps``, ``comm`` and ``gc`` tables of scanned datagrams ``[(ident, data, frames)]`` of one job."""
    idents: list = []
    ident_ix: dict[int, int] = {}
    datas, base = [], 0
    s_cur, s_own = [], []                         # step offsets (current version), owner
    s_old: dict[int, tuple[list, list]] = {}      # older versions: (their offsets, their order among the steps)
    p_off, p_step = [], []                        # phase offsets, index of their step
    c_off, c_own, c_step = [], [], []             # comm offsets, owner, index of their step
    g_off, g_own = [], []
    hs, ps, cs, gs = datagram.HDR.size, datagram.PHASE.size, datagram.COMM.size, datagram.GCREC.size
    n_steps = 0
    for ident, data, frames in chunks:
        oi = ident_ix.get(id(ident))
        if oi is None:
            oi = ident_ix[id(ident)] = len(idents)
            idents.append(ident)
        datas.append(data)
        for off, _, ver, n_step, n_phase, n_comm, n_gc in frames:
            p = base + off + hs
            if n_step:
                if ver == datagram.VERSION:
                    s_cur.append(p)
                else:
                    offs, order = s_old.setdefault(ver, ([], []))
                    offs.append(p)
                    order.append(n_steps)
                p += datagram.STEP_BY_VERSION[ver].size
                s_own.append(oi)
                for _ in range(n_phase):
                    p_off.append(p)
                    p_step.append(n_steps)
                    p += ps
                for _ in range(n_comm):
                    c_off.append(p)
                    c_own.append(oi)
                    c_step.append(n_steps)
                    p += cs
                n_steps += 1
            else:
                p += n_phase * ps + n_comm * cs          # (phases and comm without a step: no row)
            for _ in range(n_gc):
                g_off.append(p)
                g_own.append(oi)
                p += gs
        base += len(data)
    u8 = np.frombuffer(b"".join(datas), np.uint8)
    steps = None
    if n_steps:
        st = np.zeros(n_steps, STEP_DT)
        cur = np.ones(n_steps, bool)
        for ver, (offs, order) in s_old.items():
            cur[order] = False
            old = _gather(u8, offs, STEP_DT, datagram.STEP_BY_VERSION[ver].size)
            for f in _LACKS[ver]:
                old[f] = -1.0
            st[order] = old
        st[cur] = _gather(u8, s_cur, STEP_DT)
        own = np.asarray(s_own, np.int32)
        steps = steps_table(idents, own, st, _gather(u8, p_off, PHASE_DT), np.asarray(p_step, np.int64))
        comm = comm_table(idents, np.asarray(c_own, np.int32), st["step"][np.asarray(c_step, np.int64)],
                          _gather(u8, c_off, COMM_DT)) if c_off else None
    else:
        comm = None
    gc = gc_table(idents, np.asarray(g_own, np.int32), _gather(u8, g_off, GCREC_DT)) if g_off else None
    return steps, comm, gc


def _base(idents: list, own: np.ndarray) -> list:
    """The ``job``, ``node`` and ``rank`` columns of records owned by ``idents[own]``."""
    job = _strings(own, [i.job for i in idents])       # (one job per table: the agent keeps them apart)
    node = _strings(own, [i.node for i in idents])
    rank = _arr(np.asarray([i.rank for i in idents], np.int32)[own], I32)
    return [job, node, rank]


def steps_table(idents: list, own: np.ndarray, st: np.ndarray, ph: np.ndarray, ph_step: np.ndarray) -> Batch:
    n = len(st)
    counts = np.bincount(ph_step, minlength=n) if len(ph_step) else np.zeros(n, np.int64)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    keys = _names(idents, own[ph_step] if len(ph_step) else np.zeros(0, np.int32), ph["name"])
    valid, n_null = _valid(counts == 0)          # a step without phases has a null map
    (entries,) = _MAP.children
    kv = na.c_array_from_buffers(entries, len(ph), [None], null_count=0, children=[keys, _arr(ph["ns"] / 1e6, F64)])
    phases = na.c_array_from_buffers(_MAP, n, [valid, offsets], null_count=n_null, children=[kv])
    cpu, cw = st["cpu_ns"], st["cpu_wait_ns"]
    tot, exp = st["comm_total_ns"], st["comm_exposed_ns"]
    cols = _base(idents, own) + [
        _arr(st["step"], I64), _arr(st["t_start"], TS), _arr(st["t_end"], TS),
        _arr(st["step_ns"] / 1e6, F64), _arr(st["data_ns"] / 1e6, F64), _arr(st["compute_ns"] / 1e6, F64),
        _arr(st["comm_ns"] / 1e6, F64), _arr(st["comm_wait_ns"] / 1e6, F64), _arr(st["gc_ns"] / 1e6, F64),
        _arr(st["gc_count"], I32), _opt(st["samples"], I64), _opt(st["tokens"], I64),
        phases, _opt(st["data_queue"], I32),
        _arr(cpu / 1e6, F64, cpu < 0), _arr(cw / 1e6, F64, cw < 0),
        _arr(tot / 1e6, F64, tot < 0), _arr(exp / 1e6, F64, exp < 0)]
    return lite.from_columns("steps", n, cols)


def comm_table(idents: list, own: np.ndarray, step: np.ndarray, cm: np.ndarray) -> Batch:
    pairs, inv = _keys(own, cm["group"])
    gnames, gsizes = [], []
    for o, i in pairs:                     # each distinct (probe, group): its name, and its size from the hello
        name = idents[o].names.get(i, f"#{i}")
        gs = idents[o].hello.get("group_sizes")
        v = gs.get(name) if isinstance(gs, dict) else None
        gnames.append(name)
        gsizes.append(v if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 31 else -1)
    gsize = np.asarray(gsizes, np.int32)[inv]         # in range: < 2**31 or -1 (no cast, see _ts)
    cols = _base(idents, own) + [
        _arr(step, I64), _names(idents, own, cm["op"]), _strings(inv, gnames),
        _arr(cm["calls"], I64), _arr(cm["bytes"], I64), _arr(cm["time_ns"] / 1e6, F64),
        _arr(cm["wait_ns"] / 1e6, F64), _opt(gsize, I32)]
    return lite.from_columns("comm", len(cm), cols)


def gc_table(idents: list, own: np.ndarray, g: np.ndarray) -> Batch:
    cols = _base(idents, own) + [
        _arr(g["t_end"], TS), _arr(g["generation"].astype(np.int32), I32),
        _arr(g["duration_ns"] / 1e6, F64), _arr(g["collected"], I64),
        _arr(g["uncollectable"], I64)]
    return lite.from_columns("gc", len(g), cols)

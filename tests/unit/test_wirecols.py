"""The agent's columnar decoder (stepwatch/wire/columns.py) against the row decoder it replaced (probe.decode +
agent.rows_from_batch): same tables, value for value, on real probes' datagrams (both hot paths) and on
version-1 frames; the same datagrams rejected."""
from __future__ import annotations

import gc
import os
import socket
import struct

import pyarrow as pa
import pytest

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import validate
from stepwatch.wire import columns, datagram
from stepwatch.agents.agent import identity_from_hello, rows_from_batch
from stepwatch.agents.probe import BadDatagram, Probe, decode, eventlog

pytestmark = pytest.mark.unit


def _raw(d: str):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(os.path.join(d, datagram.SOCKET_NAME))
    s.setblocking(False)
    return s


def _read(s) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(s.recv(65536))
        except BlockingIOError:
            return out


def _by_rows(datagrams: list[bytes], node: str = "n1"):
    """The tables the agent built before: a dict per row, then from_pylist."""
    idents, steps, comm, gcs = {}, [], [], []
    for d in datagrams:
        frames = decode(d)
        if frames[0][0] == datagram.T_HELLO:
            idents[frames[0][1]] = identity_from_hello(frames[0][3], node, None)
            continue
        for _, inst, _, body in frames:
            s, c, g = rows_from_batch(idents[inst], body)
            steps += [s] if s is not None else []
            comm += c
            gcs += g
    mk = lambda rows, schema: pa.Table.from_pylist(rows, schema=schema) if rows else None  # noqa: E731
    return mk(steps, wire.STEPS), mk(comm, wire.COMM), mk(gcs, wire.GC)


def _same(a: pa.Table, b: pa.Table) -> None:
    assert b.schema == a.schema, (a.schema, b.schema)
    for name in a.column_names:
        x, y = a.column(name).combine_chunks(), b.column(name).combine_chunks()
        assert x.equals(y), (name, x.slice(0, 5), y.slice(0, 5))
    assert b.equals(a)


def _by_columns(datagrams: list[bytes], node: str = "n1"):
    idents, bc = {}, columns.BatchColumns()
    counts = [0, 0, 0]
    for d in datagrams:
        typ, inst, frames = datagram.scan(d)
        if typ == datagram.T_HELLO:
            idents[inst] = identity_from_hello(decode(d)[0][3], node, None)
            continue
        for i, n in enumerate(bc.add(idents[inst], d, frames)):
            counts[i] += n
    (job, groups), = bc.take().items()
    (tabs,) = groups                                    # (one message's worth: under lite.MAX_ROWS rows)
    tabs = [None if t is None else pa.table(t) for t in tabs]     # nanoarrow's batches, read by pyarrow
    assert [t.num_rows if t is not None else 0 for t in tabs] == counts      # (the agent's records_in)
    return tabs


@pytest.fixture(params=["c", "python"])
def hot_path(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(eventlog, "_fast", None)
    return request.param


def test_columns_equal_rows_on_real_probes(sockdir, hot_path):
    rx = _raw(sockdir)
    probes = [Probe().init(job="cols", rank=r, world_size=2, socket_dir=sockdir, auto=False, flush_ms=100000,
                           dp=2) for r in range(2)]
    try:
        ar, bc, dp, world = (probes[0].names.intern(n) for n in ("all_reduce", "broadcast", "dp", "world"))
        for p in probes[1:]:
            for n in ("all_reduce", "broadcast", "dp", "world"):
                p.names.intern(n)
        probes[0].names.group_sizes["dp"] = 2              # (as a wrapped collective records it, for the hello)
        for i in range(40):
            for r, p in enumerate(probes):
                with p.step(samples=8 if i % 3 else None, tokens=4096 if i % 2 else None):
                    if i % 4 == 0:
                        with p.phase("forward"):
                            pass
                        p.add_phase("backward", 1.5 + r)
                    if i % 5:
                        p.hooks._record_comm(ar, dp, 1 << 20, 2_000_000 + i, 500_000.0)
                        p.hooks._record_comm(bc, world, 1024, 30_000, 10_000.0)
                    if i == 7:
                        gc.collect()
                        gc.collect(0)
            if i == 20:
                for p in probes:
                    p.flush()
        for p in probes:
            p.flush()
        grams = _read(rx)
    finally:
        for p in probes:
            p.shutdown()
        rx.close()
    rows = _by_rows(grams)
    cols = _by_columns(grams)
    assert rows[0].num_rows == 80 and rows[1].num_rows > 0 and rows[2] is not None
    for a, b in zip(rows, cols):
        _same(a, b)
    assert validate("steps", cols[0])[1] == []
    sizes = {(r["rank"], r["group"]): r["group_size"] for r in cols[1].to_pylist()}
    assert sizes[(0, "dp")] == 2 and sizes[(1, "dp")] is None       # from the hello that said it


def test_version1_frames_and_frames_without_a_step():
    inst = 77
    hello = datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, inst, 3, 0, 0, 0, 0) + b'{"job": "old", "rank": 3, "world_size": 4, ' \
        b'"names": {"1": "all_reduce", "2": "dp", "5": "fwd"}}'
    v1 = (datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_BATCH, inst, 3, 1, 1, 1, 1) + datagram.STEP_V1.pack(5, 1, 2, 1e6, 0, 1e6, 0, 0, 0, 0,
                                                                                   -1, -1, -1, 9)
          + datagram.PHASE.pack(5, 2e6) + datagram.COMM.pack(1, 2, 3, 4096, 1e6, 0.5e6) + datagram.GCREC.pack(15, 2e6, 2, 10, 0))
    v2 = (datagram.HDR.pack(datagram.MAGIC, 2, datagram.T_BATCH, inst, 3, 1, 0, 0, 0)
          + datagram.STEP_V2.pack(6, 2, 3, 1e6, 0, 1e6, 0, 0, 0, 0, 4, 8, 100, 11, 3e5, -1.0))
    v3 = (datagram.HDR.pack(datagram.MAGIC, 3, datagram.T_BATCH, inst, 3, 1, 0, 0, 0)
          + datagram.STEP.pack(7, 3, 4, 1e6, 0, 1e6, 0, 0, 0, 0, 4, 8, 100, 12, 3e5, -1.0, 4e5, 1e5))
    alone = (datagram.HDR.pack(datagram.MAGIC, 2, datagram.T_BATCH, inst, 3, 0, 1, 2, 0) + datagram.COMM.pack(1, 2, 1, 8, 1.0, 0.0)
             + datagram.GCREC.pack(20, 1e6, 0, 1, 0) + datagram.GCREC.pack(21, 1e6, 1, 2, 0))      # gc burst: no step, no comm row
    grams = [hello, v1 + v2 + v3, alone]
    rows, cols = _by_rows(grams), _by_columns(grams)
    for a, b in zip(rows, cols):
        _same(a, b)
    s = cols[0].select(["cpu_ms", "phases", "comm_total_ms", "comm_exposed_ms"]).to_pylist()
    assert [r["cpu_ms"] for r in s] == [None, 0.3, 0.3] and s[0]["phases"] == [("fwd", 2.0)] and s[1]["phases"] is None
    assert [(r["comm_total_ms"], r["comm_exposed_ms"]) for r in s] == [(None, None), (None, None), (0.4, 0.1)]
    assert cols[1].num_rows == 1 and cols[2].num_rows == 3
    _, _, frames = datagram.scan(v1 + v2 + v3)
    assert columns.last_dropped(v1 + v2 + v3, frames) == 12


def test_scan_rejects_what_decode_rejects():
    good = datagram.HDR.pack(datagram.MAGIC, 3, datagram.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(datagram.STEP.size)
    assert datagram.scan(good + good)[2] == [(0, 1, 3, 1, 0, 0, 0), (152, 1, 3, 1, 0, 0, 0)]
    bad = [b"", b"xx", good[:-1], good + b"\0", struct.pack("<H", 0x1234) + good[2:],
           datagram.HDR.pack(datagram.MAGIC, 9, datagram.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(datagram.STEP.size),
           datagram.HDR.pack(datagram.MAGIC, 1, 7, 1, 0, 0, 0, 0, 0),
           datagram.HDR.pack(datagram.MAGIC, 3, datagram.T_BATCH, 1, 0, 2, 0, 0, 0) + bytes(2 * datagram.STEP.size),
           datagram.HDR.pack(datagram.MAGIC, 2, datagram.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(datagram.STEP_V1.size),
           datagram.HDR.pack(datagram.MAGIC, 3, datagram.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(datagram.STEP_V2.size),
           datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_BATCH, 1, 0, 0, 99, 0, 0),
           good + datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, 1, 0, 0, 0, 0, 0) + b"{}", good + good[:20]]
    for b in bad:
        with pytest.raises(BadDatagram):
            decode(b)
        with pytest.raises(BadDatagram):
            datagram.scan(b)


def test_columns_from_numpy_buffers_encode_to_the_bytes_pa_array_gives():
    """The agent's columns are built from their numpy buffers (``columns._arr``: no ``numpy.ma``, no cast);
    each one is the array ``pa.array(values, type, mask=)`` gives, and its Arrow IPC stream the same bytes:
    odd lengths, no / some / all nulls, strided (a field of the records) and contiguous values."""
    import numpy as np

    from stepwatch.wire.encode import encode_arrow

    rng = np.random.default_rng(7)
    rec = np.zeros(37, columns.STEP_DT)
    rec["samples"] = np.where(rng.random(37) < 0.4, -1, rng.integers(0, 1 << 40, 37))
    rec["t_start"] = rng.integers(1 << 60, 1 << 61, 37)
    rec["gc_count"] = rng.integers(-1, 5, 37)
    cases = [(rec["samples"], pa.int64()), (rec["t_start"], wire.TS), (rec["gc_count"], pa.int32()),
             (rec["t_start"] / 1e6, pa.float64()), (np.full(13, -1, np.int64), pa.int64()),
             (np.arange(1, dtype=np.int32), pa.int32()), (np.zeros(0, np.float64), pa.float64())]
    for values, t in cases:
        null = values < 0
        ours = pa.array(columns._arr(values, t, null))      # (nanoarrow's array, read by pyarrow)
        theirs = pa.array(values, t, mask=null)                 # what the columns were built with before
        assert ours.type == t and ours.equals(theirs) and ours.null_count == int(null.sum()), (t, len(values))
        for compression in ("lz4", None):
            a, b = (encode_arrow(pa.record_batch([x], names=["v"]), compression) for x in (ours, theirs))
            assert a == b, (t, len(values), compression)
    with pytest.raises(TypeError, match="int64 is not the layout of int32"):
        columns._arr(np.zeros(3, np.int64), pa.int32())


def test_conform_passes_the_v1_columns_through_and_still_casts_and_fills_the_rest():
    """``conform`` on a table that already has the v1 columns (what agents send) returns it as it is
    (the same table once its fields are nullable: no column rebuilt, ~0.35 ms a message before); a table
    with other types, a missing optional or an extra column still gets cast, filled and kept."""
    from stepwatch.wire.decode import conform
    rows = [{"job": "j", "node": "n", "rank": r, "step": 1, "t_start": 10**18, "t_end": 10**18 + 5,
             "step_ms": 5.0} for r in range(3)]
    t = pa.Table.from_pylist(rows, schema=wire.STEPS)
    c = conform(t, wire.STEPS)
    assert c.schema.names == wire.STEPS.names and all(f.nullable for f in c.schema)
    assert c.column("step_ms").chunk(0).buffers()[1].address == t.column("step_ms").chunk(0).buffers()[1].address
    assert conform(c, wire.STEPS) is c
    # int32 step_ms, no data_ms, an extra column: cast, null-filled, kept last
    u = pa.table({"job": ["j"], "node": ["n"], "rank": pa.array([0], pa.int64()), "step": [1],
                  "t_start": pa.array([10**18], pa.int64()), "t_end": pa.array([10**18 + 5], pa.int64()),
                  "step_ms": pa.array([5], pa.int32()), "extra_ms": [1.5]})
    v = conform(u, wire.STEPS)
    assert v.schema.names == wire.STEPS.names + ["extra_ms"]
    assert v.column("step_ms").type == pa.float64() and v.column("data_ms").null_count == 1
    assert v.column("rank").type == pa.int32() and v.column("t_end").type == wire.STEPS.field("t_end").type

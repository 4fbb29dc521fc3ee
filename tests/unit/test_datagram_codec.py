"""The probe -> agent datagram has one layout (stepwatch/wire/datagram.py) and these are held to it by test,
not by hand: the C encoder (``_probefast.pack_step``) writes the bytes of the Python one
(:func:`~stepwatch.wire.datagram.pack_frame`) for random records, and the two readers (the pure-Python
:func:`~stepwatch.wire.datagram.decode` and the agent's numpy columns, :mod:`stepwatch.wire.columns`) read back
the same records from them."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.agents import probe as P
from stepwatch.agents.probe import eventlog
from stepwatch.agents.agent import identity_from_hello, rows_from_batch
from stepwatch.wire import columns, datagram
from stepwatch.wire import tables as wire

pytestmark = pytest.mark.unit

I32 = st.integers(-(1 << 31), (1 << 31) - 1)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
U16 = st.integers(0, (1 << 16) - 1)
F64 = st.floats(allow_nan=False, allow_infinity=False, width=64)
NS = st.integers(0, 1 << 62)                  # what the probe passes as int ns (C: long long -> double)
GC = st.tuples(I64, F64, st.integers(0, 255), I64, I64)
# the C encoder sums calls per slot: one call per distinct slot, with its wait known, keeps each record as drawn
CALL = st.tuples(U16, U16, I64, I64, F64, F64)


@st.composite
def step_frames(draw):
    """The arguments of one step frame: (inst, rank, step fields, phases, comm, gc rows, hidden ns)."""
    n_phase = draw(st.integers(0, datagram.MAX_PHASES))
    phases = [(draw(U16), draw(st.one_of(NS, F64))) for _ in range(n_phase)]
    comm = draw(st.lists(CALL, max_size=datagram.MAX_COMM))
    gcs = draw(st.lists(GC, max_size=datagram.MAX_GC))
    f = draw(st.fixed_dictionaries({
        "step": I64, "t0w": I64, "wall": I64, "step_ns": NS, "data_ns": NS, "compute": st.floats(0, 1e18),
        "gc_ns": NS, "gc_count": I32, "dq": I32, "samples": I64, "tokens": I64,
        "dropped": st.integers(0, (1 << 32) - 1), "cpu": F64, "cpu_wait": F64, "hidden": F64}))
    return draw(I32), draw(I32), f, phases, comm, gcs


def _python(inst, rank, f, phases, comm, gcs) -> bytes:
    comm_ns = wait_ns = 0.0
    for *_, t, w in comm:                     # the sums, in the order (and float rounding) of the C encoder
        comm_ns += t - w
        wait_ns += w
    exposed = comm_ns + wait_ns
    step = (f["step"], f["t0w"], f["wall"], f["step_ns"], f["data_ns"], f["compute"], comm_ns, wait_ns, f["gc_ns"],
            f["gc_count"], f["dq"], f["samples"], f["tokens"], f["dropped"], f["cpu"], f["cpu_wait"],
            exposed + f["hidden"], exposed)
    return datagram.encode_frame(inst, rank, step, phases, comm, gcs)


def _c(inst, rank, f, phases, comm, gcs) -> bytes:
    buf = bytearray(datagram.MAX_FRAME)
    slots = list(range(len(comm)))
    calls = [(s, c[2], c[3], c[4], c[5]) for s, c in zip(slots, comm)]
    gcrows = b"".join(datagram.GCREC.pack(*g) for g in gcs) if gcs else None
    end = eventlog._fast.pack_step(buf, 0, inst, rank, f["step"], f["t0w"], f["wall"], f["step_ns"], f["data_ns"],
                            f["compute"], f["gc_ns"], f["gc_count"], f["dq"], f["samples"], f["tokens"], f["dropped"],
                            list(range(len(phases))), [ns for _, ns in phases], [i for i, _ in phases], calls,
                            [1.0] * len(comm), 0.0, [(c[0], c[1]) for c in comm], gcrows, f["cpu"], f["cpu_wait"],
                            f["hidden"])
    return bytes(buf[:end])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_frames())
def test_c_and_python_encoders_write_the_same_bytes(frame):
    assert eventlog._fast is not None, "the C hot path was not built (README: a C compiler and the Python headers)"
    py, c = _python(*frame), _c(*frame)
    assert c == py, (len(c), len(py), next((i for i, (a, b) in enumerate(zip(c, py)) if a != b), None))


def _as_stored(fmt: str, values: tuple) -> tuple:
    """``values`` as the struct ``fmt`` gives them back (ints packed as doubles come back as floats)."""
    return struct.unpack(fmt, struct.pack(fmt, *values))


@st.composite
def datagrams(draw):
    """Up to 4 frames of one probe back to back; a frame without a step carries only GC rows (as the probe's
    burst of collections does)."""
    inst, rank = draw(I32), draw(st.integers(0, 63))
    frames = []
    for _ in range(draw(st.integers(1, 4))):
        _, _, f, phases, comm, gcs = draw(step_frames())
        if draw(st.booleans()):
            frames.append((None, [], [], gcs))
            continue
        step = struct.unpack(datagram.STEP.format, _python(inst, rank, f, [], [], [])[16:16 + datagram.STEP.size])
        frames.append((step, phases, comm, gcs))
    return inst, rank, frames


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(datagrams())
def test_the_python_decoder_and_the_agents_columns_read_the_same_records(dg):
    inst, rank, frames = dg
    data = b"".join(datagram.encode_frame(inst, rank, *fr) for fr in frames)
    got = datagram.decode(data)
    want = [(datagram.T_BATCH, inst, rank, (s, [_as_stored(datagram.PHASE.format, p) for p in ph],
                                          [_as_stored(datagram.COMM.format, c) for c in cm],
                                          [_as_stored(datagram.GCREC.format, g) for g in gc]))
            for s, ph, cm, gc in frames]
    assert got == want
    # the agent's path: the same walk over the headers, then numpy over the same bytes, against the rows
    # of the decoded tuples (agents.agent.rows_from_batch)
    typ, i, scanned = datagram.scan(data)
    assert (typ, i, [o[3:] for o in scanned]) == (datagram.T_BATCH, inst, [
        (1 if s is not None else 0, len(ph), len(cm), len(gc)) for s, ph, cm, gc in frames])
    ident = identity_from_hello({"job": "j", "rank": rank, "world_size": 64, "names": {"1": "all_reduce", "7": "dp"},
                                 "group_sizes": {"dp": 8}}, "n1", None)
    rows = [rows_from_batch(ident, body) for _, _, _, body in got]
    refs = ([s for s, _, _ in rows if s is not None], [c for _, cm, _ in rows for c in cm],
            [g for _, _, gc in rows for g in gc])
    cols = columns.tables([(ident, data, scanned)])
    for k, (name, schema) in enumerate((("steps", wire.STEPS), ("comm", wire.COMM), ("gc", wire.GC))):
        ref = refs[k]
        if not ref:
            assert cols[k] is None, name
            continue
        assert pa.table(cols[k]).equals(pa.Table.from_pylist(ref, schema=schema)), name    # (nanoarrow's batch)
    if any(s is not None for s, *_ in frames):
        assert columns.last_dropped(data, scanned) == [s for s, *_ in frames if s is not None][-1][13]


def test_the_c_encoders_sizes_are_the_layouts():
    """The C encoder's own constants (its offsets follow from them) are the Python layout's."""
    src = (Path(P.__file__).parent / "_probefast_pack.c").read_text()
    consts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (\w+) (\d+)", src, re.M)}
    assert consts == {"MAX_SLOTS": datagram.MAX_COMM, "HDR_STEP_SIZE": datagram.HDR_STEP.size,
                      "PHASE_SIZE": datagram.PHASE.size, "COMM_SIZE": datagram.COMM.size}
    assert re.search(rf"b = {datagram.VERSION}; put\(p \+ 2", src), "the C encoder writes another version"
    assert f"uint16_t magic = 0x{datagram.MAGIC:04x};" in src.lower()
    assert datagram.HDR_STEP.format == datagram.HDR.format + datagram.STEP.format.lstrip("<")

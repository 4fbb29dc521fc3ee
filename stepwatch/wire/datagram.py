"""The probe -> agent datagram: its layout, the names both sides share, and its decoder.

The probe packs frames with :func:`pack_frame` (its pure-Python hot path, ``agents/probe/replay.py``) or
``_probefast.pack_step`` (C, ``agents/probe/_probefast_pack.c``), byte for byte the same
(tests/unit/test_datagram_codec.py); the node agent walks the headers with :func:`scan` and reads the records
with :func:`decode` (one tuple per frame) or, in columns, :mod:`stepwatch.wire.columns` (numpy over the same
bytes). Only the standard library is used: the probe imports this module.

Layout (little-endian). A datagram is a hello
alone, or one or more batch frames back to back; a frame is ``HDR`` followed by its records:

====================  =========================================================================
``HDR``  16 bytes     magic ``0x5357``, version 3, type (1 batch frame, 2 hello), instance id
                      (int32, random per probe), rank (int32), n_step (0/1), n_comm, n_gc, n_phase; types 3
                      (profile result) and 4 (in-flight state) are ``HDR`` + JSON like a hello
``STEP`` 136 bytes    step, t_start ns, t_end ns, step/data/compute/comm/comm_wait/gc ns, gc_count,
                      data_queue (-1 = null), samples, tokens (-1 = null), frames the probe
                      dropped so far (uint32), the step-ending thread's CPU ns and
                      run-queue wait ns (float64, -1 = null; version 1 frames end before them), the
                      step's communication in flight (the union of its collectives' intervals) and
                      the part of it not hidden behind compute, ns (float64, -1 = null; version 1
                      and 2 frames end before them)
``PHASE`` 16 bytes    name id, ns   (``n_phase`` of them)
``COMM`` 40 bytes     op id, group id, calls, bytes, time ns, wait ns   (``n_comm``)
``GCREC`` 40 bytes    t_end ns, duration ns, generation, collected, uncollectable   (``n_gc``)
hello                 ``HDR`` + UTF-8 JSON: identity (job, rank, world_size, node, device, ...) and
                      the table of interned names (op, group and phase ids)

Durations travel as float64 nanoseconds (the probe never divides; the agent converts to ms) and
wall times as int64 ns derived from ``perf_counter_ns`` plus an offset to ``time_ns`` that is
re-anchored with every hello (so a step costs no ``clock_gettime(CLOCK_REALTIME)``).
====================  =========================================================================
"""
from __future__ import annotations

import json
import os
import struct

MAGIC = 0x5357
VERSION = 3                           # 2: STEP carries the main thread's CPU time and run-queue wait;
                                      # 3: and the step's total and exposed communication
VERSIONS = (1, 2, 3)                  # what decode() reads (an older STEP lacks the later fields: null)
T_BATCH = 1
T_HELLO = 2
T_PROFILE = 3                         # probe -> agent: the outcome of a profiling command (HDR + JSON)
T_INFLIGHT = 4                        # probe -> agent: the watchdog's in-flight state of an overlong step (HDR + JSON)
T_SCHED = 5                           # scheduler -> agent: a job started / ended (Slurm prolog/epilog; HDR + JSON)

HDR = struct.Struct("<HBBiiBBBB")
STEP = struct.Struct("<qqqddddddiiqqI4xdddd")
STEP_V2 = struct.Struct("<qqqddddddiiqqI4xdd")                   # (version-2 probes: no comm total/exposed)
STEP_V1 = struct.Struct("<qqqddddddiiqqI4x")                      # (version-1 probes: no CPU fields either)
STEP_BY_VERSION = {1: STEP_V1, 2: STEP_V2, 3: STEP}
HDR_STEP = struct.Struct("<HBBiiBBBB" + "qqqddddddiiqqI4xdddd")   # both at once: one call per step
PHASE = struct.Struct("<H6xd")
COMM = struct.Struct("<HH4xqqdd")
GCREC = struct.Struct("<qdB7xqq")
MAX_PHASES = 8
MAX_COMM = 16
MAX_GC = 16
MAX_FRAME = HDR.size + STEP.size + MAX_PHASES * PHASE.size + MAX_COMM * COMM.size + MAX_GC * GCREC.size
MAX_DATAGRAM = 16384                  # frames of several steps are sent together up to this size
DEFAULT_FLUSH_MS = 500.0              # a datagram leaves at least this often while steps end
MAX_NAMES = 1024
MAX_BACKLOG = 16                      # datagrams kept for a retry while the agent's queue is full
MAX_PENDING = 64                      # finished steps packed and waiting to be sent (then a flush)
MAX_CALLS = 512                       # collective calls kept raw in one step; beyond, they are summed then


SOCKET_NAME = "agent.sock"


def default_socket_dir() -> str:
    """``$STEPWATCH_SOCKET_DIR``, else ``/run/stepwatch`` when it exists, else ``/tmp/stepwatch``."""
    d = os.environ.get("STEPWATCH_SOCKET_DIR")
    if d:
        return d
    return "/run/stepwatch" if os.path.isdir("/run/stepwatch") else "/tmp/stepwatch"


class BadDatagram(ValueError):
    """A datagram that does not follow the layout of this module (counted and skipped by the agent)."""


STEP_FIELDS = ("step", "t_start", "t_end", "step_ns", "data_ns", "compute_ns", "comm_ns", "comm_wait_ns",
               "gc_ns", "gc_count", "data_queue", "samples", "tokens", "probe_dropped", "cpu_ns", "cpu_wait_ns",
               "comm_total_ns", "comm_exposed_ns")
_MISSING = {1: (-1.0,) * 4, 2: (-1.0,) * 2, 3: ()}      # the fields an older STEP lacks: -1 (null)


JSON_TYPES = (T_HELLO, T_PROFILE, T_INFLIGHT, T_SCHED)     # HDR + one JSON object, alone in its datagram
_WHAT = {T_HELLO: "hello", T_PROFILE: "profile result", T_INFLIGHT: "in-flight state", T_SCHED: "scheduler event"}


def scan(data: bytes) -> tuple[int, int, list[tuple]]:
    """The one walk over a datagram's frame headers, validating them; no record is unpacked.

    Returns ``(type, instance, frames)``: for a batch datagram ``frames`` holds, per frame, ``(offset,
    instance, version, n_step, n_phase, n_comm, n_gc)``; for the JSON types (hello, profile result,
    in-flight state, scheduler event) it is empty and the body starts at ``HDR.size``. :func:`decode`
    unpacks the records from it; the agent gathers them into columns (:mod:`stepwatch.wire.columns`).
    Raises BadDatagram when any part does not follow the layout."""
    n = len(data)
    hdr = HDR
    if n < hdr.size:
        raise BadDatagram(f"short datagram ({n} bytes)")
    magic, ver, typ, inst, rank, n_step, n_comm, n_gc, n_phase = hdr.unpack_from(data, 0)
    if magic == MAGIC and ver in VERSIONS and typ in JSON_TYPES:
        return typ, inst, []
    out = []
    off = 0
    while off < n:
        if n - off < hdr.size:
            raise BadDatagram(f"{n - off} stray bytes after frame {len(out)}")
        magic, ver, typ, inst, rank, n_step, n_comm, n_gc, n_phase = hdr.unpack_from(data, off)
        if magic != MAGIC:
            raise BadDatagram(f"bad magic 0x{magic:04x}")
        if ver not in VERSIONS:
            raise BadDatagram(f"unsupported version {ver}")
        if typ in JSON_TYPES:
            raise BadDatagram(f"{_WHAT[typ]} after a batch frame")
        if typ != T_BATCH:
            raise BadDatagram(f"unknown frame type {typ}")
        if n_step > 1 or n_phase > MAX_PHASES or n_comm > MAX_COMM or n_gc > MAX_GC:
            raise BadDatagram(f"record counts out of range (step {n_step}, phase {n_phase}, comm {n_comm}, "
                              f"gc {n_gc})")
        size = hdr.size + n_step * STEP_BY_VERSION[ver].size + n_phase * PHASE.size + n_comm * COMM.size \
            + n_gc * GCREC.size
        if off + size > n:
            raise BadDatagram(f"frame {len(out)} needs {size} bytes, {n - off} left")
        out.append((off, inst, ver, n_step, n_phase, n_comm, n_gc))
        off += size
    return T_BATCH, out[0][1], out


def decode(data: bytes) -> list[tuple[int, int, int, object]]:
    """The frames of one datagram, each ``(type, instance, rank, body)``: for a JSON type (always alone in
    its datagram) the dict, for a batch frame ``(step_tuple | None, [(name_id, ns)], [comm tuples],
    [gc tuples])`` (an older STEP gets the fields it lacks as -1). Raises BadDatagram when any part does not
    follow the layout (:func:`scan`). The inverse of :func:`pack_frame`."""
    typ, inst, frames = scan(data)
    if typ != T_BATCH:
        what = _WHAT[typ]
        try:
            body = json.loads(bytes(data[HDR.size:]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise BadDatagram(f"undecodable {what}: {e}") from None
        if not isinstance(body, dict):
            raise BadDatagram(f"{what} is not a JSON object")
        return [(typ, inst, HDR.unpack_from(data, 0)[4], body)]
    out = []
    for off, inst, ver, n_step, n_phase, n_comm, n_gc in frames:
        rank = HDR.unpack_from(data, off)[4]
        p = off + HDR.size
        step = None
        if n_step:
            st = STEP_BY_VERSION[ver]
            step = st.unpack_from(data, p) + _MISSING[ver]
            p += st.size
        phases = []
        for _ in range(n_phase):
            phases.append(PHASE.unpack_from(data, p))
            p += PHASE.size
        comm = []
        for _ in range(n_comm):
            comm.append(COMM.unpack_from(data, p))
            p += COMM.size
        gcs = []
        for _ in range(n_gc):
            gcs.append(GCREC.unpack_from(data, p))
            p += GCREC.size
        out.append((T_BATCH, inst, rank, (step, phases, comm, gcs)))
    return out


def pack_frame(buf, off: int, inst: int, rank: int, step: tuple | None, phases, comm, gcs) -> int:
    """One batch frame (of the current :data:`VERSION`) at ``off`` in the writable ``buf``; returns the offset
    after it. ``step``: the 18 :data:`STEP_FIELDS` or None; ``phases``: ``(name_id, ns)`` pairs; ``comm``:
    ``(op_id, group_id, calls, bytes, time_ns, wait_ns)``; ``gcs``: ``(t_end, duration_ns, generation,
    collected, uncollectable)`` tuples, or those records already packed (bytes-like, a multiple of
    ``GCREC.size``). The one Python encoder of the layout: the probe's pure-Python hot path packs with it,
    and ``_probefast.pack_step`` (C) writes the same bytes (tests/unit/test_datagram_codec.py checks both,
    and that :func:`decode` and the agent's columns read them back)."""
    packed_gc = isinstance(gcs, (bytes, bytearray, memoryview))
    n_gc = len(gcs) // GCREC.size if packed_gc else len(gcs)
    n_phase, n_comm = len(phases), len(comm)
    if step is not None:
        HDR_STEP.pack_into(buf, off, MAGIC, VERSION, T_BATCH, inst, rank, 1, n_comm, n_gc, n_phase, *step)
        off += HDR_STEP.size
    else:
        HDR.pack_into(buf, off, MAGIC, VERSION, T_BATCH, inst, rank, 0, n_comm, n_gc, n_phase)
        off += HDR.size
    for ph in phases:
        PHASE.pack_into(buf, off, *ph)
        off += PHASE.size
    for c in comm:
        COMM.pack_into(buf, off, *c)
        off += COMM.size
    if packed_gc:
        k = n_gc * GCREC.size
        memoryview(buf)[off:off + k] = gcs[:k]
        off += k
    else:
        for g in gcs:
            GCREC.pack_into(buf, off, *g)
            off += GCREC.size
    return off


def encode_frame(inst: int, rank: int, step: tuple | None, phases=(), comm=(), gcs=()) -> bytes:
    """One batch frame as bytes (:func:`pack_frame` into a buffer of its size)."""
    buf = bytearray(MAX_FRAME)
    return bytes(buf[:pack_frame(buf, 0, inst, rank, step, phases, comm, gcs)])

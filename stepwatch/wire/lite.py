"""The node agent's Arrow writer, without pyarrow: the input tables' schemas, rows into record batches, and a
batch as the Arrow IPC stream the processor's decoder (:mod:`stepwatch.wire.decode`) reads, all with
`nanoarrow <https://arrow.apache.org/nanoarrow/>`_ (its C library: ~5 MB resident where pyarrow, with the
numpy it loads, takes ~42 MB; docs/agents.md, agent cost).

The bytes are an Arrow IPC *stream* of one record batch, with the same schema as
:data:`stepwatch.wire.tables.SCHEMAS` (``tests/unit/test_wirelite.py`` holds every input kind's schema here to
the one there), and uncompressed buffers: nanoarrow's IPC writer does not compress, so the agent's producer
compresses its Kafka record batches with LZ4 instead (:mod:`stepwatch.agents.shipper`), which the
processor's consumer undoes before the decoder sees the message.

nanoarrow's reader decodes LZ4- and zstd-compressed buffers, so the spool files an older agent wrote (Arrow
IPC *files*, LZ4 buffers, the job in the schema's metadata) are read here too (:func:`read_ipc`).
"""
from __future__ import annotations

import array
import io
from datetime import datetime, timezone

import nanoarrow as na
from nanoarrow import ipc as na_ipc
from nanoarrow.c_array_stream import CArrayStream

#: rows per message at most (a tick's table is split into batches of this size, as ``kafkaio.send_table`` does)
MAX_ROWS = 4096

_S = lambda nullable=True: na.string(nullable=nullable)        # noqa: E731
_I32 = lambda nullable=True: na.int32(nullable=nullable)       # noqa: E731
_I64 = lambda nullable=True: na.int64(nullable=nullable)       # noqa: E731
_F64 = lambda nullable=True: na.float64(nullable=nullable)     # noqa: E731
_TS = lambda nullable=True: na.timestamp("ns", "UTC", nullable=nullable)   # noqa: E731


def _table(fields: dict) -> na.Schema:
    return na.struct(fields, nullable=False)


#: The schemas of the tables the agent sends, field for field those of stepwatch.wire.tables (a test checks it).
SCHEMAS: dict[str, na.Schema] = {
    "steps": _table({
        "job": _S(False), "node": _S(False), "rank": _I32(False), "step": _I64(False), "t_start": _TS(),
        "t_end": _TS(False), "step_ms": _F64(False), "data_ms": _F64(), "compute_ms": _F64(), "comm_ms": _F64(),
        "comm_wait_ms": _F64(), "gc_ms": _F64(), "gc_count": _I32(), "samples": _I64(), "tokens": _I64(),
        "phases": na.map_(na.string(), na.float64()), "data_queue": _I32(), "cpu_ms": _F64(),
        "cpu_wait_ms": _F64(), "comm_total_ms": _F64(), "comm_exposed_ms": _F64()}),
    "topology": _table({
        "job": _S(False), "rank": _I32(False), "node": _S(False), "world_size": _I32(False), "device": _S(),
        "dp": _I32(), "tp": _I32(), "pp": _I32(), "ep": _I32(), "cp": _I32(), "framework": _S(),
        "agent_version": _S(), "device_type": _S(), "dtype": _S(), "model_flops_per_token": _F64(),
        "model_params": _I64(), "model_flops_per_sample": _F64(), "flops_source": _S(), "slurm_job": _I64(),
        "slurm_step": _I64()}),
    "host": _table({
        "job": _S(False), "node": _S(False), "t": _TS(False), "cpu_util": _F64(), "cpu_iowait": _F64(),
        "cpu_steal": _F64(), "load1": _F64(), "mem_used": _I64(), "mem_available": _I64(),
        "disk_read_bps": _F64(), "disk_write_bps": _F64(), "net_rx_bps": _F64(), "net_tx_bps": _F64(),
        "rdma_retrans": _I64(),
        "top_procs": na.list_(na.struct({"pid": _I64(), "name": _S(), "cpu_pct": _F64()})),
        "accel": na.list_(na.struct({"index": _I32(), "util": _F64(), "mem_used": _I64(), "temp_c": _F64(),
                                     "power_w": _F64(), "clock_mhz": _F64()}))}),
    "gc": _table({
        "job": _S(False), "node": _S(False), "rank": _I32(False), "t": _TS(False), "generation": _I32(),
        "duration_ms": _F64(False), "collected": _I64(), "uncollectable": _I64()}),
    "comm": _table({
        "job": _S(False), "node": _S(False), "rank": _I32(False), "step": _I64(False), "op": _S(False),
        "group": _S(), "count": _I64(), "bytes": _I64(), "time_ms": _F64(), "wait_ms": _F64(),
        "group_size": _I32()}),
    "inflight": _table({
        "job": _S(False), "node": _S(False), "rank": _I32(False), "t": _TS(False), "source": _S(False),
        "state": _S(False), "step": _I64(), "step_kind": _S(), "elapsed_ms": _F64(), "since": _TS(),
        "op": _S(), "group": _S(), "seq": _I64(), "group_size": _I32(), "stack": _S(), "pid": _I64(),
        "exit_code": _I32(), "signal": _I32(), "error": _S()}),
    "profiles": _table({
        "cmd_id": _S(False), "job": _S(False), "node": _S(), "rank": _I32(), "status": _S(False), "uri": _S(),
        "bytes": _I64(), "summary": _S(), "started_at": _TS(), "finished_at": _TS(), "kind": _S(), "role": _S(),
        "reason": _S(), "detail": _S(), "steps": _I32(), "t": _TS()}),
}
_C = {k: na.c_schema(s) for k, s in SCHEMAS.items()}
_NULLABLE = 2          # ARROW_FLAG_NULLABLE


def bitmap(valid) -> bytes:
    """An Arrow validity bitmap (LSB first) of the booleans ``valid``."""
    out = bytearray((len(valid) + 7) >> 3)
    for i, v in enumerate(valid):
        if v:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def _ns(v, where: str):
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    if isinstance(v, datetime):
        if v.tzinfo is None:
            v = v.replace(tzinfo=timezone.utc)
        d = v - datetime(1970, 1, 1, tzinfo=timezone.utc)
        return (d.days * 86_400 + d.seconds) * 1_000_000_000 + d.microseconds * 1000
    raise TypeError(f"field {where!r}: {v!r} is not a time (int ns since the epoch, or a datetime)")


def _column(sch, values: list, where: str):
    """The Arrow array of type ``sch`` (a CSchema) holding the Python ``values`` (None: null)."""
    fmt = sch.format
    if not sch.flags & _NULLABLE and None in values:
        raise ValueError(f"field {where!r}: null in a column that takes none")
    try:
        if fmt.startswith("ts"):
            return na.c_array([_ns(v, where) for v in values], sch)
        if fmt in ("+s", "+l", "+m"):
            return _nested(sch, values, where)
        return na.c_array(values, sch)
    except (TypeError, ValueError, OverflowError) as e:
        if str(e).startswith("field "):
            raise
        raise ValueError(f"field {where!r}: {e}".replace("\n", " ")) from None


def _nested(sch, values: list, where: str):
    n = len(values)
    valid = [v is not None for v in values]
    nulls = n - sum(valid)
    if sch.format == "+s":
        kids = [_column(c, [None if v is None else v.get(c.name) for v in values], f"{where}.{c.name}")
                for c in sch.children]
        return na.c_array_from_buffers(sch, n, [bitmap(valid) if nulls else None], null_count=nulls,
                                       children=kids)
    offsets, items = [0], []
    for v in values:
        if v is not None:
            if sch.format == "+m":
                v = [{"key": k, "value": x} for k, x in (v.items() if isinstance(v, dict) else v)]
            items.extend(v)
        offsets.append(len(items))
    (child,) = sch.children
    return na.c_array_from_buffers(sch, n, [bitmap(valid) if nulls else None, array.array("i", offsets)],
                                   null_count=nulls, children=[_column(child, items, f"{where}[]")])


class Batch:
    """One record batch of a wire table as the agent ships it: the Arrow IPC stream bytes (:attr:`payload`,
    what goes to Kafka and to the spool) and its row count. Any Arrow library reads it through the Arrow
    PyCapsule interface (``pyarrow.table(batch)``)."""

    __slots__ = ("num_rows", "_array", "_payload")

    def __init__(self, num_rows: int, array=None, payload: bytes | None = None):
        self.num_rows = num_rows
        self._array = array
        self._payload = payload

    @property
    def payload(self) -> bytes:
        if self._payload is None:
            self._payload = encode(self._array)
        return self._payload

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    def __arrow_c_stream__(self, requested_schema=None):
        if self._array is not None:
            return na.c_array_stream(self._array).__arrow_c_stream__(requested_schema)
        return na_ipc.InputStream.from_readable(io.BytesIO(self.payload)).__arrow_c_stream__(requested_schema)

    def __repr__(self) -> str:
        return f"Batch({self.num_rows} rows)"


def from_rows(kind: str, rows: list[dict]) -> Batch:
    """The record batch of ``kind`` holding ``rows`` (dicts; missing keys are null, other keys ignored).
    Raises ValueError naming the field where a value does not fit its column."""
    sch = _C[kind]
    kids = [_column(c, [r.get(c.name) for r in rows], c.name) for c in sch.children]
    return Batch(len(rows), na.c_array_from_buffers(sch, len(rows), [None], null_count=0, children=kids))


def from_columns(kind: str, n: int, columns: list) -> Batch:
    """The record batch of ``kind`` of ``n`` rows made of ready columns (arrays, in the schema's order)."""
    return Batch(n, na.c_array_from_buffers(_C[kind], n, [None], null_count=0, children=columns))


def encode(obj) -> bytes:
    """``obj`` (a nanoarrow array, or anything with the Arrow PyCapsule stream interface: a pyarrow Table)
    as the bytes of one Arrow IPC stream, uncompressed buffers."""
    out = io.BytesIO()
    with na_ipc.StreamWriter.from_writable(out) as w:
        w.write_stream(obj)
    return out.getvalue()


def as_batch(obj) -> Batch:
    """A :class:`Batch` of ``obj`` (itself, or a pyarrow Table: its IPC bytes)."""
    if isinstance(obj, Batch):
        return obj
    return Batch(obj.num_rows, payload=encode(obj))


IPC_FILE_MAGIC = b"ARROW1\0\0"


def read_ipc(data: bytes) -> tuple[dict[bytes, bytes], int, bytes]:
    """An Arrow IPC stream or file (``ARROW1`` magic: pyarrow's ``new_file``, the spool of agents before
    nanoarrow), any buffer compression: (schema metadata, rows, the same rows as an uncompressed IPC stream).
    A file's stream part ends with an end-of-stream marker before its footer, which is not read."""
    if data[:8] == IPC_FILE_MAGIC:
        data = data[8:]
    with na.c_array_stream(na_ipc.InputStream.from_readable(io.BytesIO(data))) as src:
        schema = src.get_schema()
        md = dict(schema.metadata or {})
        arrays = list(src)
    if md:
        schema = schema.modify(metadata={})
    out = io.BytesIO()
    with na_ipc.StreamWriter.from_writable(out) as w:
        w.write_stream(CArrayStream.from_c_arrays(arrays, schema, validate=False))
    return md, sum(a.length for a in arrays), out.getvalue()

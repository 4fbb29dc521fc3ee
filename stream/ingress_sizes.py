"""Size bounds of a Kafka message at the processor's ingress (docs/limits.md): the raw value, the
Arrow IPC stream's decoded size and rows read from its metadata before anything is decompressed,
and the expansion of dictionary / run-end / view encodings after decoding. ``limits`` is an
:class:`~stepwatch.stream.ingress_limits.IngressLimits`.
"""
from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.wire import catalog
from stepwatch.wire import tables as wire
from stepwatch.wire.decode import WireError
from stepwatch.stream.ingress_limits import IngressLimits

_I32, _U32, _U16, _I64 = struct.Struct("<i"), struct.Struct("<I"), struct.Struct("<H"), struct.Struct("<q")
_QQ = struct.Struct("<qq")


class _FB:
    """The few flatbuffer reads the Arrow ``Message`` metadata needs (bounds-checked by struct)."""

    def __init__(self, b: bytes):
        self.b = b

    def root(self) -> int:
        return _U32.unpack_from(self.b, 0)[0]

    def field(self, table: int, i: int) -> int:
        """Absolute position of field ``i`` of the table at ``table``, or 0 when absent."""
        vt = table - _I32.unpack_from(self.b, table)[0]
        vlen = _U16.unpack_from(self.b, vt)[0]
        o = 4 + 2 * i
        if o + 2 > vlen:
            return 0
        fo = _U16.unpack_from(self.b, vt + o)[0]
        return table + fo if fo else 0

    def deref(self, pos: int) -> int:
        return pos + _U32.unpack_from(self.b, pos)[0]

    def i64(self, pos: int) -> int:
        return _I64.unpack_from(self.b, pos)[0]


def _batch_sizes(meta: bytes, body) -> tuple[int, int]:
    """(decoded bytes, rows) of one record-batch or dictionary-batch message, from its metadata and
    the 8-byte uncompressed-length prefixes of its compressed buffers; nothing is decompressed."""
    fb = _FB(meta)
    msg = fb.root()
    p = fb.field(msg, 1)                       # header_type: 2 DictionaryBatch, 3 RecordBatch
    htype = meta[p] if p else 0
    p = fb.field(msg, 2)
    if not p or htype not in (2, 3):
        return 0, 0
    rb = fb.deref(p)
    if htype == 2:                             # DictionaryBatch { id, data: RecordBatch, isDelta }
        p = fb.field(rb, 1)
        if not p:
            return 0, 0
        rb = fb.deref(p)
    p = fb.field(rb, 0)
    rows = fb.i64(p) if p else 0
    compressed = bool(fb.field(rb, 3))
    p = fb.field(rb, 2)                        # buffers: [Buffer { offset: long, length: long }]
    total = 0
    if p:
        vec = fb.deref(p)
        n = _U32.unpack_from(meta, vec)[0]
        if n > (len(meta) - vec) // 16:
            raise WireError("malformed Arrow IPC metadata (buffer count)")
        mv = memoryview(body) if body is not None else memoryview(b"")
        blen = len(mv)
        start = vec + 4
        for k, (off, ln) in enumerate(_QQ.iter_unpack(meta[start:start + 16 * n])):
            if off < 0 or ln < 0 or off + ln > blen:
                raise WireError(f"malformed Arrow IPC metadata (buffer {k} outside the body)")
            if compressed and ln >= 8:
                u = _I64.unpack_from(mv, off)[0]
                if u < -1:
                    raise WireError("malformed Arrow IPC metadata (negative uncompressed length)")
                total += ln - 8 if u == -1 else u
            else:
                total += ln
    return total, rows


def check_arrow_sizes(payload: bytes, limits: IngressLimits) -> None:
    """Raise WireError if the Arrow IPC stream would decode to more than ``max_decoded_bytes`` or
    hold more than ``max_rows_per_message`` rows. Reads metadata only (no decompression)."""
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(payload))
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad message
        raise WireError(f"undecodable Arrow IPC stream: {e}") from None
    total = rows = 0
    while True:
        try:
            m = reader.read_next_message()
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001
            raise WireError(f"undecodable Arrow IPC stream: {e}") from None
        if m is None:
            break
        if m.type == "schema":
            continue
        try:
            size, n = _batch_sizes(m.metadata.to_pybytes(), m.body)
        except (struct.error, IndexError, ValueError) as e:
            raise WireError(f"malformed Arrow IPC metadata: {e}") from None
        if size < 0 or n < 0:
            raise WireError("malformed Arrow IPC metadata (negative size)")
        total += size
        if m.type == "record batch":
            rows += n
        if total > limits.max_decoded_bytes:
            raise WireError(f"message decodes to more than max_decoded_bytes={limits.max_decoded_bytes:,} "
                                 f"bytes ({len(payload):,} bytes on the wire)")
        if rows > limits.max_rows_per_message:
            raise WireError(f"message holds more than max_rows_per_message={limits.max_rows_per_message:,} rows")


def check_size(value: bytes | None, content_type, limits: IngressLimits) -> None:
    """Raise WireError if the raw value is over ``max_message_bytes`` (``max_json_bytes`` for JSON)."""
    if value is None:
        return
    ct = content_type.decode("utf-8", "replace") if isinstance(content_type, (bytes, bytearray)) else (content_type or "")
    cap = limits.max_json_bytes if ct.split(";")[0].strip() == catalog.JSON_CT else limits.max_message_bytes
    if len(value) > cap:
        raise WireError(f"message of {len(value):,} bytes (over {cap:,}: max_message_bytes / max_json_bytes)")


#: type -> whether it holds an amplifying encoding (a message's columns repeat the previous one's types:
#: the walk cost ~0.65 ms a 4,096-row message); bounded: cleared when a sender's made-up types fill it
_AMPLIFYING: dict = {}
_AMPLIFYING_MAX = 4096


def _has_amplifying(t: pa.DataType) -> bool:
    """Whether ``t`` (or a type inside it) is dictionary-, run-end- or view-encoded."""
    got = _AMPLIFYING.get(t)
    if got is None:
        if len(_AMPLIFYING) >= _AMPLIFYING_MAX:
            _AMPLIFYING.clear()
        got = _AMPLIFYING[t] = _walk_amplifying(t)
    return got


def _walk_amplifying(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
        return True
    if pa.types.is_string_view(t) or pa.types.is_binary_view(t) or pa.types.is_list_view(t) \
            or pa.types.is_large_list_view(t):
        return True
    return any(_walk_amplifying(t.field(i).type) for i in range(t.num_fields))


def _expanded_bytes(col: pa.ChunkedArray) -> int:
    """Bytes a top-level column takes once its dictionary / run-end / view encoding is undone."""
    t = col.type
    total = 0
    for ch in col.chunks:
        if pa.types.is_dictionary(t):
            d = ch.dictionary
            if _has_amplifying(d.type):
                raise WireError("nested dictionary encodings are not accepted")
            if pa.types.is_binary(d.type) or pa.types.is_string(d.type) or pa.types.is_large_string(d.type) \
                    or pa.types.is_large_binary(d.type):
                lens = pc.fill_null(pc.binary_length(d), 0).to_numpy(zero_copy_only=False).astype(np.int64)
                idx = ch.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                if len(lens) and len(idx) and (idx.min() < 0 or idx.max() >= len(lens)):
                    raise WireError("dictionary index out of range")
                total += int(lens[idx].sum()) if len(lens) else 0
            elif d.type.num_fields == 0 and hasattr(d.type, "bit_width") and d.type.bit_width:
                total += len(ch) * d.type.bit_width // 8
            else:
                raise WireError(f"dictionary-encoded {d.type} columns are not accepted")
        elif t in (pa.string_view(), pa.binary_view()):
            views = ch.buffers()[1]                # 16-byte views; the first 4 bytes: the length
            if views is not None and len(ch):
                lens = np.frombuffer(views, dtype=np.int32)[ch.offset * 4:(ch.offset + len(ch)) * 4:4]
                total += int(np.abs(lens.astype(np.int64)).sum())
        else:
            raise WireError(f"columns of type {t} are not accepted")
        total += len(ch) * 8
    return total


def check_expansion(table: pa.Table, limits: IngressLimits) -> None:
    """Raise WireError if a column's encoding would expand past ``max_decoded_bytes`` once cast
    (a 1-value dictionary of 1 MB repeated on a million rows is a terabyte), or if the message has
    more than ``max_columns`` columns."""
    if table.num_columns > limits.max_columns:
        raise WireError(f"message has {table.num_columns} columns (max_columns={limits.max_columns})")
    total = 0
    for col in table.columns:
        if _has_amplifying(col.type):
            total += _expanded_bytes(col)
            if total > limits.max_decoded_bytes:
                raise WireError(f"message expands to more than max_decoded_bytes={limits.max_decoded_bytes:,} "
                                     "bytes (dictionary/view encoding)")

"""Encoding a batch of rows for the wire (docs/wire-format.md): an Arrow IPC stream or a JSON array, and
the message's headers. The producers' half of the codec (the processor's half is :mod:`stepwatch.wire.decode`):
it loads neither ``pyarrow.compute`` nor the validation rules, so the node agent, which only encodes, stays
~9 MB smaller (an import-linter contract: no producer module imports ``stepwatch.wire.decode``)."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa


def encode_arrow(table: pa.Table | pa.RecordBatch, compression: str | None = "lz4") -> bytes:
    """One Arrow IPC stream holding the rows. Buffers are LZ4-compressed by default: it decodes
    about 2x faster than zstd (0.4 vs 0.9 ms per 4,096 step rows) for ~30% more bytes."""
    if isinstance(table, pa.Table):
        table = table.combine_chunks()
        batches = table.to_batches()
    else:
        batches = [table]
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, batches[0].schema if batches else table.schema, options=opts) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue().to_pybytes()


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if hasattr(o, "isoformat"):
        return o.isoformat()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def encode_json(rows: list[dict]) -> bytes:
    """A JSON array of row objects. Timestamps may be int ns since epoch or ISO-8601 strings."""
    return json.dumps(rows, default=_json_default, separators=(",", ":")).encode()

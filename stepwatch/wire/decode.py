"""The processor's decoder of wire contract v1 (docs/wire-format.md).

Every telemetry message on Kafka carries one batch of rows of one kind (``steps``, ``topology``,
``host``, ``gc``, ``comm``; the processor itself writes ``alerts`` and ``deadletter``). A message is
either an Arrow IPC stream (``content-type: application/vnd.apache.arrow.stream``) or a JSON array of
row objects (``application/json``), with a ``schema`` header such as ``steps/1``.

Units: times are UTC nanoseconds (``timestamp[ns, tz=UTC]``), durations float64 milliseconds,
sizes bytes.

:func:`decode` turns a payload into a table conformed to the v1 schema (unknown extra columns kept,
missing nullable columns filled with nulls) and splits it into valid rows and rejected rows, each
rejection naming the field and the value. Everything is columnar (pyarrow compute); nothing loops
per row except to format the (few) rejection messages. The schemas are :mod:`stepwatch.wire.tables`; the
producers' half (encode, headers) is :mod:`stepwatch.wire.encode`, which never imports this module.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.wire.catalog import ARROW_CT, JSON_CT, TELEMETRY, VERSION
from stepwatch.wire.tables import EPOCH, F64, JOB_PATTERN, JOB_RE, NONNEGATIVE, SCHEMAS


class WireError(ValueError):
    """A whole message cannot be used (undecodable, wrong schema header, missing required column)."""


@dataclass
class Decoded:
    """Result of decoding one message."""

    kind: str
    table: pa.Table                 # valid rows, conformed to the v1 schema (+ extra columns)
    rejected: list[tuple[int, str]]  # (row index in the message, reason naming field and value)
    rejected_rows: pa.Table | None = None


def parse_schema_header(value: str | bytes | None) -> tuple[str, int]:
    """``"steps/1"`` -> ``("steps", 1)``; raises WireError naming the value."""
    if value is None:
        raise WireError("missing 'schema' header (expected e.g. 'steps/1')")
    s = value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
    kind, _, ver = s.partition("/")
    if kind not in TELEMETRY and kind != "profiles":
        raise WireError(f"unknown schema {s!r} in 'schema' header (expected one of "
                        f"{', '.join(k + '/1' for k in TELEMETRY)})")
    try:
        v = int(ver)
    except ValueError:
        raise WireError(f"bad schema version in 'schema' header {s!r}") from None
    if v != VERSION:
        raise WireError(f"unsupported schema version {s!r} (this processor reads v{VERSION})")
    return kind, v


# --------------------------------------------------------------------------- decode

def _read_arrow(payload: bytes) -> pa.Table:
    try:
        with pa.ipc.open_stream(pa.py_buffer(payload)) as r:
            t = r.read_all()
        t.schema.names     # noqa: B018 - raises on field names that are not UTF-8
        t.validate(full=True)   # buffers, offsets, UTF-8: ~60 µs for 4,096 step rows; compute kernels trust it
        return t
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad message
        raise WireError(f"undecodable Arrow IPC stream: {e}") from None


def _json_column(values: list, field: pa.Field) -> pa.Array:
    t = field.type
    if pa.types.is_timestamp(t):
        out = []
        for v in values:
            if v is None:
                out.append(None)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append(int(v))
            elif isinstance(v, str):
                try:
                    d = datetime.fromisoformat(v.replace("Z", "+00:00"))
                except ValueError:
                    raise WireError(f"field '{field.name}': cannot read {v!r} as a time "
                                    "(int ns since epoch or ISO-8601)") from None
                if d.tzinfo is None:
                    d = d.replace(tzinfo=timezone.utc)
                delta = d - EPOCH
                out.append((delta.days * 86400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000)
            else:
                raise WireError(f"field '{field.name}': cannot read {v!r} as a time "
                                "(int ns since epoch or ISO-8601)")
        return pa.array(out, pa.int64()).cast(t)
    if t == F64:
        vals = [float("nan") if v == "NaN" else v for v in values]
        try:
            return pa.array(vals, F64, from_pandas=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
            bad = next(v for v in vals if v is not None and not isinstance(v, (int, float)))
            raise WireError(f"field '{field.name}': value {bad!r} is not a number") from None
    try:
        return pa.array(values, t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
        raise WireError(f"field '{field.name}': {e}") from None


def _read_json(payload: bytes, schema: pa.Schema) -> pa.Table:
    try:
        rows = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"undecodable JSON: {e}") from None
    if isinstance(rows, dict):
        rows = [rows]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise WireError("JSON payload must be an array of row objects")
    names = list(dict.fromkeys(k for r in rows for k in r))
    cols, fields = [], []
    for name in names:
        values = [r.get(name) for r in rows]
        idx = schema.get_field_index(name)
        if idx >= 0:
            arr = _json_column(values, schema.field(idx))
            fields.append(schema.field(idx).with_nullable(True))
        else:
            try:
                arr = pa.array(values)
            except Exception:
                arr = pa.array([json.dumps(v) for v in values], pa.string())
            fields.append(pa.field(name, arr.type))
        cols.append(arr)
    return pa.Table.from_arrays(cols, schema=pa.schema(fields)) if cols else schema.empty_table()


#: id(schema) -> (schema, the schema with every field nullable): conform's fast path
_LOOSE: dict[int, tuple] = {}


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Cast known columns to their v1 type, add missing ones as nulls, keep unknown extras last.

    Raises WireError naming the field when a column cannot be cast or a required one is missing.
    """
    loose = _LOOSE.get(id(schema))
    if loose is None or loose[0] is not schema:
        loose = _LOOSE[id(schema)] = (schema, pa.schema([f.with_nullable(True) for f in schema]))
    if table.schema.equals(loose[1]):                   # what the agents send: already the v1 columns
        return table
    if table.schema.names == schema.names and table.schema.types == schema.types:
        return pa.Table.from_arrays(table.columns, schema=loose[1])
    cols, fields = [], []
    n = table.num_rows
    present = set(table.column_names)
    for f in schema:
        if f.name in present:
            col = table.column(f.name)
            if col.type != f.type:
                try:
                    col = col.cast(f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, UnicodeDecodeError) as e:
                    raise WireError(f"field '{f.name}': cannot read its type as {f.type} ({e!r:.300})") from None
        elif not f.nullable:
            raise WireError(f"required field '{f.name}' is missing")
        else:
            col = pa.nulls(n, f.type)
        cols.append(col)
        fields.append(f.with_nullable(True))
    for name in table.column_names:
        if schema.get_field_index(name) < 0:
            cols.append(table.column(name))
            fields.append(table.schema.field(name))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def _np(col) -> np.ndarray:
    """A column as numpy (nulls become NaN / NaT / None)."""
    return col.to_numpy() if isinstance(col, pa.ChunkedArray) else col.to_numpy(zero_copy_only=False)


def _bad_values(col, ok) -> np.ndarray | None:
    """Mask of rows whose (string) value fails ``ok``; checks each distinct value once."""
    bad = [v for v in col.unique().to_pylist() if v is not None and not ok(v)]
    if not bad:
        return None
    return np.isin(_np(col).astype(object), np.array(bad, dtype=object))


def _row_checks(kind: str, table: pa.Table) -> list[tuple[str, np.ndarray]]:
    """(field, boolean mask of bad rows) for every rule that some row breaks.

    Numpy over whole columns; string rules look at distinct values only (a batch holds one job and
    a handful of nodes), so the cost does not grow with per-row Python work."""
    schema = SCHEMAS[kind]
    checks: list[tuple[str, np.ndarray]] = []
    n = table.num_rows
    for f in schema:
        col = table.column(f.name)
        if not f.nullable and col.null_count:
            checks.append((f.name, _np(col.is_null())))
    for name in NONNEGATIVE.get(kind, ()):
        col = table.column(name)
        if col.null_count == n:
            continue
        v = _np(col)
        if v.size and (v.min() >= 0 and (v.dtype.kind != "f" or v.max() < np.inf)):
            continue                    # in range (a NaN or null fails the min test and is looked at below)
        if v.dtype.kind == "f":
            with np.errstate(invalid="ignore"):
                bad = ~(v >= 0) | np.isinf(v)
            if col.null_count:
                bad &= ~_np(col.is_null())
        elif v.dtype.kind in "iu":
            bad = v < 0
        else:
            bad = np.zeros(n, dtype=bool)
        if bad.any():
            checks.append((name, bad))
    m = _bad_values(table.column("job"), lambda v: JOB_RE.fullmatch(v) is not None)
    if m is not None:
        checks.append(("job", m))
    if schema.get_field_index("node") >= 0:
        lens = pc.binary_length(table.column("node"))  # empty names, in C (hundreds of distinct nodes a batch)
        if pc.min(lens).as_py() == 0:
            checks.append(("node", _np(pc.fill_null(pc.equal(lens, 0), False))))
    if kind == "steps" and table.column("t_start").null_count < n:
        ts, te = _np(table.column("t_start")), _np(table.column("t_end"))
        bad = ts > te
        if bad.any():
            checks.append(("t_start", bad))
    if kind == "topology":
        r, w = _np(table.column("rank")), _np(table.column("world_size"))
        with np.errstate(invalid="ignore"):
            bad = r >= w
        if bad.any():
            checks.append(("rank", bad))
    return checks


def validate(kind: str, table: pa.Table) -> tuple[pa.Table, list[tuple[int, str]], pa.Table | None]:
    """Split a conformed table into (valid rows, [(row, reason)], rejected rows)."""
    if table.num_rows == 0:
        return table, [], None
    checks = _row_checks(kind, table)
    if not checks:
        return table, [], None
    any_bad = np.logical_or.reduce([m for _, m in checks])
    bad_idx = np.flatnonzero(any_bad)
    rejected = []
    for i in bad_idx:
        reasons = []
        for name, m in checks:
            if m[i]:
                v = table.column(name)[int(i)]
                v = v.value if pa.types.is_timestamp(v.type) and v.is_valid else v.as_py()
                if name == "job" and v is not None:
                    reasons.append(f"field 'job': invalid job id {v!r} (must match {JOB_PATTERN})")
                elif name == "node" and v is not None:
                    reasons.append(f"field 'node': empty node name")
                elif name == "t_start":
                    reasons.append(f"field 't_start': {v} is after t_end")
                elif name == "rank" and kind == "topology" and v is not None and v >= 0:
                    ws = table.column("world_size")[int(i)].as_py()
                    reasons.append(f"field 'rank': {v} is not below world_size {ws}")
                elif v is None:
                    reasons.append(f"field '{name}': required but null")
                else:
                    reasons.append(f"field '{name}': invalid value {v!r} (must be finite and >= 0)")
        rejected.append((int(i), "; ".join(dict.fromkeys(reasons))))
    good = table.filter(pa.array(~any_bad))
    return good, rejected, table.take(pa.array(bad_idx))


def decode(payload: bytes, content_type: str | bytes | None, schema_header: str | bytes | None,
           check_arrow=None, prepare=None) -> Decoded:
    """Decode one message into valid rows and per-row rejections.

    Raises WireError (with a reason naming the field/value) when the whole message is unusable.
    ``check_arrow(payload)`` (bounds before decompression) and ``prepare(kind, raw_table)`` (extra
    columns, expansion bounds; returns the table) are the processor's ingress hooks
    (:mod:`stepwatch.stream.ingress`).
    """
    kind, _ = parse_schema_header(schema_header)
    ct = content_type.decode("utf-8", "replace") if isinstance(content_type, (bytes, bytearray)) else content_type
    ct = (ct or ARROW_CT).split(";")[0].strip()
    schema = SCHEMAS[kind]
    if payload is None:
        raise WireError("empty message (no value)")
    if ct == ARROW_CT:
        if check_arrow is not None:
            check_arrow(payload)
        raw = _read_arrow(payload)
    elif ct == JSON_CT:
        raw = _read_json(payload, schema)
    else:
        raise WireError(f"unsupported content-type {ct!r} (use {ARROW_CT} or {JSON_CT})")
    if prepare is not None:
        raw = prepare(kind, raw)
    table = conform(raw, schema)
    good, rejected, bad_rows = validate(kind, table)
    return Decoded(kind, good, rejected, bad_rows)


def empty(kind: str) -> pa.Table:
    return SCHEMAS[kind].empty_table()

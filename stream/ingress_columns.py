"""Unknown extra columns at the processor's ingress (docs/limits.md): kept only with a type Parquet and
DuckDB store, a safe name, at most ``max_extra_columns`` names per table and the type first seen
for the name; the rest dropped and counted. The processor's :mod:`~stepwatch.stream.intake` applies it.
"""
from __future__ import annotations

import re

import pyarrow as pa

from stepwatch.wire import tables as wire
from stepwatch.stream.ingress_limits import IngressLimits

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}\Z")
_RESERVED = {"date", "job", "_received"}


def _storable(t: pa.DataType, depth: int = 0) -> pa.DataType | None:
    """The type an extra column is stored as, or None if Parquet/DuckDB cannot store it."""
    if depth > 4:
        return None
    if pa.types.is_dictionary(t):
        return _storable(t.value_type, depth)
    if t == pa.float16():
        return pa.float32()
    if t == pa.string_view():
        return pa.string()
    if t == pa.binary_view():
        return pa.binary()
    if (pa.types.is_boolean(t) or pa.types.is_integer(t) or t in (pa.float32(), pa.float64())
            or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_date32(t) or pa.types.is_time(t)):
        return t
    if pa.types.is_timestamp(t):
        return t
    if pa.types.is_decimal128(t):
        return t if t.precision <= 38 else None
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        v = _storable(t.value_type, depth + 1)
        return None if v is None else pa.list_(v)
    if pa.types.is_map(t):
        k, v = _storable(t.key_type, depth + 1), _storable(t.item_type, depth + 1)
        return None if k is None or v is None else pa.map_(k, v)
    if pa.types.is_struct(t):
        if t.num_fields == 0:
            return None
        fs = []
        for i in range(t.num_fields):
            f = t.field(i)
            v = _storable(f.type, depth + 1)
            if v is None or not _NAME_RE.fullmatch(f.name):
                return None
            fs.append(pa.field(f.name, v))
        if len({f.name for f in fs}) != len(fs):
            return None
        return pa.struct(fs)
    return None     # union, interval, duration, null, extension, run-end encoded, list views, ...


class ExtraColumns:
    """Unknown extra columns, per table: kept with a storable type under the type first seen for
    the name, at most ``max_extra_columns`` names per table; the rest dropped with a count."""

    def __init__(self, limits: IngressLimits):
        self.limits = limits
        self.types: dict[str, dict[str, pa.DataType]] = {}
        self.dropped: dict[str, int] = {}        # reason -> columns dropped
        self.cast: int = 0                       # columns cast to the name's first type

    def _drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def apply(self, kind: str, table: pa.Table) -> pa.Table:
        schema = wire.SCHEMAS[kind]
        names = table.column_names
        extra = [i for i, n in enumerate(names) if schema.get_field_index(n) < 0]
        if not extra and len(set(names)) == len(names):
            return table
        known = self.types.setdefault(kind, {})
        keep_idx, cols, fields = [], [], []
        seen: set[str] = set()
        for i, name in enumerate(names):
            col = table.column(i)
            if name in seen:
                self._drop("duplicate name")
                continue
            seen.add(name)
            if schema.get_field_index(name) >= 0:
                keep_idx.append(i)
                cols.append(col)
                fields.append(table.schema.field(i))
                continue
            if not _NAME_RE.fullmatch(name) or name in _RESERVED:
                self._drop("name")
                continue
            if self.limits.extra_column_types == "any":
                cols.append(col)
                fields.append(table.schema.field(i))
                continue
            try:
                want = _storable(col.type)
            except UnicodeDecodeError:             # a nested field name that is not UTF-8
                want = None
            if want is None:
                self._drop("type")
                continue
            have = known.get(name)
            if have is None:
                if len(known) >= self.limits.max_extra_columns:
                    self._drop("too many extra columns")
                    continue
                known[name] = have = want
            if col.type != have:
                try:
                    col = col.cast(have, safe=True)
                    if col.type != want:
                        self.cast += 1
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OverflowError):
                    self._drop("type conflict")
                    continue
            cols.append(col)
            fields.append(pa.field(name, have))
        return pa.Table.from_arrays(cols, schema=pa.schema(fields))

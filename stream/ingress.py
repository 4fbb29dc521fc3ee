"""The processor's ingress: the bounds every Kafka message must fit before it reaches the store.

Every boundary is a contract with bounds (``docs/limits.md``): a message that breaks
them costs its sender one deadletter record, never the pipeline. This module holds the settings
(:class:`IngressLimits`, one dataclass so a config file can fill it) and the checks the processor
calls around :func:`stepwatch.schema.decode`:

- :func:`check_arrow_sizes`: before anything is decompressed, the IPC stream's record-batch
  metadata is read (a few flatbuffer fields) and the *decoded* size of every buffer (the 8-byte
  uncompressed length that prefixes each compressed buffer) and the row count are summed and
  bounded: an 8 KiB zstd message cannot inflate to 520 MiB.
- :func:`check_expansion`: after decoding, encodings whose materialisation can be far larger than
  their buffers (dictionary, run-end encoded, string/binary views) are bounded too.
- :class:`ExtraColumns`: unknown extra columns are kept only with a type Parquet (and DuckDB)
  store, a safe name, at most ``max_extra_columns`` per table, and the type first seen for that
  name (later messages are cast to it, or the column is dropped); everything else is dropped and
  counted.
- :func:`row_bounds`: rank and world size below ``max_ranks``, timestamps after 1970 and at most
  ``max_future_skew_s`` ahead of the later of the receive time and the job's own time (optionally
  not older than ``max_age_s``).
- per job, a step more than ``max_step_jump`` ahead of where the job's ranks are:
  :mod:`stepwatch.stream.stepaxis`.
- :class:`MessageDeadletter`: one deadletter record per source message, with a summary of the bad
  rows (count, first reasons) and the raw value (capped), producer headers stripped.
- :class:`TokenBucket` / :class:`RateLimitedLog`: rate limits for log lines and store rebuilds.
- :func:`isolate_failing_sources`: when a flush fails, bisect the buffered pieces by source
  message against a scratch store, so only the message(s) that break it go to the deadletter.
"""
from __future__ import annotations

import functools
import logging
import re
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch import catalog
from stepwatch import schema as wire

log = logging.getLogger("stepwatch.ingress")


@dataclass
class IngressLimits:
    """Bounds of the processor's Kafka boundary. Defaults fit jobs of 100,000 ranks.

    Every field is a setting (``stepwatch process --help`` names the flags; docs/limits.md the
    reasoning). Units are in the names: ``_bytes``, ``_s`` (seconds), ``_ns``, counts otherwise.
    """

    max_message_bytes: int = 64 << 20
    """Raw Kafka value, bytes. Larger messages are deadlettered (payload truncated)."""
    max_decoded_bytes: int = 256 << 20
    """Arrow buffers after decompression (and dictionary/view expansion), bytes per message."""
    max_json_bytes: int = 8 << 20
    """Raw value of a JSON message, bytes (JSON is for small producers; its Python objects take ~20x)."""
    max_rows_per_message: int = 1_000_000
    """Rows per message (a 100k-rank job sends 100k step rows per step, usually in 4,096-row messages)."""
    max_columns: int = 256
    """Columns per message, known and extra together."""
    max_extra_columns: int = 64
    """Distinct unknown extra column names kept per table over the processor's life; further names are dropped."""
    extra_column_types: str = "parquet"
    """``parquet``: extra columns only of types Parquet and DuckDB store (others dropped, counted).
    ``any``: keep every extra column as sent (trusted producers only: a message whose column cannot be
    stored is then isolated at flush time, which costs a flush retry)."""
    max_ranks: int = 131_072
    """A rank must be below this and a declared world size at most this. Memory follows the ranks that
    report (≈6.8 KB per rank per job at a 128-step window), never the declared world size."""
    max_step_jump: int = 1_000_000
    """A step row more than this many steps ahead of where its job's ranks are (stream.stepaxis: the
    upper quartile of the ranks' last reported steps) is rejected. Rows ahead by more than half the
    alignment window but within this are stored, not aligned. The largest jump a whole job makes
    between two reports the processor sees is the steps it ran while its rows were lost: at 10 steps/s,
    1,000,000 steps is 28 hours."""
    max_future_skew_s: float = 300.0
    """A timestamp at most this far ahead of the later of the processor's receive time and the job's
    own time (the upper quartile of its ranks' last ``t_end``), seconds. 300 s is the clock skew
    Kerberos tolerates between hosts, far above what NTP keeps (milliseconds) or a node that lost NTP
    drifts in a day (about 1 s); a row this far ahead can close its job's steps early by at most this
    long. Simulations replayed faster than real time move their job's own time and are not refused."""
    min_time_ns: int = 0
    """Timestamps before this (UTC ns) are rejected; the default rejects anything before 1970."""
    max_age_s: float | None = None
    """If set, timestamps older than this before the receive time are rejected, seconds (None: backfills allowed)."""
    max_jobs: int = 10_000
    """Jobs with alignment/detector state in memory; beyond it the least recently active are evicted."""
    max_state_bytes: int = 8 << 30
    """Alignment rings of all jobs together, bytes; beyond it the least recently active jobs are evicted."""
    job_idle_evict_s: float = 3600.0
    """A job that sent nothing for this long is closed and evicted from memory, seconds (it is rebuilt
    from the store if it comes back)."""
    rebuilds_per_s: float = 20.0
    """Rebuilds of a job's state from the store (a job with stored history seen for the first time),
    per second; jobs without stored history cost nothing. Over the rate a job starts cold (counted)."""
    rebuild_burst: int = 200
    """Rebuilds allowed at once before the rate applies."""
    deadletter_payload_bytes: int = 1 << 20
    """Raw payload kept in a deadletter record, bytes (the rest is cut and the cut noted)."""
    deadletter_reasons: int = 5
    """Distinct reasons kept in a deadletter record's summary."""
    log_per_s: float = 1.0
    """Deadletter/ingress warnings logged per second (burst of 10); the rest are counted."""


def limits_from_pairs(pairs: list[str] | None, base: IngressLimits | None = None) -> IngressLimits:
    """``["max_ranks=262144", "max_age_s=none"]`` -> IngressLimits (``stepwatch process --limit``)."""
    import dataclasses
    lim = dataclasses.replace(base or IngressLimits())
    types = {f.name: f.type for f in dataclasses.fields(IngressLimits)}
    for p in pairs or ():
        name, sep, raw = p.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in types:
            raise ValueError(f"unknown limit {p!r} (one of: {', '.join(types)})")
        t = str(types[name])
        raw = raw.strip()
        if raw.lower() in ("none", "") and "None" in t:
            v = None
        elif t.startswith("int"):
            v = int(float(raw)) if "e" in raw.lower() else int(raw, 0)
        elif t.startswith("float"):
            v = float(raw)
        else:
            v = raw
        setattr(lim, name, v)
    return lim


# ------------------------------------------------------------------------------ rate limits
class TokenBucket:
    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = float(rate), float(burst)
        self.tokens = float(burst)
        self.t = time.monotonic()

    def take(self, n: float = 1.0) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False


class RateLimitedLog:
    """``warning`` at most ``per_s`` lines a second (burst 10); suppressed lines are counted and the
    count is appended to the next line that gets out."""

    def __init__(self, logger: logging.Logger, per_s: float, burst: int = 10):
        self.log = logger
        self.bucket = TokenBucket(per_s, burst)
        self.suppressed = 0

    def warning(self, fmt: str, *args) -> bool:
        if not self.bucket.take():
            self.suppressed += 1
            return False
        if self.suppressed:
            fmt += " (%d similar lines suppressed)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self.log.warning(fmt, *args)
        return True


# ------------------------------------------------------------------------------ Arrow IPC sizes
_I32, _U32, _U16, _I64 = struct.Struct("<i"), struct.Struct("<I"), struct.Struct("<H"), struct.Struct("<q")


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
            raise wire.WireError("malformed Arrow IPC metadata (buffer count)")
        if not n:
            return 0, rows
        blen = len(body) if body is not None else 0
        # all (offset, length) pairs at once (little-endian int64, unaligned is fine for frombuffer)
        ol = np.frombuffer(meta, dtype="<i8", count=2 * n, offset=vec + 4).reshape(n, 2)
        off, ln = ol[:, 0], ol[:, 1]
        out = (off < 0) | (ln < 0) | (off > blen - ln)
        if out.any():
            raise wire.WireError(f"malformed Arrow IPC metadata (buffer {int(np.argmax(out))} outside the body)")
        if compressed:
            pre = ln >= 8                          # the 8-byte uncompressed length before each buffer
            if pre.any():
                b = np.frombuffer(body, dtype=np.uint8)
                at = off[pre][:, None] + np.arange(8)
                u = b[at].copy().view("<i8")[:, 0]
                if (u < -1).any():
                    raise wire.WireError("malformed Arrow IPC metadata (negative uncompressed length)")
                # lengths are bounded by the body; the prefixes are the sender's: summed as Python ints
                total = int(ln[~pre].sum()) + sum(np.where(u == -1, ln[pre] - 8, u).tolist())
            else:
                total = int(ln.sum())
        else:
            total = int(ln.sum())
    return total, rows


def check_arrow_sizes(payload: bytes, limits: IngressLimits) -> None:
    """Raise WireError if the Arrow IPC stream would decode to more than ``max_decoded_bytes`` or
    hold more than ``max_rows_per_message`` rows. Reads metadata only (no decompression)."""
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(payload))
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad message
        raise wire.WireError(f"undecodable Arrow IPC stream: {e}") from None
    total = rows = 0
    while True:
        try:
            m = reader.read_next_message()
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001
            raise wire.WireError(f"undecodable Arrow IPC stream: {e}") from None
        if m is None:
            break
        if m.type == "schema":
            continue
        try:
            size, n = _batch_sizes(m.metadata.to_pybytes(), m.body)
        except (struct.error, IndexError, ValueError) as e:
            raise wire.WireError(f"malformed Arrow IPC metadata: {e}") from None
        if size < 0 or n < 0:
            raise wire.WireError("malformed Arrow IPC metadata (negative size)")
        total += size
        if m.type == "record batch":
            rows += n
        if total > limits.max_decoded_bytes:
            raise wire.WireError(f"message decodes to more than max_decoded_bytes={limits.max_decoded_bytes:,} "
                                 f"bytes ({len(payload):,} bytes on the wire)")
        if rows > limits.max_rows_per_message:
            raise wire.WireError(f"message holds more than max_rows_per_message={limits.max_rows_per_message:,} rows")


def check_size(value: bytes | None, content_type, limits: IngressLimits) -> None:
    """Raise WireError if the raw value is over ``max_message_bytes`` (``max_json_bytes`` for JSON)."""
    if value is None:
        return
    ct = content_type.decode("utf-8", "replace") if isinstance(content_type, (bytes, bytearray)) else (content_type or "")
    cap = limits.max_json_bytes if ct.split(";")[0].strip() == wire.JSON_CT else limits.max_message_bytes
    if len(value) > cap:
        raise wire.WireError(f"message of {len(value):,} bytes (over {cap:,}: max_message_bytes / max_json_bytes)")


def _has_amplifying(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
        return True
    if t in (pa.string_view(), pa.binary_view()) or pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        return True
    return any(_has_amplifying(t.field(i).type) for i in range(t.num_fields))


def _expanded_bytes(col: pa.ChunkedArray) -> int:
    """Bytes a top-level column takes once its dictionary / run-end / view encoding is undone."""
    t = col.type
    total = 0
    for ch in col.chunks:
        if pa.types.is_dictionary(t):
            d = ch.dictionary
            if _has_amplifying(d.type):
                raise wire.WireError("nested dictionary encodings are not accepted")
            if pa.types.is_binary(d.type) or pa.types.is_string(d.type) or pa.types.is_large_string(d.type) \
                    or pa.types.is_large_binary(d.type):
                lens = pc.fill_null(pc.binary_length(d), 0).to_numpy(zero_copy_only=False).astype(np.int64)
                idx = ch.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                if len(lens) and len(idx) and (idx.min() < 0 or idx.max() >= len(lens)):
                    raise wire.WireError("dictionary index out of range")
                total += int(lens[idx].sum()) if len(lens) else 0
            elif d.type.num_fields == 0 and hasattr(d.type, "bit_width") and d.type.bit_width:
                total += len(ch) * d.type.bit_width // 8
            else:
                raise wire.WireError(f"dictionary-encoded {d.type} columns are not accepted")
        elif t in (pa.string_view(), pa.binary_view()):
            views = ch.buffers()[1]                # 16-byte views; the first 4 bytes: the length
            if views is not None and len(ch):
                lens = np.frombuffer(views, dtype=np.int32)[ch.offset * 4:(ch.offset + len(ch)) * 4:4]
                total += int(np.abs(lens.astype(np.int64)).sum())
        else:
            raise wire.WireError(f"columns of type {t} are not accepted")
        total += len(ch) * 8
    return total


def check_expansion(table: pa.Table, limits: IngressLimits) -> None:
    """Raise WireError if a column's encoding would expand past ``max_decoded_bytes`` once cast
    (a 1-value dictionary of 1 MB repeated on a million rows is a terabyte), or if the message has
    more than ``max_columns`` columns."""
    if table.num_columns > limits.max_columns:
        raise wire.WireError(f"message has {table.num_columns} columns (max_columns={limits.max_columns})")
    total = 0
    for col in table.columns:
        if _has_amplifying(col.type):
            total += _expanded_bytes(col)
            if total > limits.max_decoded_bytes:
                raise wire.WireError(f"message expands to more than max_decoded_bytes={limits.max_decoded_bytes:,} "
                                     "bytes (dictionary/view encoding)")


# ------------------------------------------------------------------------------ extra columns
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
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
            if v is None or not _NAME_RE.match(f.name):
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
            if not _NAME_RE.match(name) or name in _RESERVED:
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


# ------------------------------------------------------------------------------ row bounds
_RANKED = catalog.RANKED


@functools.lru_cache(maxsize=None)
def time_columns(kind: str) -> tuple[str, ...]:
    return tuple(f.name for f in wire.SCHEMAS[kind] if pa.types.is_timestamp(f.type))


def _iso(ns: int) -> str:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns // 1_000_000_000))
    except (OverflowError, OSError, ValueError):
        return f"{ns} ns"


def _int_range(col) -> tuple[int, int] | None:
    """(min, max) of an integer or timestamp column as int, nulls ignored; None when all null. In C:
    a batch whose range is inside the bounds needs no per-row mask."""
    mm = pc.min_max(col.cast(pa.int64()) if pa.types.is_timestamp(col.type) else col)
    lo, hi = mm["min"].as_py(), mm["max"].as_py()
    return None if lo is None else (int(lo), int(hi))


def row_bounds(kind: str, table: pa.Table, limits: IngressLimits, now_ns: int,
               base_ns: np.ndarray | int | None = None) -> list[tuple[str, np.ndarray]]:
    """(reason, bad-row mask) for each bound some row breaks: rank, world size, timestamps.

    A timestamp may be at most ``max_future_skew_s`` ahead of the later of ``now_ns`` (the receive
    time) and ``base_ns`` (per row or one value, or a callable returning it: the job's anchor time,
    stream.stepaxis.time_base, called only for a column whose newest value needs it). Each column's
    range is taken first (in C); masks are built only for a column whose range breaks a bound."""
    out: list[tuple[str, np.ndarray]] = []
    n = table.num_rows
    if n == 0:
        return out
    if kind in _RANKED and "rank" in table.column_names:
        r = table.column("rank")
        rng = _int_range(r) if r.null_count < n else None
        if rng is not None and rng[1] >= limits.max_ranks:
            v = pc.fill_null(r, 0).to_numpy().astype(np.int64)
            bad = v >= limits.max_ranks
            out.append((f"field 'rank': value {int(v[bad][0]):,} at or above max_ranks={limits.max_ranks:,}", bad))
    if kind == "topology":
        w = pc.fill_null(table.column("world_size"), 0).to_numpy().astype(np.int64)
        bad = w > limits.max_ranks
        if bad.any():
            out.append((f"field 'world_size': value {int(w[bad][0]):,} above max_ranks={limits.max_ranks:,}", bad))
    skew = int(limits.max_future_skew_s * 1e9)
    hi_min = hi = now_ns + skew                  # the bound of every row is at least this
    lazy_base = callable(base_ns)                # stepaxis.time_base: per-row job times, asked only if needed
    lo = limits.min_time_ns
    if limits.max_age_s is not None:
        lo = max(lo, now_ns - int(limits.max_age_s * 1e9))
    for c in time_columns(kind):
        col = table.column(c)
        if col.null_count == n:
            continue
        rng = _int_range(col)
        if rng is None or (rng[0] >= lo and rng[1] <= hi_min):
            continue
        if lazy_base:
            base_ns, lazy_base = base_ns(), False
        if base_ns is not None:
            hi = np.maximum(now_ns, base_ns) + skew
        v = col.cast(pa.int64()).to_numpy(zero_copy_only=False)
        if col.null_count:
            ok_null = pc.is_null(col).to_numpy(zero_copy_only=False)
            v = np.where(ok_null, lo, v)
        early = v < lo
        late = v > hi
        if early.any():
            out.append((f"field '{c}': value {_iso(int(v[early][0]))} before "
                        f"{'1970' if lo == 0 else _iso(lo)} (min_time_ns / max_age_s)", early))
        if late.any():
            out.append((f"field '{c}': value {_iso(int(v[late][0]))} more than max_future_skew_s="
                        f"{limits.max_future_skew_s:g} s ahead of the receive time {_iso(now_ns)} "
                        "(and of the job's own time)", late))
    return out


def split(table: pa.Table, checks: list[tuple[str, np.ndarray]]) -> tuple[pa.Table, list[str], int]:
    """(rows passing every check, [reason per failing check with its first value count], n bad)."""
    if not checks:
        return table, [], 0
    bad = np.logical_or.reduce([m for _, m in checks])
    nbad = int(bad.sum())
    reasons = [f"{why} ({int(m.sum())} rows)" for why, m in checks]
    return table.filter(pa.array(~bad)), reasons, nbad


# ------------------------------------------------------------------------------ deadletter records
class MessageDeadletter:
    """What went wrong with one source message, summarised into one deadletter record."""

    __slots__ = ("whole", "reasons", "bad_rows", "jobs", "first_row", "total_rows")

    def __init__(self):
        self.whole: str | None = None        # the whole message was rejected: why
        self.reasons: list[str] = []         # distinct row-level reasons, in order
        self.bad_rows = 0
        self.jobs: set = set()
        self.first_row: int | None = None
        self.total_rows: int | None = None

    def add(self, reason: str | None = None, rejected=None, rows: pa.Table | None = None, n: int | None = None,
            keep: int = 5) -> None:
        """``reason`` alone: the whole message is bad. ``rejected`` [(row, why)] or ``reason`` with
        ``n`` (rows it covers, may be 0 for a second reason on the same rows): some rows are bad."""
        if not rejected and n is None:
            if reason is not None:
                self.whole = self.whole or reason
            return
        if rejected:
            if self.first_row is None:
                self.first_row = int(rejected[0][0])
            for _, why in rejected:
                if len(self.reasons) >= keep:
                    break
                if why not in self.reasons:
                    self.reasons.append(why)
            self.bad_rows += len(rejected)
        elif reason is not None:
            if len(self.reasons) < keep and reason not in self.reasons:
                self.reasons.append(reason)
            self.bad_rows += int(n or 0)
        if rows is not None and "job" in rows.column_names and len(self.jobs) < 2:
            for j in pc.unique(rows.column("job")).to_pylist()[:2]:
                if isinstance(j, str) and wire.JOB_RE.match(j):
                    self.jobs.add(j)

    def __bool__(self) -> bool:
        return self.whole is not None or self.bad_rows > 0

    def reason(self, total_rows: int | None) -> str:
        if self.whole is not None:
            return self.whole
        of = f" of {total_rows}" if total_rows is not None else ""
        return f"{self.bad_rows}{of} row(s) rejected: " + "; ".join(self.reasons)

    def record(self, msg, key_job: str | None, total_rows: int | None, limits: IngressLimits, now_ns: int) -> dict:
        job = key_job or (next(iter(self.jobs)) if len(self.jobs) == 1 else None) or "_unknown"
        value = msg.value if msg.value is not None else b""
        reason = self.reason(total_rows)
        if len(value) > limits.deadletter_payload_bytes:
            reason += f" [payload cut to {limits.deadletter_payload_bytes:,} of {len(value):,} bytes]"
            value = value[:limits.deadletter_payload_bytes]
        hdr = {k: v for k, v in (msg.headers or [])} if isinstance(msg.headers, list) else {}
        sch = hdr.get("schema")
        sch = sch.decode("utf-8", "replace")[:64] if isinstance(sch, (bytes, bytearray)) else None
        return {"job": job, "t_received": now_ns, "source_topic": msg.topic,
                "source_partition": msg.partition, "source_offset": msg.offset, "schema": sch,
                "row": None if self.whole is not None else self.first_row,
                "reason": reason[:4000], "payload": bytes(value)}


def key_job(msg) -> str | None:
    k = getattr(msg, "key", None)
    if not k or len(k) > 128:
        return None
    s = k.decode("utf-8", "replace")
    return s if wire.JOB_RE.match(s) else None


# ------------------------------------------------------------------------------ flush isolation
def isolate_failing_sources(pieces: list[tuple[str, pa.Table, object]], try_write) -> tuple[list, dict]:
    """Split buffered ``(table, rows, source)`` pieces into those that flush together and, per
    source, the error of the pieces that do not.

    ``try_write(pieces)`` writes a set of pieces to a scratch store and raises on failure. Sources
    are bisected: a group that fails is halved until the single sources that fail (alone or with
    the good ones) are found; log2(sources) scratch writes per bad source."""
    order: list = []
    by_src: dict = {}
    for p in pieces:
        if p[2] not in by_src:
            by_src[p[2]] = []
            order.append(p[2])
        by_src[p[2]].append(p)
    good: list = []
    bad: dict = {}

    def check(srcs: list) -> None:
        cand = [p for s in srcs for p in by_src[s]]
        try:
            try_write(good + cand)
            good.extend(cand)
            return
        except Exception as e:  # noqa: BLE001 - the reason goes to the deadletter
            if len(srcs) == 1:
                bad[srcs[0]] = e
                return
        mid = len(srcs) // 2
        check(srcs[:mid])
        check(srcs[mid:])

    check(order)
    return good, bad


def scratch_writer(store_cls):
    """A ``try_write`` for :func:`isolate_failing_sources`: writes the pieces into a throw-away
    store of the same class (no fsync) and removes it."""
    def try_write(pieces):
        tables: dict[str, list[pa.Table]] = {}
        for name, t, _ in pieces:
            tables.setdefault(name, []).append(t)
        d = tempfile.mkdtemp(prefix="stepwatch-isolate-")
        try:
            from stepwatch.storage.lake import Lake      # a local scratch lake, never the configured one
            store_cls(Lake.make(f"sqlite:{d}/lake.sqlite", f"{d}/lake"), fsync=False).init().write_flush(tables, {})
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return try_write

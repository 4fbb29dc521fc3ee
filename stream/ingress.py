"""The processor's ingress: the bounds every Kafka message must fit before it reaches the store.

Every boundary is a contract with bounds (``docs/limits.md``): a message that breaks
them costs its sender one deadletter record, never the pipeline. This module holds the row bounds and
rate limits; the settings and the other checks the processor calls around
:func:`stepwatch.wire.decode.decode` live in modules of their own, imported from there:

- :mod:`stepwatch.stream.ingress_limits`: the settings, :class:`IngressLimits` (one dataclass so a
  config file can fill it) and ``limits_from_pairs`` (``stepwatch process --limit``).
- :mod:`stepwatch.stream.ingress_sizes`: ``check_size`` (the raw value); ``check_arrow_sizes``
  (before anything is decompressed, the IPC stream's record-batch metadata is read, a few
  flatbuffer fields, and the *decoded* size of every buffer, the 8-byte uncompressed length that
  prefixes each compressed buffer, and the row count are summed and bounded: an 8 KiB zstd message
  cannot inflate to 520 MiB); ``check_expansion`` (after decoding, encodings whose materialisation
  can be far larger than their buffers: dictionary, run-end encoded, string/binary views).
- :mod:`stepwatch.stream.ingress_columns`: ``ExtraColumns``: unknown extra columns are kept only
  with a type Parquet (and DuckDB) store, a safe name, at most ``max_extra_columns`` per table, and
  the type first seen for that name (later messages are cast to it, or the column is dropped);
  everything else is dropped and counted.
- here, :func:`row_bounds`: rank and world size below ``max_ranks``, timestamps after 1970 and at
  most ``max_future_skew_s`` ahead of the later of the receive time and the job's own time
  (optionally not older than ``max_age_s``); each column's range is taken in C first, so a batch
  inside the bounds costs no per-row mask.
- per job, a step more than ``max_step_jump`` ahead of where the job's ranks are:
  :mod:`stepwatch.stream.stepaxis`.
- :mod:`stepwatch.stream.ingress_deadletter`: ``MessageDeadletter``, one deadletter record per
  source message, with a summary of the bad rows (count, first reasons) and the raw value (capped),
  producer headers stripped; ``isolate_failing_sources``: when a flush fails, bisect the buffered
  pieces by source message against a scratch store (``scratch_writer``), so only the message(s)
  that break it go to the deadletter.
- here, :class:`TokenBucket` / :class:`RateLimitedLog`: rate limits for log lines and store rebuilds.
"""
from __future__ import annotations

import functools
import logging
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.wire import catalog
from stepwatch.wire import tables as wire
from stepwatch.stream.ingress_limits import IngressLimits

log = logging.getLogger("stepwatch.ingress")


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

    def charge(self, n: float) -> None:
        """Spend ``n`` after the fact (a cost known only once paid, e.g. seconds): the bucket may go
        negative and refills from there."""
        self.tokens -= n


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

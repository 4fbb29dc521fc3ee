"""The settings of the processor's Kafka boundary (docs/limits.md, ``stepwatch process --limit``).
Every module that bounds or configures the ingress imports it from here.
"""
from __future__ import annotations

from dataclasses import dataclass


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
    rebuild_time_share: float = 0.05
    """Share of the processor's wall time spent rebuilding jobs from the store, averaged over a minute
    (a rebuild is a few store queries, 10-200 ms: at ``rebuilds_per_s`` alone, job ids churning at
    ``max_jobs`` turned ingest into rebuilds). Over it a job starts cold (counted ``rate_limited``)."""
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

"""What the processor does with a message that breaks its bounds (docs/limits.md): one deadletter
record per source message (:class:`MessageDeadletter`), and, when a flush fails, the bisection that
finds the source message(s) whose rows break it (:func:`isolate_failing_sources`).
"""
from __future__ import annotations

import shutil
import tempfile

import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.wire import tables as wire
from stepwatch.stream.ingress_limits import IngressLimits

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
                if isinstance(j, str) and wire.JOB_RE.fullmatch(j):
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
    return s if wire.JOB_RE.fullmatch(s) else None


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

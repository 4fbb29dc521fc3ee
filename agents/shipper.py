"""Getting the node agent's batches to Kafka, or to a bounded local spool while Kafka is away.

:class:`Spool` is a directory of Arrow IPC *files*, one per (kind, job) table, named
``<seq:016d>-<kind>-<rows>.arrow`` (the job is in the schema metadata). Files are written under a
temporary name and renamed into place, so a crash leaves no half file; the sequence continues across
restarts, so an agent that comes back replays what its predecessor spooled. When the directory grows
past ``max_bytes`` the oldest files are deleted and their rows counted as dropped.

:class:`Shipper` sends each tick's tables with :func:`~stepwatch.stream.kafkaio.send_table` (Arrow,
keyed by job, ``schema`` headers) and waits for the acknowledgements. A send that fails or is not
acknowledged within ``send_timeout_s`` sends the unacknowledged tables to the spool and drops the
producer (closed without waiting, so it cannot deliver them later behind the replay's back). While the
spool holds anything, new tables go to the spool too, so Kafka sees every table in the order it was
produced; every ``retry_s`` the shipper reconnects and replays the spool oldest first, deleting each
file only once Kafka acknowledged it. A table whose acknowledgement was lost can be delivered twice;
the processor drops duplicate step rows by their natural key (job, rank, step).
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

log = logging.getLogger("stepwatch.agent.ship")

_NAME = re.compile(r"^(\d{16})-([a-z]+)-(\d+)\.arrow$")


@dataclass(frozen=True)
class SpoolFile:
    path: Path
    seq: int
    kind: str
    rows: int
    size: int


class Spool:
    def __init__(self, directory: str | Path, max_bytes: int = 256 << 20, metrics=None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.metrics = metrics
        for p in self.dir.glob(".tmp-*"):
            p.unlink(missing_ok=True)
        self._files: list[SpoolFile] = sorted(
            (f for f in (self._parse(p) for p in self.dir.iterdir()) if f is not None), key=lambda f: f.seq)
        self._seq = self._files[-1].seq + 1 if self._files else 0
        self.bytes = sum(f.size for f in self._files)
        self.dropped_rows = 0
        self._gauge()

    @staticmethod
    def _parse(p: Path) -> SpoolFile | None:
        m = _NAME.match(p.name)
        if not m:
            return None
        try:
            size = p.stat().st_size
        except OSError:
            return None
        return SpoolFile(p, int(m.group(1)), m.group(2), int(m.group(3)), size)

    def __len__(self) -> int:
        return len(self._files)

    def pending(self) -> list[SpoolFile]:
        """Spooled files, oldest first."""
        return list(self._files)

    def put(self, kind: str, job: str, table: pa.Table) -> SpoolFile:
        """Write one table; then drop the oldest files while the spool is over its bound."""
        md = dict(table.schema.metadata or {})
        md.update({b"stepwatch.job": job.encode(), b"stepwatch.kind": kind.encode()})
        table = table.replace_schema_metadata(md)
        name = f"{self._seq:016d}-{kind}-{table.num_rows}.arrow"
        self._seq += 1
        tmp = self.dir / f".tmp-{name}"
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(
                sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as w:
            w.write_table(table)
        final = self.dir / name
        os.replace(tmp, final)
        f = SpoolFile(final, self._seq - 1, kind, table.num_rows, final.stat().st_size)
        self._files.append(f)
        self.bytes += f.size
        self._enforce()
        self._gauge()
        return f

    def _enforce(self) -> None:
        while self._files and self.bytes > self.max_bytes:
            old = self._files.pop(0)
            old.path.unlink(missing_ok=True)
            self.bytes -= old.size
            self.dropped_rows += old.rows
            if self.metrics is not None:
                self.metrics.dropped.labels("spool_full").inc(old.rows)
            log.warning("spool over %d bytes: dropped %s (%d %s rows)", self.max_bytes, old.path.name, old.rows,
                        old.kind)

    @staticmethod
    def read(f: SpoolFile) -> tuple[str, str, pa.Table]:
        """(kind, job, table) of a spooled file."""
        with pa.memory_map(str(f.path)) as src:
            t = pa.ipc.open_file(src).read_all()
        md = t.schema.metadata or {}
        job = md.get(b"stepwatch.job", b"").decode()
        return f.kind, job, t.replace_schema_metadata(None)

    def remove(self, f: SpoolFile) -> None:
        f.path.unlink(missing_ok=True)
        self._files.remove(f)
        self.bytes -= f.size
        self._gauge()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.spool_bytes.set(self.bytes)
            self.metrics.spool_files.set(len(self._files))


class Shipper:
    """Sends (kind, job, table) items; spools what Kafka did not take. Not thread-safe: one caller."""

    def __init__(self, settings, spool: Spool, metrics=None, send_timeout_s: float = 5.0, retry_s: float = 2.0,
                 replay_files_per_call: int = 64, create_topics: bool = True):
        self.settings = settings
        self.spool = spool
        self.metrics = metrics
        self.send_timeout_s = send_timeout_s
        self.retry_s = retry_s
        self.replay_files_per_call = replay_files_per_call
        self.create_topics = create_topics
        self.producer = None
        self._t_attempt = -1e18
        self._topics_done = False
        self._state_logged = False
        self.online = False

    # -------------------------------------------------------------- connection
    def _connect(self) -> bool:
        if self.producer is not None:
            return True
        now = time.monotonic()
        if now - self._t_attempt < self.retry_s:
            return False
        self._t_attempt = now
        import dataclasses

        from stepwatch.stream.kafkaio import ensure_topics, make_producer
        t = max(1000, int(self.send_timeout_s * 1000))
        try:
            self.producer = make_producer(self.settings, bootstrap_timeout_ms=t, max_block_ms=t,
                                          request_timeout_ms=t, delivery_timeout_ms=2 * t + 100, linger_ms=5,
                                          reconnect_backoff_max_ms=1000)
        except Exception as e:  # noqa: BLE001 - NoBrokersAvailable, KafkaTimeoutError, OSError ...
            self._set_online(False, f"cannot reach Kafka at {self.settings.bootstrap} ({e}); "
                                    f"spooling to {self.spool.dir}")
            return False
        if self.create_topics and not self._topics_done:
            try:
                quick = dataclasses.replace(self.settings, extra=dict(self.settings.extra, bootstrap_timeout_ms=t,
                                                                      request_timeout_ms=t))
                ensure_topics(quick, names=("steps", "host", "gc", "comm", "topology"))
                self._topics_done = True
            except Exception as e:  # noqa: BLE001 - no ACL to create topics: they may exist anyway
                log.info("could not check/create topics (%r); sending anyway", e)
                self._topics_done = True
        self._set_online(True, f"connected to Kafka at {self.settings.bootstrap}")
        return True

    def _set_online(self, up: bool, why: str) -> None:
        if up != self.online or not self._state_logged:
            (log.info if up else log.warning)("%s", why)
            self._state_logged = True
        self.online = up
        if self.metrics is not None:
            self.metrics.kafka_up.set(1 if up else 0)

    def _drop_producer(self, why: str) -> None:
        p, self.producer = self.producer, None
        if p is not None:
            try:
                p.close(timeout=0)
            except Exception:  # noqa: BLE001
                pass
        self._t_attempt = time.monotonic()
        self._set_online(False, why)

    # -------------------------------------------------------------- sending
    def _send(self, items: list[tuple[str, str, pa.Table]]) -> list[int]:
        """Send items and wait for their acks; returns the indices of items not acknowledged."""
        from stepwatch.stream.kafkaio import send_table
        t0 = time.perf_counter()
        futs: list[tuple[int, list]] = []
        failed: list[int] = []
        for i, (kind, job, table) in enumerate(items):
            try:
                futs.append((i, send_table(self.producer, self.settings, kind, table)))
            except Exception as e:  # noqa: BLE001 - KafkaTimeoutError (metadata), buffer full ...
                log.debug("send of %s/%s failed: %r", kind, job, e)
                failed.append(i)
        try:
            self.producer.flush(timeout=self.send_timeout_s)
        except Exception as e:  # noqa: BLE001
            log.debug("flush failed: %r", e)
        for i, fs in futs:
            if not all(f.is_done and f.succeeded() for f in fs):
                failed.append(i)
        if self.metrics is not None:
            self.metrics.send_seconds.observe(time.perf_counter() - t0)
        return sorted(set(failed))

    def _count_out(self, kind: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.records_out.labels(kind).inc(n)

    def _spool(self, kind: str, job: str, table: pa.Table) -> None:
        self.spool.put(kind, job, table)
        if self.metrics is not None:
            self.metrics.records_spooled.labels(kind).inc(table.num_rows)

    def ship(self, items: list[tuple[str, str, pa.Table]]) -> None:
        """Send a tick's tables in order (to Kafka, or to the spool to keep the order)."""
        items = [it for it in items if it[2].num_rows]
        if len(self.spool) or not self._connect():
            for kind, job, t in items:
                self._spool(kind, job, t)
            self.replay()
            return
        if not items:
            return
        failed = self._send(items)
        for i, (kind, _, t) in enumerate(items):
            if i not in failed:
                self._count_out(kind, t.num_rows)
        if failed:
            for i in failed:
                self._spool(*items[i])
            self._drop_producer(f"Kafka did not acknowledge {len(failed)} of {len(items)} tables within "
                                f"{self.send_timeout_s:.0f}s; spooling to {self.spool.dir}")

    def replay(self) -> int:
        """Send spooled files oldest first (at most ``replay_files_per_call``); returns files sent."""
        if not len(self.spool) or not self._connect():
            return 0
        sent = 0
        for f in self.spool.pending()[: self.replay_files_per_call]:
            try:
                kind, job, t = Spool.read(f)
            except Exception as e:  # noqa: BLE001 - a damaged file must not block the rest
                log.warning("unreadable spool file %s dropped: %r", f.path.name, e)
                if self.metrics is not None:
                    self.metrics.dropped.labels("spool_unreadable").inc(f.rows)
                self.spool.remove(f)
                continue
            if self._send([(kind, job, t)]):
                self._drop_producer(f"replay of {f.path.name} not acknowledged; will retry")
                break
            self.spool.remove(f)
            self._count_out(kind, t.num_rows)
            sent += 1
        if sent and not len(self.spool):
            log.info("spool replayed; sending live again")
        return sent

    def close(self, timeout_s: float = 5.0) -> None:
        if self.producer is not None:
            try:
                self.producer.flush(timeout=timeout_s)
            except Exception:  # noqa: BLE001
                pass
            try:
                self.producer.close(timeout=timeout_s)
            except Exception:  # noqa: BLE001
                pass
            self.producer = None

"""Getting the node agent's batches to Kafka, or to a bounded local spool while Kafka is away.

:class:`Spool` is a directory of files, one per (kind, job) record batch, named
``<seq:016d>-<kind>-<rows>-<crc32:08x>.arrows`` (the CRC-32 covers the file's bytes): the magic
``SWSPOOL1``, the job (a 2-byte little-endian length, UTF-8), and the message's Arrow IPC stream as it goes
to Kafka, LZ4-framed. Files an agent before nanoarrow wrote (``.arrow``: Arrow IPC *files*, LZ4 buffers, the
job in the schema metadata) are read and sent too (:func:`stepwatch.wire.lite.read_ipc`). Files are written under a temporary name, fsynced, renamed into place and the directory
fsynced, so a crash leaves no half file and a spooled table survives a power loss; the sequence
continues across restarts, so an agent that comes back replays what its predecessor spooled.

Nothing is lost silently (docs/limits.md): every row the spool gives up is counted in
``stepwatch_agent_records_dropped_total{reason}`` and logged once per reason and minute --
``spool_full`` (past ``max_bytes`` the oldest files go), ``spool_unreadable`` (a file whose CRC or Arrow
structure is damaged), ``spool_incomplete`` (a temporary file a crash left; its rows never reached the
spool), ``disk_full`` (see below).

:class:`Shipper` sends each tick's record batches (:class:`stepwatch.wire.lite.Batch`: Arrow IPC
streams, uncompressed buffers, keyed by job, ``schema`` headers) in LZ4-compressed Kafka record batches and waits for the acknowledgements. A send that fails or is not
acknowledged within ``send_timeout_s`` sends the unacknowledged tables to the spool and drops the
producer (closed without waiting, so it cannot deliver them later behind the replay's back). While the
spool holds anything, new tables go to the spool too, so Kafka sees every table in the order it was
produced; every ``retry_s`` the shipper reconnects and replays the spool oldest first, deleting each
file only once Kafka acknowledged it. When the spool cannot be written (disk full, I/O error) tables are
held in memory, in order behind the spool, up to ``held_max_bytes`` (64 MiB); they move to the spool
as soon as it takes writes again, or go to Kafka once the spool before them is replayed; beyond the
bound the oldest held table is dropped (``disk_full``, counted and logged once). A table whose acknowledgement was lost can be delivered twice;
the processor drops duplicate step rows by their natural key (job, rank, step).
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import re
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from stepwatch.wire import catalog
from stepwatch.wire import lite
from stepwatch.wire.lite import Batch

log = logging.getLogger("stepwatch.agent.ship")

_NAME = re.compile(r"^(\d{16})-([a-z]+)-(\d+)(?:-([0-9a-f]{8}))?\.arrows?$")
_TMP = re.compile(r"^\.tmp-\d{16}-[a-z]+-(\d+)(?:-[0-9a-f]{8})?\.arrows?$")
MAGIC = b"SWSPOOL1"                 # a spool file: MAGIC, job (u16 length + UTF-8), LZ4 frame of the IPC stream


class DropLog:
    """Counts what is dropped, by reason, and logs each reason once, then at most once a minute with
    the rows dropped since (a full disk must not become a log line per tick)."""

    def __init__(self, metrics=None, every_s: float = 60.0):
        self.metrics = metrics
        self.every_s = every_s
        self.total: dict[str, int] = collections.Counter()
        self._since: dict[str, int] = collections.Counter()
        self._t: dict[str, float] = {}

    def drop(self, reason: str, rows: int, what: str) -> None:
        self.total[reason] += rows
        self._since[reason] += rows
        if self.metrics is not None:
            self.metrics.dropped.labels(reason).inc(rows)
        now = time.monotonic()
        t = self._t.get(reason)
        if t is None or now - t >= self.every_s:
            self._t[reason] = now
            first = "" if t is None else f" ({self._since[reason]} rows dropped for this reason since the last message)"
            log.warning("%s rows dropped (%s): %s%s", rows, reason, what, first)
            self._since[reason] = 0


@dataclass(frozen=True)
class SpoolFile:
    path: Path
    seq: int
    kind: str
    rows: int
    size: int
    crc: int | None = None


class Spool:
    def __init__(self, directory: str | Path, max_bytes: int = 256 << 20, metrics=None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.metrics = metrics
        self.drops = DropLog(metrics)
        for p in self.dir.glob(".tmp-*"):
            m = _TMP.match(p.name)
            self.drops.drop("spool_incomplete", int(m.group(1)) if m else 0,
                            f"{p.name}: a spool write interrupted by a crash (its rows never reached the spool)")
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
        return SpoolFile(p, int(m.group(1)), m.group(2), int(m.group(3)), size,
                         int(m.group(4), 16) if m.group(4) else None)

    def __len__(self) -> int:
        return len(self._files)

    def pending(self) -> list[SpoolFile]:
        """Spooled files, oldest first."""
        return list(self._files)

    def put(self, kind: str, job: str, table) -> SpoolFile:
        """Write one record batch (a :class:`~stepwatch.wire.lite.Batch`, or a pyarrow Table) durably (fsync
        of the file and the directory); then drop the oldest files while the spool is over its bound. Raises
        OSError (e.g. ENOSPC) with nothing left behind."""
        import lz4.frame     # (here: `stepwatch agent --no-kafka` marks lz4 absent, and spools nothing)
        table = lite.as_batch(table)
        j = job.encode()
        data = b"".join([MAGIC, len(j).to_bytes(2, "little"), j, lz4.frame.compress(table.payload)])
        crc = zlib.crc32(data)
        name = f"{self._seq:016d}-{kind}-{table.num_rows}-{crc:08x}.arrows"
        tmp = self.dir / f".tmp-{name}"
        final = self.dir / name
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            fsync_dir(self.dir)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self._seq += 1
        f = SpoolFile(final, self._seq - 1, kind, table.num_rows, len(data), crc)
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
            self.drops.drop("spool_full", old.rows, f"spool over {self.max_bytes} bytes: the oldest file "
                                                    f"{old.path.name} ({old.kind}) deleted")

    @staticmethod
    def read(f: SpoolFile) -> tuple[str, str, Batch]:
        """(kind, job, batch) of a spooled file, of this agent or of one before nanoarrow (an Arrow IPC
        file); raises ValueError when its CRC does not match or its Arrow stream does not read."""
        with open(f.path, "rb") as fh:
            data = fh.read()
        if f.crc is not None and zlib.crc32(data) != f.crc:
            raise ValueError(f"CRC-32 mismatch ({zlib.crc32(data):08x}, written {f.crc:08x})")
        if data[:len(MAGIC)] == MAGIC:
            import lz4.frame
            n = len(MAGIC) + 2 + int.from_bytes(data[len(MAGIC):len(MAGIC) + 2], "little")
            job = data[len(MAGIC) + 2:n].decode()
            data = lz4.frame.decompress(data[n:])
        else:
            job = None                               # an older agent's file: the job is in the metadata
        md, rows, payload = lite.read_ipc(data)      # (reads every batch: a damaged stream raises here)
        if job is None:
            job = md.get(b"stepwatch.job", b"").decode()
        return f.kind, job, Batch(rows, payload=payload)

    def remove(self, f: SpoolFile) -> None:
        f.path.unlink(missing_ok=True)
        self._files.remove(f)
        self.bytes -= f.size
        self._gauge()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.spool_bytes.set(self.bytes)
            self.metrics.spool_files.set(len(self._files))


def fsync_dir(d) -> None:
    """Make a rename or a new file in directory ``d`` durable (fsync of the directory itself)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Shipper:
    """Sends (kind, job, table) items; spools what Kafka did not take. Not thread-safe: one caller."""

    def __init__(self, settings, spool: Spool, metrics=None, send_timeout_s: float = 5.0, retry_s: float = 2.0,
                 replay_files_per_call: int = 64, create_topics: bool = True, held_max_bytes: int = 64 << 20,
                 background_connect: bool = False):
        self.settings = settings
        self.spool = spool
        self.drops = spool.drops
        self.held: collections.deque = collections.deque()   # (kind, job, table) the spool could not take
        self.held_bytes = 0
        self.held_max_bytes = held_max_bytes
        self._spool_errors = 0
        self.metrics = metrics
        self.send_timeout_s = send_timeout_s
        self.retry_s = retry_s
        self.replay_files_per_call = replay_files_per_call
        self.create_topics = create_topics
        self.producer = None
        # connect in a thread of its own (the agent): a broker that cannot be reached holds a connection
        # attempt for up to send_timeout_s; in the caller's thread that stopped the agent's tick (host
        # samples, liveness, the spool) for 5 s of every 7 while Kafka was away
        self.background_connect = background_connect
        self._opening: threading.Thread | None = None
        self._opened: tuple = (None, None)
        self._t_attempt = -1e18
        self._topics_done = False
        self._state_logged = False
        self.online = False

    # -------------------------------------------------------------- connection
    def _connect(self) -> bool:
        if self.producer is not None:
            return True
        if self._opening is not None:                   # a background attempt: done yet?
            if self._opening.is_alive():
                return False
            self._opening = None
            opened, self._opened = self._opened, (None, None)
            return self._connected(*opened)
        now = time.monotonic()
        if now - self._t_attempt < self.retry_s:
            return False
        self._t_attempt = now
        if self.background_connect:
            self._opening = threading.Thread(target=self._open_in_background, name="stepwatch-agent-connect",
                                             daemon=True)
            self._opening.start()
            return False                                 # this tick spools; a later one finds the producer
        return self._connected(*self._open())

    def connect_soon(self) -> None:
        """Begin connecting now (the agent's start), so the first tick finds the producer."""
        self._connect()

    def wait_connect(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a connection attempt under way (the agent's last tick: what it spools
        then would wait for the next start)."""
        if self._opening is not None:
            self._opening.join(timeout_s)

    def _open_in_background(self) -> None:
        self._opened = self._open()

    def _connected(self, producer, err) -> bool:
        if producer is None:
            self._set_online(False, f"cannot reach Kafka at {self.settings.bootstrap} ({err}); "
                                    f"spooling to {self.spool.dir}")
            return False
        self.producer = producer
        self._set_online(True, f"connected to Kafka at {self.settings.bootstrap}")
        return True

    def _open(self) -> tuple:
        """(a producer, None) or (None, the error): a connection, and the input topics made once."""
        import dataclasses

        from stepwatch.kafkaio import ensure_topics, make_producer
        t = max(1000, int(self.send_timeout_s * 1000))
        try:
            producer = make_producer(self.settings, bootstrap_timeout_ms=t, max_block_ms=t,
                                     request_timeout_ms=t, delivery_timeout_ms=2 * t + 100, linger_ms=5,
                                     reconnect_backoff_max_ms=1000,
                                     compression_type="lz4")   # nanoarrow's IPC buffers are not compressed
        except Exception as e:  # noqa: BLE001 - NoBrokersAvailable, KafkaTimeoutError, OSError ...
            return None, e
        if self.create_topics and not self._topics_done:
            try:
                quick = dataclasses.replace(self.settings, extra=dict(self.settings.extra, bootstrap_timeout_ms=t,
                                                                      request_timeout_ms=t))
                ensure_topics(quick, names=catalog.INPUT_TOPICS)
                self._topics_done = True
            except Exception as e:  # noqa: BLE001 - no ACL to create topics: they may exist anyway
                log.info("could not check/create topics (%r); sending anyway", e)
                self._topics_done = True
        return producer, None

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
    def _send(self, items: list[tuple[str, str, Batch]]) -> list[int]:
        """Send items (one message each) and wait for their acks; returns the indices of items not acknowledged."""
        t0 = time.perf_counter()
        futs: list[tuple[int, list]] = []
        failed: list[int] = []
        for i, (kind, job, table) in enumerate(items):
            try:
                futs.append((i, [self.producer.send(self.settings.topic(kind), table.payload, key=job.encode(),
                                                    headers=catalog.headers(kind))]))
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

    def _put(self, kind: str, job: str, table: Batch) -> bool:
        try:
            self.spool.put(kind, job, table)
        except OSError as e:
            self._spool_errors += 1
            if self._spool_errors == 1 or e.errno != errno.ENOSPC:
                log.warning("cannot write the spool %s (%s): holding tables in memory, in order, up to %d MiB",
                            self.spool.dir, e.strerror or e, self.held_max_bytes >> 20)
            return False
        if self.metrics is not None:
            self.metrics.records_spooled.labels(kind).inc(table.num_rows)
        return True

    def _unhold(self) -> None:
        """Held tables go to the spool (oldest first) as soon as it takes writes again."""
        while self.held:
            k, j, t = self.held[0]
            if not self._put(k, j, t):
                return
            self.held.popleft()
            self.held_bytes -= t.nbytes
        self._spool_errors = 0

    def _spool(self, kind: str, job: str, table: Batch) -> None:
        """Behind everything that waits already: the spool, or memory while the spool cannot be written."""
        if self.held:
            self._unhold()
        if not self.held and self._put(kind, job, table):
            return
        self.held.append((kind, job, table))
        self.held_bytes += table.nbytes
        while self.held_bytes > self.held_max_bytes and self.held:
            k, j, t = self.held.popleft()
            self.held_bytes -= t.nbytes
            self.drops.drop("disk_full", t.num_rows, f"the spool cannot be written and {self.held_max_bytes >> 20} "
                                                     f"MiB are held in memory already: the oldest {k} table of job "
                                                     f"{j} dropped")

    def ship(self, items: list[tuple]) -> None:
        """Send a tick's record batches (:class:`~stepwatch.wire.lite.Batch`, or pyarrow Tables) in order (to
        Kafka, or to the spool to keep the order)."""
        items = [(k, j, lite.as_batch(t)) for k, j, t in items if t.num_rows]
        if len(self.spool) or self.held or not self._connect():
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
        if not (len(self.spool) or self.held) or not self._connect():
            return 0
        sent = 0
        for f in self.spool.pending()[: self.replay_files_per_call]:
            try:
                kind, job, t = Spool.read(f)
            except Exception as e:  # noqa: BLE001 - a damaged file must not block the rest
                self.drops.drop("spool_unreadable", f.rows, f"damaged spool file {f.path.name} deleted: {e!r}"[:300])
                self.spool.remove(f)
                continue
            if self._send([(kind, job, t)]):
                self._drop_producer(f"replay of {f.path.name} not acknowledged; will retry")
                return sent
            self.spool.remove(f)
            self._count_out(kind, t.num_rows)
            sent += 1
        while not len(self.spool) and self.held and sent < self.replay_files_per_call:
            kind, job, t = self.held[0]                 # after the spool: what memory held, in order
            if self._send([(kind, job, t)]):
                self._drop_producer("replay of a held table not acknowledged; will retry")
                return sent
            self.held.popleft()
            self.held_bytes -= t.nbytes
            self._count_out(kind, t.num_rows)
            sent += 1
        if sent and not len(self.spool) and not self.held:
            log.info("spool replayed; sending live again")
        return sent

    def close(self, timeout_s: float = 5.0) -> None:
        if self._opening is not None:                   # an attempt under way: its producer is closed too
            self._opening.join(timeout_s)
            if not self._opening.is_alive() and self._opened[0] is not None and self.producer is None:
                self.producer = self._opened[0]
            self._opening = None
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

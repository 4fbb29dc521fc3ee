"""The processor's outputs, behind one interface: :class:`Sink` (``write(batch)``, ``flush(checkpoint)``,
``close()``), in the manner of quix-streams' sinks.

What the processor hands out is one of three batches:

* :class:`Rows` — rows for a table of the store (telemetry as received, the detectors' declared row
  outputs, alert rows, deadletter records), with the source message they come from;
* :class:`AlertOut` — an alert to tell people about, as it is emitted (firing, resolved, re-sent with a
  profile diff), or ``restored``: still open in the store when a job was rebuilt;
* :class:`Message` — a record for a topic of its own (the deadletter copy of a bad message).

:class:`Sinks` routes each batch to the sinks that accept its type (``Sink.accepts``), in the order they
were added. The processor's sinks, in that order:

========================  ==========================================================  =====================
sink                      writes                                                       flush (checkpoint)
========================  ==========================================================  =====================
:class:`LakeSink`         buffers :class:`Rows`                                        one DuckLake
                                                                                       transaction: the rows
                                                                                       and the offsets
:class:`TopicSink`        alerts to the ``alerts`` topic, :class:`Message` to theirs   waits for delivery
                          (the producer sends at once, never blocking)
:class:`ConsoleSink`      the processor's ``on_alert`` callback, else a log line       —
:class:`NotifierSink`     a non-blocking notifier (:class:`~stepwatch.dashboards.      — (its own queue and
                          annotations.AnnotationSink` for Grafana, :class:`~stepwatch.  thread; its owner
                          dashboards.alertmanager.AlertmanagerSink`), added by          closes it)
                          :func:`stepwatch.stream.alertfanout.attach`
========================  ==========================================================  =====================

Alerts go out when they are emitted (detection latency is the processor's; an alert is never held for a
flush); the checkpoint (:mod:`stepwatch.stream.checkpoint`) orders what makes them durable: the store
first, then the topics' delivery, then the Kafka offsets.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace

import pyarrow as pa

from stepwatch.wire import catalog
from stepwatch.wire import tables as wire
from stepwatch.wire.encode import encode_arrow
from stepwatch.detectors.base import Alert
from stepwatch.storage.store import Fenced
from stepwatch.stream.ingress_deadletter import MessageDeadletter, isolate_failing_sources, scratch_writer

log = logging.getLogger("stepwatch.processor")


# ---------------------------------------------------------------------------- batches
@dataclass
class Rows:
    """Rows for the store's table ``table``; ``src``: (topic, partition, offset) of their message."""
    table: str
    rows: pa.Table
    src: tuple | None = None


@dataclass
class AlertOut:
    """An alert for the sinks that tell people. ``row``: its ``alerts`` row (None: made from the alert);
    ``restored``: open in the store when the job was rebuilt (not new: sinks that keep alerts up resume it,
    the others ignore it); ``note``: what the console line adds (a profile diff)."""
    alert: Alert
    row: pa.Table | None = None
    restored: bool = False
    note: str = ""

    def arrow(self) -> pa.Table:
        if self.row is None:
            self.row = pa.Table.from_pylist([self.alert.row()], schema=wire.ALERTS)
        return self.row


@dataclass
class Message:
    """A record for the topic of kind ``kind`` (the deadletter copy of a message)."""
    kind: str
    value: bytes
    key: bytes | None = None
    headers: list = field(default_factory=list)


# ---------------------------------------------------------------------------- the interface
class Sink:
    """One output of the processor. ``write`` must not block (it runs on the processor's thread between
    messages); ``flush`` is called by every checkpoint (:class:`~stepwatch.stream.checkpoint.Checkpoint`,
    whose ``markers`` and ``generation`` the store's flush commits with its rows); ``close`` once, at the
    end (after a last checkpoint)."""

    #: the batch types this sink takes (:class:`Rows`, :class:`AlertOut`, :class:`Message`)
    accepts: tuple[type, ...] = ()

    def write(self, batch) -> None:
        raise NotImplementedError

    def flush(self, checkpoint=None) -> None:
        """Make what was written durable or delivered; nothing by default."""

    def close(self) -> None:
        """Release what the sink holds; nothing by default."""


class Sinks:
    """The processor's sinks, each batch routed to those that accept its type, in the order added."""

    def __init__(self, sinks=()):
        self.sinks: list[Sink] = []
        self._route: dict[type, list[Sink]] = {}
        for s in sinks:
            self.add(s)

    def add(self, sink: Sink) -> Sink:
        self.sinks.append(sink)
        self._route = {}
        return sink

    def of(self, kind: type) -> list[Sink]:
        r = self._route.get(kind)
        if r is None:
            r = self._route[kind] = [s for s in self.sinks if issubclass(kind, s.accepts)]
        return r

    def write(self, batch) -> None:
        for s in self.of(type(batch)):
            s.write(batch)

    def close(self) -> None:
        for s in self.sinks:
            try:
                s.close()
            except Exception:  # noqa: BLE001 - one sink must not keep the others open
                log.exception("closing sink %s", type(s).__name__)


# ---------------------------------------------------------------------------- the store
class LakeSink(Sink):
    """Buffers rows per table (with their source message) until the checkpoint writes them and the
    consumed offsets in one lake transaction (:meth:`stepwatch.storage.store.LakeStore.write_flush`).
    A write that fails is bisected by source message (:meth:`isolate`): the messages whose rows break it
    become one deadletter record each, the rest is stored."""

    accepts = (Rows,)

    def __init__(self, store, metrics, limits, rlog):
        self.store, self.metrics, self.limits, self.rlog = store, metrics, limits, rlog
        self.drop()

    def drop(self) -> None:
        """Forget what is buffered (stored, or fenced)."""
        self.buffers: dict[str, list[pa.Table]] = defaultdict(list)
        self.buffer_src: dict[str, list] = defaultdict(list)   # source message of each buffered piece
        self.rows = 0

    def write(self, batch: Rows) -> None:
        self.buffers[batch.table].append(batch.rows)
        self.buffer_src[batch.table].append(batch.src)
        self.rows += batch.rows.num_rows

    def flush(self, checkpoint=None) -> dict[str, int]:
        """Store the buffers with ``checkpoint.markers`` in one transaction; rows stored per table.
        Raises :class:`~stepwatch.storage.store.Fenced` (nothing stored, buffers kept for the caller)."""
        markers = getattr(checkpoint, "markers", {}) or {}
        gen = getattr(checkpoint, "generation", None)
        tables = dict(self.buffers)
        try:
            self.store.write_flush(tables, markers, generation=gen)
        except Fenced:
            raise
        except Exception as e:  # noqa: BLE001 - find the message(s) that break it; store the rest
            tables = self.isolate(e)
            self.store.write_flush(tables, markers, generation=gen)
        self.drop()
        return {k: sum(t.num_rows for t in v) for k, v in tables.items()}

    def isolate(self, err: Exception) -> dict[str, list[pa.Table]]:
        """A flush failed: bisect its pieces by source message against a scratch store; the pieces
        of the messages that break it are replaced by one deadletter record each."""
        self.metrics.flush_isolations.inc()
        log.warning("flush failed (%r); isolating the message(s) that cause it", err)
        pieces = [(name, t, src) for name, ts in self.buffers.items() for t, src in zip(ts, self.buffer_src[name])]
        good, bad = isolate_failing_sources(pieces, scratch_writer(type(self.store)))
        tables: dict[str, list[pa.Table]] = defaultdict(list)
        for name, t, _ in good:
            tables[name].append(t)
        for src, e in bad.items():
            if src is None:
                log.error("rows the processor derived could not be stored and are dropped: %r", e)
                continue
            topic, part, off = src
            msg = SimpleNamespace(topic=topic, partition=part, offset=off, key=None, value=b"", headers=[])
            rec = MessageDeadletter()
            rec.add(f"rows could not be stored: {e!r}"[:2000])
            r = rec.record(msg, None, None, self.limits, time.time_ns())
            tables["deadletter"].append(pa.Table.from_pylist([r], schema=wire.DEADLETTER))
            self.metrics.dropped.labels("deadletter").inc()
            self.rlog.warning("deadletter %s@%d/%d: %s", topic, part, off, r["reason"][:300])
        return tables


# ---------------------------------------------------------------------------- topics
class TopicSink(Sink):
    """Alerts to the ``alerts`` topic (Arrow, keyed by job) and :class:`Message` s to their topics, sent at
    once by the processor's producer (``producer()`` gives it: None before ``start`` or without Kafka);
    ``flush`` waits up to ``timeout_s`` for what was sent since the last checkpoint to be delivered."""

    accepts = (AlertOut, Message)

    def __init__(self, kafka, producer, timeout_s: float = 10.0):
        self.kafka, self.producer, self.timeout_s = kafka, producer, timeout_s
        self.pending = 0

    def write(self, batch) -> None:
        p = self.producer()
        if p is None:
            return
        if isinstance(batch, Message):
            p.send(self.kafka.topic(batch.kind), batch.value, key=batch.key, headers=batch.headers)
        elif not batch.restored:
            p.send(self.kafka.topic("alerts"), encode_arrow(batch.arrow()), key=batch.alert.job.encode(),
                   headers=[("content-type", catalog.ARROW_CT.encode()), ("schema", b"alerts/1")])
        else:
            return
        self.pending += 1

    def flush(self, checkpoint=None) -> None:
        p = self.producer()
        if not self.pending or p is None:
            return
        self.pending = 0
        try:
            p.flush(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the store holds the alerts; the topic copy is best effort
            log.warning("alerts/deadletter topic: not all records delivered in %.0fs: %s", self.timeout_s, e)


class ConsoleSink(Sink):
    """Every alert to the processor's ``on_alert`` callback (``callback()`` gives it), or, without one,
    to the log as its readable line."""

    accepts = (AlertOut,)

    def __init__(self, callback):
        self.callback = callback

    def write(self, batch: AlertOut) -> None:
        if batch.restored:
            return
        cb = self.callback()
        if cb:
            cb(batch.alert)
        elif batch.note:
            log.warning("%s — %s", batch.alert.line(), batch.note)
        else:
            log.warning("%s", batch.alert.line())


class NotifierSink(Sink):
    """A non-blocking notifier with ``submit(alert)`` (and optionally ``restore(alert)``, which resumes
    an alert found open in the store) as a sink: Grafana annotations, Alertmanager
    (:mod:`stepwatch.dashboards.sink`). The notifier belongs to whoever made it (``stepwatch process``
    closes it after the processor stops, draining its queue): closing the sink leaves it open."""

    accepts = (AlertOut,)

    def __init__(self, notifier):
        self.notifier = notifier

    def write(self, batch: AlertOut) -> None:
        if not batch.restored:
            self.notifier.submit(batch.alert)
            return
        restore = getattr(self.notifier, "restore", None)
        if restore is not None:
            restore(batch.alert)

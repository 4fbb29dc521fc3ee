"""The processor's intake of one Kafka record (:class:`Intake`, an object the
:class:`~stepwatch.stream.processor.Processor` holds as ``intake``, built with what it uses).

:meth:`Intake.process_message` decodes and validates a record at the Kafka boundary (sizes and expansion:
:mod:`stepwatch.stream.ingress_sizes`; extra columns: :mod:`~stepwatch.stream.ingress_columns`; row
bounds: :mod:`~stepwatch.stream.ingress`; docs/limits.md), hands the valid rows to the processor's
``route``, and writes at most ONE deadletter record per source message (the ``deadletter`` table and
topic, through the sinks: :mod:`stepwatch.stream.sinks`) saying what was wrong. A batch the Kafka client
cannot decode at all is deadlettered at its position and skipped (:meth:`Intake.skip_undecodable`).
Nothing here raises: one message never stops the processor (the fuzz harness, :mod:`stepwatch.fuzz`,
drives the same entry point).
"""
from __future__ import annotations

import logging
import time

import pyarrow as pa

from stepwatch.wire import tables as wire
from stepwatch.wire import decode as decoder   # (its attribute: `stepwatch bench ingress --parts` times decode)
from stepwatch.stream import ingress, stepaxis
from stepwatch.stream import ingress_sizes   # (its attributes: `stepwatch bench ingress --parts` times check_arrow_sizes)
from stepwatch.stream.ingress_columns import ExtraColumns
from stepwatch.stream.ingress_deadletter import MessageDeadletter, key_job
from stepwatch.stream.sinks import Message

log = logging.getLogger("stepwatch.processor")


class Intake:
    """Decode, bound and deadletter (see the module docs). Its collaborators: ``topic_kind`` (topic name
    -> kind), the ingress ``limits``, the processor's ``metrics`` and rate-limited log ``rlog``, ``jobs``
    (job -> runtime: their anchor times bound timestamps, :func:`stepwatch.stream.stepaxis.time_base`),
    ``route(kind, table, msg)`` (the valid rows), ``buffer(table, rows)`` (rows for the store, of the
    message in hand), ``send(batch)`` (the sinks: the deadletter topic) and ``progress`` ((topic,
    partition) -> :class:`~stepwatch.stream.checkpoint.PartitionProgress`: a skipped record is consumed).

    While a message is handled, ``dl`` is its deadletter record
    (:class:`~stepwatch.stream.ingress_deadletter.MessageDeadletter`) and ``src`` its (topic, partition, offset);
    None between messages."""

    def __init__(self, *, topic_kind: dict, limits, metrics, rlog, jobs: dict, route, buffer, send, progress: dict):
        self.topic_kind, self.limits, self.metrics, self.rlog = topic_kind, limits, metrics, rlog
        self.jobs, self.route, self.buffer, self.send, self.progress = jobs, route, buffer, send, progress
        self.extras = ExtraColumns(limits)
        self.dl: MessageDeadletter | None = None   # what went wrong with the message in hand
        self.src = None                             # (topic, partition, offset) of that message

    def process_message(self, msg) -> None:
        """One Kafka record: decode, bound, route, buffer; at most one deadletter record for it.
        Never raises (the fuzz harness, :mod:`stepwatch.fuzz`, drives this same entry point)."""
        self.dl, self.src = MessageDeadletter(), (msg.topic, msg.partition, msg.offset)
        try:
            self._handle(msg)
        except Exception as e:  # noqa: BLE001 - one message must never stop the processor
            log.exception("failed to handle %s@%d/%d", msg.topic, msg.partition, msg.offset)
            self.dl.add(f"internal error while processing: {e!r}"[:2000])
        try:
            self.finish_deadletter(msg)
        except Exception:  # noqa: BLE001
            log.exception("could not deadletter %s@%d/%d", msg.topic, msg.partition, msg.offset)
        self.dl = self.src = None

    def _handle(self, msg) -> None:
        """The message in hand (``dl`` and ``src`` set by :meth:`process_message`)."""
        hdr = {k: v for k, v in (msg.headers or [])}
        kind = self.topic_kind.get(msg.topic, "?")
        self.metrics.messages_in.labels(kind).inc()
        t0 = time.perf_counter()
        lim = self.limits
        try:
            ingress_sizes.check_size(msg.value, hdr.get("content-type"), lim)
            d = decoder.decode(msg.value, hdr.get("content-type"), hdr.get("schema"),
                                    check_arrow=lambda p: ingress_sizes.check_arrow_sizes(p, lim), prepare=self.prepare)
            if d.kind != kind:
                raise decoder.WireError(f"schema header {d.kind!r} does not match topic {msg.topic!r}")
        except decoder.WireError as e:
            self.deadletter(msg, str(e), None, None)
            return
        except Exception as e:  # noqa: BLE001 - a bad message must never stop the processor
            log.exception("unexpected error decoding %s@%d", msg.topic, msg.offset)
            self.deadletter(msg, f"internal error while decoding: {e!r}", None, None)
            return
        finally:
            self.metrics.decode_seconds.observe(time.perf_counter() - t0)
        self.metrics.records_in.labels(kind).inc(d.table.num_rows + len(d.rejected))
        self.dl.total_rows = d.table.num_rows + len(d.rejected)
        if d.rejected:
            self.deadletter(msg, None, d.rejected, d.rejected_rows)
        checks = ingress.row_bounds(kind, d.table, lim, time.time_ns(), stepaxis.time_base(self.jobs, d.table, lim))
        if checks:
            table, reasons, nbad = ingress.split(d.table, checks)
            self.metrics.rows_rejected.labels(kind).inc(nbad)
            for r in reasons:
                self.dl.add(r, n=nbad if r is reasons[0] else 0, keep=lim.deadletter_reasons)
            d.table = table
        if d.table.num_rows:
            self.route(kind, d.table, msg)

    def prepare(self, kind: str, raw: pa.Table) -> pa.Table:
        """Ingress hook of :func:`stepwatch.wire.decode.decode`: expansion bounds, then extra columns."""
        ingress_sizes.check_expansion(raw, self.limits)
        before = dict(self.extras.dropped)
        t = self.extras.apply(kind, raw)
        for why, k in self.extras.dropped.items():
            if k != before.get(why, 0):
                self.metrics.columns_dropped.labels(why).inc(k - before.get(why, 0))
        return t

    def skip_undecodable(self, consumer, e: Exception) -> bool:
        """``consumer.poll`` raised on a batch it cannot decode: deadletter the record at the
        partition's position and seek past it (records of a bad batch go one at a time), so the
        processor never restarts into the same offsets. False if no partition can be blamed."""
        tp = getattr(getattr(getattr(consumer, "_fetcher", None), "_next_partition_records", None),
                     "topic_partition", None)
        cands = [tp] if tp is not None else sorted(consumer.assignment())
        for tp in cands:
            try:
                off = consumer.position(tp)
            except Exception:  # noqa: BLE001
                continue
            if off is None:
                continue
            if tp is not cands[0] or len(cands) > 1:
                # no partition named by the client: probe each alone
                others = [x for x in consumer.assignment() if x != tp]
                consumer.pause(*others)
                try:
                    consumer.poll(timeout_ms=200, max_records=1, update_offsets=False)
                    consumer.seek(tp, off)
                    continue
                except Exception:  # noqa: BLE001 - this is the one
                    pass
                finally:
                    consumer.resume(*others)
            self.metrics.undecodable.inc()
            from types import SimpleNamespace
            msg = SimpleNamespace(topic=tp.topic, partition=tp.partition, offset=off, key=None, value=b"",
                                  headers=[])
            prog = self.progress.get((tp.topic, tp.partition))
            if prog is not None:
                prog.consumed.append(off)
            self.dl, self.src = MessageDeadletter(), (tp.topic, tp.partition, off)
            self.dl.add(f"Kafka client cannot decode the record batch: {type(e).__name__}: {e}"[:2000])
            try:
                self.finish_deadletter(msg)
            finally:
                self.dl = self.src = None
            consumer.seek(tp, off + 1)
            return True
        log.error("consumer.poll failed and no partition could be blamed: %r", e)
        time.sleep(0.5)
        return True

    def deadletter(self, msg, reason: str | None, rejected, rows: pa.Table | None) -> None:
        """Note what is wrong with the message in hand; :meth:`finish_deadletter` writes ONE record
        per source message (a summary of its bad rows, the raw value capped, headers stripped)."""
        if self.dl is None:          # outside a message's handling: a record of its own
            self.dl = MessageDeadletter()
            try:
                self.dl.add(reason, rejected, rows, keep=self.limits.deadletter_reasons)
                self.finish_deadletter(msg)
            finally:
                self.dl = None
            return
        self.dl.add(reason, rejected, rows, keep=self.limits.deadletter_reasons)

    def finish_deadletter(self, msg) -> None:
        dl = self.dl
        if not dl:
            return
        rec = dl.record(msg, key_job(msg), getattr(dl, "total_rows", None), self.limits, time.time_ns())
        self.rlog.warning("deadletter %s@%d/%d: %s", msg.topic, msg.partition, msg.offset, rec["reason"][:300])
        self.metrics.dropped.labels("deadletter").inc()
        self.buffer("deadletter", pa.Table.from_pylist([rec], schema=wire.DEADLETTER))
        h = [("error", rec["reason"][:1000].encode()), ("source", f"{msg.topic}/{msg.partition}/{msg.offset}".encode())]
        self.send(Message("deadletter", rec["payload"], msg.key if msg.key and len(msg.key) <= 256 else None, h))

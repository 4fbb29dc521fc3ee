"""The processor's intake of one Kafka record, as a part of :class:`~stepwatch.stream.processor.Processor`
(a mixin: the processor's state, its sinks and its ``_route`` are used as they are).

:meth:`Intake.process_message` decodes and validates a record at the Kafka boundary (sizes, expansion,
extra columns, row bounds: :mod:`stepwatch.stream.ingress`, docs/limits.md), hands the valid rows to
``_route``, and writes at most ONE deadletter record per source message (the ``deadletter`` table and
topic, through the sinks: :mod:`stepwatch.stream.sinks`) saying what was wrong. A batch the Kafka client
cannot decode at all is deadlettered at its position and skipped (:meth:`Intake._skip_undecodable`).
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
from stepwatch.stream.sinks import Message

log = logging.getLogger("stepwatch.processor")


class Intake:
    """Decode, bound and deadletter (see the module docs); mixed into the processor."""

    def process_message(self, msg) -> None:
        """One Kafka record: decode, bound, route, buffer; at most one deadletter record for it.
        Never raises (the fuzz harness, :mod:`stepwatch.fuzz`, drives this same entry point)."""
        self._dl, self._src = ingress.MessageDeadletter(), (msg.topic, msg.partition, msg.offset)
        try:
            self._handle(msg)
        except Exception as e:  # noqa: BLE001 - one message must never stop the processor
            log.exception("failed to handle %s@%d/%d", msg.topic, msg.partition, msg.offset)
            self._dl.add(f"internal error while processing: {e!r}"[:2000])
        try:
            self._finish_deadletter(msg)
        except Exception:  # noqa: BLE001
            log.exception("could not deadletter %s@%d/%d", msg.topic, msg.partition, msg.offset)
        self._dl = self._src = None

    def _handle(self, msg) -> None:
        if self._dl is None:          # called directly (eval, tests): the same path as poll_once
            self.process_message(msg)
            return
        hdr = {k: v for k, v in (msg.headers or [])}
        kind = self._topic_kind.get(msg.topic, "?")
        self.metrics.messages_in.labels(kind).inc()
        t0 = time.perf_counter()
        lim = self.limits
        try:
            ingress.check_size(msg.value, hdr.get("content-type"), lim)
            d = decoder.decode(msg.value, hdr.get("content-type"), hdr.get("schema"),
                                    check_arrow=lambda p: ingress.check_arrow_sizes(p, lim), prepare=self._prepare)
            if d.kind != kind:
                raise decoder.WireError(f"schema header {d.kind!r} does not match topic {msg.topic!r}")
        except decoder.WireError as e:
            self._deadletter(msg, str(e), None, None)
            return
        except Exception as e:  # noqa: BLE001 - a bad message must never stop the processor
            log.exception("unexpected error decoding %s@%d", msg.topic, msg.offset)
            self._deadletter(msg, f"internal error while decoding: {e!r}", None, None)
            return
        finally:
            self.metrics.decode_seconds.observe(time.perf_counter() - t0)
        self.metrics.records_in.labels(kind).inc(d.table.num_rows + len(d.rejected))
        self._dl.total_rows = d.table.num_rows + len(d.rejected)
        if d.rejected:
            self._deadletter(msg, None, d.rejected, d.rejected_rows)
        checks = ingress.row_bounds(kind, d.table, lim, time.time_ns(), stepaxis.time_base(self.jobs, d.table, lim))
        if checks:
            table, reasons, nbad = ingress.split(d.table, checks)
            self.metrics.rows_rejected.labels(kind).inc(nbad)
            for r in reasons:
                self._dl.add(r, n=nbad if r is reasons[0] else 0, keep=lim.deadletter_reasons)
            d.table = table
        if d.table.num_rows:
            self._route(kind, d.table, msg)

    def _prepare(self, kind: str, raw: pa.Table) -> pa.Table:
        """Ingress hook of :func:`stepwatch.wire.decode.decode`: expansion bounds, then extra columns."""
        ingress.check_expansion(raw, self.limits)
        before = dict(self.extras.dropped)
        t = self.extras.apply(kind, raw)
        for why, k in self.extras.dropped.items():
            if k != before.get(why, 0):
                self.metrics.columns_dropped.labels(why).inc(k - before.get(why, 0))
        return t

    def _skip_undecodable(self, e: Exception) -> bool:
        """``consumer.poll`` raised on a batch it cannot decode: deadletter the record at the
        partition's position and seek past it (records of a bad batch go one at a time), so the
        processor never restarts into the same offsets. False if no partition can be blamed."""
        tp = getattr(getattr(getattr(self.consumer, "_fetcher", None), "_next_partition_records", None),
                     "topic_partition", None)
        cands = [tp] if tp is not None else sorted(self.consumer.assignment())
        for tp in cands:
            try:
                off = self.consumer.position(tp)
            except Exception:  # noqa: BLE001
                continue
            if off is None:
                continue
            if tp is not cands[0] or len(cands) > 1:
                # no partition named by the client: probe each alone
                others = [x for x in self.consumer.assignment() if x != tp]
                self.consumer.pause(*others)
                try:
                    self.consumer.poll(timeout_ms=200, max_records=1, update_offsets=False)
                    self.consumer.seek(tp, off)
                    continue
                except Exception:  # noqa: BLE001 - this is the one
                    pass
                finally:
                    self.consumer.resume(*others)
            self.metrics.undecodable.inc()
            from types import SimpleNamespace
            msg = SimpleNamespace(topic=tp.topic, partition=tp.partition, offset=off, key=None, value=b"",
                                  headers=[])
            prog = self.progress.get((tp.topic, tp.partition))
            if prog is not None:
                prog.consumed.append(off)
            self._dl, self._src = ingress.MessageDeadletter(), (tp.topic, tp.partition, off)
            self._dl.add(f"Kafka client cannot decode the record batch: {type(e).__name__}: {e}"[:2000])
            try:
                self._finish_deadletter(msg)
            finally:
                self._dl = self._src = None
            self.consumer.seek(tp, off + 1)
            return True
        log.error("consumer.poll failed and no partition could be blamed: %r", e)
        time.sleep(0.5)
        return True

    def _deadletter(self, msg, reason: str | None, rejected, rows: pa.Table | None) -> None:
        """Note what is wrong with the message in hand; :meth:`_finish_deadletter` writes ONE record
        per source message (a summary of its bad rows, the raw value capped, headers stripped)."""
        if self._dl is None:          # outside a message's handling: a record of its own
            self._dl = ingress.MessageDeadletter()
            try:
                self._dl.add(reason, rejected, rows, keep=self.limits.deadletter_reasons)
                self._finish_deadletter(msg)
            finally:
                self._dl = None
            return
        self._dl.add(reason, rejected, rows, keep=self.limits.deadletter_reasons)

    def _finish_deadletter(self, msg) -> None:
        dl = self._dl
        if not dl:
            return
        rec = dl.record(msg, ingress.key_job(msg), getattr(dl, "total_rows", None), self.limits, time.time_ns())
        self.rlog.warning("deadletter %s@%d/%d: %s", msg.topic, msg.partition, msg.offset, rec["reason"][:300])
        self.metrics.dropped.labels("deadletter").inc()
        self._buffer("deadletter", pa.Table.from_pylist([rec], schema=wire.DEADLETTER))
        h = [("error", rec["reason"][:1000].encode()), ("source", f"{msg.topic}/{msg.partition}/{msg.offset}".encode())]
        self.sinks.write(Message("deadletter", rec["payload"], msg.key if msg.key and len(msg.key) <= 256 else None, h))

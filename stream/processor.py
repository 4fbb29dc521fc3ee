"""The stream processor: Kafka consumer group -> decode -> align -> detect -> DuckLake, alerts.

Lifecycle of one message: poll -> skip if the store's marker lists it as done -> decode and validate
(whole-message errors and bad rows go to the deadletter topic and table with a reason) -> buffer the
valid rows per table; steps are also scattered into their job's alignment ring, which drops
duplicates by natural key and closes steps for the detectors. Every ``flush_interval_s`` (or when
``max_buffer_rows`` are buffered) the buffers and the consumed positions (with the consumer-group
generation) are committed to the lake in one transaction, and only then the offsets committed to
Kafka (at-least-once delivery, exactly-once in the store, older generations fenced; see
:mod:`stepwatch.storage.store` and :mod:`stepwatch.stream.fencing`).

A job's detector state is rebuilt from the store the first time this processor sees the job (after
a restart or a partition move): its topology, the last window of steps and the alerts already
stored, so a straggler in progress is not forgotten and an alert is not sent twice.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch import schema as wire
from stepwatch.detectors.base import Alert, Detector, JobContext, StepBlock
from stepwatch.detectors.context import JobTelemetry
from stepwatch.detectors.incidents import Incidents
from stepwatch import catalog
from stepwatch.storage.store import Fenced, Marker, ParquetStore
from stepwatch.storage.views import connect as views_connect
from stepwatch.stream import fencing, ingress, stepaxis
from stepwatch.stream.align import JobState
from stepwatch.stream.hostwait import HostWait
from stepwatch.stream.stepaxis import JobAxis
from stepwatch.stream.ingress import IngressLimits
from stepwatch.stream.jobmetrics import JobMetrics
from stepwatch.stream.kafkaio import KafkaSettings, ensure_topics, make_consumer, make_producer
from stepwatch.stream.metrics import ProcessorMetrics

log = logging.getLogger("stepwatch.processor")

INPUT_TOPICS = catalog.INPUT_TOPICS


def _build_detectors(settings, job: str | None = None):
    from stepwatch.detectors.registry import build
    if hasattr(settings, "detector_settings"):      # a stepwatch.config.Config: per-job overrides
        settings = settings.detector_settings(job)
    return build(settings)


@dataclass
class JobRuntime:
    state: JobState
    detectors: list
    alerts_seen: set = field(default_factory=set)     # (alert_id, status) already emitted/stored
    replaying: bool = False
    telemetry: JobTelemetry = field(default_factory=JobTelemetry)   # bounded host/gc/comm windows
    steps_partition: int | None = None                # partition the job's step rows arrive on
    pending: list = field(default_factory=list)       # closed steps held until the topology is read
    incidents: Incidents = field(default_factory=Incidents)   # alerts grouped per fault
    hostwait: HostWait = field(default_factory=HostWait)      # alert rows waiting for their host samples
    host_partition: int | None = None                 # partition the job's host rows arrive on
    axis: JobAxis = field(default_factory=JobAxis)    # where its ranks are (stream.stepaxis)


@dataclass
class PartitionProgress:
    marker: Marker
    consumed: list = field(default_factory=list)      # offsets consumed since the last flush


def _plain(t: pa.Table) -> pa.Table:
    """Timestamps as int ns so rows convert to Python without pandas (deadletter payloads)."""
    cols = [c.cast(pa.int64()) if pa.types.is_timestamp(c.type) else c for c in t.columns]
    return pa.Table.from_arrays(cols, names=t.column_names)


class Processor:
    def __init__(self, kafka: KafkaSettings, data_dir: str | Path, group: str = "stepwatch-processor",
                 flush_interval_s: float = 1.0, max_buffer_rows: int = 1_000_000,
                 lateness_s: float = 10.0, window_steps: int = 128, replay_steps: int = 256,
                 detector_settings: dict | None = None,
                 on_alert: Callable[[Alert], None] | None = None, metrics: ProcessorMetrics | None = None,
                 create_topics: bool = True, idle_close_s: float = 5.0, profiling="env",
                 limits: IngressLimits | None = None):
        self.kafka = kafka
        self.limits = limits or IngressLimits()      # the Kafka boundary's bounds (stream.ingress, docs/limits.md)
        self.extras = ingress.ExtraColumns(self.limits)
        self.rlog = ingress.RateLimitedLog(log, self.limits.log_per_s)
        self.rebuild_bucket = ingress.TokenBucket(self.limits.rebuilds_per_s, self.limits.rebuild_burst)
        self._dl: ingress.MessageDeadletter | None = None   # what went wrong with the message in hand
        self._src = None                                     # (topic, partition, offset) of that message
        self.job_seen: dict[str, float] = {}                 # job -> monotonic time of its last message
        self.store = ParquetStore(data_dir).init()
        self.group = group
        self.flush_interval_s = flush_interval_s
        self.max_buffer_rows = max_buffer_rows
        self.lateness_ns = int(lateness_s * 1e9)
        self.window_steps = window_steps      # alignment ring (steps x ranks in memory)
        self.replay_steps = replay_steps      # steps replayed from the store into fresh detectors
        self.detector_settings = detector_settings
        self.on_alert = on_alert
        self.metrics = metrics or ProcessorMetrics()
        self.create_topics = create_topics
        self.idle_close_s = idle_close_s
        if profiling == "env":                      # on when STEPWATCH_PROFILING_PRIVATE_KEY[_FILE] holds a key
            from stepwatch.stream.profiling import settings_from_env
            profiling = settings_from_env()
        self.profiling_settings = profiling         # ProfilingSettings (stream.profiling); None: no commands
        self.profiling = None                       # its Issuer, once the producer exists
        self.jobs: dict[str, JobRuntime] = {}
        self.buffers: dict[str, list[pa.Table]] = defaultdict(list)
        self.buffer_src: dict[str, list] = defaultdict(list)   # source message of each buffered piece
        self.buffered_rows = 0
        self.progress: dict[tuple[str, int], PartitionProgress] = {}
        self.last_flush = time.monotonic()
        self.last_data = time.monotonic()
        self.consumer = None
        self.producer = None
        self.stop_event = threading.Event()
        self.alerts: list[Alert] = []
        self.t_first_data: float | None = None      # wall time of the first message
        self.t_last_flush: float | None = None      # wall time of the last flush that wrote rows
        self._topic_kind = {kafka.topic(k): k for k in INPUT_TOPICS}
        self._lag_by_tp: dict[tuple[str, int], int] = {}   # consumer lag per partition (last flush)
        #: (topic, partition) -> whether it is read to its end; None: ask the consumer (see _caught_up)
        self.caught_up_hook: Callable[[str, int], bool] | None = None
        self._caught_up_cache: dict[tuple[str, int], tuple[float, float]] = {}
        self._read_to: dict[tuple[str, int], int] = {}     # next offset after the last message handled
        self.job_metrics = JobMetrics(self.metrics.registry)   # per-job Prometheus metrics (None: off)
        # called with each alert still open in the store when a job is rebuilt (stream.alertfanout.attach)
        self.on_alert_restored: Callable[[Alert], None] | None = self.job_metrics.on_alert

    # ------------------------------------------------------------------ kafka lifecycle
    def start(self) -> None:
        _build_detectors(self.detector_settings)   # import detector libraries (ruptures) now, not mid-stream
        if self.create_topics:
            ensure_topics(self.kafka)
        from stepwatch.stream.kafkaio import cluster_id_of
        cfg = self.kafka.client_config()
        cid = cluster_id_of(cfg.pop("bootstrap_servers"), config=cfg, timeout_s=10) or "default"
        self.store.cluster = re.sub(r"[^A-Za-z0-9._-]", "_", cid)
        self.store.recover()
        self.producer = make_producer(self.kafka, linger_ms=20)
        if self.profiling_settings is not None:
            from stepwatch.stream.profiling import Issuer
            self.profiling = Issuer(self.profiling_settings, self.kafka, self.producer)
        self.consumer = make_consumer(self.kafka, self.group, client_id=f"{self.kafka.client_id}-processor")
        from kafka import ConsumerRebalanceListener

        proc = self

        class Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked):
                proc._flush()
                for tp in revoked:
                    proc.progress.pop((tp.topic, tp.partition), None)

            def on_partitions_lost(self, lost):      # the group moved on: never commit these
                fencing.lost(proc, lost)

            def on_partitions_assigned(self, assigned):
                proc._assigned(assigned)

        self.consumer.subscribe([self.kafka.topic(k) for k in INPUT_TOPICS], listener=Listener())

    def _assigned(self, assigned) -> None:
        self.store.recover()
        self.store.group, self.store.member = self.group, fencing.member(self.consumer)
        try:        # take the partitions for our generation: older owners can no longer commit them
            pos = self.store.claim([(tp.topic, tp.partition) for tp in assigned], fencing.generation(self.consumer))
        except Fenced as e:
            log.warning("%s: not consuming until the next assignment", e)
            self.consumer.pause(*assigned)
            return
        for tp in assigned:
            m = pos.get((tp.topic, tp.partition))
            if m is not None:
                self.consumer.seek(tp, m.next)
            self.progress[(tp.topic, tp.partition)] = PartitionProgress(m or Marker(-1))
        # jobs owned by partitions that moved here are rebuilt lazily from the store
        log.info("assigned %d partitions", len(assigned))

    def close(self) -> None:
        try:
            for rt in self.jobs.values():
                self._host_settled(rt, force=True)
            self._flush()
        finally:
            if self.consumer is not None:
                self.consumer.close(autocommit=False)
            if self.producer is not None:
                self.producer.flush(10)
                self.producer.close(5)
            self.consumer = self.producer = None

    # ------------------------------------------------------------------ main loop
    def run(self, stop_event: threading.Event | None = None, idle_exit_s: float | None = None,
            on_tick: Callable[["Processor"], None] | None = None) -> None:
        """Consume until ``stop_event`` is set (or, with ``idle_exit_s``, until no message arrived
        for that long after the first one)."""
        stop = stop_event or self.stop_event
        self.start()
        seen_any = False
        try:
            while not stop.is_set():
                n = self.poll_once(timeout_ms=200)
                seen_any |= n > 0
                if on_tick:
                    on_tick(self)
                if idle_exit_s and seen_any and time.monotonic() - self.last_data > idle_exit_s:
                    break
        finally:
            self.close()

    def poll_once(self, timeout_ms: int = 200) -> int:
        try:
            records = self.consumer.poll(timeout_ms=timeout_ms, max_records=2000)
        except Exception as e:  # noqa: BLE001 - a batch the client cannot decode (codec, corruption)
            if not self._skip_undecodable(e):
                raise
            records = {}
        n = 0
        # topology first so steps in the same poll find their job's world size; then steps, so a host
        # sample is never judged against steps already fetched but not yet handled (job-hang proof)
        order = {"topology": 0, "steps": 1}
        for tp in sorted(records, key=lambda tp: order.get(self._topic_kind.get(tp.topic), 2)):
            prog = self.progress.get((tp.topic, tp.partition))
            for msg in records[tp]:
                n += 1
                self._read_to[(tp.topic, tp.partition)] = msg.offset + 1   # handled up to here (_caught_up)
                if prog is not None:
                    if prog.marker.is_done(msg.offset):
                        self.metrics.skipped.inc()
                        continue
                    prog.consumed.append(msg.offset)
                self.process_message(msg)
        if n:
            self.last_data = time.monotonic()
            if self.t_first_data is None:
                self.t_first_data = time.time()
                self.cpu_first_data = time.process_time()   # bench ingest: CPU per row on a shared machine
        now = time.monotonic()
        if self.buffered_rows >= self.max_buffer_rows or now - self.last_flush >= self.flush_interval_s:
            self._close_idle_jobs()
            self._evict_jobs()
            for rt in self.jobs.values():
                self._host_settled(rt)
            self._flush()
            self._update_lag()
        return n

    # ------------------------------------------------------------------ messages
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
            d = wire.decode(msg.value, hdr.get("content-type"), hdr.get("schema"),
                            check_arrow=lambda p: ingress.check_arrow_sizes(p, lim), prepare=self._prepare)
            if d.kind != kind:
                raise wire.WireError(f"schema header {d.kind!r} does not match topic {msg.topic!r}")
        except wire.WireError as e:
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

    def _route(self, kind: str, t: pa.Table, msg) -> None:
        if kind == "topology":
            for job in pc.unique(t.column("job")).to_pylist():
                part = t.filter(pc.equal(t.column("job"), job))
                rt = self._job(job)
                w0 = rt.state.world_size
                rt.state.set_topology(part)
                stepaxis.check_budget(self, rt, w0)
                if rt.pending:                              # steps held for it: detect them now
                    self._detect(rt, [])
            self._buffer("topology", t)
            return
        if kind != "steps":
            self._buffer(kind, t)
            if kind == "profiles" and self.profiling is not None:
                self._profile_results(t)
            if kind in ("host", "gc", "comm", "inflight"):
                self._context(kind, t)
            return
        jobs = pc.unique(t.column("job"))
        for job in jobs.to_pylist():
            part = t if len(jobs) == 1 else t.filter(pc.equal(t.column("job"), job))
            rt = self._job(job)
            part = stepaxis.admit_steps(self, rt, job, part)    # bounds to where the job's ranks are
            if not part.num_rows:
                continue
            t0, w0 = time.perf_counter(), rt.state.world_size
            res, blocks = rt.state.ingest(part)
            self.metrics.align_seconds.observe(time.perf_counter() - t0)
            stepaxis.check_budget(self, rt, w0)
            if res.duplicates:
                self.metrics.dropped.labels("duplicate").inc(res.duplicates)
            if len(res.bad_rank):
                bad = part.take(pa.array(res.bad_rank))
                ws = rt.state.expected or rt.state.world_size
                reasons = [(int(i), f"field 'rank': {r} is outside world_size {ws} of job {job!r}")
                           for i, r in zip(res.bad_rank, bad.column("rank").to_pylist())]
                self._deadletter(msg, None, reasons, bad)
            if res.keep.all():
                self._buffer("steps", part)
            elif res.keep.any():
                self._buffer("steps", part.filter(pa.array(res.keep)))
            rt.steps_partition = getattr(msg, "partition", None)
            self._detect(rt, blocks)
            self._tick(rt)
            self._host_settled(rt)

    def _context(self, kind: str, t: pa.Table) -> None:
        """Keep host/gc/comm rows in their job's bounded windows (detector evidence); host samples
        move the job's event time on, which the detectors judging silence (hangs) are told about."""
        jobs = pc.unique(t.column("job"))
        for job in jobs.to_pylist():
            part = t if len(jobs) == 1 else t.filter(pc.equal(t.column("job"), job))
            rt = self._job(job)
            rt.telemetry.add(kind, part)
            if kind == "host":
                rt.host_partition = self._src[1] if self._src else rt.host_partition
                self._tick(rt)
                self._host_settled(rt)

    def _ctx(self, rt: JobRuntime) -> JobContext:
        ctx = rt.state.context()
        rt.telemetry.attach(ctx)
        if rt.steps_partition is not None:
            ctx.backlog = self._lag_by_tp.get((self.kafka.topic("steps"), rt.steps_partition), 0) > 0
        ctx.caught_up = lambda: self._caught_up(rt)
        return ctx

    def _caught_up(self, rt: JobRuntime) -> bool:
        """The job's steps read to their end (:meth:`_steps_caught_up`) and the in-flight states too: a
        step that is long by design (evaluation, checkpoint) is known so only from them."""
        if not self._steps_caught_up(rt):
            return False
        topic = self.kafka.topic("inflight")
        if self.caught_up_hook is not None:
            return bool(self.caught_up_hook(topic, None))
        # with a real consumer the in-flight partitions are not required read to the end: during a hang
        # the watchdogs write them continuously, so a prefetched record would always be pending
        return True

    def _steps_caught_up(self, rt: JobRuntime) -> bool:
        """Whether the job's steps partition has been read to its end: it is assigned and not paused, and
        the messages handled reach the broker's end offset (asked at most every 0.5 s per partition) and
        the high watermark of the last fetch. The proof a silence judged on event time needs
        (docs/detectors.md, stall). Without a consumer (rows handed over in order) it is taken as yes. A job
        whose steps this processor has not read since it started (rebuilt from the store) needs every steps
        partition it is assigned read to its end."""
        topic, part = self.kafka.topic("steps"), rt.steps_partition
        if part is None:
            if self.consumer is None:
                return self.caught_up_hook is None or all(
                    self.caught_up_hook(topic, p) for (t, p) in list(self._read_to) if t == topic)
            try:
                parts = [tp.partition for tp in self.consumer.assignment() if tp.topic == topic]
            except Exception:  # noqa: BLE001
                return False
            return bool(parts) and all(self._tp_caught_up(topic, p) for p in parts)
        if self.caught_up_hook is not None:
            return bool(self.caught_up_hook(topic, part))
        if self.consumer is None:
            return True
        return self._tp_caught_up(topic, part)

    def _tp_caught_up(self, topic: str, part: int) -> bool:
        from kafka.structs import TopicPartition
        tp = TopicPartition(topic, part)
        try:
            if tp in self.consumer.paused() or tp not in self.consumer.assignment():
                return False                               # not being read: no proof
            # what was handled (the consumer's position runs ahead by the records of the current poll)
            pos = self._read_to.get((topic, part))
            if pos is None:
                pos = self.consumer.position(tp)
            now = time.monotonic()
            hit = self._caught_up_cache.get((topic, part))
            if hit is None or now - hit[0] >= 0.5:         # the broker's end offset, at most every 0.5 s
                hit = (now, self.consumer.end_offsets([tp])[tp])
                self._caught_up_cache[(topic, part)] = hit
            # the high watermark of the last fetch too (some brokers answer ListOffsets with less)
            return pos >= max(hit[1], self.consumer.highwater(tp) or 0)
        except Exception:  # noqa: BLE001 - unknown (e.g. the partition is not ours): no proof
            return False

    def _host_caught_up(self, rt: JobRuntime) -> bool:
        """Whether the job's host partition (or, before its first host row, every host partition this
        processor reads) is read to its end (stream/hostwait.py). Without a consumer: yes."""
        topic = self.kafka.topic("host")
        if self.caught_up_hook is not None:
            return bool(self.caught_up_hook(topic, rt.host_partition))
        if self.consumer is None:
            return True
        if rt.host_partition is not None:
            return self._tp_caught_up(topic, rt.host_partition)
        try:
            parts = [tp.partition for tp in self.consumer.assignment() if tp.topic == topic]
        except Exception:  # noqa: BLE001
            return False
        return bool(parts) and all(self._tp_caught_up(topic, p) for p in parts)

    def _tick(self, rt: JobRuntime) -> None:
        """Tell the detectors the job's event time (newest step end or host sample) moved."""
        if rt.replaying:
            return
        ctx = None
        for det in rt.detectors:
            if type(det).tick is Detector.tick:
                continue
            ctx = ctx or self._ctx(rt)
            self._run_detector(rt, det, det.tick, ctx, max(ctx.steps_event_ns, ctx.host_event_ns))

    def _buffer(self, table: str, t: pa.Table) -> None:
        self.buffers[table].append(t)
        self.buffer_src[table].append(self._src)
        self.buffered_rows += t.num_rows
        if self.job_metrics is not None:
            self.job_metrics.on_rows(table, t)

    def _prepare(self, kind: str, raw: pa.Table) -> pa.Table:
        """Ingress hook of :func:`wire.decode`: expansion bounds, then extra columns."""
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
        if self.producer is not None:
            h = [("error", rec["reason"][:1000].encode()),
                 ("source", f"{msg.topic}/{msg.partition}/{msg.offset}".encode())]
            self.producer.send(self.kafka.topic("deadletter"), rec["payload"], key=msg.key if msg.key and len(msg.key) <= 256 else None,
                               headers=h)

    # ------------------------------------------------------------------ jobs and detectors
    def new_detectors(self, job: str) -> list[Detector]:
        """A fresh set of the job's detectors (stream.stepaxis uses it when it re-anchors a job)."""
        return _build_detectors(self.detector_settings, job)

    def _job(self, job: str) -> JobRuntime:
        self.job_seen[job] = time.monotonic()
        rt = self.jobs.get(job)
        if rt is None:
            if len(self.jobs) >= self.limits.max_jobs:
                self._evict_jobs(room=1)
            rt = JobRuntime(JobState(job, capacity=self.window_steps, lateness_ns=self.lateness_ns),
                            _build_detectors(self.detector_settings, job))
            self.jobs[job] = rt
            # a burst of made-up job ids must not stall ingest: only jobs with stored history are
            # rebuilt from the store, at a bounded rate
            if not self._has_history(job):
                self.metrics.rebuilds.labels("none").inc()
            elif self.rebuild_bucket.take():
                self.metrics.rebuilds.labels("store").inc()
                self._rebuild(rt)
            else:
                self.metrics.rebuilds.labels("rate_limited").inc()
                self.rlog.warning("job %s starts cold: over rebuilds_per_s=%g", job, self.limits.rebuilds_per_s)
        return rt

    def _has_history(self, job: str) -> bool:
        """Whether the store may hold rows of ``job`` (its partition folders exist)."""
        return self.store.has_history(job)

    def _evict_jobs(self, room: int = 0) -> None:
        """Close and forget jobs idle for ``job_idle_evict_s``, and the least recently active ones
        while more than ``max_jobs - room`` jobs or ``max_state_bytes`` of rings are held."""
        if not self.jobs:
            return
        lim = self.limits
        now = time.monotonic()
        idle = [j for j in self.jobs if now - self.job_seen.get(j, now) > lim.job_idle_evict_s]
        over = len(self.jobs) - len(idle) + room - lim.max_jobs
        size = 0
        if over <= 0 and len(self.jobs) > 1:
            size = sum(rt.state.state_bytes() for rt in self.jobs.values())
        if over > 0 or size > lim.max_state_bytes:
            # sparse rings first (a row at a high rank of a made-up job), then the least recently active
            rest = sorted((j for j in self.jobs if j not in set(idle)),
                          key=lambda j: (not stepaxis.sparse(self.jobs[j]), self.job_seen.get(j, 0)))
            k = max(over, 0)
            extra = rest[:k]
            if size > lim.max_state_bytes:
                freed = sum(self.jobs[j].state.state_bytes() for j in extra)
                for j in rest[k:-1]:
                    if size - freed <= lim.max_state_bytes:
                        break
                    extra.append(j)
                    freed += self.jobs[j].state.state_bytes()
            idle += extra
        for j in idle:
            rt = self.jobs.pop(j)
            self.job_seen.pop(j, None)
            try:
                if rt.state.open_steps():
                    self._detect(rt, rt.state.close_ready(force=True))
                self._host_settled(rt, force=True)
            except Exception:  # noqa: BLE001 - eviction never stops the processor
                log.exception("closing evicted job %s", j)
            self.metrics.jobs_evicted.inc()

    def _rebuild(self, rt: JobRuntime) -> None:
        """Warm a job's state from the store: topology, last window of steps, stored alerts."""
        job = rt.state.job
        try:
            con = views_connect(self.store.root)
            topo = con.sql("SELECT * FROM topology WHERE job = ? QUALIFY row_number() OVER "
                           "(PARTITION BY rank ORDER BY date DESC) = 1", params=[job]).to_arrow_table()
            if topo.num_rows:
                rt.state.set_topology(topo)
            for aid, status in con.execute("SELECT alert_id, status FROM alerts WHERE job = ?", [job]).fetchall():
                rt.alerts_seen.add((aid, status))
            try:                                           # incidents keep their ids across restarts
                rt.incidents.seed(con.sql("SELECT * FROM alerts WHERE job = ? AND incident_id IS NOT NULL "
                                          "ORDER BY t_detected", params=[job]).to_arrow_table().to_pylist())
            except Exception:  # noqa: BLE001 - a store written before incidents existed
                log.info("no incidents to warm for job %s", job, exc_info=True)
            if self.on_alert_restored is not None:     # sinks re-send them, job metrics count them
                from stepwatch.stream.alertfanout import open_alerts
                for a in open_alerts(con, job):
                    self.on_alert_restored(a)
            # the job's position: where its ranks' newest steps are (stream.stepaxis; one bad row cannot place it)
            top = con.execute("SELECT quantile_disc(m, 0.75) FROM (SELECT max(step) AS m FROM steps WHERE job = ? "
                              "GROUP BY rank)", [job]).fetchall()[0][0]
            if top is not None:
                lo = int(top) - self.replay_steps + 1
                hist = con.sql("SELECT * FROM steps WHERE job = ? AND step BETWEEN ? AND ? ORDER BY step, rank",
                               params=[job, lo, int(top) + self.window_steps // 2]).to_arrow_table()
                if hist.num_rows:
                    self._rebuild_context(con, rt, hist)
                    hist = wire.conform(hist.drop_columns([c for c in ("date",) if c in hist.column_names]),
                                        wire.STEPS)
                    rt.replaying = True
                    _, blocks = rt.state.ingest(hist)
                    self._detect(rt, blocks)
                    rt.replaying = False
                    log.info("rebuilt job %s from store: %d rows up to step %s, %d alerts known",
                             job, hist.num_rows, top, len(rt.alerts_seen))
            con.close()
        except Exception:  # noqa: BLE001 - a cold start must not stop the processor
            log.exception("could not rebuild state of job %s from the store; starting cold", job)

    def _rebuild_context(self, con, rt: JobRuntime, hist: pa.Table) -> None:
        """Warm the job's host/gc windows from the store over the replayed steps' time span."""
        try:
            mm = pc.min_max(hist.column("t_end").cast(pa.int64())).as_py()
            if mm["min"] is None:
                return
            lo = max(int(mm["min"]) - 60_000_000_000, int(mm["max"]) - 300_000_000_000)
            for kind, schema in (("host", wire.HOST), ("gc", wire.GC)):
                # in time order: the window's row cap keeps the newest
                t = con.sql(f"SELECT * FROM {kind} WHERE job = ? AND epoch_ns(t) >= ? ORDER BY t",
                            params=[rt.state.job, lo]).to_arrow_table()
                if t.num_rows:
                    rt.telemetry.add(kind, wire.conform(t.drop_columns([c for c in ("date",) if c in t.column_names]),
                                                        schema))
        except Exception:  # noqa: BLE001 - evidence is optional; the steps replay is what matters
            log.info("could not warm the host/gc context of job %s from the store", rt.state.job, exc_info=True)

    def _detect(self, rt: JobRuntime, blocks: list[StepBlock], force: bool = False) -> None:
        # a job's topology (pipeline stages: which ranks are peers) may be read after its first steps
        # (Kafka orders nothing across topics): hold its closed steps, bounded, until it comes
        if not rt.state.topology_known and not rt.replaying and not force:
            rt.pending += blocks
            held = sum(len(b) for b in rt.pending)
            if held < max(8, min(128, 4_000_000 // max(rt.state.world_size, 1))):
                return
        if rt.pending:
            blocks, rt.pending = rt.pending + list(blocks), []
        if not blocks:
            return
        ctx = self._ctx(rt)
        for blk in blocks:
            self.metrics.steps_closed.inc(len(blk))
            if self.job_metrics is not None:
                self.job_metrics.on_block(ctx, blk)
            for det in rt.detectors:
                self._run_detector(rt, det, det.update, ctx, blk)

    def _run_detector(self, rt: JobRuntime, det, fn, *args) -> None:
        """Call one detector entry point with timing and error metrics; emit what it returns.
        A failing detector is logged and counted, never allowed to stop the processor."""
        t0 = time.perf_counter()
        try:
            alerts = fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("detector %s failed (%s) on job %s", det.name, fn.__name__, rt.state.job)
            self.metrics.detector_errors.labels(det.name).inc()
            return
        finally:
            self.metrics.detector_seconds.labels(det.name).observe(time.perf_counter() - t0)
        drain = getattr(det, "drain_rows", None)     # detectors that also produce table rows (efficiency)
        if drain is not None:
            for table, rows in drain().items():
                if rows.num_rows and not rt.replaying:   # replayed steps' rows are already stored
                    self._buffer(table, wire.conform(rows, wire.SCHEMAS[table]))
        for a in alerts:
            self._emit(rt, a)

    def _emit(self, rt: JobRuntime, a: Alert) -> None:
        key = (a.alert_id, a.status)
        if key in rt.alerts_seen:
            if not a.incident_id:                           # replayed: its incident is known (seeded)
                a.incident_id = rt.incidents.by_alert.get(a.alert_id, "")
            return
        rt.alerts_seen.add(key)
        rt.incidents.assign(a)                               # one incident per fault (detectors/incidents.py)
        st = rt.state
        sl = a.step_first % st.capacity
        if "t_first_ns" not in a.evidence and st.slot_step[sl] == a.step_first and st.t_end[sl]:
            a.evidence["t_first_ns"] = int(st.t_end[sl])    # lets Grafana draw the alert as a region
        self.alerts.append(a)
        self.metrics.alerts.labels(a.kind, a.status).inc()
        if self.job_metrics is not None:
            self.job_metrics.on_alert(a)
        row = pa.Table.from_pylist([a.row()], schema=wire.ALERTS)
        if rt.replaying or not rt.hostwait.hold(a, rt.telemetry):
            self._buffer("alerts", row)                      # else when its host samples came (_host_settled)
        self._notify(a, row)
        if self.profiling is not None and a.status == "firing" and not rt.replaying:
            self._profile_alert(rt, a)

    def _notify(self, a: Alert, row: pa.Table) -> None:
        if self.producer is not None:
            self.producer.send(self.kafka.topic("alerts"), wire.encode_arrow(row), key=a.job.encode(),
                               headers=[("content-type", wire.ARROW_CT.encode()), ("schema", b"alerts/1")])
        if self.on_alert:
            self.on_alert(a)
        else:
            log.warning("%s", a.line())

    def _host_settled(self, rt: JobRuntime, force: bool = False) -> None:
        """Alerts whose row waited for the host samples of their steps (stream/hostwait.py): decided again,
        stored, and sent again (same alert id) when their cause or foreign process changed."""
        if not len(rt.hostwait):
            return
        for a, changed in rt.hostwait.due(rt.telemetry, rt.state.max_t_end, force=force,
                                          caught_up=self._host_caught_up(rt)):
            if changed:
                rt.incidents.refresh(a)
            row = pa.Table.from_pylist([a.row()], schema=wire.ALERTS)
            self._buffer("alerts", row)
            if changed:
                self._notify(a, row)

    # ------------------------------------------------------------------ targeted profiling (stream.profiling)
    def _profile_alert(self, rt: JobRuntime, a: Alert) -> None:
        try:
            rows = self.profiling.on_alert(rt.state, a)
        except Exception:  # noqa: BLE001 - profiling never stops the processor
            log.exception("could not issue profiling commands for alert %s", a.alert_id)
            return
        if rows:
            from stepwatch.stream.profiling import profile_rows_table
            self._buffer("profiles", profile_rows_table(rows))

    def _profile_results(self, t: pa.Table) -> None:
        """Suspect + reference summaries in: store the comparison (``profile_diffs`` table) and re-emit
        the alert with a ``profile_diff`` section (on the alerts topic and to the callback; the alerts
        table keeps one row per alert and status)."""
        from stepwatch.stream.profiling import alert_with_diff, diff_rows_table
        for p, d in self.profiling.on_results(t):
            aid = getattr(p.alert, "alert_id", "") or ""
            self._buffer("profile_diffs", diff_rows_table(p.job, aid, p.cmd_id, d))
            if p.alert is None:
                continue
            a = alert_with_diff(p.alert, p.cmd_id, d)
            row = pa.Table.from_pylist([a.row()], schema=wire.ALERTS)
            if self.producer is not None:
                self.producer.send(self.kafka.topic("alerts"), wire.encode_arrow(row), key=a.job.encode(),
                                   headers=[("content-type", wire.ARROW_CT.encode()), ("schema", b"alerts/1")])
            if self.on_alert:
                self.on_alert(a)
            else:
                log.warning("%s — profile: %s", a.line(), ", ".join(
                    f"{x['name']} +{x['delta_ms']:.2f} ms/step" for x in d["slower"][:3]))

    def _close_idle_jobs(self) -> None:
        """Close steps of jobs whose stream went quiet (event time cannot advance without data)."""
        if time.monotonic() - self.last_data < self.idle_close_s:
            return
        for rt in self.jobs.values():
            if rt.state.open_steps() or rt.pending:
                self._detect(rt, rt.state.close_ready(force=True), force=True)

    # ------------------------------------------------------------------ flush
    def _flush(self) -> None:
        now = time.monotonic()
        self.last_flush = now
        markers: dict[tuple[str, int], Marker] = {}
        commits = {}
        for (topic, part), prog in self.progress.items():
            if not prog.consumed:
                continue
            nxt = max(max(prog.consumed) + 1, prog.marker.next)
            done = [r for r in (prog.marker.done or []) if r[1] >= nxt]
            markers[(topic, part)] = Marker(nxt, done)
        if not markers and not self.buffered_rows:
            return
        t0 = time.perf_counter()
        tables = dict(self.buffers)
        gen = fencing.generation(self.consumer)
        try:
            try:
                self.store.write_flush(tables, markers, generation=gen)
            except Fenced:
                raise
            except Exception as e:  # noqa: BLE001 - find the message(s) that break it; store the rest
                tables = self._isolate(e)
                self.store.write_flush(tables, markers, generation=gen)
        except Fenced as e:         # another processor owns a partition now: store nothing
            fencing.fenced(self, e)
            return
        rows = {k: sum(t.num_rows for t in v) for k, v in tables.items()}
        self.metrics.flush_seconds.observe(time.perf_counter() - t0)
        for k, n in rows.items():
            self.metrics.records_out.labels(k).inc(n)
        self.buffers = defaultdict(list)
        self.buffer_src = defaultdict(list)
        self.buffered_rows = 0
        from kafka.structs import OffsetAndMetadata, TopicPartition
        for (topic, part), m in markers.items():
            prog = self.progress[(topic, part)]
            prog.marker = m
            prog.consumed = []
            commits[TopicPartition(topic, part)] = OffsetAndMetadata(m.next, "", -1)
        if commits and self.consumer is not None:
            try:
                self.consumer.commit(commits)
            except Exception as e:  # noqa: BLE001 - the store's markers are the truth; Kafka's commit is advisory
                log.warning("offset commit failed (store markers stay authoritative): %s", e)
        self.t_last_flush = time.time()
        self.cpu_last_flush = time.process_time()
        self.metrics.last_flush.set(self.t_last_flush)

    def _isolate(self, err: Exception) -> dict[str, list[pa.Table]]:
        """A flush failed: bisect its pieces by source message against a scratch store; the pieces
        of the messages that break it are replaced by one deadletter record each."""
        self.metrics.flush_isolations.inc()
        log.warning("flush failed (%r); isolating the message(s) that cause it", err)
        pieces = [(name, t, src) for name, ts in self.buffers.items() for t, src in zip(ts, self.buffer_src[name])]
        good, bad = ingress.isolate_failing_sources(pieces, ingress.scratch_writer(type(self.store)))
        tables: dict[str, list[pa.Table]] = defaultdict(list)
        for name, t, _ in good:
            tables[name].append(t)
        from types import SimpleNamespace
        for src, e in bad.items():
            if src is None:
                log.error("rows the processor derived could not be stored and are dropped: %r", e)
                continue
            topic, part, off = src
            msg = SimpleNamespace(topic=topic, partition=part, offset=off, key=None, value=b"", headers=[])
            rec = ingress.MessageDeadletter()
            rec.add(f"rows could not be stored: {e!r}"[:2000])
            r = rec.record(msg, None, None, self.limits, time.time_ns())
            tables["deadletter"].append(pa.Table.from_pylist([r], schema=wire.DEADLETTER))
            self.metrics.dropped.labels("deadletter").inc()
            self.rlog.warning("deadletter %s@%d/%d: %s", topic, part, off, r["reason"][:300])
        return tables

    def _update_lag(self) -> None:
        if self.consumer is None:
            return
        total = 0
        for tp in self.consumer.assignment():
            hw = self.consumer.highwater(tp)
            if hw is None:
                continue
            try:
                pos = self.consumer.position(tp, timeout_ms=100) if hasattr(self.consumer, "position") else None
            except TypeError:
                pos = self.consumer.position(tp)
            except Exception:  # noqa: BLE001
                pos = None
            if pos is None:
                continue
            lag = max(0, hw - pos)
            self._lag_by_tp[(tp.topic, tp.partition)] = lag
            total += lag
            self.metrics.lag.labels(tp.topic, str(tp.partition)).set(lag)
        self.metrics.total_lag = total

    def stats(self) -> dict:
        m = self.metrics
        return {"rows_in": m.value(m.records_in), "rows_out": m.value(m.records_out),
                "deadletter": m.value(m.dropped, "deadletter"), "duplicates": m.value(m.dropped, "duplicate"),
                "alerts": len(self.alerts), "lag": getattr(m, "total_lag", 0),
                "jobs": len(self.jobs), "rows_out_steps": m.value(m.records_out, "steps"),
                "t_first_data": self.t_first_data, "t_last_flush": self.t_last_flush,
                "cpu_first_data": getattr(self, "cpu_first_data", None), "cpu_last_flush": getattr(self, "cpu_last_flush", None),
                "flush_s": sum(x.value for c in m.flush_seconds.collect() for x in c.samples if x.name.endswith("_sum"))}

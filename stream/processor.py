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
from stepwatch.storage.store import Fenced, Marker, ParquetStore
from stepwatch.storage.views import connect as views_connect
from stepwatch.stream import fencing
from stepwatch.stream.align import JobState
from stepwatch.stream.jobmetrics import JobMetrics
from stepwatch.stream.kafkaio import KafkaSettings, ensure_topics, make_consumer, make_producer
from stepwatch.stream.metrics import ProcessorMetrics

log = logging.getLogger("stepwatch.processor")

INPUT_TOPICS = ("topology", "steps", "host", "gc", "comm", "profiles")


def _build_detectors(settings):
    from stepwatch.detectors.registry import build
    return build(settings)


@dataclass
class JobRuntime:
    state: JobState
    detectors: list
    alerts_seen: set = field(default_factory=set)     # (alert_id, status) already emitted/stored
    replaying: bool = False
    telemetry: JobTelemetry = field(default_factory=JobTelemetry)   # bounded host/gc/comm windows
    steps_partition: int | None = None                # partition the job's step rows arrive on


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
                 create_topics: bool = True, idle_close_s: float = 5.0, profiling="env"):
        self.kafka = kafka
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
        self.job_metrics = JobMetrics(self.metrics.registry)   # per-job Prometheus metrics (None: off)
        # called with each alert still open in the store when a job is rebuilt (stream.alertfanout.attach)
        self.on_alert_restored: Callable[[Alert], None] | None = self.job_metrics.on_alert

    # ------------------------------------------------------------------ kafka lifecycle
    def start(self) -> None:
        _build_detectors(self.detector_settings)   # import detector libraries (ruptures) now, not mid-stream
        if self.create_topics:
            ensure_topics(self.kafka)
        from stepwatch.stream.broker import cluster_id_of
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
        records = self.consumer.poll(timeout_ms=timeout_ms, max_records=2000)
        n = 0
        # topology first so steps in the same poll find their job's world size
        for tp in sorted(records, key=lambda tp: self._topic_kind.get(tp.topic) != "topology"):
            prog = self.progress.get((tp.topic, tp.partition))
            for msg in records[tp]:
                n += 1
                if prog is not None:
                    if prog.marker.is_done(msg.offset):
                        self.metrics.skipped.inc()
                        continue
                    prog.consumed.append(msg.offset)
                try:
                    self._handle(msg)
                except Exception as e:  # noqa: BLE001 - one message must never stop the processor
                    log.exception("failed to handle %s@%d/%d", msg.topic, msg.partition, msg.offset)
                    try:
                        self._deadletter(msg, f"internal error while processing: {e!r}", None, None)
                    except Exception:  # noqa: BLE001
                        log.exception("could not deadletter %s@%d/%d", msg.topic, msg.partition, msg.offset)
        if n:
            self.last_data = time.monotonic()
            if self.t_first_data is None:
                self.t_first_data = time.time()
        now = time.monotonic()
        if self.buffered_rows >= self.max_buffer_rows or now - self.last_flush >= self.flush_interval_s:
            self._close_idle_jobs()
            self._flush()
            self._update_lag()
        return n

    # ------------------------------------------------------------------ messages
    def _handle(self, msg) -> None:
        hdr = {k: v for k, v in (msg.headers or [])}
        kind = self._topic_kind.get(msg.topic, "?")
        self.metrics.messages_in.labels(kind).inc()
        t0 = time.perf_counter()
        try:
            d = wire.decode(msg.value, hdr.get("content-type"), hdr.get("schema"))
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
        if d.rejected:
            self._deadletter(msg, None, d.rejected, d.rejected_rows)
        if d.table.num_rows:
            self._route(kind, d.table, msg)

    def _route(self, kind: str, t: pa.Table, msg) -> None:
        if kind == "topology":
            for job in pc.unique(t.column("job")).to_pylist():
                part = t.filter(pc.equal(t.column("job"), job))
                self._job(job).state.set_topology(part)
            self._buffer("topology", t)
            return
        if kind != "steps":
            self._buffer(kind, t)
            if kind == "profiles" and self.profiling is not None:
                self._profile_results(t)
            if kind in ("host", "gc", "comm"):
                self._context(kind, t)
            return
        jobs = pc.unique(t.column("job"))
        for job in jobs.to_pylist():
            part = t if len(jobs) == 1 else t.filter(pc.equal(t.column("job"), job))
            rt = self._job(job)
            t0 = time.perf_counter()
            res, blocks = rt.state.ingest(part)
            self.metrics.align_seconds.observe(time.perf_counter() - t0)
            if res.duplicates:
                self.metrics.dropped.labels("duplicate").inc(res.duplicates)
            if len(res.bad_rank):
                bad = part.take(pa.array(res.bad_rank))
                ws = rt.state.world_size
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

    def _context(self, kind: str, t: pa.Table) -> None:
        """Keep host/gc/comm rows in their job's bounded windows (detector evidence); host samples
        move the job's event time on, which the detectors judging silence (hangs) are told about."""
        jobs = pc.unique(t.column("job"))
        for job in jobs.to_pylist():
            part = t if len(jobs) == 1 else t.filter(pc.equal(t.column("job"), job))
            rt = self._job(job)
            rt.telemetry.add(kind, part)
            if kind == "host":
                self._tick(rt)

    def _ctx(self, rt: JobRuntime) -> JobContext:
        ctx = rt.state.context()
        rt.telemetry.attach(ctx)
        if rt.steps_partition is not None:
            ctx.backlog = self._lag_by_tp.get((self.kafka.topic("steps"), rt.steps_partition), 0) > 0
        return ctx

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
        self.buffered_rows += t.num_rows
        if self.job_metrics is not None:
            self.job_metrics.on_rows(table, t)

    def _deadletter(self, msg, reason: str | None, rejected, rows: pa.Table | None) -> None:
        now = time.time_ns()
        key_job = None
        if msg.key:
            k = msg.key.decode("utf-8", "replace")
            key_job = k if wire.JOB_RE.match(k) else None
        hdr = {k: v for k, v in (msg.headers or [])}
        schema_h = hdr.get("schema")
        schema_s = schema_h.decode("utf-8", "replace") if isinstance(schema_h, bytes) else schema_h
        recs = []
        if reason is not None:
            recs.append({"job": key_job or "_unknown", "t_received": now, "source_topic": msg.topic,
                         "source_partition": msg.partition, "source_offset": msg.offset, "schema": schema_s, "row": None,
                         "reason": reason, "payload": msg.value if msg.value is not None else b""})
            log.warning("deadletter %s@%d/%d: %s", msg.topic, msg.partition, msg.offset, reason)
        else:
            pyrows = _plain(rows).to_pylist() if rows is not None else []
            for (i, why), r in zip(rejected, pyrows):
                job = r.get("job") if isinstance(r.get("job"), str) and wire.JOB_RE.match(r.get("job") or "") else key_job
                recs.append({"job": job or "_unknown", "t_received": now, "source_topic": msg.topic,
                             "source_partition": msg.partition, "source_offset": msg.offset, "schema": schema_s, "row": i,
                             "reason": why, "payload": json.dumps(r, default=str).encode()})
            log.warning("deadletter %d row(s) of %s@%d/%d, first: %s", len(recs), msg.topic, msg.partition,
                        msg.offset, rejected[0][1] if rejected else "")
        if not recs:
            return
        self.metrics.dropped.labels("deadletter").inc(len(recs))
        self._buffer("deadletter", pa.Table.from_pylist(recs, schema=wire.DEADLETTER))
        for r in recs:
            h = list(msg.headers or []) + [("error", r["reason"].encode()),
                                           ("source", f"{msg.topic}/{msg.partition}/{msg.offset}".encode())]
            self.producer.send(self.kafka.topic("deadletter"), r["payload"], key=msg.key, headers=h)

    # ------------------------------------------------------------------ jobs and detectors
    def _job(self, job: str) -> JobRuntime:
        rt = self.jobs.get(job)
        if rt is None:
            rt = JobRuntime(JobState(job, capacity=self.window_steps, lateness_ns=self.lateness_ns),
                            _build_detectors(self.detector_settings))
            self.jobs[job] = rt
            self._rebuild(rt)
        return rt

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
            if self.on_alert_restored is not None:     # sinks re-send them, job metrics count them
                from stepwatch.stream.alertfanout import open_alerts
                for a in open_alerts(con, job):
                    self.on_alert_restored(a)
            top = con.execute("SELECT max(step) FROM steps WHERE job = ?", [job]).fetchall()[0][0]
            if top is not None:
                lo = int(top) - self.replay_steps + 1
                hist = con.sql("SELECT * FROM steps WHERE job = ? AND step >= ? ORDER BY step, rank",
                               params=[job, lo]).to_arrow_table()
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

    def _detect(self, rt: JobRuntime, blocks: list[StepBlock]) -> None:
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
            return
        rt.alerts_seen.add(key)
        st = rt.state
        sl = a.step_first % st.capacity
        if "t_first_ns" not in a.evidence and st.slot_step[sl] == a.step_first and st.t_end[sl]:
            a.evidence["t_first_ns"] = int(st.t_end[sl])    # lets Grafana draw the alert as a region
        self.alerts.append(a)
        self.metrics.alerts.labels(a.kind, a.status).inc()
        if self.job_metrics is not None:
            self.job_metrics.on_alert(a)
        row = pa.Table.from_pylist([a.row()], schema=wire.ALERTS)
        self._buffer("alerts", row)
        if self.producer is not None:
            self.producer.send(self.kafka.topic("alerts"), wire.encode_arrow(row), key=a.job.encode(),
                               headers=[("content-type", wire.ARROW_CT.encode()), ("schema", b"alerts/1")])
        if self.on_alert:
            self.on_alert(a)
        else:
            log.warning("%s", a.line())
        if self.profiling is not None and a.status == "firing" and not rt.replaying:
            self._profile_alert(rt, a)

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
            if rt.state.open_steps():
                self._detect(rt, rt.state.close_ready(force=True))

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
        rows = {k: sum(t.num_rows for t in v) for k, v in tables.items()}
        try:
            self.store.write_flush(tables, markers, generation=fencing.generation(self.consumer))
        except Fenced as e:
            fencing.fenced(self, e)
            return
        self.metrics.flush_seconds.observe(time.perf_counter() - t0)
        for k, n in rows.items():
            self.metrics.records_out.labels(k).inc(n)
        self.buffers = defaultdict(list)
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
        self.metrics.last_flush.set(self.t_last_flush)

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
                "t_first_data": self.t_first_data, "t_last_flush": self.t_last_flush}

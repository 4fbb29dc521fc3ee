"""The stream processor: Kafka consumer group -> decode -> align -> detect -> DuckLake, alerts.

Lifecycle of one message: poll -> skip if the store's marker lists it as done -> decode and validate
(whole-message errors and bad rows go to the deadletter topic and table with a reason) -> write the
valid rows to the sinks; steps are also scattered into their job's alignment ring, which drops
duplicates by natural key and closes steps for the detectors (:func:`stepwatch.detectors.replay.replay`
feeds them; their alerts and declared row outputs go to the sinks too).

Every output is a sink (:mod:`stepwatch.stream.sinks`): the store (rows buffered per table), the alerts
and deadletter topics, the console (``on_alert``), and the notifiers :func:`stepwatch.stream.alertfanout.attach`
adds (Grafana annotations, Alertmanager). Every ``flush_interval_s`` (or when ``max_buffer_rows`` are
buffered) a checkpoint (:mod:`stepwatch.stream.checkpoint`) stores the buffers and the consumed positions
(with the consumer-group generation) in one lake transaction, then waits for the topics' delivery, and
only then commits the offsets to Kafka (at-least-once delivery, exactly-once in the store, older
generations fenced; see :mod:`stepwatch.storage.store` and :mod:`stepwatch.stream.fencing`).

A job's detector state is rebuilt from the store the first time this processor sees the job (after
a restart or a partition move; :mod:`stepwatch.stream.rebuild`): its topology, the last window of steps
and the alerts already stored, so a straggler in progress is not forgotten and an alert is not sent twice.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.detectors.base import Alert, Detector, JobContext, StepBlock
from stepwatch.detectors.context import JobTelemetry
from stepwatch.detectors.incidents import Incidents
from stepwatch.detectors.replay import drain, replay
from stepwatch.wire import catalog
from stepwatch.storage.store import Fenced, Marker, LakeStore
from stepwatch.stream import fencing, ingress, rebuild, stepaxis
from stepwatch.stream.caughtup import CaughtUp
from stepwatch.stream.intake import Intake
from stepwatch.stream.emitter import AlertEmitter
from stepwatch.stream.jobchanges import JobChanges
from stepwatch.stream.checkpoint import Checkpoint, PartitionProgress
from stepwatch.stream.sinks import ConsoleSink, LakeSink, Rows, Sinks, TopicSink
from stepwatch.stream.align import COLUMN_DENSITY, COLUMN_FLOOR, JobState
from stepwatch.stream.hostwait import HostWait
from stepwatch.stream.stepaxis import JobAxis
from stepwatch.stream.ingress_limits import IngressLimits
from stepwatch.stream.jobmetrics import JobMetrics
from stepwatch.kafkaio import KafkaSettings, ensure_topics, make_consumer, make_producer
from stepwatch.stream.processor_metrics import ProcessorMetrics
from stepwatch.stream.processor_settings import PROCESSOR
from stepwatch.detectors.settings import bind as bind_settings

log = logging.getLogger("stepwatch.processor")

INPUT_TOPICS = catalog.INPUT_TOPICS
IN_HAND = object()                # Processor._buffer: the rows are of the message in hand
REBUILD_TIME_WINDOW_S = 60.0     # rebuild_time_share is averaged over this long (the time bucket's burst)


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
    firing: dict = field(default_factory=dict)        # alert_id -> its firing Alert, until resolved
    inflight_partition: int | None = None             # partition the job's in-flight rows arrive on
    topology: list = field(default_factory=list)      # its topology rows as applied (a restart re-applies them)
    changes: list = field(default_factory=list)       # steps at which the job announced a change (mark_change)

    def keep_topology(self, part: pa.Table) -> None:
        """Keep the topology rows applied to the job's state, bounded by its ranks (the newest rows of each
        rank are what counts; older parts go once the parts hold twice the ranks)."""
        self.topology.append(part)
        n = sum(t.num_rows for t in self.topology)
        while len(self.topology) > 1 and n > 2 * max(self.state.world_size, 1) + 64:
            n -= self.topology.pop(0).num_rows


class Processor:
    """Kafka consumer group -> decode (``intake``: :class:`~stepwatch.stream.intake.Intake`) -> align
    (``stepaxis``: :class:`~stepwatch.stream.stepaxis.StepAxisGate`; a job's announced changes and
    restarts: ``jobchanges``, :class:`~stepwatch.stream.jobchanges.JobChanges`) -> detect -> alerts
    (``emitter``: :class:`~stepwatch.stream.emitter.AlertEmitter`) -> sinks, checkpointed
    (:class:`~stepwatch.stream.checkpoint.Checkpoint`; see the module docs); read-to-end proofs and lag:
    ``caught`` (:class:`~stepwatch.stream.caughtup.CaughtUp`). Each stage is an object built here with
    the collaborators it uses."""

    #: the limits (:mod:`stepwatch.stream.processor_settings`): keyword arguments of the constructor, the ``[processor]``
    #: table of the configuration file. Code may pass values beyond the file's ranges (a test's
    #: ``flush_interval_s=1e9``: never by time); their types are checked.
    SETTINGS = PROCESSOR

    def __init__(self, kafka: KafkaSettings, data_dir: str | Path, group: str = "stepwatch-processor", *,
                 detector_settings: dict | None = None,
                 on_alert: Callable[[Alert], None] | None = None, metrics: ProcessorMetrics | None = None,
                 create_topics: bool = True, profiling="env", limits: IngressLimits | None = None, **settings):
        self.kafka = kafka
        self.limits = limits or IngressLimits()      # the Kafka boundary's bounds (stream.ingress, docs/limits.md)
        self.rlog = ingress.RateLimitedLog(log, self.limits.log_per_s)
        self.rebuild_bucket = ingress.TokenBucket(self.limits.rebuilds_per_s, self.limits.rebuild_burst)
        # seconds of rebuilding allowed: a share of the wall time, averaged over a minute (a rebuild is
        # store queries, ~10-200 ms: 20 a second could take all of it when job ids churn at max_jobs)
        self.rebuild_time = ingress.TokenBucket(self.limits.rebuild_time_share,
                                                self.limits.rebuild_time_share * REBUILD_TIME_WINDOW_S)
        # job -> monotonic time of its last message, least recently active first (_job moves a job to
        # the end), so eviction takes jobs from the front: O(1) per job, not a sort of all of them.
        # Entries of jobs no longer held (fencing drops them all) are skipped and removed when reached.
        self.job_seen: OrderedDict[str, float] = OrderedDict()
        self._wide: set[str] = set()      # jobs whose ring is wider than stepaxis.SPARSE_MIN_WIDTH ranks
        self.store = LakeStore(data_dir).init()
        self.group = group
        # flush_interval_s, max_buffer_rows, idle_close_s; lateness_s, window_steps (alignment ring, steps x
        # ranks in memory), replay_steps (steps replayed from the store into fresh detectors): for new jobs
        self.retune(settings)
        self.detector_settings = detector_settings
        self.on_alert = on_alert
        self.metrics = metrics or ProcessorMetrics()
        self.create_topics = create_topics
        if profiling == "env":                      # on when STEPWATCH_PROFILING_PRIVATE_KEY[_FILE] holds a key
            from stepwatch.stream.profiling import settings_from_env
            profiling = settings_from_env()
        self.profiling_settings = profiling         # ProfilingSettings (stream.profiling); None: no commands
        self.profiling = None                       # its Issuer, once the producer exists
        self.jobs: dict[str, JobRuntime] = {}
        # the outputs (stream.sinks), in the order an alert reaches them: topic, console, then attach()'s
        self.lake = LakeSink(self.store, self.metrics, self.limits, self.rlog)
        self.sinks = Sinks([self.lake, TopicSink(kafka, lambda: self.producer),
                            ConsoleSink(lambda: self.on_alert)])
        self.progress: dict[tuple[str, int], PartitionProgress] = {}
        self.last_flush = time.monotonic()
        self.last_data = time.monotonic()
        self._last_retick = 0.0                          # _retick_ended_jobs
        self.consumer = None
        self.producer = None
        self.stop_event = threading.Event()
        self.t_first_data: float | None = None      # wall time of the first message
        self.t_last_flush: float | None = None      # wall time of the last flush that wrote rows
        self._topic_kind = {kafka.topic(k): k for k in INPUT_TOPICS}
        # whether a job's sources are read to their end, and the consumer lag (stream.caughtup); its
        # ``hook``: (topic, partition) -> read to its end?, None: ask the consumer
        self.caught = CaughtUp(kafka, self.metrics, lambda: self.consumer)
        # one Kafka record decoded, bounded, routed; at most one deadletter record for it (stream.intake)
        self.intake = Intake(topic_kind=self._topic_kind, limits=self.limits, metrics=self.metrics, rlog=self.rlog,
                             jobs=self.jobs, route=self._route, buffer=self._buffer, send=self.sinks.write,
                             progress=self.progress)
        self.job_metrics = JobMetrics(self.metrics.registry)   # per-job Prometheus metrics (None: off)
        # called with each alert still open in the store when a job is rebuilt (the job metrics count it;
        # the sinks get it as AlertOut(restored=True): stream.rebuild)
        self.on_alert_restored: Callable[[Alert], None] | None = self.job_metrics.on_alert
        # the detectors' alerts to the store and the sinks: incidents, host waits, profiles (stream.emitter)
        self.emitter = AlertEmitter(metrics=self.metrics, job_metrics=self.job_metrics, buffer=self._buffer,
                                    send=self.sinks.write, profiling=lambda: self.profiling,
                                    host_caught_up=self.caught.host_caught_up)
        # a job's announced changes and restarts: new baselines (stream.jobchanges)
        self.jobchanges = JobChanges(new_detectors=self.new_detectors, emit=self.emitter.emit)
        # a job's step rows judged against where its ranks are (stream.stepaxis)
        self.stepaxis = stepaxis.StepAxisGate(limits=self.limits, metrics=self.metrics, rlog=self.rlog,
                                              lake=self.lake, new_detectors=self.new_detectors,
                                              buffer=self._buffer, send=self.sinks.write, evict=self._evict_jobs)
        # partitions the group or the lake took away (stream.fencing)
        self.fencing = fencing.Fencing(lake=self.lake, jobs=self.jobs, progress=self.progress,
                                       read_to=self.caught.read_to, store=self.store, consumer=lambda: self.consumer)

    @property
    def alerts(self) -> list[Alert]:
        """The newest alerts emitted (1,024: :data:`stepwatch.stream.emitter.KEEP`; all are stored)."""
        return self.emitter.alerts

    @property
    def events(self) -> list[Alert]:
        """The newest lifecycle events (``job_end``) emitted (1,024)."""
        return self.emitter.events

    def retune(self, kw: dict) -> None:
        """Put the limits ``kw`` in force (those left out: their defaults); a reload calls this too. The
        ``live`` ones act at once; ``lateness_s``, ``window_steps`` and ``replay_steps`` on the jobs
        started after (a running job keeps its alignment ring). Raises
        :class:`~stepwatch.detectors.settings.SettingError` (the field and the value) for a wrong type."""
        vals = bind_settings(self, PROCESSOR, kw, "processor", ranges=False)
        self.lateness_ns = int(vals["lateness_s"] * 1e9)

    def job_detectors(self) -> dict[str, list[Detector]]:
        """job -> its detectors (in use: do not change them; :meth:`apply_settings` does)."""
        return {job: list(rt.detectors) for job, rt in self.jobs.items()}

    def apply_settings(self, processor: dict, detector_settings, *,
                       detectors: Callable[[str, list[Detector]], list[Detector] | None] | None = None,
                       profiling: tuple | None = None) -> None:
        """Put checked settings in force (a reload: :func:`stepwatch.config.apply` checks them first):
        the ``processor`` limits (:meth:`retune`: the live ones now, the others for jobs started from
        now on), ``profiling`` ((issuer, settings), or None: unchanged), each job's detectors as
        ``detectors(job, current)`` returns them (None: kept), and ``detector_settings`` for the jobs
        and detectors made from now on."""
        self.retune(processor)
        if profiling is not None:
            self.profiling, self.profiling_settings = profiling
        if detectors is not None:
            for job, rt in self.jobs.items():
                new = detectors(job, rt.detectors)
                if new is not None:
                    rt.detectors = new
        self.detector_settings = detector_settings

    # ------------------------------------------------------------------ kafka lifecycle
    def start(self) -> None:
        _build_detectors(self.detector_settings)   # import detector libraries (ruptures) now, not mid-stream
        if self.create_topics:
            ensure_topics(self.kafka)
        from stepwatch.kafkaio import cluster_id_of
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
                    proc.caught.read_to.pop((tp.topic, tp.partition), None)

            def on_partitions_lost(self, lost):      # the group moved on: never commit these
                proc.fencing.lost(lost)

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
            # what was handled before is no proof now: the consumer may read this partition again from
            # the catalog's offset (a rejoin after the session expired), so CaughtUp asks its position
            self.caught.read_to.pop((tp.topic, tp.partition), None)
            m = pos.get((tp.topic, tp.partition))
            if m is not None:
                self.consumer.seek(tp, m.next)
            self.progress[(tp.topic, tp.partition)] = PartitionProgress(m or Marker(-1))
        # jobs owned by partitions that moved here are rebuilt lazily from the store
        log.info("assigned %d partitions", len(assigned))

    def close(self) -> None:
        try:
            for rt in self.jobs.values():
                self.emitter.settle(rt, force=True)
            self._flush()
        finally:
            if self.consumer is not None:
                self.consumer.close(autocommit=False)
            if self.producer is not None:
                self.producer.flush(10)
                self.producer.close(5)
            self.consumer = self.producer = None
            self.sinks.close()

    # ------------------------------------------------------------------ main loop
    def run(self, stop_event: threading.Event | None = None, idle_exit_s: float | None = None,
            on_tick: Callable[["Processor"], None] | None = None) -> None:
        """Consume until ``stop_event`` is set (or, with ``idle_exit_s``, until no message arrived
        for that long after the first one and every partition assigned is read to its end: a rejoin
        after an expired session is silent too, and must not end the run with records unread)."""
        stop = stop_event or self.stop_event
        self.start()
        seen_any = False
        try:
            while not stop.is_set():
                n = self.poll_once(timeout_ms=200)
                seen_any |= n > 0
                if on_tick:
                    on_tick(self)
                if idle_exit_s and seen_any and time.monotonic() - self.last_data > idle_exit_s \
                        and self.caught.all_caught_up():
                    break
        finally:
            self.close()

    def poll_once(self, timeout_ms: int = 200) -> int:
        try:
            records = self.consumer.poll(timeout_ms=timeout_ms, max_records=2000)
            self.caught.polled_at = time.monotonic()
        except Exception as e:  # noqa: BLE001 - a batch the client cannot decode (codec, corruption)
            if not self.intake.skip_undecodable(self.consumer, e):
                raise
            records = {}
        n = 0
        # topology first so steps in the same poll find their job's world size; then steps and the in-flight
        # states (goodbyes, watchdog reports), so a host sample is never judged against steps or a goodbye
        # already fetched but not yet handled (job-hang proof)
        order = {"topology": 0, "steps": 1, "inflight": 2}
        for tp, msgs in records.items():      # handled so far: up to this poll's first record, not the
            if msgs:                          # consumer's position (which counts what this poll fetched)
                self.caught.read_to[(tp.topic, tp.partition)] = msgs[0].offset
        for tp in sorted(records, key=lambda tp: order.get(self._topic_kind.get(tp.topic), 3)):
            prog = self.progress.get((tp.topic, tp.partition))
            for msg in records[tp]:
                n += 1
                self.caught.read_to[(tp.topic, tp.partition)] = msg.offset + 1   # handled up to here
                if prog is not None:
                    if prog.marker.is_done(msg.offset):
                        self.metrics.skipped.inc()
                        continue
                    prog.consumed.append(msg.offset)
                self.process_message(msg)
        if not n:
            self._retick_ended_jobs()
        if n:
            self.last_data = time.monotonic()
            if self.t_first_data is None:
                self.t_first_data = time.time()
                self.cpu_first_data = time.process_time()   # bench ingest: CPU per row on a shared machine
        now = time.monotonic()
        if self.lake.rows >= self.max_buffer_rows or now - self.last_flush >= self.flush_interval_s:
            self._close_idle_jobs()
            self._evict_jobs()
            for rt in self.jobs.values():
                self.emitter.settle(rt)
            self._flush()
            self.caught.update_lag()
        return n

    # ------------------------------------------------------------------ messages
    def process_message(self, msg) -> None:
        """One Kafka record: decode, bound, route, buffer; at most one deadletter record for it
        (:meth:`stepwatch.stream.intake.Intake.process_message`). Never raises."""
        self.intake.process_message(msg)

    def _route(self, kind: str, t: pa.Table, msg) -> None:
        if kind == "topology":
            for job in pc.unique(t.column("job")).to_pylist():
                part = t.filter(pc.equal(t.column("job"), job))
                rt = self._job(job)
                w0 = rt.state.world_size
                rt.state.set_topology(part)
                rt.keep_topology(part)
                self._widened(rt, w0)
                if rt.state.topology_known and rt.state.world_size == rt.state.expected:
                    # every declared rank has its column: the detectors allocate for that width now
                    # (an allocation event; no-op for those that have seen a block)
                    ctx = self._ctx(rt)
                    for det in rt.detectors:
                        self._call(rt, det, det.prepare, ctx)
                if rt.pending:                              # steps held for it: detect them now
                    self._detect(rt, [])
            self._buffer("topology", t)
            return
        if kind != "steps":
            self._buffer(kind, t)
            if kind == "profiles" and self.profiling is not None:
                self.emitter.profile_results(t)
            if kind in ("host", "gc", "comm", "inflight"):
                self._context(kind, t)
            return
        jobs = pc.unique(t.column("job"))
        for job in jobs.to_pylist():
            part = t if len(jobs) == 1 else t.filter(pc.equal(t.column("job"), job))
            rt = self._job(job)
            if rt.telemetry.life.outcome is not None:           # steps after the job's end: a restart
                self.jobchanges.restarted(rt, part)
            part = self.stepaxis.admit(rt, job, part, self.intake.dl, self.intake.src)   # bounds to where its ranks are
            if not part.num_rows:
                continue
            self.jobchanges.announced(rt, part)
            t0, w0 = time.perf_counter(), rt.state.world_size
            res, blocks = rt.state.ingest(part)
            self.metrics.align_seconds.observe(time.perf_counter() - t0)
            self._widened(rt, w0)
            if res.duplicates:
                self.metrics.dropped.labels("duplicate").inc(res.duplicates)
            if res.unplaced:                                # stored, not aligned (stream.align.JobState.place)
                self.metrics.step_axis.labels("rank_unplaced").inc(res.unplaced)
                self.rlog.warning("job %s: %d step row(s) stored but not aligned: field 'rank': value %d has no "
                                  "column (the job's ring has %d; ranks above %d get one once 1 in %d of the "
                                  "ranks up to them report)", job, res.unplaced, res.unplaced_rank,
                                  rt.state.world_size, COLUMN_FLOOR, COLUMN_DENSITY)
            if len(res.bad_rank):
                bad = part.take(pa.array(res.bad_rank))
                ws = rt.state.expected or rt.state.world_size
                reasons = [(int(i), f"field 'rank': {r} is outside world_size {ws} of job {job!r}")
                           for i, r in zip(res.bad_rank, bad.column("rank").to_pylist())]
                self.intake.deadletter(msg, None, reasons, bad)
            if res.keep.all():
                self._buffer("steps", part)
            elif res.keep.any():
                self._buffer("steps", part.filter(pa.array(res.keep)))
            rt.steps_partition = getattr(msg, "partition", None)
            self._detect(rt, blocks)
            self._tick(rt)
            self.emitter.settle(rt)

    def _context(self, kind: str, t: pa.Table) -> None:
        """Keep host/gc/comm rows in their job's bounded windows (detector evidence); host samples
        move the job's event time on, which the detectors judging silence (hangs) are told about."""
        jobs = pc.unique(t.column("job"))
        for job in jobs.to_pylist():
            part = t if len(jobs) == 1 else t.filter(pc.equal(t.column("job"), job))
            rt = self._job(job)
            rt.telemetry.add(kind, part)
            if kind == "host":
                rt.host_partition = self.intake.src[1] if self.intake.src else rt.host_partition
                self._tick(rt)
                self.emitter.settle(rt)
            elif kind == "inflight":                     # a watchdog's report, a rank's end: judged now
                rt.inflight_partition = self.intake.src[1] if self.intake.src else rt.inflight_partition
                self._tick(rt)
            elif kind == "comm" and not rt.replaying:    # rows of steps that may have closed already
                ctx = None
                for det in rt.detectors:
                    if type(det).on_context is not Detector.on_context:
                        ctx = ctx or self._ctx(rt)
                        self._run_detector(rt, det, det.on_context, ctx, kind)

    def _ctx(self, rt: JobRuntime) -> JobContext:
        ctx = rt.state.context()
        rt.telemetry.attach(ctx)
        if rt.steps_partition is not None:
            ctx.backlog = self.caught.lag_by_tp.get((self.kafka.topic("steps"), rt.steps_partition), 0) > 0
        ctx.caught_up = lambda: self.caught.caught_up(rt)
        return ctx

    def _retick_ended_jobs(self) -> None:
        """After an empty poll (at most once a second): tell the detectors again the event time of the jobs
        whose ranks have said goodbye but whose end is not judged yet. That judgement waits until the job's
        partitions are read to their end, and is asked at the job's own rows: when the goodbyes and the
        last rows came in one burst (a spool replayed, a consumer catching up), no later row of that job
        may come to ask again, and the stall detector would read the ended job's silence as a hang."""
        now = time.monotonic()
        if now - self._last_retick < 1.0:
            return
        self._last_retick = now
        for rt in list(self.jobs.values()):
            life = rt.telemetry.life
            if life.first and life.outcome is None:
                self._tick(rt)

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

    def _buffer(self, table: str, t: pa.Table, src=IN_HAND) -> None:
        """Rows for the store (the lake sink buffers them until the next checkpoint), of the source
        message ``src`` ((topic, partition, offset); by default the message in hand)."""
        self.sinks.write(Rows(table, t, self.intake.src if src is IN_HAND else src))
        if self.job_metrics is not None:
            self.job_metrics.on_rows(table, t)

    # ------------------------------------------------------------------ jobs and detectors
    def new_detectors(self, job: str) -> list[Detector]:
        """A fresh set of the job's detectors (stream.stepaxis uses it when it re-anchors a job)."""
        return _build_detectors(self.detector_settings, job)

    def _job(self, job: str) -> JobRuntime:
        self.job_seen[job] = time.monotonic()
        self.job_seen.move_to_end(job)
        rt = self.jobs.get(job)
        if rt is None:
            if len(self.jobs) >= self.limits.max_jobs:
                self._evict_jobs(room=1)
            rt = JobRuntime(JobState(job, capacity=self.window_steps, lateness_ns=self.lateness_ns),
                            _build_detectors(self.detector_settings, job))
            self.jobs[job] = rt
            # a burst of made-up job ids must not stall ingest: only jobs with stored history are
            # rebuilt from the store, at a bounded rate and a bounded share of the time
            if not self._has_history(job):
                self.metrics.rebuilds.labels("none").inc()
            elif self.rebuild_time.take(0.0) and self.rebuild_bucket.take():
                self.metrics.rebuilds.labels("store").inc()
                t0, w0 = time.monotonic(), rt.state.world_size
                self._rebuild(rt)
                self.rebuild_time.charge(time.monotonic() - t0)
                self._widened(rt, w0)
            else:
                self.metrics.rebuilds.labels("rate_limited").inc()
                self.rlog.warning("job %s starts cold: over rebuilds_per_s=%g or rebuild_time_share=%g", job,
                                  self.limits.rebuilds_per_s, self.limits.rebuild_time_share)
        return rt

    def _widened(self, rt: JobRuntime, old_width: int) -> None:
        """After a job's ring may have widened: note a wide one (the candidates for sparse-first
        eviction, so eviction need not look at every job) and hold the state budget (stream.stepaxis)."""
        if rt.state.world_size > stepaxis.SPARSE_MIN_WIDTH:
            self._wide.add(rt.state.job)
        self.stepaxis.check_budget(rt, old_width)

    def _has_history(self, job: str) -> bool:
        """Whether the store may hold rows of ``job`` (its partition folders exist)."""
        return self.store.has_history(job)

    def _evict_jobs(self, room: int = 0) -> None:
        """Close and forget jobs idle for ``job_idle_evict_s``, and the least recently active ones
        while more than ``max_jobs - room`` jobs or ``max_state_bytes`` of rings are held; sparse rings
        (a row at a high rank of a made-up job: stepaxis.sparse) go first. O(jobs evicted) with
        ``job_seen`` in activity order, plus, below the job cap, one sum of the rings' sizes."""
        if not self.jobs:
            return
        lim = self.limits
        now = time.monotonic()
        seen, gone = self.job_seen, []

        def take(j: str) -> None:
            gone.append((j, self.jobs.pop(j)))
            seen.pop(j, None)
            self._wide.discard(j)

        def oldest() -> str | None:
            while seen:
                j, t = next(iter(seen.items()))
                if j in self.jobs:
                    return j
                seen.popitem(last=False)            # no longer held (fenced): drop the stale entry
            return None

        while (j := oldest()) is not None and now - seen[j] > lim.job_idle_evict_s:
            take(j)

        def sparse_first():
            wide = [j for j in self._wide if j in self.jobs and stepaxis.sparse(self.jobs[j])]
            yield from sorted(wide, key=lambda j: seen.get(j, 0.0))
            while (j := oldest()) is not None:
                yield j

        over = len(self.jobs) + room - lim.max_jobs
        if over > 0:
            for j in sparse_first():
                if over <= 0:
                    break
                if j in self.jobs:
                    take(j)
                    over -= 1
        elif len(self.jobs) > 1:
            size = sum(rt.state.state_bytes() for rt in self.jobs.values())
            if size > lim.max_state_bytes:
                for j in sparse_first():
                    if size <= lim.max_state_bytes or len(self.jobs) <= 1:
                        break
                    if j in self.jobs:
                        size -= self.jobs[j].state.state_bytes()
                        take(j)
        for j, rt in gone:
            try:
                if rt.state.open_steps():
                    self._detect(rt, rt.state.close_ready(force=True))
                self.emitter.settle(rt, force=True)
            except Exception:  # noqa: BLE001 - eviction never stops the processor
                log.exception("closing evicted job %s", j)
            if self.job_metrics is not None:        # its series go too: they are bounded by max_jobs
                self.job_metrics.forget(j)
            self.metrics.jobs_evicted.inc()

    def _rebuild(self, rt: JobRuntime) -> None:
        """Warm a job's state from the store: topology, last window of steps, stored alerts (stream.rebuild)."""
        rebuild.rebuild(self.store, rt, replay_steps=self.replay_steps, window_steps=self.window_steps,
                        sinks=self.sinks, on_restored=self.on_alert_restored, call=self._call, detect=self._detect)

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

        def on_block(blk: StepBlock) -> None:
            self.metrics.steps_closed.inc(len(blk))
            if self.job_metrics is not None:
                self.job_metrics.on_block(ctx, blk)
        for seg, change in self.jobchanges.segments(rt, blocks):
            replay(rt.detectors, ctx, seg, call=lambda det, fn, *a: self._call(rt, det, fn, *a),
                   on_block=on_block, out=lambda det, alerts, rows: self._out(rt, alerts, rows))
            if change is not None:
                self.jobchanges.rebaseline(rt, change)
        if blocks and len(blocks[-1]):
            rt.incidents.expire(int(blocks[-1].steps[-1]))   # incidents quiet for long are closed

    def _run_detector(self, rt: JobRuntime, det, fn, *args) -> None:
        """Call one detector entry point outside a replay (``tick``) and hand out what it returns, as
        :func:`~stepwatch.detectors.replay.replay` does."""
        alerts = self._call(rt, det, fn, *args)
        if alerts is None:
            return
        self._out(rt, alerts, drain(det))

    def _call(self, rt: JobRuntime, det, fn, *args):
        """One detector entry point with timing and error metrics. A failing detector is logged and
        counted (None), never allowed to stop the processor."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("detector %s failed (%s) on job %s", det.name, fn.__name__, rt.state.job)
            self.metrics.detector_errors.labels(det.name).inc()
            return None
        finally:
            self.metrics.detector_seconds.labels(det.name).observe(time.perf_counter() - t0)

    def _out(self, rt: JobRuntime, alerts: list[Alert], rows: dict[str, pa.Table]) -> None:
        """A detector's outputs (declared in its class: stepwatch.detectors.base.Detector.outputs)."""
        for table, t in rows.items():
            if t.num_rows and not rt.replaying:          # replayed steps' rows are already stored
                self._buffer(table, conform(t, wire.SCHEMAS[table]))
        for a in alerts:
            self.emitter.emit(rt, a)

    def _close_idle_jobs(self) -> None:
        """Close steps of jobs whose stream went quiet (event time cannot advance without data)."""
        if time.monotonic() - self.last_data < self.idle_close_s:
            return
        for rt in self.jobs.values():
            if rt.state.open_steps() or rt.pending:
                self._detect(rt, rt.state.close_ready(force=True), force=True)

    # ------------------------------------------------------------------ flush
    def _flush(self) -> None:
        """A checkpoint: flush (the store: rows and offsets in one transaction) -> produce (the topics'
        delivery) -> commit (Kafka offsets); see :mod:`stepwatch.stream.checkpoint`."""
        self.last_flush = time.monotonic()
        cp = Checkpoint(self.progress, self.consumer, self.lake, [s for s in self.sinks.sinks if s is not self.lake],
                        self.metrics, self.fencing.fenced)
        if cp.commit():
            self.t_last_flush, self.cpu_last_flush = cp.committed_at

    def stats(self) -> dict:
        m = self.metrics
        return {"rows_in": m.value(m.records_in), "rows_out": m.value(m.records_out),
                "deadletter": m.value(m.dropped, "deadletter"), "duplicates": m.value(m.dropped, "duplicate"),
                "alerts": self.emitter.emitted, "lag": getattr(m, "total_lag", 0),
                "jobs": len(self.jobs), "jobs_evicted": m.value(m.jobs_evicted),
                "rebuilds": {h: m.value(m.rebuilds, h) for h in ("store", "none", "rate_limited")},
                "rows_out_steps": m.value(m.records_out, "steps"),
                "t_first_data": self.t_first_data, "t_last_flush": self.t_last_flush,
                "cpu_first_data": getattr(self, "cpu_first_data", None), "cpu_last_flush": getattr(self, "cpu_last_flush", None),
                "flush_s": sum(x.value for c in m.flush_seconds.collect() for x in c.samples if x.name.endswith("_sum"))}

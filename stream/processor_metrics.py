"""Self-metrics of the processor, exported for Prometheus (``--metrics-port``).

Each processor instance has its own registry (tests run several in one interpreter).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stepwatch.metrics import Metrics

_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ProcessorMetrics(Metrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.messages_in = Counter("stepwatch_processor_messages_in", "Kafka messages read", ["kind"], registry=r)
        self.records_in = Counter("stepwatch_processor_records_in", "Rows decoded", ["kind"], registry=r)
        self.records_out = Counter("stepwatch_processor_records_out", "Rows written to the store", ["table"], registry=r)
        self.dropped = Counter("stepwatch_processor_records_dropped",
                               "Rows not stored in their table (duplicate, deadletter)", ["reason"], registry=r)
        self.skipped = Counter("stepwatch_processor_messages_skipped",
                               "Redelivered messages already in the store", registry=r)
        self.steps_closed = Counter("stepwatch_processor_steps_closed", "Aligned steps handed to detectors",
                                    registry=r)
        self.alerts = Counter("stepwatch_processor_alerts", "Alerts emitted", ["kind", "status"], registry=r)
        self.detector_errors = Counter("stepwatch_processor_detector_errors", "Detector exceptions", ["detector"],
                                       registry=r)
        self.detector_seconds = Histogram("stepwatch_processor_detector_seconds", "Time per detector update",
                                          ["detector"], buckets=_FAST, registry=r)
        self.decode_seconds = Histogram("stepwatch_processor_decode_seconds", "Decode+validate time per message",
                                        buckets=_FAST, registry=r)
        self.align_seconds = Histogram("stepwatch_processor_align_seconds", "Alignment time per batch",
                                       buckets=_FAST, registry=r)
        self.flush_seconds = Histogram("stepwatch_processor_flush_seconds", "Store flush time", buckets=_FAST,
                                       registry=r)
        self.lag = Gauge("stepwatch_processor_lag_messages", "Highwater minus position", ["topic", "partition"],
                         registry=r)
        self.last_flush = Gauge("stepwatch_processor_last_flush_timestamp_seconds", "Time of the last flush",
                                registry=r)
        # ingress bounds (stream.ingress, docs/limits.md)
        self.undecodable = Counter("stepwatch_processor_undecodable_records",
                                   "Kafka records the client could not decode (skipped, deadlettered)", registry=r)
        self.columns_dropped = Counter("stepwatch_processor_columns_dropped",
                                       "Unknown extra columns dropped (type, name, conflict, too many)", ["reason"],
                                       registry=r)
        self.rows_rejected = Counter("stepwatch_processor_rows_rejected", "Rows outside the ingress bounds",
                                     ["kind"], registry=r)
        self.flush_isolations = Counter("stepwatch_processor_flush_isolations",
                                        "Flushes that failed and were bisected by source message", registry=r)
        self.step_axis = Counter("stepwatch_processor_step_axis",
                                 "A job's step and rank axes: re-anchors to its ranks, rows purged then (stream.stepaxis); "
                                 "rank_unplaced: step rows stored but not aligned, their rank has no column yet "
                                 "(stream.align)",
                                 ["event"], registry=r)
        self.jobs_evicted = Counter("stepwatch_processor_jobs_evicted", "Jobs evicted from memory (idle, budget)",
                                    registry=r)
        self.rebuilds = Counter("stepwatch_processor_job_rebuilds",
                                "New jobs by how their state began (store, none: no history, rate_limited)",
                                ["how"], registry=r)
        self.config_reloads = Counter("stepwatch_processor_config_reloads",
                                      "Configuration reloads (SIGHUP, a changed file) by result: applied, refused",
                                      ["result"], registry=r)
        self.total_lag = 0

"""The processor's checkpoint: flush -> produce -> commit, in the manner of quix-streams' ``Checkpoint``.

Every ``flush_interval_s`` (or ``max_buffer_rows``), on a rebalance and at close, the processor makes one
:class:`Checkpoint` of what it consumed since the last one and calls :meth:`Checkpoint.commit`, which
orders its sinks (:mod:`stepwatch.stream.sinks`):

1. **flush** — the store (:class:`~stepwatch.stream.sinks.LakeSink`): the buffered rows and the consumed
   positions (``markers``: next offset and the ranges already done per partition, with the consumer-group
   generation) in ONE DuckLake transaction (:meth:`stepwatch.storage.store.LakeStore.write_flush`). This
   is the truth: exactly-once in the store, an older generation fenced (then nothing is stored, the
   buffers and the jobs' state are dropped and the partitions re-read: :func:`stepwatch.stream.fencing.fenced`,
   and the checkpoint stops here);
2. **produce** — the other sinks' ``flush``: the alerts and deadletter topics wait for the delivery of
   what was sent since the last checkpoint (the notifiers deliver from their own queues);
3. **commit** — the offsets to Kafka (advisory: a restart reads the store's markers; a failed commit is
   logged, never retried here).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from stepwatch.storage.store import Fenced, Marker
from stepwatch.stream import fencing

log = logging.getLogger("stepwatch.processor")


@dataclass
class PartitionProgress:
    marker: Marker
    consumed: list = field(default_factory=list)      # offsets consumed since the last flush


class Checkpoint:
    """What the processor consumed since its last checkpoint (``proc.progress``), and the ordered
    commit of it (see the module docs). ``markers``: (topic, partition) -> the :class:`Marker` to store;
    ``generation``: the consumer group's generation the store checks them against."""

    def __init__(self, proc):
        self.proc = proc
        self.markers: dict[tuple[str, int], Marker] = {}
        for (topic, part), prog in proc.progress.items():
            if not prog.consumed:
                continue
            nxt = max(max(prog.consumed) + 1, prog.marker.next)
            done = [r for r in (prog.marker.done or []) if r[1] >= nxt]
            self.markers[(topic, part)] = Marker(nxt, done)
        self.generation = fencing.generation(proc.consumer)

    def empty(self) -> bool:
        return not self.markers and not self.proc.lake.rows

    def commit(self) -> bool:
        """Flush, produce, commit. False when there was nothing to do or the store fenced it."""
        proc = self.proc
        if self.empty():
            return False
        t0 = time.perf_counter()
        try:                                                     # 1. flush: the store, one transaction
            rows = proc.lake.flush(self)
        except Fenced as e:         # another processor owns a partition now: store nothing
            fencing.fenced(proc, e)
            return False
        proc.metrics.flush_seconds.observe(time.perf_counter() - t0)
        for k, n in rows.items():
            proc.metrics.records_out.labels(k).inc(n)
        for key, m in self.markers.items():
            prog = proc.progress[key]
            prog.marker = m
            prog.consumed = []
        for s in proc.sinks.sinks:                               # 2. produce: what was sent is delivered
            if s is not proc.lake:
                try:
                    s.flush(self)
                except Exception:  # noqa: BLE001 - a sink never stops the checkpoint
                    log.exception("flushing sink %s", type(s).__name__)
        self._commit_offsets()                                   # 3. commit: the offsets to Kafka
        proc.t_last_flush = time.time()
        proc.cpu_last_flush = time.process_time()
        proc.metrics.last_flush.set(proc.t_last_flush)
        return True

    def _commit_offsets(self) -> None:
        consumer = self.proc.consumer
        if not self.markers or consumer is None:
            return
        from kafka.structs import OffsetAndMetadata, TopicPartition
        commits = {TopicPartition(topic, part): OffsetAndMetadata(m.next, "", -1)
                   for (topic, part), m in self.markers.items()}
        try:
            consumer.commit(commits)
        except Exception as e:  # noqa: BLE001 - the store's markers are the truth; Kafka's commit is advisory
            log.warning("offset commit failed (store markers stay authoritative): %s", e)

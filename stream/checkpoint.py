"""The processor's checkpoint: flush -> produce -> commit, in the manner of quix-streams' ``Checkpoint``.

Every ``flush_interval_s`` (or ``max_buffer_rows``), on a rebalance and at close, the processor makes one
:class:`Checkpoint` of what it consumed since the last one and calls :meth:`Checkpoint.commit`, which
orders its sinks (:mod:`stepwatch.stream.sinks`):

1. **flush** — the store (:class:`~stepwatch.stream.sinks.LakeSink`): the buffered rows and the consumed
   positions (``markers``: next offset and the ranges already done per partition, with the consumer-group
   generation) in ONE DuckLake transaction (:meth:`stepwatch.storage.store.LakeStore.write_flush`). This
   is the truth: exactly-once in the store, an older generation fenced (then nothing is stored, the
   buffers and the jobs' state are dropped and the partitions re-read: :meth:`stepwatch.stream.fencing.Fencing.fenced`,
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
    """What the processor consumed since its last checkpoint, and the ordered commit of it (see the
    module docs). Its collaborators are passed in, as quix-streams' ``Checkpoint(producer, consumer,
    sinks)``: ``progress`` ((topic, partition) -> :class:`PartitionProgress`, updated once stored), the
    ``consumer`` (its generation, the advisory commit; None without a group), the ``lake`` sink (flushed
    first), the other ``sinks`` (flushed after it), the processor's ``metrics``, and ``on_fenced(e)``
    (the store refused the flush: :meth:`stepwatch.stream.fencing.Fencing.fenced`).

    ``markers``: (topic, partition) -> the :class:`Marker` to store; ``generation``: the consumer
    group's generation the store checks them against; ``committed_at``: (wall time, process CPU time)
    once committed."""

    def __init__(self, progress: dict, consumer, lake, sinks, metrics, on_fenced):
        self.progress = progress
        self.consumer = consumer
        self.lake = lake
        self.sinks = list(sinks)
        self.metrics = metrics
        self.on_fenced = on_fenced
        self.committed_at: tuple[float, float] | None = None
        self.markers: dict[tuple[str, int], Marker] = {}
        for (topic, part), prog in progress.items():
            if not prog.consumed:
                continue
            nxt = max(max(prog.consumed) + 1, prog.marker.next)
            done = [r for r in (prog.marker.done or []) if r[1] >= nxt]
            self.markers[(topic, part)] = Marker(nxt, done)
        self.generation = fencing.generation(consumer)

    def empty(self) -> bool:
        return not self.markers and not self.lake.rows

    def commit(self) -> bool:
        """Flush, produce, commit. False when there was nothing to do or the store fenced it."""
        if self.empty():
            return False
        t0 = time.perf_counter()
        try:                                                     # 1. flush: the store, one transaction
            rows = self.lake.flush(self)
        except Fenced as e:         # another processor owns a partition now: store nothing
            self.on_fenced(e)
            return False
        self.metrics.flush_seconds.observe(time.perf_counter() - t0)
        for k, n in rows.items():
            self.metrics.records_out.labels(k).inc(n)
        for key, m in self.markers.items():
            prog = self.progress[key]
            prog.marker = m
            prog.consumed = []
        for s in self.sinks:                                     # 2. produce: what was sent is delivered
            if s is not self.lake:
                try:
                    s.flush(self)
                except Exception:  # noqa: BLE001 - a sink never stops the checkpoint
                    log.exception("flushing sink %s", type(s).__name__)
        self._commit_offsets()                                   # 3. commit: the offsets to Kafka
        self.committed_at = (time.time(), time.process_time())
        self.metrics.last_flush.set(self.committed_at[0])
        return True

    def _commit_offsets(self) -> None:
        consumer = self.consumer
        if not self.markers or consumer is None:
            return
        from kafka.structs import OffsetAndMetadata, TopicPartition
        commits = {TopicPartition(topic, part): OffsetAndMetadata(m.next, "", -1)
                   for (topic, part), m in self.markers.items()}
        try:
            consumer.commit(commits)
        except Exception as e:  # noqa: BLE001 - the store's markers are the truth; Kafka's commit is advisory
            log.warning("offset commit failed (store markers stay authoritative): %s", e)

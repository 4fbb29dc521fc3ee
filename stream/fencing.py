"""The processor's side of exactly-once: its consumer-group generation, and what it does when the
lake fences it (see :mod:`stepwatch.storage.store`).

A processor whose generation is older than the one stored for a partition no longer owns it: the
group moved on (it was paused past the session timeout, or lost its membership) and the new owner
already claimed the partition. Its flush was rejected whole, so nothing it buffered is stored; it
drops the buffers and the jobs' detector state (rebuilt from the store later), stops fetching the
partitions it lost, and rewinds the others to their stored positions. The consumer rejoins the group
on its next poll and gets a fresh assignment.
"""
from __future__ import annotations

import logging

log = logging.getLogger("stepwatch.processor")


def generation(consumer) -> int | None:
    """The consumer's group generation: -1 once it has lost its membership (such a commit is then
    fenced by any claimed partition); None without a group consumer (tests, benchmarks)."""
    coord = getattr(consumer, "_coordinator", None)
    gen = getattr(coord, "_generation", None)
    g = getattr(gen, "generation_id", None)
    return int(g) if isinstance(g, int) else None


def member(consumer) -> str:
    """The consumer's member id in its group (recorded with the offsets it commits)."""
    gen = getattr(getattr(consumer, "_coordinator", None), "_generation", None)
    return str(getattr(gen, "member_id", "") or "")


class Fencing:
    """What the processor does when the group or the lake says it no longer owns partitions. Its
    collaborators are passed in: the ``lake`` sink (its buffers), ``jobs`` (job -> runtime: their
    detector state saw rows that are not stored), ``progress`` ((topic, partition) ->
    :class:`~stepwatch.stream.checkpoint.PartitionProgress`), ``read_to`` ((topic, partition) -> the next
    offset handled: the read-to-end proof, :class:`~stepwatch.stream.caughtup.CaughtUp`), the ``store``
    (the stored positions) and ``consumer`` (a callable: the consumer exists once the processor starts).
    The dicts are the processor's own, changed in place."""

    def __init__(self, *, lake, jobs: dict, progress: dict, read_to: dict, store, consumer):
        self.lake, self.jobs, self.progress, self.read_to = lake, jobs, progress, read_to
        self.store, self.consumer = store, consumer

    def drop_buffers(self) -> None:
        self.lake.drop()           # the store sink's buffers (stream.sinks.LakeSink)
        self.jobs.clear()          # detector state saw rows that are not stored: rebuild it from the store

    def lost(self, partitions) -> None:
        """``on_partitions_lost``: the group already gave these partitions to others; do not commit."""
        log.warning("lost %d partitions (membership expired): dropping %d buffered rows, no commit",
                    len(partitions), self.lake.rows)
        self.drop_buffers()
        for tp in partitions:
            self.progress.pop((tp.topic, tp.partition), None)
            self.read_to.pop((tp.topic, tp.partition), None)

    def fenced(self, e) -> None:
        """A flush was rejected by the lake (:class:`~stepwatch.storage.store.Fenced`)."""
        log.warning("%s: dropping %d buffered rows; re-reading from the stored positions", e, self.lake.rows)
        self.drop_buffers()
        consumer = self.consumer()
        from kafka.structs import TopicPartition
        for (topic, part), prog in list(self.progress.items()):
            tp = TopicPartition(topic, part)
            self.read_to.pop((topic, part), None)        # read again from the stored position: no proof
            if (topic, part) in e.partitions:
                self.progress.pop((topic, part), None)
                if consumer is not None:
                    consumer.pause(tp)
                continue
            prog.consumed = []
            m = self.store.load_marker(topic, part)
            if consumer is not None and m is not None:
                consumer.seek(tp, m.next)
            if m is not None:
                prog.marker = m

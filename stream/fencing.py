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


def drop_buffers(proc) -> None:
    proc.lake.drop()           # the store sink's buffers (stream.sinks.LakeSink)
    proc.jobs.clear()          # detector state saw rows that are not stored: rebuild it from the store


def lost(proc, partitions) -> None:
    """``on_partitions_lost``: the group already gave these partitions to others; do not commit."""
    log.warning("lost %d partitions (membership expired): dropping %d buffered rows, no commit",
                len(partitions), proc.lake.rows)
    drop_buffers(proc)
    for tp in partitions:
        proc.progress.pop((tp.topic, tp.partition), None)
        proc._read_to.pop((tp.topic, tp.partition), None)


def fenced(proc, e) -> None:
    """A flush was rejected by the lake (:class:`~stepwatch.storage.store.Fenced`)."""
    log.warning("%s: dropping %d buffered rows; re-reading from the stored positions", e, proc.lake.rows)
    drop_buffers(proc)
    consumer = proc.consumer
    from kafka.structs import TopicPartition
    for (topic, part), prog in list(proc.progress.items()):
        tp = TopicPartition(topic, part)
        proc._read_to.pop((topic, part), None)        # read again from the stored position: no proof
        if (topic, part) in e.partitions:
            proc.progress.pop((topic, part), None)
            if consumer is not None:
                consumer.pause(tp)
            continue
        prog.consumed = []
        m = proc.store.load_marker(topic, part)
        if consumer is not None and m is not None:
            consumer.seek(tp, m.next)
        if m is not None:
            prog.marker = m

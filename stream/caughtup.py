"""Where the processor's consumer stands (:class:`CaughtUp`, an object the
:class:`~stepwatch.stream.processor.Processor` holds as ``caught``): whether a job's sources have been read to their end (the proof a silence judged on event time
needs: docs/detectors.md, stall; and the host samples an alert waits for: :mod:`stepwatch.stream.hostwait`),
and the consumer lag per partition (metrics, and ``ctx.backlog`` for the detectors).

Without a consumer (rows handed over in order: tests, the eval) a source counts as read to its end, or as
``hook(topic, partition)`` says.
"""
from __future__ import annotations

import time


class CaughtUp:
    """Read-to-end proofs and the consumer lag (see the module docs). Built by the processor with its
    ``kafka`` settings (the topics' names), its ``metrics`` (the lag gauges) and ``consumer`` (a callable:
    the consumer exists once the processor starts; None without one). It keeps ``read_to``
    ((topic, partition) -> the next offset after the last message handled, set by the processor's poll
    and dropped on a rebalance or fencing), ``lag_by_tp`` (the consumer lag per partition at the last
    flush) and ``hook`` ((topic, partition) -> read to its end?, or None: ask the consumer)."""

    def __init__(self, kafka, metrics, consumer):
        self.kafka, self.metrics, self._consumer = kafka, metrics, consumer
        self.hook = None
        self.polled_at = 0.0        # monotonic time of the poll whose records are being handled
        self.read_to: dict[tuple[str, int], int] = {}
        self.lag_by_tp: dict[tuple[str, int], int] = {}
        self._cache: dict[tuple[str, int], tuple[float, float]] = {}

    @property
    def consumer(self):
        return self._consumer()

    def caught_up(self, rt) -> bool:
        """The job's steps read to their end (:meth:`steps_caught_up`) and the in-flight states too: a
        step that is long by design (evaluation, checkpoint) is known so only from them. The proof of a
        hang: the broker's end offsets it compares with were asked after the poll that brought the host
        sample being judged (:attr:`polled_at`), never from the 0.5 s cache alone — a goodbye produced
        just before that sample is then in them. Seen replaying an agent's spool, where a job's whole
        end arrives within a second: a `job_hang` at a clean job's end in 1 replay of 2, its goodbye
        produced within the cached end offset's age. At most one round trip per poll and partition."""
        if not self.steps_caught_up(rt, fresh=True):
            return False
        topic = self.kafka.topic("inflight")
        if self.hook is not None:
            return bool(self.hook(topic, None))
        if self.consumer is None:
            return True
        # the job's in-flight partition read to its end too: a rank's goodbye (or the agent's word that it
        # is gone) can sit there unread while the host samples that move event time were read; during a
        # hang the watchdogs write it every few seconds, so this only delays a hang until a poll has read
        # what was there (it is asked again at every host batch)
        part = getattr(rt, "inflight_partition", None)
        if part is None:
            part = rt.steps_partition                      # the same key: the same partition where the
        if part is None:                                   # topics have as many partitions
            return True
        try:
            from kafka.structs import TopicPartition
            if TopicPartition(topic, part) not in self.consumer.assignment():
                return True                                # another processor's: nothing to wait for here
        except Exception:  # noqa: BLE001
            return True
        return self.tp_caught_up(topic, part, fresh=True)

    def steps_caught_up(self, rt, fresh: bool = False) -> bool:
        """Whether the job's steps partition has been read to its end: it is assigned and not paused, and
        the messages handled reach the broker's end offset (asked at most every 0.5 s per partition) and
        the high watermark of the last fetch. The proof a silence judged on event time needs
        (docs/detectors.md, stall). Without a consumer (rows handed over in order) it is taken as yes. A job
        whose steps this processor has not read since it started (rebuilt from the store) needs every steps
        partition it is assigned read to its end."""
        topic, part = self.kafka.topic("steps"), rt.steps_partition
        if part is None:
            if self.consumer is None:
                return self.hook is None or all(
                    self.hook(topic, p) for (t, p) in list(self.read_to) if t == topic)
            try:
                parts = [tp.partition for tp in self.consumer.assignment() if tp.topic == topic]
            except Exception:  # noqa: BLE001
                return False
            return bool(parts) and all(self.tp_caught_up(topic, p, fresh) for p in parts)
        if self.hook is not None:
            return bool(self.hook(topic, part))
        if self.consumer is None:
            return True
        return self.tp_caught_up(topic, part, fresh)

    def all_caught_up(self) -> bool:
        """Every partition assigned is read to its end (and there is one). Without a consumer: yes."""
        if self.consumer is None:
            return True
        try:
            tps = list(self.consumer.assignment())
        except Exception:  # noqa: BLE001
            return False
        return bool(tps) and all(self.tp_caught_up(tp.topic, tp.partition) for tp in tps)

    def tp_caught_up(self, topic: str, part: int, fresh: bool = False) -> bool:
        from kafka.structs import TopicPartition
        tp = TopicPartition(topic, part)
        try:
            if tp in self.consumer.paused() or tp not in self.consumer.assignment():
                return False                               # not being read: no proof
            # what was handled (the consumer's position runs ahead by the records of the current poll)
            pos = self.read_to.get((topic, part))
            if pos is None:
                pos = self.consumer.position(tp)
            now = time.monotonic()
            hit = self._cache.get((topic, part))
            if hit is None or now - hit[0] >= 0.5 or fresh and hit[0] < self.polled_at:
                # the broker's end offset, at most every 0.5 s (fresh: asked after the current poll)
                hit = (now, self.consumer.end_offsets([tp])[tp])
                self._cache[(topic, part)] = hit
            # the high watermark of the last fetch too (some brokers answer ListOffsets with less)
            return pos >= max(hit[1], self.consumer.highwater(tp) or 0)
        except Exception:  # noqa: BLE001 - unknown (e.g. the partition is not ours): no proof
            return False

    def host_caught_up(self, rt) -> bool:
        """Whether the job's host partition (or, before its first host row, every host partition this
        processor reads) is read to its end (stream/hostwait.py). Without a consumer: yes."""
        topic = self.kafka.topic("host")
        if self.hook is not None:
            return bool(self.hook(topic, rt.host_partition))
        if self.consumer is None:
            return True
        if rt.host_partition is not None:
            return self.tp_caught_up(topic, rt.host_partition)
        try:
            parts = [tp.partition for tp in self.consumer.assignment() if tp.topic == topic]
        except Exception:  # noqa: BLE001
            return False
        return bool(parts) and all(self.tp_caught_up(topic, p) for p in parts)

    def update_lag(self) -> None:
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
            self.lag_by_tp[(tp.topic, tp.partition)] = lag
            total += lag
            self.metrics.lag.labels(tp.topic, str(tp.partition)).set(lag)
        self.metrics.total_lag = total

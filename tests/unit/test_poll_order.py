"""What a poll brought but the processor has not handled yet proves nothing: the job-hang proof
(``CaughtUp.caught_up``) compares what was *handled* with the broker's end offsets. A goodbye fetched in
the same poll as a host sample 30 s past the job's last step used to count as read (the consumer's position
runs ahead by the whole poll) while the host sample was judged first: replaying a GPU run's spool, a clean
1-rank job got a job_hang at its normal end in 2 replays of 4. Now each partition of a poll counts as
handled up to its first record until its records are handled, and the in-flight states are handled before
the host samples."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from kafka.structs import TopicPartition

from stepwatch.kafkaio import KafkaSettings
from stepwatch.stream.processor import Processor

pytestmark = pytest.mark.unit


def test_a_goodbye_fetched_with_a_host_sample_is_unread_until_handled_and_handled_first(tmp_path):
    kafka = KafkaSettings()
    p = Processor(kafka, tmp_path, on_alert=lambda a: None, profiling=None)
    host, infl = TopicPartition(kafka.topic("host"), 0), TopicPartition(kafka.topic("inflight"), 0)
    p.caught.read_to[(infl.topic, 0)] = 3                     # handled before: offsets 0-2

    def msg(tp, off):
        return SimpleNamespace(topic=tp.topic, partition=tp.partition, offset=off, key=b"j", value=b"",
                               headers=[])

    records = {host: [msg(host, 40), msg(host, 41)], infl: [msg(infl, 3), msg(infl, 4)]}
    p.consumer = SimpleNamespace(poll=lambda **kw: records)
    seen = []
    p.process_message = lambda m: seen.append((m.topic, m.offset, p.caught.read_to.get((infl.topic, 0)),
                                               p.caught.read_to.get((host.topic, 0))))
    try:
        assert p.poll_once() == 4
    finally:
        p.consumer = None
        p.close()
    assert [s[:2] for s in seen] == [(infl.topic, 3), (infl.topic, 4), (host.topic, 40), (host.topic, 41)]
    # while the first in-flight record is handled, neither partition counts this poll's records as read
    assert seen[0][2:] == (4, 40)
    # once the goodbyes are handled, a host sample judged sees them read
    assert seen[2][2] == 5

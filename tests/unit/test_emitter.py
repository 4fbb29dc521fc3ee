"""The processor's alert stage (stream/emitter.py) as the processor runs it, fed as its consumer loop
feeds it (no broker): what it keeps in memory of the alerts it emitted is bounded (issue 29)."""
from __future__ import annotations

from stepwatch.detectors.base import Alert, Detector
from stepwatch.devtools.eval import Record
from stepwatch.devtools.simulate import Simulation
from stepwatch.kafkaio import KafkaSettings
from stepwatch.stream.processor import Processor
from stepwatch.wire.catalog import headers
from stepwatch.wire.encode import encode_arrow

import pytest
pytestmark = pytest.mark.unit

S = 1_000_000_000


class Chatty(Detector):
    """Twelve distinct firing alerts for every step it sees."""
    name = "chatty"

    def __init__(self, **kw):
        self._bind(kw)

    def update(self, ctx, block):
        return [Alert(job=ctx.job, kind="chatty", status="firing", step_first=int(s), step_detected=int(s),
                      t_detected=0, alert_id=f"chatty-{int(s)}-{i}") for s in block.steps for i in range(12)]


def test_the_alerts_held_in_memory_are_the_newest_1024_and_the_count_stays_true(tmp_path):
    """``Processor.alerts`` held every alert emitted since the start (a chatty job over weeks: without
    bound); it holds the newest 1,024, as ``events`` does, and ``stats()['alerts']`` still counts all."""
    seen = []
    p = Processor(KafkaSettings(), tmp_path, on_alert=seen.append, profiling=None, create_topics=False)
    sim = Simulation(job="ch", ranks=2, ranks_per_node=2, steps=120, step_ms=100.0, seed=3,
                     t0_ns=1_767_225_600 * S)
    off = iter(range(10**6))

    def send(kind, t):
        p.process_message(Record(p.kafka.topic(kind), 0, next(off), b"ch", encode_arrow(t), headers(kind)))

    send("topology", sim.topology())
    p.apply_settings({}, None, detectors=lambda job, current: [Chatty()])
    for a in range(0, 120, 10):
        send("steps", sim.generate(a, a + 10)["steps"])
    assert len(seen) > 1200, len(seen)                  # every alert reached the sinks
    assert len(p.alerts) == 1024
    assert [a.alert_id for a in p.alerts] == [a.alert_id for a in seen[-1024:]]
    assert p.stats()["alerts"] == len(seen)

"""The processor's outputs as sinks and its checkpoint (stream/sinks.py, stream/checkpoint.py), through the
real broker and a real lake: every checkpoint stores first (rows + offsets, one transaction), then waits for
the alerts topic's delivery, then commits the offsets to Kafka; an alert reaches the topic, the console
callback and an attached notifier, and is stored once."""
from __future__ import annotations

import threading
import time

import pyarrow as pa

from stepwatch.wire import catalog
from stepwatch.devtools.simsend import send_simulation
from stepwatch.devtools.simulate import Simulation
from stepwatch.storage.views import connect
from stepwatch.stream.alertfanout import attach
from stepwatch.kafkaio import make_consumer, make_producer
from stepwatch.stream.processor import Processor
from stepwatch.stream.sinks import ConsoleSink, LakeSink, NotifierSink, TopicSink

import pytest
pytestmark = pytest.mark.integration


class Recorded(Processor):
    """The real processor; the real store, producer and consumer, each call noted before it is made."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[str] = []
        self._note(self.store, "write_flush", "store")

    def _note(self, obj, name, label):
        real = getattr(obj, name)

        def noted(*a, **kw):
            self.calls.append(label)
            return real(*a, **kw)
        setattr(obj, name, noted)

    def start(self):
        super().start()
        self._note(self.producer, "flush", "produce")
        self._note(self.consumer, "commit", "commit")

    def close(self):
        self.calls.append("close")                  # its last checkpoint, then the producer's own flush
        super().close()


class Notifier:
    """A notifier as the dashboards' sinks are (submit never blocks; restore optional)."""

    def __init__(self):
        self.got = []

    def submit(self, a):
        self.got.append(a)


def test_checkpoint_stores_then_produces_then_commits_and_every_sink_gets_the_alert(kafka, tmp_path):
    sim = Simulation(job="snk", ranks=64, steps=120, seed=4, faults=["slow-rank:rank=9,pct=40,start=30"])
    prod = make_producer(kafka)
    sent = send_simulation(sim, prod, kafka, rows_per_message=640)
    prod.close()
    proc = Recorded(kafka, tmp_path, group="g-sinks", flush_interval_s=0.3, profiling=None)
    console, notifier = [], Notifier()
    attach(proc, [notifier], echo=console.append)
    assert [type(s) for s in proc.sinks.sinks] == [LakeSink, TopicSink, ConsoleSink, NotifierSink]
    stop = threading.Event()
    th = threading.Thread(target=proc.run, kwargs={"stop_event": stop}, daemon=True)
    th.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
            proc.metrics.value(proc.metrics.records_out, "steps") >= sent["steps"]
            and proc.metrics.value(proc.metrics.records_out, "alerts") >= 1):
        time.sleep(0.2)
    stop.set()
    th.join(30)
    assert not th.is_alive()
    assert proc.metrics.value(proc.metrics.records_out, "steps") == sent["steps"]
    fired = [a for a in proc.alerts if a.kind == "slow_rank" and a.status == "firing"]
    assert len(fired) == 1 and fired[0].ranks == [9]
    # every sink got it: the console callback, the notifier, the alerts topic; the store holds it once
    assert [a.alert_id for a in console if a.kind == "slow_rank"] == [fired[0].alert_id]
    assert [a.alert_id for a in notifier.got if a.kind == "slow_rank"] == [fired[0].alert_id]
    con = connect(tmp_path)
    assert con.execute("SELECT count(*) FROM alerts WHERE alert_id = ? AND status = 'firing'",
                       [fired[0].alert_id]).fetchone()[0] == 1
    con.close()
    c = make_consumer(kafka, "g-sinks-read")
    c.subscribe([kafka.topic("alerts")])
    ids, deadline = [], time.monotonic() + 30
    while not ids and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=500).values():
            for r in recs:
                assert dict(r.headers) == {"content-type": catalog.ARROW_CT.encode(), "schema": b"alerts/1"}
                t = pa.ipc.open_stream(r.value).read_all()
                ids += [x for x, k in zip(t.column("alert_id").to_pylist(), t.column("kind").to_pylist())
                        if k == "slow_rank"]
    c.close()
    assert ids == [fired[0].alert_id]
    # the checkpoints: each stores first; the producer's delivery is awaited only after a store (the
    # alert's checkpoint) and before that checkpoint's Kafka commit
    calls = proc.calls
    assert calls[0] == "store" and "produce" in calls and "commit" in calls and "close" in calls
    for i, c in enumerate(calls[:calls.index("close")]):
        if c == "produce":
            assert calls[i - 1] == "store" and calls[i + 1] == "commit", calls
    first = calls.index("produce")                       # the alert's checkpoint
    assert first < calls.index("close") and calls[first - 1:first + 2] == ["store", "produce", "commit"], calls


def test_a_detector_row_output_goes_to_the_table_it_declares(tmp_path):
    """The processor reads Detector.outputs: rows a detector hands out go to the declared table; rows of an
    undeclared output are refused (the message is deadlettered, not stored under a guessed name)."""
    from stepwatch.detectors.base import Detector
    from stepwatch.detectors.replay import drain
    from stepwatch.kafkaio import KafkaSettings

    class Writes(Detector):
        name = "writes"
        outputs = {"alerts": "alerts", "eff": "efficiency"}

        def __init__(self, out="eff"):
            self.out, self.pending = out, None

        def update(self, ctx, block):
            self.pending = pa.table({"job": ["j"], "step": pa.array([int(block.steps[-1])], pa.int64()),
                                     "t_end": pa.array([int(block.t_end[-1])], pa.timestamp("ns", "UTC"))})
            return []

        def drain_rows(self):
            t, self.pending = self.pending, None
            return {self.out: t} if t is not None else {}

    p = Processor(KafkaSettings(), tmp_path, on_alert=lambda a: None, profiling=None, create_topics=False)
    sim = Simulation(job="j", ranks=8, steps=12, seed=1)
    rt = p._job("j")
    rt.state.set_topology(sim.topology())
    rt.detectors = [Writes()]
    _, blocks = rt.state.ingest(sim.generate(0, 12)["steps"])
    blocks += rt.state.close_ready(force=True)
    p._detect(rt, blocks)
    assert sum(t.num_rows for t in p.lake.buffers["efficiency"]) == len([b for b in blocks if len(b)]) > 0
    bad = Writes(out="nope")
    bad.update(None, blocks[0])
    try:
        drain(bad)
    except ValueError as e:
        assert "nope" in str(e) and "does not declare" in str(e)
    else:
        raise AssertionError("an undeclared output was accepted")

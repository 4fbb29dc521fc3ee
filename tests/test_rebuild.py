"""A processor that meets a job for the first time rebuilds its detector state from the store."""
import pyarrow as pa

from stepwatch import schema as wire
from stepwatch.devtools.simulate import Simulation
from stepwatch.storage.store import ParquetStore
from stepwatch.kafkaio import KafkaSettings
from stepwatch.stream.processor import Processor


def test_rebuild_replays_window_and_does_not_repeat_stored_alerts(tmp_path):
    sim = Simulation(job="rb", ranks=128, steps=300, seed=5, faults=["slow-rank:rank=100,pct=30,start=40"])
    st = ParquetStore(tmp_path).init()
    g = sim.generate(0, 70)
    st.write_flush({"topology": [sim.topology()], "steps": [g["steps"]]}, {})

    # first processor: replays the stored steps, finds the straggler (not stored yet) and reports it
    seen = []
    p1 = Processor(KafkaSettings(), tmp_path, on_alert=seen.append)
    rt = p1._job("rb")
    assert rt.state.world_size == 128 and rt.state.max_step == 69
    assert [(a.kind, a.ranks, a.step_first) for a in seen] == [("slow_rank", [100], 40)]
    st.write_flush({"alerts": list(p1.buffers["alerts"])}, {})

    # second processor (restart / partition moved): same replay, but the alert is already stored
    seen2 = []
    p2 = Processor(KafkaSettings(), tmp_path, on_alert=seen2.append)
    rt2 = p2._job("rb")
    assert seen2 == []
    assert (seen[0].alert_id, "firing") in rt2.alerts_seen
    # and it carries on: the live stream after the stored window does not re-fire either
    res, blocks = rt2.state.ingest(sim.generate(70, 90)["steps"])
    p2._detect(rt2, blocks)
    assert res.keep.all() and seen2 == []

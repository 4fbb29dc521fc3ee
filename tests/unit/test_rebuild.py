"""A processor that meets a job for the first time rebuilds its detector state from the store."""
import pyarrow as pa

from stepwatch.devtools.simulate import Simulation
from stepwatch.storage.store import LakeStore
from stepwatch.kafkaio import KafkaSettings
from stepwatch.stream.processor import Processor

import pytest
pytestmark = pytest.mark.unit


def test_rebuild_replays_window_and_does_not_repeat_stored_alerts(tmp_path):
    sim = Simulation(job="rb", ranks=128, steps=300, seed=5, faults=["slow-rank:rank=100,pct=30,start=40"])
    st = LakeStore(tmp_path).init()
    g = sim.generate(0, 70)
    st.write_flush({"topology": [sim.topology()], "steps": [g["steps"]]}, {})

    # first processor: replays the stored steps, finds the straggler (not stored yet) and reports it
    seen = []
    p1 = Processor(KafkaSettings(), tmp_path, on_alert=seen.append)
    rt = p1._job("rb")
    assert rt.state.world_size == 128 and rt.state.max_step == 69
    assert [(a.kind, a.ranks, a.step_first) for a in seen] == [("slow_rank", [100], 40)]
    st.write_flush({"alerts": list(p1.lake.buffers["alerts"])}, {})

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


def test_rebuild_hands_the_stored_open_alerts_to_the_jobs_detectors(tmp_path, monkeypatch):
    """What began before the replay window is known to the fresh detectors only from the store's open
    alerts: the rebuild hands them over before it replays (ChangePoint uses them to report a recovery)."""
    from stepwatch.detectors.changepoint import ChangePoint
    sim = Simulation(job="rb2", ranks=128, steps=300, seed=5, faults=["slow-rank:rank=100,pct=30,start=40"])
    st = LakeStore(tmp_path).init()
    st.write_flush({"topology": [sim.topology()], "steps": [sim.generate(0, 70)["steps"]]}, {})
    p1 = Processor(KafkaSettings(), tmp_path)
    p1._job("rb2")
    st.write_flush({"alerts": list(p1.lake.buffers["alerts"])}, {})
    stored = [r["alert_id"] for t in p1.lake.buffers["alerts"] for r in t.to_pylist()]
    handed = []
    orig = ChangePoint.restore_open
    monkeypatch.setattr(ChangePoint, "restore_open", lambda self, alerts: (handed.append(list(alerts)),
                                                                           orig(self, alerts))[1])
    Processor(KafkaSettings(), tmp_path)._job("rb2")
    assert len(handed) == 1 and [(a.kind, a.ranks, a.step_first) for a in handed[0]] == [("slow_rank", [100], 40)]
    assert [a.alert_id for a in handed[0]] == stored

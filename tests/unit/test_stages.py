"""The processor's stages work from the collaborators they are built with, without a processor
(issue 29 item 2): a checkpoint fenced by the lake hands the error to the fencing stage, which drops
the buffers and the jobs and stops reading the lost partition; the next owner's checkpoint stores
the rows with their offsets and commits them to its consumer."""
import logging
from types import SimpleNamespace

from stepwatch.devtools.simulate import Simulation
from stepwatch.storage.store import LakeStore, Marker
from stepwatch.stream import ingress
from stepwatch.stream.ingress_limits import IngressLimits
from stepwatch.stream.checkpoint import Checkpoint, PartitionProgress
from stepwatch.stream.fencing import Fencing
from stepwatch.stream.processor_metrics import ProcessorMetrics
from stepwatch.stream.sinks import LakeSink, Rows

import pytest
pytestmark = pytest.mark.unit


class Consumer:
    """What a checkpoint and fencing ask of a kafka-python consumer: its group generation, pause,
    seek, commit (recorded)."""

    def __init__(self, generation):
        self._coordinator = SimpleNamespace(_generation=SimpleNamespace(generation_id=generation, member_id="m"))
        self.calls = []

    def pause(self, *tps):
        self.calls.append(("pause", [(tp.topic, tp.partition) for tp in tps]))

    def seek(self, tp, off):
        self.calls.append(("seek", (tp.topic, tp.partition), off))

    def commit(self, offsets):
        self.calls.append(("commit", {(tp.topic, tp.partition): o.offset for tp, o in offsets.items()}))


def test_a_fenced_checkpoint_and_the_next_owners_one_from_their_collaborators_alone(tmp_path):
    store = LakeStore(tmp_path).init()
    metrics = ProcessorMetrics()
    lake = LakeSink(store, metrics, IngressLimits(), ingress.RateLimitedLog(logging.getLogger("t"), 10))
    store.claim([("t", 0)], 5)                          # generation 5 owns the partition now
    topo = Simulation(job="st", ranks=4, steps=2, seed=1).topology()

    old = Consumer(4)
    progress = {("t", 0): PartitionProgress(Marker(-1), consumed=[0, 1, 2])}
    jobs, read_to = {"st": object()}, {("t", 0): 3}
    fencing = Fencing(lake=lake, jobs=jobs, progress=progress, read_to=read_to, store=store, consumer=lambda: old)
    lake.write(Rows("topology", topo, ("t", 0, 2)))
    assert Checkpoint(progress, old, lake, [], metrics, fencing.fenced).commit() is False
    assert (lake.rows, jobs, progress, read_to) == (0, {}, {}, {})
    assert old.calls == [("pause", [("t", 0)])]         # never committed
    assert (store.load_marker("t", 0) or Marker(-1)).next == -1   # nothing stored

    new = Consumer(5)
    progress[("t", 0)] = PartitionProgress(Marker(-1), consumed=[0, 1, 2])
    lake.write(Rows("topology", topo, ("t", 0, 2)))
    cp = Checkpoint(progress, new, lake, [], metrics, fencing.fenced)
    assert cp.commit() is True and cp.committed_at is not None
    assert store.load_marker("t", 0).next == 3 and progress[("t", 0)].consumed == [] and lake.rows == 0
    assert new.calls == [("commit", {("t", 0): 3})]
    assert metrics.value(metrics.records_out, "topology") == topo.num_rows

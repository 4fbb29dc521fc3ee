"""Detector.prepare: the job's width known from its topology before its first step (issue 28 item 2). The
per-rank state of ``slow_rank`` and ``dataloader`` is allocated (and its pages faulted in) there, once per
job, not on the first step; the alerts are those of a detector that allocated on its first step, and the
processor calls it when every declared rank of a job has its column."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from stepwatch.detectors.dataloader import DataLoader
from stepwatch.detectors.slowrank import SlowRank
from stepwatch.devtools.eval import Record, _NullProducer
from stepwatch.devtools.simulate import Simulation
from stepwatch.kafkaio import KafkaSettings
from stepwatch.stream.processor import Processor
from stepwatch.wire.catalog import headers
from stepwatch.wire.encode import encode_arrow
from testkit import make_block, make_ctx

pytestmark = pytest.mark.unit


def _blocks(R: int, S: int = 120):
    """Steps of an R-rank job whose rank 13 is 20% slow from step 40, one step a block (as the
    processor's live loop hands them), with DataLoader queue depths that empty on rank 3 from step 30."""
    rng = np.random.default_rng(4)
    comp = 100.0 * (1.0 + 0.01 * rng.standard_normal((S, R)))
    comp[40:, 13] *= 1.2
    q = np.full((S, R), 4.0, dtype=np.float32)
    q[30:, 3] = 0.0
    data = np.full((S, R), 5.0)
    data[30:, 3] = 60.0
    for s in range(S):
        b = make_block([s], comp[s:s + 1], data=data[s:s + 1])
        yield dataclasses.replace(b, data_queue=q[s:s + 1])


def _run(det, ctx, R, prepare: bool):
    if prepare:
        det.prepare(ctx)
    alerts = []
    for b in _blocks(R):
        alerts += det.update(ctx, b)
    return [repr(a) for a in alerts]


@pytest.mark.parametrize("cls", [SlowRank, DataLoader])
def test_prepare_allocates_for_the_width_and_changes_no_alert(cls):
    R = 64
    ctx = make_ctx(R)
    det = cls()
    det.prepare(ctx)
    ring = det._flag if cls is SlowRank else det._q
    assert det._R == R and ring.shape[1] == R
    first = next(iter(_blocks(R)))
    det.update(ctx, first)
    assert (det._flag if cls is SlowRank else det._q) is ring          # the first step kept what prepare made
    want = _run(cls(), ctx, R, prepare=False)
    assert any("firing" in a for a in want)
    assert _run(cls(), ctx, R, prepare=True) == want
    # a prepare after a block of the job changes nothing (its width is the block's)
    det2 = cls()
    det2.update(ctx, first)
    kept = det2._flag if cls is SlowRank else det2._q
    det2.prepare(make_ctx(2 * R))
    assert det2._R == R and (det2._flag if cls is SlowRank else det2._q) is kept


def test_processor_prepares_detectors_when_the_topology_is_complete(tmp_path):
    job, R = "prep-job", 16
    sim = Simulation(job=job, ranks=R, ranks_per_node=4, steps=8, step_ms=100.0, seed=3, t0_ns=1_767_225_600 * 10**9)
    kafka = KafkaSettings(prefix="prep.")
    p = Processor(kafka, tmp_path, flush_interval_s=1e9, create_topics=False)
    p.producer = _NullProducer()
    off = {}

    def send(kind, t):
        o = off[kind] = off.get(kind, -1) + 1
        p.process_message(Record(kafka.topic(kind), 0, o, job.encode(), encode_arrow(t), headers(kind)))

    def slow_rank():
        return next(d for d in p.jobs[job].detectors if d.name == "slow_rank")

    topo = sim.topology()
    send("topology", topo.slice(0, R // 2))              # half the declared ranks: not allocated yet
    assert slow_rank()._R == -1
    send("topology", topo.slice(R // 2))
    assert slow_rank()._R == R and slow_rank()._pos == 0  # allocated for the job's width, no step seen

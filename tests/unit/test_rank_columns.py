"""A job's alignment ring and world size follow the ranks that really report (issue 26, finding 4).

One row at rank 99,999 (world size 100,000) of an 8-rank job, sent by the job's own sender or
straight to Kafka, used to widen the job's ring to 100,000 columns (≈ 800 MB; the processor's RSS went
358 -> 1,184 MiB) and make the job wait for 100,000 ranks. Fed here through the real processor's
message entry point (``process_message``: decode, bounds, step axis, alignment, detectors, store).
"""
from __future__ import annotations

import os

import numpy as np
import psutil
import pyarrow as pa

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.wire.catalog import headers
from stepwatch.wire.encode import encode_arrow
from stepwatch.devtools.eval import Record, _NullProducer
from stepwatch.devtools.hostile import steps_table
from stepwatch.devtools.simulate import Simulation
from stepwatch.kafkaio import KafkaSettings
from stepwatch.storage.views import connect
from stepwatch.stream.processor import Processor

import pytest
pytestmark = pytest.mark.unit

T0 = 1_767_225_600_000_000_000
OUTLIER = 99_999
STEPS = 140           # a job without topology has its closed steps judged once 128 are held


def _feed(tmp_path, job: str, with_topology: bool):
    """140 steps of an 8-rank job whose rank 5 is slow from step 10; after step 3 one topology row
    (when ``with_topology``) and one step row at rank 99,999 of world size 100,000."""
    sim = Simulation(job=job, ranks=8, ranks_per_node=4, steps=STEPS, step_ms=100.0, seed=3, t0_ns=T0,
                     faults=["slow-rank:rank=5,pct=40,start=10"])
    seen = []
    kafka = KafkaSettings(prefix="cols.")
    p = Processor(kafka, tmp_path, flush_interval_s=1e9, on_alert=seen.append, create_topics=False)
    p.producer = _NullProducer()
    off = {}

    def send(kind, t):
        o = off[kind] = off.get(kind, -1) + 1
        p.process_message(Record(kafka.topic(kind), 0, o, job.encode(), encode_arrow(t), headers(kind)))

    proc = psutil.Process(os.getpid())
    rss0 = rss1 = 0
    if with_topology:
        send("topology", sim.topology())
    for s in range(0, STEPS, 4):                     # 4 steps a message
        send("steps", sim.generate(s, s + 4)["steps"])
        if s == 8:
            rss1 = proc.memory_info().rss           # the outlier's rows and the steps after them
        if s == 0:
            rss0 = proc.memory_info().rss
            if with_topology:
                send("topology", pa.table({"job": [job], "rank": pa.array([OUTLIER], pa.int32()),
                                           "node": ["intruder"], "world_size": pa.array([100_000], pa.int32())}))
            t_end = T0 + 4 * 100_000_000
            send("steps", steps_table(job, [OUTLIER], [4], t_end, node="intruder"))
    p._flush()
    return p, seen, rss1 - rss0


def _judged_by_real_ranks(p, seen, job):
    st = p.jobs[job].state
    # the ring holds the 8 ranks that report, not 100,000 columns (≈ 800 MB before)
    assert st.planes["step_ms"].shape == (st.capacity, 8), st.planes["step_ms"].shape
    assert st.world_size == 8 and st.state_bytes() < 1 << 20, (st.world_size, st.state_bytes())
    assert len(p.jobs[job].axis.step) == 8
    # every step is complete with the 8 ranks (not waiting for 100,000): all closed, the last ones
    # by completeness (no event time passes the lateness bound after the last step)
    assert st.next_close == STEPS, st.next_close
    kinds = [(a.kind, a.status) for a in seen]
    assert not [k for k in kinds if k[0] in ("rank_stall", "node_stall", "job_hang")], kinds
    slow = [a for a in seen if a.kind == "slow_rank" and a.status == "firing"]
    assert [a.ranks for a in slow] == [[5]], [(a.kind, a.ranks) for a in seen]
    assert all(r < 8 for a in seen for r in a.ranks), [(a.kind, a.ranks) for a in seen]


def test_a_row_at_rank_99999_with_its_topology_is_held_and_its_steps_deadlettered(tmp_path):
    """With its topology row (world size 100,000): the row is stored in the topology table but gets no
    column, the job's world size stays what its 8 ranks declare (upper quartile of the declarations),
    so the step row of rank 99,999 is deadlettered naming the field and value."""
    job = "victim"
    p, seen, grew = _feed(tmp_path, job, with_topology=True)
    _judged_by_real_ranks(p, seen, job)
    st = p.jobs[job].state
    assert st.expected == 8 and st.held is not None and st.held.column("rank").to_pylist() == [OUTLIER]
    assert grew < 50 << 20, f"RSS grew by {grew >> 20} MiB"
    con = connect(tmp_path)
    assert con.execute("SELECT count(*) FROM topology WHERE job = ? AND rank = ?", [job, OUTLIER]).fetchone()[0] == 1
    assert con.execute("SELECT count(*) FROM steps WHERE job = ?", [job]).fetchone()[0] == 8 * STEPS
    reasons = [r for (r,) in con.execute("SELECT reason FROM deadletter").fetchall()]
    assert len(reasons) == 1 and "field 'rank': 99999 is outside world_size 8" in reasons[0], reasons


def test_a_row_at_rank_99999_without_topology_is_stored_not_aligned(tmp_path):
    """Without topology (a producer writing steps straight to Kafka): the row is stored, counted
    (``stepwatch_processor_step_axis{event="rank_unplaced"}``), and not aligned: rank 99,999 gets a
    column only once 1 in 8 of the ranks up to it report."""
    job = "bare"
    p, seen, grew = _feed(tmp_path, job, with_topology=False)
    _judged_by_real_ranks(p, seen, job)
    assert p.jobs[job].state.pending.tolist() == [OUTLIER]
    assert p.metrics.value(p.metrics.step_axis, "rank_unplaced") == 1
    assert grew < 50 << 20, f"RSS grew by {grew >> 20} MiB"
    con = connect(tmp_path)
    assert con.execute("SELECT count(*) FROM steps WHERE job = ?", [job]).fetchone()[0] == 8 * STEPS + 1
    assert con.execute("SELECT node FROM steps WHERE job = ? AND rank = ?", [job, OUTLIER]).fetchall() == [("intruder",)]
    assert con.execute("SELECT count(*) FROM deadletter").fetchone()[0] == 0


def test_a_large_job_whose_ranks_report_gets_all_its_columns():
    """The floor and the density rule do not hold back a real job: 16,384 ranks whose topology rows
    arrive one node (8 ranks) at a time in scattered order get every column once 1 in 8 reported, and
    the ranks held until then get their topology rows applied."""
    from stepwatch.stream.align import COLUMN_DENSITY, COLUMN_FLOOR, JobState
    R = 16_384
    sim = Simulation(job="big", ranks=R, ranks_per_node=8, steps=2, seed=1, t0_ns=T0)
    topo = sim.topology()
    st = JobState("big")
    nodes = np.random.default_rng(0).permutation(R // 8)
    for i, n in enumerate(nodes):
        st.set_topology(topo.slice(int(n) * 8, 8))
        reported = (i + 1) * 8
        if reported * COLUMN_DENSITY < R // 2:
            assert st.world_size <= max(COLUMN_FLOOR, COLUMN_DENSITY * reported), (i, st.world_size)
    assert st.world_size == R and st.expected == R and st.held is None and len(st.pending) == 0
    assert (st.nodes == np.asarray(topo.column("node").to_pylist(), dtype=object)).all()
    res, blocks = st.ingest(conform(sim.generate(0, 1)["steps"], wire.STEPS))
    assert res.unplaced == 0 and res.keep.all() and [len(b) for b in blocks] == [1]

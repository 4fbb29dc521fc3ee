"""The one detector loop (detectors/replay.py) and the outputs every detector declares (Detector.outputs)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from stepwatch.wire import catalog
from stepwatch.wire import tables as wire
from stepwatch.devtools.simulate import Simulation
from stepwatch.detectors.context import JobTelemetry
from stepwatch.detectors.registry import REGISTRY, build
from stepwatch.detectors.replay import Feed, block_slice, replay
from stepwatch.stream.align import JobState

import pytest
pytestmark = pytest.mark.unit


def test_every_detector_declares_its_alerts_and_row_tables():
    for name, cls in REGISTRY.items():
        assert cls.outputs.get("alerts") == "alerts", name
        for out, table in cls.row_outputs().items():
            assert catalog.BY_NAME[table].writer == "processor" and table in wire.SCHEMAS, (name, out, table)
    assert REGISTRY["mfu"].row_outputs() == {"efficiency": "efficiency"}
    assert REGISTRY["comm_bw"].row_outputs() == {"comm_bw": "comm_bw"}
    assert REGISTRY["slow_rank"].row_outputs() == {}


def _job(steps=90, ranks=64):
    sim = Simulation(job="rp", ranks=ranks, steps=steps, seed=7, comm=True,
                     faults=["slow-rank:rank=11,pct=35,start=20", "regression:start=60,pct=20,cause=io"])
    st = JobState(sim.job, world_size=ranks, capacity=steps + 8)
    st.set_topology(sim.topology())
    g = sim.generate(0, steps)
    _, blocks = st.ingest(g["steps"])
    blocks += st.close_ready(force=True)
    return st, g, blocks


def test_replay_recut_and_feeds_give_what_a_hand_written_loop_gives():
    """Blocks re-cut to 1 step with comm rows (by step) and host samples (by time) reaching the windows
    first: the same alerts and rows, in the same order, as the loop the benchmark used to write by hand."""
    st, g, blocks = _job()
    steps = np.concatenate([b.steps for b in blocks])

    def by_hand():
        tel, ctx, dets = JobTelemetry(), st.context(), build()
        cstep = g["comm"].column("step").to_numpy()
        host_t = g["host"].column("t").cast(pa.int64()).to_numpy()
        order = np.argsort(host_t, kind="stable")
        host, host_t, at = g["host"].take(order), host_t[order], 0
        got = []
        for b in blocks:
            for j in range(len(b)):
                blk = block_slice(b, j, j + 1)
                lo, hi = np.searchsorted(cstep, [blk.steps[0], blk.steps[-1] + 1])
                if hi > lo:
                    tel.add("comm", g["comm"].slice(lo, hi - lo))
                h = int(np.searchsorted(host_t, int(blk.t_end[-1]), side="right"))
                if h > at:
                    tel.add("host", host.slice(at, h - at))
                    at = h
                tel.attach(ctx)
                for d in dets:
                    got += [(d.name, a.alert_id, a.status) for a in d.update(ctx, blk) + d.tick(ctx, int(blk.t_end[-1]))]
                    got += [(d.name, k, t.num_rows) for k, t in d.drain_rows().items()]
        return got

    got = []

    def out(d, alerts, rows):
        got.extend((d.name, a.alert_id, a.status) for a in alerts)
        got.extend((d.name, k, t.num_rows) for k, t in rows.items())
    tel = JobTelemetry()
    replay(build(), st.context(), blocks, block_steps=1, telemetry=tel, tick=True, out=out,
           feeds=[Feed("comm", g["comm"]), Feed("host", g["host"], by="t")])
    want = by_hand()
    assert got == want and len(steps) == 90
    fired = {x[0] for x in got if x[2] == "firing"}
    assert {"slow_rank", "changepoint"} <= fired
    assert {x[1] for x in got if isinstance(x[2], int)} == {"efficiency", "comm_bw"}

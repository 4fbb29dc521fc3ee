"""The simulator faults the scenario suite needs: intermittent, gc-jitter, data-stall, comm-slow,
rank-hang, job-hang (rows, host evidence, labels), and the optional comm table."""
from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pytest

from stepwatch.devtools.simmodel import parse_fault
from stepwatch.devtools.simulate import Simulation

pytestmark = pytest.mark.unit

R, RPN, S = 64, 8, 40


def sim(faults=(), **kw):
    args = dict(job="f", ranks=R, ranks_per_node=RPN, steps=S, seed=4, t0_ns=1_700_000_000_000_000_000)
    args.update(kw)
    return Simulation(faults=list(faults), **args)


def grid(t, name, ranks=R):
    return t.column(name).to_numpy().reshape(-1, ranks)


def test_every_makes_an_intermittent_fault_and_round_trips():
    f = parse_fault("slow-rank:rank=5,pct=30,start=10,every=3")
    assert f.every == 3 and parse_fault(f.spec()) == f
    s = sim([f])
    st, clean = s.generate(0, S)["steps"], sim().generate(0, S)["steps"]
    extra = grid(st, "compute_ms")[:, 5] - grid(clean, "compute_ms")[:, 5]
    assert np.flatnonzero(extra > 1.0).tolist() == list(range(10, S, 3))
    assert s.labels()[0]["every"] == 3 and "every" not in sim(["slow-rank:rank=5,start=1"]).labels()[0]
    with pytest.raises(ValueError, match="'every'"):
        parse_fault("slow-rank:rank=1,every=0")


def test_gc_jitter_pauses_random_ranks_and_labels_gc():
    s = sim(["gc-jitter:start=10,pct=30"])
    out, clean = s.generate(0, S), sim().generate(0, S)
    gc, gc0 = out["gc"], clean["gc"]
    extra = gc.num_rows - gc0.num_rows
    assert 4 <= extra <= 30                                 # ~0.35 pauses per step over 30 steps
    long = gc.filter(pc.greater(gc.column("duration_ms"), 50.0))
    assert len(set(long.column("rank").to_pylist())) >= 3 and pc.min(long.column("generation")).as_py() == 2
    step = grid(out["steps"], "step_ms")[:, 0]
    assert np.allclose(step[:10], grid(clean["steps"], "step_ms")[:10, 0])
    assert (step[10:] > 1.1 * np.median(step)).sum() >= 3
    [lab] = s.labels()
    assert (lab["scope"], lab["cause"], lab["ranks"]) == ("job", "gc", [])


def test_data_stall_hits_some_steps_on_every_rank_with_iowait():
    s = sim(["data-stall:start=10,pct=30"])
    out, clean = s.generate(0, S), sim().generate(0, S)
    d = grid(out["steps"], "data_ms") - grid(clean["steps"], "data_ms")
    hit = np.flatnonzero(d[:, 0] > 50)
    assert 3 <= len(hit) <= 20 and hit.min() >= 10
    assert (d[hit] > 50).all()                               # every rank waits
    iow = out["host"].column("cpu_iowait").to_numpy().reshape(S, -1)
    assert iow[hit].min() > iow[:10].max()
    assert s.labels()[0]["cause"] == "io"
    one = sim(["data-stall:rank=9,start=10,pct=30"])
    d1 = grid(one.generate(0, S)["steps"], "data_ms") - grid(clean["steps"], "data_ms")
    assert (d1[:, 9] > 50).any() and np.allclose(np.delete(d1, 9, axis=1), 0)
    assert one.labels()[0]["scope"] == "rank" and one.labels()[0]["ranks"] == [9]


def test_comm_slow_of_one_dp_group_and_the_comm_table():
    s = sim(["comm-slow:rank=3,pct=20,start=10"], tp=8, comm=True)
    out, clean = s.generate(0, S), sim(tp=8, comm=True).generate(0, S)
    d = grid(out["steps"], "comm_ms") - grid(clean["steps"], "comm_ms")
    group = list(range(3, R, 8))
    assert (d[10:, group] > 50).all() and np.allclose(np.delete(d, group, axis=1), 0) and np.allclose(d[:10], 0)
    lab = s.labels()[0]
    assert lab["ranks"] == group and lab["scope"] == "group" and lab["group"] == "dp3"
    assert lab["cause"] == "communication" and len(lab["nodes"]) == R // RPN
    comm = out["comm"]
    # per rank and step: the all_reduce on the DP group (wall time = transfer + wait for the group's last
    # rank, as the probe records it) and a barrier on "world" holding the rest of the comm wait
    ar = comm.filter(pc.equal(comm.column("op"), "all_reduce"))
    bar = comm.filter(pc.equal(comm.column("op"), "barrier"))
    assert ar.num_rows == bar.num_rows == R * S and set(ar.column("group").to_pylist()) == {f"dp{i}" for i in range(8)}
    assert set(bar.column("group").to_pylist()) == {"world"} and set(ar.column("group_size").to_pylist()) == {R // 8}
    assert np.allclose(grid(ar, "time_ms") - grid(ar, "wait_ms"), grid(out["steps"], "comm_ms"))
    assert np.allclose(grid(ar, "wait_ms") + grid(bar, "wait_ms"), grid(out["steps"], "comm_wait_ms"))
    assert "comm" not in sim().generate(0, 2)                     # off by default


def test_rank_hang_and_job_hang_drop_rows_but_not_host_samples():
    s = sim(["rank-hang:rank=20,start=15"], comm=True)
    out = s.generate(0, S)
    st = out["steps"]
    r20 = st.filter(pc.equal(st.column("rank"), 20)).column("step").to_pylist()
    assert max(r20) == 14 and st.num_rows == R * S - (S - 15)
    assert out["comm"].num_rows == 2 * st.num_rows and out["host"].num_rows == S * (R // RPN)
    assert 20 not in out["gc"].filter(pc.greater_equal(out["gc"].column("t"), st.column("t_end")[15 * R])) \
        .column("rank").to_pylist()
    assert (s.labels()[0]["scope"], s.labels()[0]["ranks"], s.labels()[0]["cause"]) == ("rank", [20], None)

    j = sim(["job-hang:rank=7,start=20"])
    out = j.generate(0, S)
    st = out["steps"]
    last = {r: max(st.filter(pc.equal(st.column("rank"), r)).column("step").to_pylist()) for r in (7, 8, 63)}
    assert last == {7: 19, 8: 21, 63: 21}
    assert out["host"].num_rows == S * (R // RPN)               # the node agents keep sampling
    host_t = out["host"].column("t").cast("int64").to_numpy()
    assert host_t.max() > st.column("t_end").cast("int64").to_numpy().max() + 15 * 10**9
    lab = j.labels()[0]
    assert (lab["scope"], lab["ranks"], lab["cause"]) == ("job", [7], "communication")
    all_stop = sim(["job-hang:start=20"]).generate(0, S)["steps"]
    assert pc.max(all_stop.column("step")).as_py() == 19

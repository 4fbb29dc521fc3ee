"""Tests of the telemetry simulator (stepwatch.devtools.simulate)."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from stepwatch.devtools.simmodel import Fault, parse_fault
from stepwatch.devtools.simulate import Simulation
from stepwatch.wire.tables import GC, HOST, STEPS, TOPOLOGY
from stepwatch.wire.decode import validate

pytestmark = pytest.mark.unit

R, RPN, STEPS_N = 64, 8, 60
T0 = 1_700_000_000 * 10**9
SEED = 7


def sim(faults=(), **kw) -> Simulation:
    args = dict(job="job-a", ranks=R, ranks_per_node=RPN, steps=STEPS_N, seed=SEED, t0_ns=T0)
    args.update(kw)
    return Simulation(faults=faults, **args)


def col(table: pa.Table, name: str, shape=None) -> np.ndarray:
    a = table.column(name).to_numpy()
    return a.reshape(shape) if shape else a


def grid(table: pa.Table, name: str, ranks: int = R) -> np.ndarray:
    """(S, R) array of one steps column (rows are ordered by step then rank)."""
    return col(table, name).reshape(-1, ranks)


def busy(t: pa.Table, ranks: int = R) -> np.ndarray:
    """Own work of each rank: data + compute + host gap + gc = step - comm - comm_wait."""
    return grid(t, "step_ms", ranks) - grid(t, "comm_ms", ranks) - grid(t, "comm_wait_ms", ranks)


ALL_FAULTS = ["slow-rank:rank=17,pct=30,start=10", "cpu-contention:rank=40,start=20,pct=25",
              "gc-storm:rank=3,start=30,end=45", "regression:start=40,pct=20,cause=communication"]


@pytest.fixture(scope="module")
def faulted():
    s = sim(ALL_FAULTS)
    return s, s.generate(0, STEPS_N)


@pytest.fixture(scope="module")
def clean():
    s = sim()
    return s, s.generate(0, STEPS_N)


# --------------------------------------------------------------------------- schemas

def test_schemas_and_validation(faulted):
    s, out = faulted
    assert set(out) == {"steps", "host", "gc"}
    for kind, schema in (("steps", STEPS), ("host", HOST), ("gc", GC)):
        t = out[kind]
        assert t.schema.equals(schema), kind
        good, rejected, _ = validate(kind, t)
        assert rejected == [], (kind, rejected[:3])
        assert good.num_rows == t.num_rows > 0
    topo = s.topology()
    assert topo.schema.equals(TOPOLOGY)
    assert validate("topology", topo)[1] == []
    assert out["steps"].num_rows == R * STEPS_N
    assert out["host"].num_rows == (R // RPN) * STEPS_N
    # rows ordered by step then rank; host by step then node
    assert np.array_equal(col(out["steps"], "rank"), np.tile(np.arange(R), STEPS_N))
    assert np.array_equal(col(out["steps"], "step"), np.repeat(np.arange(STEPS_N), R))
    assert out["host"].column("node").to_pylist()[:R // RPN] == [f"node-{i:04d}" for i in range(R // RPN)]
    st = out["steps"]
    assert pc.all(pc.equal(st.column("job"), "job-a")).as_py()
    assert st.column("node").to_pylist()[:RPN + 1] == ["node-0000"] * RPN + ["node-0001"]
    assert (col(st, "samples") == 8).all() and (col(st, "tokens") == 8 * 4096).all()
    # timestamps are microsecond-aligned, so they convert to datetimes without pandas
    assert st.slice(0, 2).to_pylist()[0]["t_end"].year >= 2023
    assert out["gc"].to_pylist()[0]["t"] is not None


def test_topology_layout():
    s = sim(pp=4, tp=2)
    t = s.topology().to_pylist()
    assert len(t) == R and all(r["world_size"] == R for r in t)
    per_stage = R // 4
    for r in (0, 15, 16, 33, 63):
        row = t[r]
        assert row["rank"] == r and row["node"] == f"node-{r // RPN:04d}" == s.nodes[r]
        assert row["pp"] == r // per_stage == s.stage[r]
        assert row["tp"] == r % 2 and row["dp"] == (r % per_stage) // 2
    assert s.world_size == R and len(s.nodes) == R


# --------------------------------------------------------------------------- synchronous semantics

def test_synchronous_step_semantics(faulted):
    s, out = faulted
    st = out["steps"]
    step = grid(st, "step_ms")
    assert np.all(step == step[:, :1]), "all ranks of a step share the step time"
    cw = grid(st, "comm_wait_ms")
    assert cw.min() >= 0
    # the slowest rank (busy + comm) is the one that waits least, and waits ~0
    own = busy(st) + grid(st, "comm_ms")
    assert np.array_equal(np.argmin(cw, axis=1), np.argmax(own, axis=1))
    assert np.allclose(cw.min(axis=1), 0.0, atol=2e-3)
    # busy = data + compute + gap + gc with a small non-negative host gap
    gap = busy(st) - grid(st, "data_ms") - grid(st, "compute_ms") - grid(st, "gc_ms")
    assert gap.min() > 0
    # time axis: shared per step, t_end = t_start + step_ms, consecutive steps
    ts, te = grid(st, "t_start").astype(np.int64), grid(st, "t_end").astype(np.int64)
    assert np.all(ts == ts[:, :1]) and np.all(te == te[:, :1])
    assert ts[0, 0] == T0
    assert np.array_equal(ts[1:, 0], te[:-1, 0])
    assert np.allclose((te[:, 0] - ts[:, 0]) / 1e6, step[:, 0], atol=1e-6)
    # host rows stamped at the step's end
    host_t = col(out["host"], "t").astype(np.int64).reshape(STEPS_N, -1)
    assert np.array_equal(host_t[:, 0], te[:, 0])


def test_clean_job(clean):
    s, out = clean
    assert s.labels() == [] and s.faults == []
    step = grid(out["steps"], "step_ms")[:, 0]
    normal = np.setdiff1d(np.arange(STEPS_N), s.checkpoint_steps())
    assert abs(np.median(step[normal]) / 1000.0 - 1) < 0.03
    assert step[normal].max() < 1150
    # a 'clean' fault is no fault
    s2 = sim(["clean"])
    assert s2.labels() == [] and s2.generate(0, 5)["steps"].equals(s.generate(0, 5)["steps"])
    # baseline GC: a few short collections, consistent with gc_ms/gc_count
    gc = out["gc"]
    assert 0 < gc.num_rows < 0.1 * R * STEPS_N
    assert col(gc, "duration_ms").max() < 50
    assert grid(out["steps"], "gc_count").sum() == gc.num_rows
    assert np.isclose(grid(out["steps"], "gc_ms").sum(), col(gc, "duration_ms").sum())
    # no foreign process anywhere
    names = pc.list_flatten(out["host"].column("top_procs")).combine_chunks().field("name")
    assert set(names.to_pylist()) == {"python"}


def test_checkpoint_spike():
    s = sim(checkpoint_every=20, noise=0.0, gc_rate=0.0)
    step = s.step_times(0, 60)
    assert s.checkpoint_steps() == [20, 40]
    base = np.median(step)
    assert abs(base - 1000) < 1.0           # noiseless: exactly the calibrated step time
    for c in (20, 40):
        assert 1.25 * base < step[c] < 1.55 * base
    assert np.all(step[[0, 1, 19, 21, 39, 41]] < 1.01 * base)


def test_pipeline_stages_differ():
    s = sim(pp=4, checkpoint_every=0)
    b = busy(s.generate(0, 20)["steps"])
    med = [np.median(b[:, k * 16:(k + 1) * 16]) for k in range(4)]
    assert all(m2 > m1 * 1.03 for m1, m2 in zip(med, med[1:]))
    assert 1.12 < med[3] / med[0] < 1.20            # last stage ~15% busier than the first
    within = [np.median(np.abs(b[:, k * 16:(k + 1) * 16] - med[k])) for k in range(4)]
    assert max(within) < 0.02 * med[0]             # stage peers are alike


# --------------------------------------------------------------------------- faults

def test_slow_rank(faulted, clean):
    s, out = faulted
    c, cout = clean
    st, ct = out["steps"], cout["steps"]
    extra = grid(st, "compute_ms") - grid(ct, "compute_ms")
    add = 0.30 * s.nominal_busy_ms[17]
    assert np.allclose(extra[10:, 17], add) and np.allclose(extra[:10, 17], 0)
    assert np.allclose(extra[:, [16, 18, 0, 63]], 0)
    b = busy(st)
    before, after = np.median(b[:10, 17]), np.median(b[10:20, 17])
    assert after / before == pytest.approx(1.30, abs=0.06)
    # the slow rank gates the job: highest busy, lowest comm wait, job step time up
    assert np.all(np.argmax(b[10:20], axis=1) == 17)
    assert np.all(np.argmin(grid(st, "comm_wait_ms")[10:20], axis=1) == 17)
    step = grid(st, "step_ms")[:, 0]
    assert np.median(step[10:20]) > 1.15 * np.median(step[:10])
    # its accelerator shows the down-clock
    accel = out["host"].column("accel").to_pylist()
    n_nodes = R // RPN
    before_clk = accel[5 * n_nodes + 2][1]["clock_mhz"]     # step 5, node-0002, local rank 1
    after_clk = accel[15 * n_nodes + 2][1]["clock_mhz"]
    assert after_clk < 0.85 * before_clk


@pytest.mark.parametrize("cause,column", [("io", "data_ms"), ("communication", "comm_ms"),
                                          ("computation", "compute_ms"), ("cpu", None)])
def test_regression(cause, column, clean):
    c, cout = clean
    s = sim([f"regression:start=30,pct=20,cause={cause}"])
    out = s.generate(0, STEPS_N)
    st, ct = out["steps"], cout["steps"]
    step = grid(st, "step_ms")[:, 0]
    normal = np.setdiff1d(np.arange(STEPS_N), s.checkpoint_steps())
    before = np.median(step[normal[normal < 30]])
    after = np.median(step[normal[normal >= 30]])
    assert after / before == pytest.approx(1.20, abs=0.04)
    assert np.array_equal(step[:30], grid(ct, "step_ms")[:30, 0])      # nothing changes before
    for name in ("data_ms", "comm_ms", "compute_ms"):
        diff = grid(st, name) - grid(ct, name)
        if name == column:
            assert np.allclose(diff[30:], 200.0) and np.allclose(diff[:30], 0)
        else:
            assert np.allclose(diff, 0)
    if cause == "cpu":   # the host gap (step - all reported phases) grows on every rank
        gap = lambda t: busy(t) - grid(t, "data_ms") - grid(t, "compute_ms") - grid(t, "gc_ms")
        assert np.allclose((gap(st) - gap(ct))[30:], 200.0, atol=1e-2)
    host = out["host"]
    if cause == "communication":
        rt = col(host, "rdma_retrans").reshape(STEPS_N, -1)
        assert rt[30:].min() > 50 and rt[:30].max() < 5
    if cause == "io":
        iow = col(host, "cpu_iowait").reshape(STEPS_N, -1)
        assert iow[30:].mean() > 3 * iow[:30].mean()
        assert (grid(st, "data_queue")[30:] == 0).all()
    [lab] = s.labels()
    assert lab["kind"] == "regression" and lab["cause"] == cause and lab["scope"] == "job"
    assert lab["start"] == 30 and lab["end"] == STEPS_N - 1 and lab["ranks"] == []


def test_gc_storm(faulted):
    s, out = faulted
    st, gc = out["steps"], out["gc"]
    rank, gen, t = col(gc, "rank"), col(gc, "generation"), col(gc, "t").astype(np.int64)
    ts = grid(st, "t_start").astype(np.int64)[:, 0]
    te = grid(st, "t_end").astype(np.int64)[:, 0]
    step_of = np.searchsorted(ts, t, side="right") - 1
    assert np.all(t >= ts[step_of]) and np.all(t < te[step_of])
    storm = (rank == 3) & (step_of >= 30) & (step_of <= 45)
    assert storm.sum() >= 2.5 * 16                # ~4 collections per step
    assert (gen[storm] == 2).mean() > 0.9          # full collections (a baseline one may mix in)
    assert ((rank == 3) & (step_of < 30)).sum() <= 3 and ((rank == 3) & (step_of > 45)).sum() <= 3
    gcms = grid(st, "gc_ms")
    assert np.mean(gcms[30:46, 3]) == pytest.approx(0.20 * s.nominal_busy_ms[3], rel=0.35)
    assert np.median(gcms[30:46, 3]) > 10 * max(np.median(gcms[30:46, 4]), 1.0)
    # gc_count / gc_ms agree with the gc rows
    cnt = np.zeros((STEPS_N, R), int)
    np.add.at(cnt, (step_of, rank), 1)
    assert np.array_equal(cnt, grid(st, "gc_count"))
    dur = np.zeros((STEPS_N, R))
    np.add.at(dur, (step_of, rank), col(gc, "duration_ms"))
    assert np.allclose(dur, gcms)
    # (job, rank, t) is a unique key
    key = rank.astype(np.int64) * 2**40 + (t - T0) // 1000
    assert len(np.unique(key)) == gc.num_rows
    # busy of the storming rank goes up
    b = busy(st)
    assert np.median(b[30:46, 3]) > 1.1 * np.median(b[:10, 3])


def test_gc_storm_all_ranks():
    s = sim(["gc-storm:start=5,pct=15"], ranks=16, steps=12)
    out = s.generate(0, 12)
    gcms = grid(out["steps"], "gc_ms", 16)
    assert (grid(out["steps"], "gc_count", 16)[5:] > 0).mean() > 0.9
    assert np.mean(gcms[5:]) == pytest.approx(0.15 * np.mean(s.nominal_busy_ms), rel=0.2)
    [lab] = s.labels()
    assert lab["scope"] == "job" and lab["ranks"] == [] and lab["cause"] == "gc"


def test_cpu_contention(faulted, clean):
    s, out = faulted
    host = out["host"]
    n_nodes = R // RPN
    nodes = np.array(host.column("node").to_pylist()).reshape(STEPS_N, n_nodes)
    procs = host.column("top_procs").to_pylist()
    assert all(len(p) == 5 for p in procs)
    procs = [procs[i * n_nodes:(i + 1) * n_nodes] for i in range(STEPS_N)]
    node = s.nodes[40]
    assert node == "node-0005"
    j = list(nodes[0]).index(node)
    for i in range(STEPS_N):
        for k in range(n_nodes):
            names = [p["name"] for p in procs[i][k]]
            foreign = "monitor-plugin" in names
            assert foreign == (i >= 20 and k == j), (i, k, names)
            if foreign:
                top = procs[i][k][0]
                assert top["name"] == "monitor-plugin" and top["cpu_pct"] > 1000
            else:
                assert all(p["cpu_pct"] < 200 for p in procs[i][k])
    util = col(host, "cpu_util").reshape(STEPS_N, n_nodes)
    assert util[20:, j].min() > util[:20, j].max() + 10
    assert util[20:, j].min() > np.delete(util[20:], j, axis=1).max() + 10
    # the ranks of that node are slower (mostly in the host gap), the others are not
    st, ct = out["steps"], clean[1]["steps"]
    b, cb = busy(st), busy(ct)
    on = np.arange(40, 48)
    ratio = np.median(b[20:30, on] / cb[20:30, on])
    assert ratio == pytest.approx(1 + 0.25 * 0.78 / 0.90, abs=0.08)   # +25% of nominal busy
    assert np.allclose(b[20:30, 48:], cb[20:30, 48:])
    assert np.allclose(b[:20, on], cb[:20, on])


def test_labels(faulted, tmp_path):
    s, _ = faulted
    labels = s.labels()
    assert [lab["kind"] for lab in labels] == ["slow-rank", "cpu-contention", "gc-storm", "regression"]
    slow, cont, storm, reg = labels
    assert slow == {"job": "job-a", "kind": "slow-rank", "spec": "slow-rank:start=10,rank=17,pct=30",
                    "start": 10, "end": STEPS_N - 1, "ranks": [17], "nodes": ["node-0002"],
                    "scope": "rank", "pct": 30.0, "cause": "computation"}
    assert cont["ranks"] == list(range(40, 48)) and cont["nodes"] == ["node-0005"]
    assert cont["cause"] == "cpu" and cont["process"] == "monitor-plugin" and cont["scope"] == "node"
    assert storm["cause"] == "gc" and storm["end"] == 45 and storm["ranks"] == [3]
    assert reg["cause"] == "communication" and reg["pct"] == 20.0
    for lab in labels:   # specs round-trip
        assert parse_fault(lab["spec"]).kind == lab["kind"]
    p = tmp_path / "sub" / "labels.json"
    s.write_labels(p)
    assert json.loads(p.read_text()) == labels


# --------------------------------------------------------------------------- determinism

def _assert_tables_equal(a: dict, b: dict):
    for k in ("steps", "host", "gc"):
        assert a[k].equals(b[k]), k


def test_determinism_and_chunking():
    faults = ALL_FAULTS[:3]
    whole = sim(faults).generate(0, 50)
    _assert_tables_equal(whole, sim(faults).generate(0, 50))
    s = sim(faults)
    parts = [s.generate(a, b) for a, b in ((0, 7), (7, 30), (30, 31), (31, 50))]
    joined = {k: pa.concat_tables([p[k] for p in parts]).combine_chunks() for k in whole}
    _assert_tables_equal({k: v.combine_chunks() for k, v in whole.items()}, joined)
    # skipping ahead continues the same time axis (steps 0-29 are simulated, not returned)
    late = sim(faults).generate(30, 50)
    assert late["steps"].equals(whole["steps"].slice(30 * R))
    assert late["host"].equals(whole["host"].slice(30 * (R // RPN)))
    gc_t = col(whole["gc"], "t").astype(np.int64)
    t30 = int(col(late["steps"], "t_start")[0].astype(np.int64))
    assert late["gc"].num_rows > 0 and late["gc"].equals(whole["gc"].filter(pa.array(gc_t >= t30)))
    # regenerating a chunk already generated gives the same rows
    _assert_tables_equal(s.generate(7, 30), parts[1])
    # a different seed differs
    assert not sim(faults, seed=SEED + 1).generate(0, 5)["steps"].equals(whole["steps"].slice(0, 5 * R))


# --------------------------------------------------------------------------- parse_fault

def test_parse_fault_good():
    f = parse_fault("slow-rank:rank=17,pct=30,start=100")
    assert f == Fault(kind="slow-rank", start=100, rank=17, pct=30.0)
    f = parse_fault("regression:start=200,pct=20,cause=io")
    assert (f.kind, f.start, f.end, f.rank, f.pct, f.cause) == ("regression", 200, None, None, 20.0, "io")
    assert parse_fault("regression: start=5, end=9, cause=comm").cause == "communication"
    assert parse_fault("gc-storm:start=50,end=80").rank is None
    assert parse_fault("clean") == Fault(kind="clean", start=0)
    assert parse_fault("cpu-contention:rank=9").start == 0
    for spec in ("slow-rank:start=100,rank=17,pct=30", "regression:start=1,end=4,pct=5.5,cause=cpu"):
        assert parse_fault(spec).spec() == spec


@pytest.mark.parametrize("spec,named", [
    ("slow-rank:rank=abc,start=1", "'rank'"),
    ("slow-rank:rank=1,speed=3", "'speed'"),
    ("regression:start=1,cause=disk", "'cause'"),
    ("regression:start=x", "'start'"),
    ("regression:pct=-5", "'pct'"),
    ("regression:start=10,end=5", "'end'"),
    ("slow-rank:start=3", "'rank'"),
    ("slow-rank:rank=", "'rank'"),
    ("slowrank:rank=1", "'slowrank'"),
    ("clean:start=3", "'clean'"),
    ("", "''"),
])
def test_parse_fault_bad(spec, named):
    with pytest.raises(ValueError) as e:
        parse_fault(spec)
    assert named in str(e.value)


def test_bad_arguments():
    with pytest.raises(ValueError, match="'rank'"):
        sim(["slow-rank:rank=64,start=0"])
    with pytest.raises(ValueError, match="'start'"):
        sim(["regression:start=60"])
    with pytest.raises(ValueError, match="pp"):
        sim(pp=3)
    with pytest.raises(ValueError, match="job"):
        sim(job="bad job/../x")
    # Fault objects are accepted (and not mutated)
    f = Fault("regression", start=3, cause="comm")
    assert sim([f]).labels()[0]["cause"] == "communication" and f.cause == "comm"

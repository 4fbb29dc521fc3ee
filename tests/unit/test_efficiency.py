"""Efficiency analytics (issue 9): MFU and goodput, bus bandwidth and the transmission diagnoses, the
DataLoader queue analysis; hand-computed values, small synthetic tables, and the processor storing the
``efficiency`` and ``comm_bw`` tables."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.detectors.base import JobContext, StepBlock
from stepwatch.detectors.context import JobTelemetry
from stepwatch.agents.probe.collectives import device_family, peak_tflops
from stepwatch.detectors.busbw import bus_bandwidth, comm_analysis
from stepwatch.detectors.commbw import CommBandwidth
from stepwatch.detectors.dataloader import DataLoader
from stepwatch.detectors.mfu import Mfu, load_peak_table, model_flops_per_token
from stepwatch.stream.align import JobState
from testkit import job_context

pytestmark = pytest.mark.unit

FIELDS = ("step_ms", "data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms")
TS = pa.timestamp("ns", tz="UTC")


def ctx_of(R: int, per_node: int = 4, **info) -> JobContext:
    return job_context(R, per_node, job="eff", info=info)


def block(steps, step_ms, R, t_end=None, data_ms=None, **extra) -> StepBlock:
    steps = np.asarray(steps, dtype=np.int64)
    S = len(steps)
    sm = np.broadcast_to(np.asarray(step_ms, dtype=float).reshape(S, -1), (S, R)).copy()
    arr = {f: np.zeros((S, R)) for f in FIELDS}
    arr["step_ms"] = sm
    arr["compute_ms"] = sm * 0.8
    if data_ms is not None:
        arr["data_ms"] = np.broadcast_to(np.asarray(data_ms, dtype=float).reshape(S, -1), (S, R)).copy()
    if t_end is None:
        t_end = np.cumsum(sm[:, 0] * 1e6).astype(np.int64)
    return StepBlock(steps=steps, t_end=np.asarray(t_end, dtype=np.int64), **arr, **extra)


# --------------------------------------------------------------------------- peak table and MFU
def test_device_family_and_peak_table_with_overrides(tmp_path):
    assert device_family("NVIDIA H100 80GB HBM3") == "h100" and device_family("NVIDIA H200") == "h200"
    assert device_family("Ascend910B3") == "ascend910b" and device_family("Ascend 910C") == "ascend910c"
    assert device_family("TPU v5p") == "tpu-v5p" and device_family("tpu7x ironwood") == "tpu-v7x"
    assert device_family("NVIDIA A100-SXM4-80GB") == "a100" and device_family("mystery") is None
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16")[0] == 989.0
    assert peak_tflops("H100", "torch.float8_e4m3fn")[0] == 1979.0
    assert peak_tflops("A100", "tf32")[0] == 156.0 and peak_tflops("A100", None)[0] == 312.0
    assert peak_tflops("TPU v7x", "bf16")[0] == 2307.0 and peak_tflops("Ascend910B", "fp16")[0] == 313.0
    assert peak_tflops("mystery", "bf16")[0] is None
    f = tmp_path / "peaks.json"
    f.write_text(json.dumps({"h100/bf16": 900, "ascend910b": 280}))
    table = load_peak_table(str(f))
    assert peak_tflops("H100", "bf16", table) == (900.0, "override h100/bf16")
    assert peak_tflops("Ascend910B4", "bf16", table)[0] == 280.0
    assert peak_tflops("mystery", "bf16", load_peak_table(123.0))[0] == 123.0
    assert peak_tflops("mystery", "bf16", load_peak_table("50"))[0] == 50.0


def test_mfu_hand_computed():
    """4 ranks of H100 bf16 (989 TFLOPS), tp=2: 1e9 parameters per rank -> 2e9 in the model -> 1.2e10
    FLOPs per token; each rank reports 4,096 tokens, replicated across the 2 tp ranks -> 8,192 global
    tokens -> 9.8304e13 FLOPs per step; 500 ms x 4 devices x 989e12 = 1.978e15 -> MFU 0.0496987."""
    info = {"device_type": "NVIDIA H100 80GB HBM3", "dtype": "bf16", "model_params": 1e9, "tp_size": 2, "pp_size": 1}
    assert model_flops_per_token(info)[0] == pytest.approx(1.2e10)
    det = Mfu()
    R = 4
    b = block([0, 1], [500.0, 500.0], R, tokens=np.array([4 * 4096.0] * 2), tokens_ranks=np.array([4, 4]))
    assert det.update(ctx_of(R, **info), b) == []
    rows = det.drain_rows()["efficiency"]
    assert rows.column("tokens").to_pylist() == [8192.0, 8192.0]
    assert rows.column("model_flops").to_pylist()[0] == pytest.approx(9.8304e13)
    assert rows.column("mfu").to_pylist()[0] == pytest.approx(0.0496987, rel=1e-5)
    assert rows.column("peak_tflops").to_pylist()[0] == 989.0 and det.drain_rows() == {}
    # model_flops_per_token given: used as is (whole model), replication still removed
    det = Mfu()
    det.update(ctx_of(R, **dict(info, model_flops_per_token=1.2e10)), b)
    assert det.drain_rows()["efficiency"].column("mfu").to_pylist()[0] == pytest.approx(0.0496987, rel=1e-5)
    # per sample when no tokens: 1e12 FLOPs/sample x 8 samples / 2 replicas, 1 s, 4 x 989e12
    det = Mfu()
    b = block([0], [1000.0], R, samples=np.array([8.0]), samples_ranks=np.array([4]))
    det.update(ctx_of(R, **dict(info, model_params=None, model_flops_per_sample=1e12)), b)
    assert det.drain_rows()["efficiency"].column("mfu").to_pylist()[0] == pytest.approx(4e12 / (4 * 989e12))
    # peak override (a number) and an unknown device: no MFU, rows still written
    det = Mfu(peak_tflops=100.0)
    det.update(ctx_of(R, **dict(info, device_type="mystery")), block([0], [500.0], R, tokens=np.array([16384.0]),
                                                                   tokens_ranks=np.array([4])))
    assert det.drain_rows()["efficiency"].column("mfu").to_pylist()[0] == pytest.approx(9.8304e13 / (0.5 * 4 * 100e12))
    det = Mfu()
    det.update(ctx_of(R, **dict(info, device_type="mystery")), block([0], [500.0], R, tokens=np.array([16384.0]),
                                                                   tokens_ranks=np.array([4])))
    assert det.drain_rows()["efficiency"].column("mfu").to_pylist() == [None]


def test_goodput_hand_computed():
    """10 steps of 100 ms; step 5 takes 300 ms (a checkpoint pause: 200 ms not productive); a 1 s gap
    (restart) before step 8. Wall = 2,200 ms, productive = 1,000 ms -> goodput 0.4545."""
    sm = np.full(10, 100.0)
    sm[5] = 300.0
    t_end = np.cumsum(sm * 1e6).astype(np.int64)
    t_end[8:] += 1_000_000_000
    det = Mfu()
    det.update(ctx_of(4), block(range(10), sm, 4, t_end=t_end))
    rows = det.drain_rows()["efficiency"]
    wall, prod = np.array(rows.column("wall_ms").to_pylist()), np.array(rows.column("productive_ms").to_pylist())
    assert wall.tolist() == [100.0] * 5 + [300.0, 100.0, 100.0, 1100.0, 100.0]
    assert prod.tolist() == [100.0] * 10
    assert prod.sum() / wall.sum() == pytest.approx(1000 / 2200)


def test_mfu_regression_fires_on_lower_mfu_with_the_same_step_time():
    """Tokens per step halve at step 120 while the step time stays: the job does half the work per second.
    The step-time change point sees nothing; the MFU change point does."""
    rng = np.random.default_rng(0)
    R, S = 16, 240
    info = {"device_type": "H100", "dtype": "bf16", "model_flops_per_token": 1e10}
    sm = 1000.0 * (1 + 0.01 * rng.standard_normal((S, R)))
    tokens = np.where(np.arange(S) < 120, 16 * 32768.0, 16 * 16384.0)
    det = Mfu()
    alerts = []
    for a in range(0, S, 20):
        sl = slice(a, a + 20)
        b = block(np.arange(a, a + 20), sm[sl], R, tokens=tokens[sl], tokens_ranks=np.full(20, R))
        alerts += det.update(ctx_of(R, **info), b)
    assert [a.kind for a in alerts] == ["mfu_regression"]
    a = alerts[0]
    assert abs(a.step_first - 120) <= 3 and a.ranks == []
    assert a.evidence["mfu_after"] == pytest.approx(a.evidence["mfu_before"] / 2, rel=0.05)
    assert "MFU fell from" in a.suggestion


# --------------------------------------------------------------------------- bus bandwidth
@pytest.mark.parametrize("op,n,nbytes,ms,alg,bus", [
    ("all_reduce", 8, 1e9, 10.0, 100.0, 175.0),            # 2(n-1)/n = 1.75
    ("all_gather_into_tensor", 4, 2.5e8, 5.0, 200.0, 150.0),   # payload = shard: S = 4 x 2.5e8; (n-1)/n
    ("reduce_scatter_tensor", 4, 1e9, 10.0, 100.0, 75.0),
    ("all_to_all_single", 2, 1e9, 10.0, 100.0, 50.0),
    ("broadcast", 8, 1e9, 10.0, 100.0, 100.0),
])
def test_bus_bandwidth_hand_computed(op, n, nbytes, ms, alg, bus):
    a, b = bus_bandwidth(op, n, nbytes, ms)
    assert float(a) == pytest.approx(alg) and float(b) == pytest.approx(bus)


def comm_rows(spec) -> pa.Table:
    """spec: list of (rank, step, op, group, count, bytes, time_ms, wait_ms, group_size)."""
    cols = list(zip(*spec))
    return pa.table({"job": ["eff"] * len(spec), "node": [f"n{r // 4}" for r in cols[0]],
                     "rank": pa.array(cols[0], pa.int32()), "step": pa.array(cols[1], pa.int64()),
                     "op": list(cols[2]), "group": list(cols[3]), "count": pa.array(cols[4], pa.int64()),
                     "bytes": pa.array(cols[5], pa.int64()), "time_ms": list(map(float, cols[6])),
                     "wait_ms": list(map(float, cols[7])), "group_size": pa.array(cols[8], pa.int32())})


def test_comm_analysis_takes_the_last_arrivals_time_as_transfer():
    # 2 ranks of g0 all-reduce 1e9 bytes; rank 1 arrived 4 ms early and waited: transfer = 10 ms
    t = comm_rows([(0, 0, "all_reduce", "g0", 1, 10**9, 10.0, 0.0, 2), (1, 0, "all_reduce", "g0", 1, 10**9, 14.0, 4.0, 2),
                   (0, 0, "barrier", "world", 1, 0, 1.0, 1.0, 2), (1, 0, "barrier", "world", 1, 0, 3.0, 3.0, 2)])
    res = comm_analysis(t, np.array(["n0", "n0"], dtype=object), "h100", 100.0)
    g = res["groups"]
    assert g["op"] == ["all_reduce"] and g["link"] == ["nvlink"] and g["group_size"].tolist() == [2]
    assert g["xfer_ms_per_step"].tolist() == [10.0]
    assert g["algbw_gbps"][0] == pytest.approx(100.0) and g["busbw_gbps"][0] == pytest.approx(100.0)  # 2(n-1)/n = 1
    assert g["util"][0] == pytest.approx(100.0 / 450.0)
    assert res["wait_share"] == pytest.approx(8.0 / 28.0)
    assert res["comm_share"] == pytest.approx(14.0 / 100.0)          # 28 ms over 2 ranks, 1 step, 100 ms steps
    assert res["hist"][">=256MiB"] == 2
    # across nodes the link is RDMA; CPU/unknown devices: loopback
    assert comm_analysis(t, np.array(["n0", "n1"], dtype=object), "h100", 100.0)["groups"]["link"] == ["rdma"]
    assert comm_analysis(t, None, None, 100.0)["groups"]["link"] == ["loopback"]


def feed_comm(det, ctx, S, make_rows, step_ms=100.0, R=16):
    tel = JobTelemetry()
    tel.attach(ctx)
    alerts = []
    for s in range(S):
        tel.add("comm", make_rows(s))
        tel.attach(ctx)
        alerts += det.update(ctx, block([s], [step_ms], R, t_end=[(s + 1) * 10**8]))
    return alerts


def test_slow_link_names_the_group_its_ranks_and_nodes():
    R = 16                      # 4 groups of 4 ranks, group g2 = ranks 8..11 (node n2) at 1/3 of the bandwidth

    def rows(s):
        spec = []
        for r in range(R):
            g = r // 4
            spec.append((r, s, "all_reduce", f"g{g}", 1, 4 * 2**30, 30.0 if g == 2 else 10.0, 0.0, 4))
        return comm_rows(spec)
    det = CommBandwidth()
    ctx = ctx_of(R, device_type="H100")
    alerts = feed_comm(det, ctx, 40, rows)
    fired = [a for a in alerts if a.status == "firing"]
    assert [a.kind for a in fired] == ["comm_slow_link"]
    a = fired[0]
    assert a.ranks == [8, 9, 10, 11] and set(a.nodes) == {"n2"} and a.cause == "communication"
    assert "check the link/nic of n2" in a.suggestion.lower() and a.evidence["group"] == "g2"
    assert a.evidence["busbw_gbps"] == pytest.approx(a.evidence["peers_median_busbw_gbps"] / 3, rel=1e-3)
    bw = det.drain_rows()["comm_bw"]
    assert set(bw.column("diagnosis").to_pylist()) == {None, "slow-link"}
    assert conform(bw, wire.COMM_BW).num_rows == bw.num_rows


def test_small_messages_and_sync_bound():
    R = 16

    def small(s):       # 1,000 calls of 64 KiB per rank and step over NVLink (within one node per group)
        return comm_rows([(r, s, "all_reduce", f"g{r // 4}", 1000, 1000 * 65536, 20.0, 1.0, 4) for r in range(R)])
    ctx = ctx_of(R, device_type="H100")
    assert feed_comm(CommBandwidth(), ctx_of(R, device_type="H100"), 30, small) == []   # warm-up: not judged
    alerts = feed_comm(CommBandwidth(), ctx, 60, small)          # from the steady state on: the job's way
    assert [a.kind for a in alerts] == ["comm_small_messages"]
    assert "tensor fusion" in alerts[0].suggestion and alerts[0].ranks == []
    assert alerts[0].evidence["size_histogram"]["64KiB-1MiB"] > 0

    def syncb(s):       # on each step one rank of a group arrives last and waits nothing, the others wait 25-27 of
        #                 a 30 ms collective, and which rank that is rotates: no single straggler (each rank waits
        #                 19.5 ms on average), sync-bound
        return comm_rows([(r, s, "all_reduce", f"g{r // 4}", 1, 2**30, 30.0, (0.0, 25.0, 26.0, 27.0)[(r + s) % 4], 4)
                          for r in range(R)])
    # sync-bound from its steady state on: the job's own way (its comm_bw rows say so), no alert
    assert feed_comm(CommBandwidth(), ctx_of(R, device_type="H100"), 90, syncb) == []

    def latency(s):     # every rank waits 24 ms on every step: nobody waits for a peer (the collective's latency)
        return comm_rows([(r, s, "all_reduce", f"g{r // 4}", 1, 2**30, 30.0, 24.0, 4) for r in range(R)])
    # a job that becomes sync-bound (the latency-bound job from step 60 on): a change, alerted
    alerts = feed_comm(CommBandwidth(), ctx_of(R, device_type="H100"), 100, lambda s: latency(s) if s < 60 else syncb(s))
    assert [a.kind for a in alerts] == ["comm_sync_bound"] and alerts[0].cause == "parallelism"
    assert "look for the straggler" in alerts[0].suggestion.lower()
    assert 15.0 < alerts[0].evidence["least_waiting"][0]["wait_ms"] <= 19.5    # 19.5 over whole rotations

    assert feed_comm(CommBandwidth(), ctx_of(R, device_type="H100"), 60, latency) == []

    def straggler(s):   # one rank everyone waits for: left to slow_rank (it names the rank)
        return comm_rows([(r, s, "all_reduce", f"g{r // 4}", 1, 2**30, 30.0 if r else 6.0, 24.0 if r else 0.0, 4)
                          for r in range(R)])
    assert feed_comm(CommBandwidth(), ctx_of(R, device_type="H100"), 100,
                     lambda s: latency(s) if s < 60 else straggler(s)) == []


def test_incremental_comm_aggregate_matches_comm_analysis():
    """The detector folds comm rows into per-step accumulators as they arrive (any batches, late rows,
    nulls); analysing a window from those gives what comm_analysis computes over the window's raw rows."""
    from stepwatch.detectors.commagg import _CommAggregate
    rng = np.random.default_rng(7)
    R = 48
    nodes = np.array([f"n{r // 4}" for r in range(R)], dtype=object)
    tabs = []
    for s in range(30):
        spec = []
        for r in range(R):
            for op, grp in (("all_reduce", f"g{r % 6}"), ("all_gather", f"t{r // 8}"), ("barrier", "world")):
                if rng.random() < 0.05:
                    continue                                    # a missing row
                step = s - 1 if s and rng.random() < 0.1 else s  # a late row of the previous step
                spec.append((r, step, op, grp, int(rng.integers(0, 4)),
                             int(rng.integers(0, 2**24)) * int(rng.random() > 0.05), float(rng.random() * 20),
                             float(rng.random() * 5), int(rng.choice([0, 8]))))
        t = comm_rows(spec)
        t = t.set_column(t.column_names.index("group_size"), "group_size",       # some null group sizes
                         pa.array([None if rng.random() < 0.1 else v for v in t.column("group_size").to_pylist()],
                                  pa.int32()))
        tabs.append(t)
    agg = _CommAggregate(40)
    rows = pa.concat_tables(tabs)
    cuts = np.sort(rng.choice(np.arange(1, rows.num_rows), 60, replace=False))
    for a, b in zip(np.r_[0, cuts], np.r_[cuts, rows.num_rows]):                 # batches of random sizes
        agg.ingest(rows.slice(int(a), int(b - a)), 1 << 16)
    step = rows.column("step").to_numpy()
    for lo, hi in ((0, 9), (5, 24), (20, 29)):
        ref = comm_analysis(rows.filter(pa.array((step >= lo) & (step <= hi))), nodes, "h100", 100.0)
        got = agg.analyse(lo, hi, nodes, "h100", 100.0)
        for k in ("wait_share", "comm_share", "steps", "ranks"):
            assert got[k] == pytest.approx(ref[k], rel=1e-9)
        assert got["hist"] == ref["hist"]
        assert got["rank_wait"][0].tolist() == ref["rank_wait"][0].tolist()
        assert np.allclose(got["rank_wait"][1], ref["rank_wait"][1], rtol=1e-9)
        gr, gg = ref["groups"], got["groups"]
        order = lambda g: sorted(range(len(g["op"])), key=lambda i: (g["op"][i], g["group"][i]))
        ir, ig = order(gr), order(gg)
        assert [(gr["op"][i], gr["group"][i], gr["link"][i]) for i in ir] == [
            (gg["op"][i], gg["group"][i], gg["link"][i]) for i in ig]
        for k in ("group_size", "ranks", "calls_per_step", "bytes_per_call", "xfer_ms_per_step", "time_ms_per_step",
                  "wait_share", "algbw_gbps", "busbw_gbps", "peak_gbps", "util", "saturate_bytes", "calls", "rows"):
            assert np.allclose(np.asarray(gg[k], float)[ig], np.asarray(gr[k], float)[ir], rtol=1e-9, equal_nan=True), k
        assert {o for o, _ in zip(gg["op"], gg["group"])} == {"all_reduce", "all_gather"}


# --------------------------------------------------------------------------- data loader
def test_dataloader_starved_job_wide_and_per_node_and_quiet_when_fed():
    R = 16
    ctx = ctx_of(R)

    def run(queue, data_ms):
        det = DataLoader()
        out = []
        for a in range(0, 40, 10):
            q = np.broadcast_to(np.asarray(queue, dtype=np.float32), (10, R)).copy()
            out += det.update(ctx, block(np.arange(a, a + 10), [100.0] * 10, R, data_ms=np.broadcast_to(
                np.asarray(data_ms, float), (10, R)), data_queue=q))
        return out
    alerts = run(0, 30.0)
    assert [a.kind for a in alerts] == ["dataloader_starved"] and alerts[0].ranks == [] and alerts[0].cause == "io"
    for word in ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers"):
        assert word in alerts[0].suggestion
    assert alerts[0].evidence["empty_share"] == 1.0
    assert run(2, 30.0) == []                   # queue full: I/O is not the bottleneck
    assert run(0, 2.0) == []                    # empty but no material data wait
    q = np.full(R, 3.0)
    q[4:8] = 0.0                                # node n1's loader starved
    d = np.full(R, 2.0)
    d[4:8] = 30.0
    alerts = run(q, d)
    assert [a.ranks for a in alerts] == [[4, 5, 6, 7]] and set(alerts[0].nodes) == {"n1"}


# --------------------------------------------------------------------------- plumbing
def test_alignment_keeps_token_sums_queue_depths_and_topology_facts():
    st = JobState("eff", capacity=16)
    st.set_topology(pa.table({"job": ["eff"] * 2, "rank": pa.array([0, 1], pa.int32()), "node": ["a", "a"],
                              "world_size": pa.array([2, 2], pa.int32()), "pp": pa.array([0, 0], pa.int32()),
                              "tp": pa.array([0, 1], pa.int32()), "device_type": ["H100", "H100"],
                              "dtype": ["bf16", "bf16"], "model_params": pa.array([10, 30], pa.int64())}))
    info = st.context().info
    assert info["model_params"] == 20.0 and info["tp_size"] == 2 and info["device_type"] == "H100"
    t = pa.table({"job": ["eff"] * 2, "node": ["a", "a"], "rank": pa.array([0, 1], pa.int32()),
                  "step": pa.array([3, 3], pa.int64()), "t_end": pa.array([10, 11], pa.int64()).cast(TS),
                  "step_ms": [5.0, 5.0], "tokens": pa.array([100, 50], pa.int64()),
                  "data_queue": pa.array([0, 2], pa.int32())})
    _, blocks = st.ingest(conform(t, wire.STEPS))
    b = blocks[0]
    assert b.tokens.tolist() == [150.0] and b.tokens_ranks.tolist() == [2] and b.samples is None
    assert b.data_queue.tolist() == [[0.0, 2.0]]


def test_agent_puts_model_params_and_group_sizes_into_rows():
    from stepwatch.agents.agent import identity_from_hello, rows_from_batch
    hello = {"job": "j", "rank": 1, "world_size": 2, "names": {"1": "all_reduce", "2": "dp0"},
             "model_params": 1234, "model_flops_per_token": 6.0, "group_sizes": {"dp0": 2}}
    ident = identity_from_hello(hello, "n", None)
    row = ident.topology_row()
    assert row["model_params"] == 1234 and row["model_flops_per_token"] == 6.0
    step = (7, 10, 20, 5e6, 1e6, 3e6, 0.5e6, 0.5e6, 0.0, 0, 0, 32, -1, 4)
    s, c, _ = rows_from_batch(ident, (step, [], [(1, 2, 3, 4096, 1e6, 0.8e6)], []))
    assert c[0]["group_size"] == 2 and s["data_queue"] == 0
    t = pa.Table.from_pylist(c, schema=wire.COMM)
    assert t.column("group_size").to_pylist() == [2]


def test_processor_stores_efficiency_and_comm_bw_tables(tmp_path):
    from stepwatch.devtools.eval import run_scenario
    from stepwatch.devtools.evalsuite import Scenario
    from stepwatch.storage.views import connect
    res = run_scenario(Scenario("eff-store", [], ranks=64, steps=40, seed=3, comm=True, checkpoint_every=None),
                       tmp_path)
    assert not [e for e in res["emitted"] if e.alert.status == "firing"]
    con = connect(tmp_path)
    n, mfu, good = con.execute("SELECT count(*), median(mfu), sum(productive_ms) / sum(wall_ms) "
                               "FROM efficiency WHERE job = 'eval-eff-store'").fetchone()
    assert n == 40 and 0.2 < mfu < 0.6 and good > 0.99
    rows = con.execute("SELECT op, \"group\", group_size, busbw_gbps, peak_gbps FROM comm_bw "
                       "WHERE job = 'eval-eff-store'").fetchall()
    assert rows and all(r[0] == "all_reduce" and r[2] == 64 and 0 < r[3] < r[4] for r in rows)

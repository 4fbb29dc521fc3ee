"""Cause evidence from host / GC / comm windows, the final cause rules, the bounded windows and the
data-parallel groups of the detector context."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.detectors.base import JobContext
from stepwatch.detectors.causes import decide, gc_evidence, host_evidence
from stepwatch.detectors.context import JobTelemetry, Window
from testkit import job_context

import pytest
pytestmark = pytest.mark.unit

NS = 10**9


def host_rows(n_nodes=10, t=(1, 2, 3), foreign_on=None, slow_dev=None, everywhere=None):
    rows = []
    for ti in t:
        for n in range(n_nodes):
            procs = [{"pid": 100 + i, "name": "python", "cpu_pct": 99.0} for i in range(4)]
            if n == foreign_on:
                procs.insert(0, {"pid": 4242, "name": "crypto-miner", "cpu_pct": 3800.0})
            if everywhere:
                procs.append({"pid": 7, "name": everywhere, "cpu_pct": 80.0})
            acc = [{"index": i, "util": 90.0, "mem_used": 1, "temp_c": 60.0,
                    "clock_mhz": 1400.0 if (n, i) == slow_dev else 1980.0, "power_w": 300.0} for i in range(4)]
            rows.append({"job": "j", "node": f"n{n}", "t": ti * NS, "cpu_util": 90.0 if n == foreign_on else 10.0,
                         "cpu_iowait": 0.3, "load1": 12.0, "rdma_retrans": 0, "top_procs": procs, "accel": acc})
    return conform(pa.Table.from_pylist(rows), wire.HOST)


def ctx_with(host=None, gc=None) -> JobContext:
    ctx = job_context(40, per_node=4)
    tel = JobTelemetry()
    if host is not None:
        tel.add("host", host)
    if gc is not None:
        tel.add("gc", gc)
    tel.attach(ctx)
    return ctx


def test_foreign_process_on_the_suspect_node_names_cpu():
    ctx = ctx_with(host_rows(foreign_on=3, everywhere="node-exporter"))
    ev = host_evidence(ctx, ["n3"], 0, 4 * NS)
    assert [p["name"] for p in ev["foreign"]] == ["crypto-miner"]      # node-exporter runs everywhere
    assert ev["cpu_util"] == {"suspect": 90.0, "others": 10.0} and ev["samples"] == 3
    cause, why = decide("computation", ev)
    assert cause == "cpu" and "crypto-miner" in why and "pid 4242" in why
    assert host_evidence(ctx, ["n4"], 0, 4 * NS)["foreign"] == []
    assert host_evidence(ctx, ["n3"], 10 * NS, 20 * NS) == {}          # nothing in range


def test_down_clocked_accelerator_names_computation_over_phases():
    ctx = ctx_with(host_rows(slow_dev=(2, 1)))
    ev = host_evidence(ctx, ["n2"], 0, 4 * NS)
    assert ev["accel"]["down_clocked"] and ev["accel"]["index"] == 1 and ev["accel"]["clock_mhz"] == 1400.0
    assert decide("cpu", ev)[0] == "computation"
    assert decide("io", ev)[0] == "io"                                # a data wait is not the device's


def test_gc_records_and_comm_rules():
    gc = conform(pa.Table.from_pylist(
        [{"job": "j", "node": "n1", "rank": 5, "t": (s * NS) + 1, "generation": 2, "duration_ms": 40.0}
         for s in range(10)]), wire.GC)
    ctx = ctx_with(gc=gc)
    ev = gc_evidence(ctx, [5], 0, 11 * NS, steps=10)
    assert ev["suspect_per_step"] == 1.0 and ev["suspect_ms_per_step"] == 40.0 and ev["max_generation"] == 2
    assert decide("cpu", {}, ev, excess_ms=50.0)[0] == "gc"             # records explain the gap
    assert decide("cpu", {}, ev, excess_ms=200.0)[0] == "cpu"
    comm = {"ops": [{"op": "all_reduce", "groups": ["dp3"], "suspect_ms": 150.0, "others_ms": 100.0}]}
    assert decide("parallelism", comm=comm)[0] == "communication"
    assert decide("computation", comm=comm)[0] == "computation"
    assert decide("io") == ("io", "phase breakdown")


def test_window_is_bounded_by_time_and_rows():
    w = Window("t", span=5 * NS, max_rows=25)
    for s in range(20):
        w.add(host_rows(n_nodes=4, t=(s,)))
    assert len(w) <= 24 and w.newest == 19 * NS
    assert w.select(0, 13 * NS) is None and w.select(18 * NS, None).num_rows == 8
    big = host_rows(n_nodes=40, t=(30,))
    w.add(big)
    assert len(w) == 25


def test_dp_groups_from_topology_coordinates():
    R = 32
    stage = (np.arange(R) // 16).astype(np.int32)
    tp = (np.arange(R) % 4).astype(np.int32)
    ctx = JobContext("j", R, np.array(["n"] * R, dtype=object), stage, coords={"tp": tp})
    g = ctx.dp_groups()
    assert len(np.unique(g)) == 8 and g[0] == g[4] != g[1] and g[0] != g[16]
    assert JobContext("j", R, np.array(["n"] * R, dtype=object), stage).dp_groups() is None
    no_tp = {"tp": np.full(R, -1, np.int32)}
    assert JobContext("j", R, np.array(["n"] * R, dtype=object), stage, coords=no_tp).dp_groups() is None


def test_measured_run_queue_wait_decides_contention_and_the_new_process_comes_first():
    """Where the ranks report cpu_wait_ms (the stepwatch probe), a busy process beside a rank whose compute
    grew is not the cause; when the rank waited for its CPU (host gap), the process that was not on the
    node before the window is named first, even below half a core."""
    rows = []
    for ti in range(1, 40):
        procs = [{"pid": 11, "name": "pt_main_thread", "cpu_pct": 60.0},       # the job's own ranks
                 {"pid": 12, "name": "pt_main_thread", "cpu_pct": 58.0}]
        if ti >= 30:                                                           # from t=30 s on the same node
            procs.append({"pid": 999, "name": "cpu-hog", "cpu_pct": 45.0})
        rows.append({"job": "j", "node": "node-a", "t": ti * NS, "cpu_util": 80.0, "top_procs": procs})
    ctx = ctx_with(conform(pa.Table.from_pylist(rows), wire.HOST))
    ctx.nodes = np.array(["node-a", "node-a"], dtype=object)
    unmeasured = host_evidence(ctx, ["node-a"], 30 * NS, 39 * NS)
    assert "cpu_wait_reported" not in unmeasured
    assert [p["name"] for p in unmeasured["foreign"]] == ["pt_main_thread"]    # >= 50%: the old rule
    assert decide("computation", unmeasured)[0] == "cpu"                       # inferred, as before
    ctx.info["cpu_wait_reported"] = True
    ev = host_evidence(ctx, ["node-a"], 30 * NS, 39 * NS)
    assert ev["cpu_wait_reported"] is True
    assert ev["foreign"][0] == {"node": "node-a", "name": "cpu-hog", "pid": 999, "cpu_pct": 45.0,
                                "seen_elsewhere": 0.0, "new": True}
    assert ev["foreign"][1]["name"] == "pt_main_thread" and ev["foreign"][1]["new"] is False
    cause, why = decide("cpu", ev)
    assert cause == "cpu" and "cpu-hog (pid 999)" in why and "waiting for a CPU" in why and "new there" in why
    assert decide("computation", ev) == ("computation", "phase breakdown")    # it got its CPU: not contention
    # compute grew most, but the rank's run-queue wait rose too while a process new on its node ran: its
    # helper threads waited for the CPU as well (the main thread's compute), contention all the same
    cause, why = decide("computation", ev, excess_ms=14.0, wait_rise_ms=2.0)
    assert cause == "cpu" and "cpu-hog (pid 999)" in why
    assert decide("computation", ev, excess_ms=14.0, wait_rise_ms=0.5)[0] == "computation"   # wait unchanged
    assert decide("computation", ev, excess_ms=40.0, wait_rise_ms=2.0)[0] == "computation"   # < 10% of it
    old = dict(ev, foreign=[p for p in ev["foreign"] if not p["new"]])       # only the job's own processes
    assert decide("computation", old, excess_ms=14.0, wait_rise_ms=2.0)[0] == "computation"
    assert decide("cpu", {"cpu_wait_reported": True, "foreign": []})[0] == "cpu"

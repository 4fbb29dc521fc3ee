"""The node agent: host plug-ins (pure parsing on strings), datagram handling (bad input never fatal),
batches to the real broker as Arrow keyed by job, the bounded spool and its replay, self-metrics."""
from __future__ import annotations

import logging
import os
import socket
import time
import urllib.request
from collections import namedtuple

import pyarrow as pa
import pytest

from stepwatch.wire import catalog
from stepwatch.wire import tables as wire
from stepwatch.wire import datagram
from stepwatch.wire.decode import decode, validate
from stepwatch.agents import hostmetrics as hm
from stepwatch.agents.agent import Agent, AgentMetrics, identity_from_hello, rows_from_batch, safe_job
from stepwatch.agents.probe import Probe
from stepwatch.agents.shipper import Shipper, Spool
from testkit import free_port
from stepwatch.kafkaio import KafkaSettings, make_consumer

pytestmark = pytest.mark.integration


def _plain(t: pa.Table) -> pa.Table:
    """Timestamps as int ns so rows convert to Python without pandas."""
    cols = [c.cast(pa.int64()) if pa.types.is_timestamp(c.type) else c for c in t.columns]
    return pa.Table.from_arrays(cols, names=t.column_names)

NPU_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc1.b030            Version: 24.1.rc1.b030                                        |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 101.8       43                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3318 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 92.0        39                0    / 0             |
| 0                         | 0000:C2:00.0  | 57          0    / 0          59351/ 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 1       0                 | 1712733       | python                   | 48954                   |
+===========================+===============+====================================================+
"""

# Atlas 800 (910A): no HBM column; memory used / total in the chip row
NPU_SMI_910A = """\
| NPU   Name                | Health        | Power(W)    Temp(C)                                |
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)                       |
+===========================+===============+====================================================+
| 4     910A                | Warning       | NA          47                                     |
| 0                         | 0000:81:00.0  | 12          2621 / 15039                           |
"""


def test_parse_npu_smi_info():
    acc = hm.parse_npu_smi_info(NPU_SMI)
    assert acc == [
        {"index": 0, "util": 0.0, "mem_used": 3318 << 20, "temp_c": 43.0, "power_w": 101.8, "clock_mhz": None},
        {"index": 1, "util": 57.0, "mem_used": 59351 << 20, "temp_c": 39.0, "power_w": 92.0, "clock_mhz": None},
    ]
    (a,) = hm.parse_npu_smi_info(NPU_SMI_910A)
    assert a["index"] == 4 and a["util"] == 12.0 and a["mem_used"] == 2621 << 20
    assert a["power_w"] is None and a["temp_c"] == 47.0
    assert hm.parse_npu_smi_info("") == [] and hm.parse_npu_smi_info("garbage\n| x | y |") == []


def test_parse_nvidia_smi_csv():
    out = hm.parse_nvidia_smi_csv("0, 97, 70123, 71, 412.35, 1980\n1, [N/A], 10, 40, [N/A], 1410\nnot,a,row\n")
    assert out[0] == {"index": 0, "util": 97.0, "mem_used": 70123 << 20, "temp_c": 71.0, "power_w": 412.35,
                      "clock_mhz": 1980.0}
    assert out[1]["util"] is None and out[1]["power_w"] is None and len(out) == 2


def test_cpu_percent_and_rates():
    T = namedtuple("T", "user nice system idle iowait irq softirq steal guest")
    a = T(100, 0, 50, 800, 10, 0, 0, 5, 30)
    b = T(160, 0, 70, 860, 30, 0, 0, 15, 60)     # +60 user +20 sys +60 idle +20 iowait +10 steal = 170
    util, iowait, steal = hm.cpu_percent(a, b)
    assert util == pytest.approx(100 * 90 / 170) and iowait == pytest.approx(100 * 20 / 170)
    assert steal == pytest.approx(100 * 10 / 170)
    assert hm.cpu_percent(a, a) == (0.0, 0.0, 0.0)
    assert hm.rate(100, 300, 2.0) == 100.0
    assert hm.rate(None, 300, 2.0) is None and hm.rate(300, 100, 2.0) is None and hm.rate(1, 2, 0) is None


def test_parse_pid_stat_and_top_procs():
    line = ("4242 (my (odd) proc) S 1 4242 4242 0 -1 4194560 1000 0 0 0 350 150 0 0 20 0 8 0 100 "
            "1000000 500 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0")
    assert hm.parse_pid_stat(line) == (4242, b"my (odd) proc", 500)
    assert hm.parse_pid_stat(line.encode()) == (4242, b"my (odd) proc", 500)
    prev = {1: 100, 2: 50, 3: 10, 9: 999}
    cur = {1: (b"a", 300), 2: ("b", 60), 3: (b"c", 10), 4: (b"new", 500), 9: (b"reused", 5)}
    top = hm.top_procs(prev, cur, dt=2.0, hz=100.0, n=5)
    assert top == [{"pid": 1, "name": "a", "cpu_pct": 100.0}, {"pid": 2, "name": "b", "cpu_pct": 5.0}]
    # with start times: a process started after the previous scan counts from 0, one started before
    # it (missed by that scan) still has no baseline
    assert hm.parse_pid_stat(line, start=True) == (4242, b"my (odd) proc", 500, 100)
    cur = {1: (b"a", 300, 0), 4: (b"new", 150, 1050), 5: (b"old", 900, 900)}
    top = hm.top_procs(prev, cur, dt=2.0, hz=100.0, n=5, born_after=10.0)
    assert top == [{"pid": 1, "name": "a", "cpu_pct": 100.0}, {"pid": 4, "name": "new", "cpu_pct": 75.0}]


def test_a_busy_process_started_between_two_samples_is_in_the_next_one():
    """A foreign process that starts between two host samples shows in the very next one (the pressure it
    puts on a rank is in the alert built from that sample), with its CPU share of the interval; before, a
    process new since the previous scan was left out of that sample."""
    import subprocess
    import sys
    p = hm.TopProcsPlugin(n=100_000)            # every process: on a loaded machine it need not be in the top 5
    p.setup()
    time.sleep(0.3)
    hog = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
    try:
        time.sleep(0.7)
        top = p.gather(0.0)["top_procs"]
    finally:
        hog.kill()
        hog.wait()
    mine = [x for x in top if x["pid"] == hog.pid]
    assert mine and mine[0]["cpu_pct"] > 0.0, [x for x in top if x["pid"] == hog.pid]


def test_rdma_plugin_reads_hw_counters(tmp_path):
    assert hm.rdma_retrans_total({"out_of_sequence": 3, "packet_seq_err": 2, "rx_bytes": 10 ** 9}) == 5
    root = tmp_path / "infiniband"
    hw = root / "mlx5_0" / "ports" / "1" / "hw_counters"
    hw.mkdir(parents=True)
    for k, v in {"out_of_sequence": 10, "local_ack_timeout_err": 1, "rx_write_requests": 77}.items():
        (hw / k).write_text(f"{v}\n")
    r = hm.PluginRunner(hm.RdmaPlugin(str(root)))
    assert r.collect(0.0) == {"rdma_retrans": 0}
    (hw / "out_of_sequence").write_text("14\n")
    assert r.collect(1.0) == {"rdma_retrans": 4}
    absent = hm.PluginRunner(hm.RdmaPlugin(str(tmp_path / "none")))
    assert absent.collect(0.0) == {} and absent.state == "absent"


def test_host_proc_and_host_sys_point_the_plugins_at_the_nodes_mounts(tmp_path, monkeypatch):
    """In the DaemonSet the node's /proc and /sys are mounted under /host (HOST_PROC, HOST_SYS): the
    plug-ins must read those, not the container's own view."""
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "4242").mkdir()
    stat = "4242 (trainer) R 1 1 1 0 -1 0 0 0 0 0 {u} 0 0 0 20 0 1 0 1 1 1 0"
    (proc / "4242" / "stat").write_text(stat.format(u=100))
    cpu = "cpu  {u} 0 {s} {i} 0 0 0 0 0 0\ncpu0 1 0 1 1 0 0 0 0 0 0\n"
    (proc / "stat").write_text(cpu.format(u=1000, s=0, i=1000))
    hw = sys_ / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "hw_counters"
    hw.mkdir(parents=True)
    (hw / "out_of_sequence").write_text("7\n")
    monkeypatch.setenv("HOST_PROC", str(proc))
    monkeypatch.setenv("HOST_SYS", str(sys_))
    try:
        r_cpu, r_top, r_rdma = (hm.PluginRunner(p) for p in (hm.CpuPlugin(), hm.TopProcsPlugin(), hm.RdmaPlugin()))
        for r in (r_cpu, r_top, r_rdma):
            r.collect(0.0)
        (proc / "stat").write_text(cpu.format(u=1300, s=100, i=1600))      # 400 busy of 1000 ticks
        (proc / "4242" / "stat").write_text(stat.format(u=100 + 50))
        (hw / "out_of_sequence").write_text("9\n")
        assert r_cpu.collect(1.0)["cpu_util"] == pytest.approx(40.0)
        top = r_top.collect(1.0)["top_procs"]
        assert [p["pid"] for p in top] == [4242] and top[0]["name"] == "trainer"   # only the node's process
        assert r_rdma.collect(1.0) == {"rdma_retrans": 2}
        monkeypatch.setenv("HOST_PROC", str(tmp_path / "nothing"))
        bad = hm.PluginRunner(hm.MemPlugin())
        assert bad.collect(0.0) == {} and bad.state == "absent"             # said once, not an error a second
    finally:
        monkeypatch.delenv("HOST_PROC")
        hm._psutil()                                                      # psutil back on this /proc
    import psutil
    assert psutil.PROCFS_PATH == "/proc"


class Boom(hm.Plugin):
    name = "boom"

    def gather(self, now):
        raise RuntimeError("sensor on fire")


class Missing(hm.Plugin):
    name = "missing"

    def setup(self):
        raise hm.Absent("no such tool")


class Slow(hm.Plugin):
    name = "slowtool"
    interval_s = 5.0
    calls = 0

    def gather(self, now):
        Slow.calls += 1
        return {"accel": [{"index": 0, "util": float(Slow.calls)}]}


def test_plugin_runner_times_counts_and_logs_absent_once(caplog):
    m = AgentMetrics()
    runners = hm.build_runners(metrics=m, plugins={"boom": Boom(), "missing": Missing(), "slow": Slow(),
                                                   "load": hm.LoadPlugin()})
    caplog.set_level(logging.INFO, logger="stepwatch.agent.host")
    for i in range(4):
        row = hm.sample(runners, float(i))
    assert row["accel"] == [{"index": 0, "util": 1.0}] and Slow.calls == 1   # every 5 s, repeated between
    assert "load1" in row
    assert sum("no such tool" in r.message for r in caplog.records) == 1
    assert sum("sensor on fire" in r.message for r in caplog.records) == 1   # errors: at most once a minute
    assert m.value(m.plugin_runs, "error") == 4 and m.value(m.plugin_runs, "absent") == 1
    assert runners[0].errors == 4


def test_every_registered_plugin_runs_on_this_machine():
    runners = hm.build_runners()
    hm.sample(runners, 0.0)
    time.sleep(0.2)
    row = hm.sample(runners, 1.0)
    for k in ("cpu_util", "cpu_iowait", "cpu_steal", "load1", "mem_used", "mem_available", "top_procs"):
        assert k in row, k
    assert 0 <= row["cpu_util"] <= 100 and row["mem_available"] > 0
    assert all(r.state in ("ok", "absent") and r.errors == 0 for r in runners)
    with pytest.raises(ValueError, match="unknown host plug-in"):
        hm.build_runners(["cpu", "gpu9000"])


# --------------------------------------------------------------------------- datagrams

def _send(path: str, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, path)


def test_safe_job_and_identity_validation():
    assert safe_job("llama-70b") == "llama-70b" and safe_job(None) == "default"
    assert safe_job("my job/1") == "my_job_1" and safe_job("_x") == "j_x"
    from stepwatch.agents.profiling import protocol   # safe_job lives there (standard library only, for the probe)
    assert protocol.JOB_RE.pattern == wire.JOB_RE.pattern, "the probe's copy of the job id rule drifted"
    ident = identity_from_hello({"job": "j", "rank": 2, "world_size": 4, "names": {"1": "all_reduce"}}, "n1", None)
    assert ident.node == "n1" and ident.names == {1: "all_reduce"}
    for bad in ({"rank": -1, "world_size": 4}, {"rank": 4, "world_size": 4}, {"rank": "0", "world_size": 4},
                {"rank": 0, "world_size": 2, "names": [1]}):
        with pytest.raises(ValueError):
            identity_from_hello(bad, "n1", None)


def test_rows_from_batch_maps_names_and_nulls():
    ident = identity_from_hello({"job": "j", "rank": 1, "world_size": 2, "names": {"1": "all_reduce", "2": "dp0",
                                                                                  "3": "forward"}}, "n", None)
    step = (7, 10, 20, 5e6, 1e6, 3e6, 0.5e6, 0.5e6, 0.0, 0, -1, 32, -1, 4, 2.5e6, -1.0)   # durations in ns
    s, c, g = rows_from_batch(ident, (step, [(3, 2.5e6)], [(1, 2, 3, 4096, 1e6, 0.8e6)], [(15, 2e6, 2, 10, 0)]))
    assert s["step"] == 7 and s["step_ms"] == 5.0 and s["phases"] == [("forward", 2.5)] and s["samples"] == 32
    assert s["tokens"] is None and s["data_queue"] is None and ident.dropped == 4
    assert s["cpu_ms"] == 2.5 and s["cpu_wait_ms"] is None             # -1: not measured -> null
    assert c == [{"job": "j", "node": "n", "rank": 1, "step": 7, "op": "all_reduce", "group": "dp0", "count": 3,
                  "bytes": 4096, "time_ms": 1.0, "wait_ms": 0.8}]
    assert g[0]["generation"] == 2 and g[0]["t"] == 15 and g[0]["duration_ms"] == 2.0
    t = pa.Table.from_pylist([s], schema=wire.STEPS)
    assert validate("steps", t)[1] == []


def test_bad_datagrams_are_counted_never_fatal(sockdir):
    a = Agent(None, socket_dir=sockdir, node="n1", plugins=["load"]).start()
    try:
        p = Probe().init(job="ok", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=0)
        garbage = [b"", b"hello", os.urandom(200), datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_BATCH, 1, 0, 1, 0, 0, 0),
                   datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, 1, 0, 0, 0, 0, 0) + b'{"rank": "x"}',
                   datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, 1, 0, 0, 0, 0, 0) + b"\x00\xff"]
        for g in garbage:
            _send(a.path, g)
        for _ in range(3):
            p.begin_step()
            p.end_step()
        time.sleep(0.3)
        items = a.tick()
        p.shutdown()
    finally:
        a.close()
    by = {(k, j): t for k, j, t in items}
    assert by[("steps", "ok")].num_rows == 3 and by[("topology", "ok")].num_rows == 1
    st = a.stats()
    # the empty datagram is received too; every bad one is counted
    assert st["bad_datagrams"] == len(garbage) and a.metrics.value(a.metrics.dropped, "bad_datagram") == len(garbage)


def test_records_before_hello_wait_for_it_and_topology_is_sent_once(sockdir):
    a = Agent(None, socket_dir=sockdir, node="n1", job="fallback", plugins=[])
    inst = 1234
    hdr = datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_BATCH, inst, 3, 1, 0, 0, 0)         # a version-1 probe (no CPU fields)
    batch = hdr + datagram.STEP_V1.pack(5, 1, 2, 1.0, 0, 1.0, 0, 0, 0, 0, -1, -1, -1, 0)
    a.handle(batch)
    assert a.tick() == []                                  # held, not dropped
    hello = datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, inst, 3, 0, 0, 0, 0) + b'{"rank": 3, "world_size": 4}'
    a.handle(hello)
    a.handle(hello)                                        # the periodic re-send changes nothing
    items = {(k, j): pa.table(t) for k, j, t in a.tick()}
    assert items[("steps", "fallback")].column("step").to_pylist() == [5]   # job from the agent's --job
    assert items[("topology", "fallback")].to_pylist()[0]["world_size"] == 4
    a.handle(hello.replace(b'"world_size": 4', b'"world_size": 8'))
    items = {(k, j): pa.table(t) for k, j, t in a.tick()}
    assert items[("topology", "fallback")].to_pylist()[0]["world_size"] == 8      # changed: sent again


def test_second_agent_on_a_live_socket_is_refused_stale_one_replaced(sockdir):
    a = Agent(None, socket_dir=sockdir, plugins=[]).start()
    try:
        with pytest.raises(RuntimeError, match="another agent"):
            Agent(None, socket_dir=sockdir, plugins=[]).start()
    finally:
        a.stop_event.set()
        a._rx.join(2)
        a.sock.close()                                     # dies without removing its socket file
    assert os.path.exists(a.path)
    b = Agent(None, socket_dir=sockdir, plugins=[]).start()
    b.close()
    assert not os.path.exists(b.path)


# --------------------------------------------------------------------------- Kafka, spool

def _consume(kafka: KafkaSettings, kinds, want: dict, timeout=30.0):
    c = make_consumer(kafka, f"g-{time.time_ns()}")
    c.subscribe([kafka.topic(k) for k in kinds])
    got: dict[str, list] = {k: [] for k in kinds}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and any(sum(m[2].num_rows for m in got[k]) < n for k, n in want.items()):
            for tp, msgs in c.poll(timeout_ms=300).items():
                for m in msgs:
                    h = dict(m.headers)
                    d = decode(m.value, h["content-type"], h["schema"])
                    assert d.rejected == []
                    got[d.kind].append((m.key, h, d.table))
    finally:
        c.close()
    return got


def test_agent_batches_to_kafka_as_arrow_keyed_by_job(kafka, sockdir, tmp_path):
    a = Agent(kafka, socket_dir=sockdir, node="node-7", spool_dir=tmp_path / "spool").start()
    try:
        p = Probe().init(job="kjob", rank=1, world_size=2, socket_dir=sockdir, auto=False, flush_ms=0)
        for _ in range(5):
            with p.step(samples=8):
                with p.phase("forward"):
                    time.sleep(0.001)
        time.sleep(0.3)
        a.tick()
        p.shutdown()
        a.metrics.serve(port := free_port())
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        a.close()
    assert 'stepwatch_agent_records_out_total{kind="steps"} 5.0' in body
    assert "stepwatch_agent_send_seconds_count" in body and "stepwatch_agent_kafka_up 1.0" in body
    got = _consume(kafka, ("steps", "topology", "host"), {"steps": 5, "topology": 1, "host": 1})
    key, h, t = got["steps"][0]
    assert key == b"kjob" and h["schema"] == b"steps/1" and h["content-type"] == catalog.ARROW_CT.encode()
    rows = _plain(pa.concat_tables([m[2] for m in got["steps"]])).to_pylist()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["node"] == "node-7" and r["rank"] == 1 and r["samples"] == 8 for r in rows)
    assert dict(rows[0]["phases"])["forward"] >= 1.0
    topo = _plain(got["topology"][0][2]).to_pylist()[0]
    assert topo["world_size"] == 2 and topo["agent_version"].startswith("stepwatch-")
    host = _plain(got["host"][0][2]).to_pylist()[0]
    assert host["job"] == "kjob" and host["node"] == "node-7" and host["cpu_util"] is not None
    assert a.stats()["spool_files"] == 0


def _table(kind: str, job: str, steps: range) -> pa.Table:
    rows = [{"job": job, "node": "n", "rank": 0, "step": s, "t_end": 10 + s, "step_ms": 1.0} for s in steps]
    return pa.Table.from_pylist(rows, schema=wire.SCHEMAS[kind])


def test_spool_is_bounded_ordered_and_survives_restart(tmp_path):
    m = AgentMetrics()
    sp = Spool(tmp_path / "sp", max_bytes=1 << 30, metrics=m)
    for i in range(5):
        sp.put("steps", "j", _table("steps", "j", range(i * 10, i * 10 + 10)))
    size = sp.pending()[0].size
    assert len(sp) == 5
    sp2 = Spool(tmp_path / "sp", max_bytes=int(size * 3.5), metrics=m)      # restart with a smaller bound
    assert len(sp2) == 5                                                     # bound applies on the next put
    sp2.put("gc", "j", pa.Table.from_pylist([{"job": "j", "node": "n", "rank": 0, "t": 1, "duration_ms": 1.0}],
                                            schema=wire.GC))
    files = sp2.pending()
    kept = len(files) - 1
    assert 1 <= kept < 5 and [f.kind for f in files] == ["steps"] * kept + ["gc"]     # the oldest went first
    assert sp2.bytes == sum(f.size for f in files) <= sp2.max_bytes
    assert sp2.dropped_rows == 10 * (5 - kept) and m.value(m.dropped, "spool_full") == 10 * (5 - kept)
    kind, job, t = Spool.read(files[0])
    first = (5 - kept) * 10
    t = pa.table(t)
    assert (kind, job) == ("steps", "j") and t.column("step").to_pylist() == list(range(first, first + 10))
    assert not t.schema.metadata


def test_shipper_spools_while_kafka_is_away_then_replays_in_order(kafka, tmp_path):
    dead = KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}", prefix=kafka.prefix)
    m = AgentMetrics()
    sh = Shipper(dead, Spool(tmp_path / "sp", metrics=m), m, send_timeout_s=1.0, retry_s=0.0)
    for i in range(3):
        sh.ship([("steps", "rj", _table("steps", "rj", range(i * 4, i * 4 + 4)))])
    assert len(sh.spool) == 3 and not sh.online
    assert m.value(m.records_spooled, "steps") == 12 and m.value(m.records_out) == 0
    sh.settings = kafka                                 # Kafka is back
    sh.ship([("steps", "rj", _table("steps", "rj", range(12, 16)))])      # queued behind the spool
    sh.replay()
    assert len(sh.spool) == 0 and sh.online
    assert m.value(m.records_out, "steps") == 16
    sh.close()
    got = _consume(kafka, ("steps",), {"steps": 16})
    steps = [s for _, _, t in got["steps"] for s in t.column("step").to_pylist()]
    assert steps == list(range(16))                     # in order, once


def test_register_adds_agent_and_wrap_subcommands():
    import argparse

    from stepwatch.agents.commands import cmd_agent, cmd_wrap, register
    p = argparse.ArgumentParser(prog="stepwatch")
    register(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["agent", "--bootstrap", "k:9092", "--socket-dir", "/run/sw", "--node", "n1", "--job", "j",
                      "--metrics-port", "9109", "--spool-max-mb", "64", "--plugins", "cpu,mem"])
    assert a.func is cmd_agent and a.bootstrap == "k:9092" and a.socket_dir == "/run/sw"
    assert a.metrics_port == 9109 and a.metrics_addr == "127.0.0.1" and a.spool_max_mb == 64.0
    w = p.parse_args(["wrap", "--job", "j1", "--", "torchrun", "--nproc-per-node", "8", "train.py"])
    assert w.func is cmd_wrap and w.job == "j1"
    assert w.command[-4:] == ["torchrun", "--nproc-per-node", "8", "train.py"]


CODECS_CODE = r"""
import argparse, sys
from stepwatch.agents.commands import register, skip_unused_codecs
p = argparse.ArgumentParser(prog="stepwatch")
register(p.add_subparsers(dest="cmd"), ("agent",))
skipped = skip_unused_codecs(p.parse_args(["agent"] + sys.argv[1:]))
import kafka.codec, prometheus_client.exposition
print(skipped, kafka.codec.has_snappy(), kafka.codec.has_zstd(), kafka.codec.has_lz4(),
      prometheus_client.exposition.snappy is not None)
"""


NONE, LZ4, ALL = ("['snappy', 'zstandard', 'lz4'] False False False False", "['snappy', 'zstandard'] False False True False",
                  "[] True True True True")


@pytest.mark.parametrize("args,key,want", [(["--no-kafka"], "k", NONE), (["--bootstrap", "127.0.0.1:1"], None, LZ4),
                                           (["--bootstrap", "127.0.0.1:1", "--no-profiling"], "k", LZ4),
                                           (["--bootstrap", "127.0.0.1:1"], "k", ALL)])
def test_agent_leaves_out_the_codecs_only_where_it_reads_nothing_from_kafka(args, key, want):
    """Without profiling the agent reads nothing from Kafka and pushes no metrics: kafka-python's and
    prometheus_client's optional codecs are left out, all but lz4 where it sends to Kafka (its producer
    compresses with LZ4: nanoarrow's IPC buffers are not). With profiling on (a public key, Kafka) its
    control channel's consumer keeps every installed codec: the commands topic's batches may be compressed."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_PROFILING")}
    if key:
        env["STEPWATCH_PROFILING_PUBLIC_KEY"] = key              # only its presence matters here
    r = subprocess.run([sys.executable, "-c", CODECS_CODE, *args], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == want, (args, key, r.stdout)


def test_agent_cli_serves_until_sigterm(sockdir):
    import signal
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-m", "stepwatch.agents.commands", "agent", "--no-kafka", "--socket-dir", sockdir,
                          "--plugins", "load", "--interval", "0.2"], stderr=subprocess.PIPE, text=True)
    path = os.path.join(sockdir, datagram.SOCKET_NAME)
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert os.path.exists(path)
    pr = Probe().init(job="cli", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=0)
    for _ in range(3):
        pr.begin_step()
        pr.end_step()
    pr.shutdown()
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert "agent stopped" in err and "'datagrams': 4.0" in err and "'ranks': 1" in err   # hello + 3 steps
    assert not os.path.exists(path)


def test_an_unreachable_broker_does_not_slow_the_agents_tick(tmp_path):
    """A broker that takes connections and never answers holds each connection attempt for the whole
    ``send_timeout_s``. Attempted in the tick, that stopped the agent's host samples, liveness and spooling
    for that long every ``retry_s`` (on a GPU machine with no broker: a tick every 5-7 s instead of every
    0.5 s, so host samples were sparse and a rank's death went unreported before the agent stopped). The
    attempts now run beside the tick: it keeps its cadence and spools, and a late close does not wait on
    them past ``send_timeout_s``."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)                                    # the kernel completes the handshake; nobody answers
    try:
        settings = KafkaSettings(bootstrap=f"127.0.0.1:{hole.getsockname()[1]}", prefix="hole.")
        ag = Agent(settings, socket_dir=str(tmp_path / "s"), node="n1", job="j", interval_s=0.2,
                   spool_dir=tmp_path / "sp", send_timeout_s=2.0, retry_s=0.1)
        ag.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:
            ag.tick()
            time.sleep(0.2)
        ticks, took = ag.ticks, time.monotonic() - t0
        t1 = time.monotonic()
        ag.close()
        assert time.monotonic() - t1 <= 2.0 + 1.5     # at most one attempt's timeout, then the last tick
    finally:
        hole.close()
    assert ticks >= 0.6 * took / 0.2, (ticks, took)    # ~15 ticks in 3 s, not one per attempt
    assert not ag.shipper.online and len(ag.spool) >= ticks // 2    # every tick's host rows spooled

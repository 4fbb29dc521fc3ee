"""Targeted profiling (issue 5): signing, every rejection path of the node agent, the issuer's cap, and
the probe running real torch.profiler / py-spy profiles at step boundaries (a real probe and a real
agent over Unix sockets; no Kafka needed here — tests/test_profiling_e2e.py runs the whole pipeline)."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pyarrow as pa
import pytest

from stepwatch.agents import profiling
from stepwatch.agents.profiling import protocol, runner, summary
from stepwatch.agents.agent import Agent
from stepwatch.agents.control import node_partition
from stepwatch.agents.profiling import open_envelope as decode_control, seal as encode_control
from stepwatch.agents.probe import Probe, decode
from stepwatch.wire.datagram import T_PROFILE
from stepwatch.detectors.base import Alert
from stepwatch.stream.align import JobState
from stepwatch.stream.profiling import Issuer, ProfilingSettings, choose_ranks, command_diff

pytestmark = pytest.mark.unit

NODE = "node-a"
PEM, PUB = protocol.keygen()
KEY = profiling.load_private_key(env={protocol.ENV_PRIVATE: PEM.decode()})      # the processor's
KEYS = profiling.load_public_keys(env={protocol.ENV_PUBLIC: PUB})                # nodes' and probes'
WRONG = profiling.load_private_key(env={protocol.ENV_PRIVATE: protocol.keygen()[0].decode()})


@pytest.fixture(autouse=True)
def _probe_public_key(monkeypatch):
    monkeypatch.setenv(protocol.ENV_PUBLIC, PUB)         # the training process verifies commands itself


# ---------------------------------------------------------------------------- signing

def test_seal_open_round_trip_and_tampering():
    c = protocol.new_command("j", NODE, [3, 1], 5, "torch", "alert1", reference=[1])
    env = encode_control(c, KEY)
    back = decode_control(env, KEYS)
    assert back == dict(c, ranks=[1, 3])
    # the canonical form does not depend on rank order
    assert profiling.canonical(c) == profiling.canonical(dict(c, ranks=[1, 3]))
    body = env[protocol.ENVELOPE_HDR:]
    for field, v in (("ranks", [1, 3, 4]), ("steps", 500), ("node", "node-b"), ("expires_at", c["expires_at"] + 1),
                     ("reference", [3]), ("kind", "py-spy"), ("job", "other")):
        altered = env[:protocol.ENVELOPE_HDR] + profiling.canonical(dict(c, **{field: v}))
        with pytest.raises(protocol.BadCommand) as e:
            decode_control(altered, KEYS)
        assert e.value.reason == "bad_signature", field
    assert body == profiling.canonical(c)
    with pytest.raises(protocol.BadCommand, match="unknown_key"):
        decode_control(encode_control(c, WRONG), KEYS)
    for junk in (b"", b"SWC2", json.dumps(c).encode(), b"\x00" * 100):
        with pytest.raises(protocol.BadCommand, match="bad_envelope"):
            decode_control(junk, KEYS)


def test_keys_from_env_or_file(tmp_path):
    from stepwatch.stream.profiling_cli import cmd_keygen
    assert cmd_keygen([str(tmp_path)]) == 0
    priv = tmp_path / "profiling-signing-key.pem"
    assert os.stat(priv).st_mode & 0o777 == 0o600
    k = profiling.load_private_key(env={protocol.ENV_PRIVATE_FILE: str(priv)})
    pub = (tmp_path / "profiling-public-key.txt").read_text().strip()
    assert protocol.public_key_text(k) == pub
    keys = profiling.load_public_keys(env={protocol.ENV_PUBLIC_FILE: str(tmp_path / "profiling-public-key.txt")})
    c = protocol.new_command("j", NODE, [0], 1)
    assert profiling.open_envelope(profiling.seal(c, k), keys)["cmd_id"] == c["cmd_id"]
    assert cmd_keygen([str(tmp_path)]) == 1                      # never overwrites a private key
    assert profiling.load_private_key(env={}) is None
    with pytest.raises(protocol.KeyError_, match="cannot read") as e:
        profiling.load_public_keys(env={protocol.ENV_PUBLIC_FILE: str(tmp_path / "missing")})
    with pytest.raises(protocol.KeyError_, match="not an Ed25519 key"):
        profiling.load_public_keys(env={protocol.ENV_PUBLIC: "c2hvcnQ="})
    assert pub not in str(e.value)


def test_node_partition_matches_the_producer_partitioner():
    from kafka.partitioner.default import DefaultPartitioner

    class Cluster:
        def topics(self):
            return {"t.control"}

        def partitions_for_topic(self, t):
            return set(range(8))

        def available_partitions_for_topic(self, t):
            return set(range(8))

    got = {node_partition(n, 8) for n in ("node-a", "node-b", "gpu-0042", "x")}
    assert len(got) > 1
    for node in ("node-a", "node-b", "gpu-0042", "x"):
        assert node_partition(node, 8) == DefaultPartitioner().partition("t.control", node, node.encode(), None, None,
                                                                         Cluster())


# ---------------------------------------------------------------------------- agent: rejection paths

class Served:
    """A real agent (no Kafka) serving real probes of this process over its Unix sockets."""

    def __init__(self, socket_dir, ranks=(0, 1), cooldown_s=0.0, job="pj"):
        self.agent = Agent(None, socket_dir=socket_dir, node=NODE, interval_s=0.2, plugins=[])
        self.agent.enable_profiling(KEYS, os.path.join(socket_dir, "traces"), cooldown_s=cooldown_s)
        self.agent.start()
        self.job = job
        self.probes = {}
        for r in ranks:
            p = Probe().init(job=job, rank=r, world_size=len(ranks), socket_dir=socket_dir, auto=False, flush_ms=0)
            self.probes[r] = p
        self.step(1)
        self.settle()
        assert {i.rank for i in self.agent.idents.values()} == set(ranks)

    def step(self, n=1, work=None):
        for _ in range(n):
            for r, p in self.probes.items():
                p.begin_step()
                if work:
                    work(r)
                p.end_step()

    def settle(self, t=0.3):
        time.sleep(t)
        self.agent.drain()

    def cmd(self, ranks, key=KEY, node=NODE, **kw):
        """A sealed command (the bytes of a ``control`` message); ``key=None``: an unsealed JSON one."""
        c = protocol.new_command(self.job, node, ranks, kw.pop("steps", 3), kw.pop("kind", "torch"),
                                  kw.pop("reason", "a1"), **kw)
        return json.dumps(c).encode() if key is None else profiling.seal(c, key)

    def rows(self):
        return self.agent.control.take_rows()

    def close(self):
        for p in self.probes.values():
            p.shutdown()
        self.agent.close()


@pytest.fixture
def served(socket_dir):
    s = Served(socket_dir)
    yield s
    s.close()


def _only(rows, **want):
    assert rows and all(all(r[k] == v for k, v in want.items()) for r in rows), rows
    return rows


def test_agent_rejects_unsigned_forged_expired_and_replayed_commands(served):
    ctl = served.agent.control
    m = ctl.metrics
    r = _only(ctl.handle_message(served.cmd([0], key=None)), status="rejected", rank=None)
    assert r[0]["detail"].startswith("bad_envelope") and r[0]["cmd_id"].startswith("sha256:")
    forged = bytearray(served.cmd([0]))
    forged[-5] ^= 1                           # altered after signing
    r = _only(ctl.handle_message(bytes(forged)), status="rejected", rank=None)
    assert r[0]["detail"].startswith("bad_signature")
    r = _only(ctl.handle_message(served.cmd([0], key=WRONG)), status="rejected")
    assert r[0]["detail"].startswith("unknown_key")
    old = served.cmd([0], ttl_s=1.0, now_ns=time.time_ns() - 5_000_000_000)
    assert ctl.handle_message(old) == []      # expired before the agent started: a backlog, skipped quietly
    assert m.rejected.labels("stale")._value.get() == 1
    ctl.t_start_ns -= 60_000_000_000          # an agent up for a minute reports it
    r = _only(ctl.handle_message(old), status="expired")
    assert "expired" in r[0]["detail"]
    # the first copy is taken (no rows until the probe answers), the replay is refused
    good = served.cmd([0], reason="a7")
    assert ctl.handle_message(good) == []
    r = _only(ctl.handle_message(good), status="rejected", reason="a7", rank=0)
    assert r[0]["detail"].startswith("replay")
    for why in ("bad_envelope", "bad_signature", "unknown_key", "expired", "replay"):
        assert m.rejected.labels(why)._value.get() >= 1, why
    # a command for another node is not ours: no row
    assert ctl.handle_message(served.cmd([0], node="node-z")) == []
    assert ctl.handle_message(served.cmd([0]), key=b"node-z") == []
    # the rows are shipped as the profiles table
    ctl.rows += [{"cmd_id": "x", "job": "pj", "status": "busy", "t": time.time_ns()}]
    items = served.agent.tick()
    kinds = {k for k, _, _ in items}
    assert "profiles" in kinds
    st = {(j, x) for k, j, t in items if k == "profiles" for x in pa.table(t).column("status").to_pylist()}
    # unverifiable messages name no job we could trust: their rows go under the agent's --job ('default')
    assert st >= {("default", "rejected"), ("pj", "rejected"), ("pj", "expired")}, st


def test_agent_busy_rank_and_node_cooldown(socket_dir):
    s = Served(socket_dir, cooldown_s=0.0)
    try:
        ctl = s.agent.control
        assert ctl.handle_message(s.cmd([0], steps=50)) == []          # forwarded: rank 0 profiles
        _only(ctl.handle_message(s.cmd([0])), status="busy", rank=0)
        # rank 1 is free; unknown ranks fail
        r = ctl.handle_message(s.cmd([1, 7]))
        assert [(x["rank"], x["status"]) for x in r] == [(7, "failed")]
        assert ctl.metrics.rejected.labels("busy")._value.get() == 1
        # the probe itself also refuses a second command while it profiles (an agent restart forgot)
        ctl.active.clear()
        assert ctl.handle_message(s.cmd([0])) == []
        s.step(1)
        s.settle()
        s.step(1)
        s.settle()
        rows = ctl.take_rows()
        assert any(x["status"] == "busy" and x["rank"] == 0 and "still running" in x["detail"] for x in rows), rows
        ctl.cooldown_s = 3600
        ctl.last_accept = time.monotonic()
        r = _only(ctl.handle_message(s.cmd([1])), status="rejected", rank=1)
        assert r[0]["detail"].startswith("cooldown")
    finally:
        s.close()


def test_agent_limits_steps_lifetime_and_rejection_rows(served):
    ctl = served.agent.control
    _only(ctl.handle_message(served.cmd([0], steps=10_000)), status="rejected")
    _only(ctl.handle_message(served.cmd([0], ttl_s=10 * 86400)), status="rejected")
    ctl.reject_rows_per_min = 3
    for _ in range(10):
        ctl.handle_message(served.cmd([0], key=None))
    assert len([r for r in ctl.take_rows() if r["detail"].startswith("bad_envelope")]) == 3
    assert ctl.metrics.rejected.labels("bad_envelope")._value.get() == 10


# ---------------------------------------------------------------------------- issuer: cap

class _Producer:
    def __init__(self):
        self.sent = []

    def send(self, topic, value, key=None, headers=None):
        self.sent.append((topic, value, key, headers))

    def flush(self, timeout=None):
        pass


class _Kafka:
    def topic(self, n):
        return "t." + n


def _state(world=8, slow=5, tp=None):
    st = JobState("cj", world_size=world, capacity=16)
    import pyarrow as pa
    from stepwatch.wire import tables as wire
    from stepwatch.wire.decode import conform
    topo = {"job": ["cj"] * world, "rank": list(range(world)), "node": [f"n{r // 4}" for r in range(world)],
            "world_size": [world] * world}
    if tp:
        topo["tp"] = [r % tp for r in range(world)]
    st.set_topology(conform(pa.table(topo), wire.TOPOLOGY))
    for s in range(10):
        step_ms = np.full(world, 100.0)
        wait = np.full(world, 20.0)
        wait[slow] = 0.0
        wait[2] = 15.0                      # rank 2 is a bit busier than the others, still healthy
        rows = [{"job": "cj", "node": f"n{r // 4}", "rank": r, "step": s, "t_start": s * 10**9,
                 "t_end": s * 10**9 + 10**8, "step_ms": step_ms[r], "comm_wait_ms": wait[r]} for r in range(world)]
        st.ingest(conform(pa.Table.from_pylist(rows), wire.STEPS))
    return st


def test_issuer_picks_a_reference_and_signs_one_command_per_node():
    st = _state()
    sus, ref = choose_ranks(st, [5])
    assert sus == [5] and len(ref) == 1 and ref[0] not in (5, 2)
    # a job-wide alert (no ranks): the busiest rank is the suspect
    assert choose_ranks(st, [])[0] == [5]
    prod = _Producer()
    iss = Issuer(ProfilingSettings(key=KEY, max_in_flight=4), _Kafka(), prod)
    a = Alert(job="cj", kind="slow_rank", status="firing", step_first=3, step_detected=8, t_detected=1, ranks=[5])
    assert iss.on_alert(st, a) == []
    cmds = [decode_control(v, KEYS) for _, v, _, _ in prod.sent]      # raises unless sealed with KEY
    assert {c["node"] for c in cmds} <= {"n0", "n1"}
    assert sorted(r for c in cmds for r in c["ranks"]) == sorted([5] + ref)
    assert all(k == c["node"].encode() for (_, _, k, _), c in zip(prod.sent, cmds))
    assert iss.in_flight() == 2
    # not a configured kind / not firing: nothing
    assert iss.on_alert(st, Alert(job="cj", kind="jitter", status="firing", step_first=1, step_detected=2,
                                  t_detected=1, ranks=[1])) == []


def test_reference_runs_the_same_part_of_the_model():
    """With tensor parallelism the reference has the suspect's tp coordinate (same shard of every
    layer), healthy and closest to the median busy time."""
    st = _state(world=16, slow=5, tp=4)
    sus, ref = choose_ranks(st, [5])
    assert sus == [5] and ref[0] % 4 == 5 % 4 and ref[0] != 5
    big = _state(world=4096, slow=4000, tp=8)                   # columnar: no per-rank Python loop
    t = time.perf_counter()
    sus, ref = choose_ranks(big, [4000])
    assert ref[0] % 8 == 4000 % 8 and ref[0] != 4000 and time.perf_counter() - t < 0.5


def test_issuer_refuses_past_the_cap_and_frees_slots_on_answers():
    st = _state()
    prod = _Producer()
    iss = Issuer(ProfilingSettings(key=KEY, max_in_flight=3), _Kafka(), prod)
    a1 = Alert(job="cj", kind="slow_rank", status="firing", step_first=3, step_detected=8, t_detected=1, ranks=[5])
    a2 = Alert(job="cj", kind="slow_rank", status="firing", step_first=4, step_detected=9, t_detected=1, ranks=[6])
    assert iss.on_alert(st, a1) == []
    n_sent = len(prod.sent)
    rows = iss.on_alert(st, a2)                     # 2 in flight + 2 new > 3
    assert len(prod.sent) == n_sent and iss.capped == 1
    assert rows and all(r["status"] == "rejected" and r["detail"].startswith("cap") and r["reason"] == a2.alert_id
                        for r in rows)
    assert {r["role"] for r in rows} == {"suspect", "reference"}
    # answers free the slots
    import pyarrow as pa
    (p,) = iss.pending.values()
    iss.on_results(pa.Table.from_pylist([{"cmd_id": p.cmd_id, "rank": r, "status": "failed"} for r in p.ranks()]))
    assert iss.in_flight() == 0
    assert iss.on_alert(st, a2) == []


# ---------------------------------------------------------------------------- summaries and diff

def test_summary_and_diff_of_real_torch_profiles_name_the_slow_op():
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function
    x = torch.randn(64, 64)

    def run(slow):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(3):
                (x @ x).relu()
                if slow:
                    with record_function("slow_op"):
                        time.sleep(0.02)
                p.step()
        return summary.torch_summary(p.key_averages(), 3)

    s, r = run(True), run(False)
    assert s["unit"] == "ms/step" and s["steps"] == 3
    top = {o["name"]: o for o in s["top"]}
    assert 15 < top["slow_op"]["self_ms"] < 200 and top["slow_op"]["calls"] == 1
    d = summary.diff(s, r)
    assert d["slower"][0]["name"] == "slow_op" and d["slower"][0]["ratio"] is None
    assert d["delta_total_ms"] > 10                 # 20 ms of sleep per step (other operators vary on a busy machine)
    assert "slow_op" in summary.format_diff(d).splitlines()[3]
    res = {1: {"status": "ok", "summary": json.dumps(s)}, 2: {"status": "ok", "summary": json.dumps(r)}}
    assert command_diff([1], [2], res)["slower"][0]["name"] == "slow_op"
    assert command_diff([1], [3], res) is None


def test_trace_file_summary_in_a_child_process_equals_the_profilers_own(tmp_path):
    """The probe summarises the exported Chrome trace in a child process (no profiler post-processing
    in the training process): the self times must be the profiler's own key_averages()."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(16, 32)

    def step():
        with record_function("slow_op"):
            time.sleep(0.01)
            (x @ x.T).sum()                        # a child inside the range: not the range's own time
        m(x).pow(2).mean().backward()
        opt.step()

    step()                                         # first calls (thread pools, allocator) outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(4):
            step()
    path = str(tmp_path / "trace.json")
    p.export_chrome_trace(path)
    want = {o["name"]: o for o in summary.torch_summary(p.key_averages(), 4, top=1000)["top"]}
    got = summary.summarize_in_subprocess(path, 4)
    assert got["steps"] == 4 and got["unit"] == "ms/step"
    slow = {o["name"]: o for o in got["top"]}["slow_op"]
    assert slow["self_ms"] >= 10.0 and slow["calls"] == 1.0     # the sleep, without its child matmul
    for o in got["top"]:
        assert o["self_ms"] == pytest.approx(want[o["name"]]["self_ms"], abs=2e-4), o["name"]
    gz = str(tmp_path / "trace.json.gz")                 # the probe's way: summary + compressed copy
    again = summary.summarize_in_subprocess(path, 4, gzip_to=gz)
    assert again == got and not os.path.exists(path)
    import gzip
    with gzip.open(gz, "rt") as f:
        assert json.load(f)["traceEvents"]
    with pytest.raises(RuntimeError, match="trace summary failed"):
        summary.summarize_in_subprocess(str(tmp_path / "missing.json"), 4)


def test_pyspy_raw_summary():
    raw = "<module> (t.py:9);train (t.py:5);slow (t.py:2) 30\n<module> (t.py:9);train (t.py:6);slow (t.py:3) 10\n" \
          "<module> (t.py:9);train (t.py:7) 20\n"
    s = summary.pyspy_summary(raw, steps=2, rate=100)
    assert s["samples"] == 60 and s["top"][0] == {"name": "slow (t.py)", "self_ms": 200.0, "samples": 40}


# ---------------------------------------------------------------------------- the probe runs profiles

def _wait_rows(s, n_steps=40, want=1, work=None, status=None):
    rows = []
    for _ in range(n_steps):
        s.step(1, work)
        time.sleep(0.02)
        s.agent.drain()
        rows += s.agent.control.take_rows()
        if len([r for r in rows if status is None or r["status"] == status]) >= want:
            break
    for _ in range(100):
        if len([r for r in rows if status is None or r["status"] == status]) >= want:
            break
        time.sleep(0.1)
        s.agent.drain()
        rows += s.agent.control.take_rows()
    return rows


def test_probe_profiles_exactly_n_steps_with_torch_profiler(served):
    torch = pytest.importorskip("torch")
    x = torch.randn(32, 32)

    def work(rank):
        y = x @ x
        if rank == 1:
            with torch.profiler.record_function("slow_op"):
                time.sleep(0.005)
        y.sum()

    ctl = served.agent.control
    # one torch profiler per process: the two probes of this test process take turns (ranks are
    # separate processes in real use, see test_profiling_e2e.py)
    ok = {}
    for rank in (1, 0):
        assert ctl.handle_message(served.cmd([rank], steps=4, reference=[0], reason="al")) == []
        rows = _wait_rows(served, work=work, status="ok")
        ok.update({r["rank"]: r for r in rows if r["status"] == "ok"})
    assert set(ok) == {0, 1}, rows
    for r, row in ok.items():
        path = row["uri"][len("file://"):]
        assert os.path.basename(path) == f"pj-r{r}-{row['cmd_id']}.json.gz" and os.path.getsize(path) == row["bytes"]
        summ = json.loads(row["summary"])
        assert summ["steps"] == 4 == row["steps"] and row["finished_at"] > row["started_at"]
        assert row["reason"] == "al" and row["role"] == ("reference" if r == 0 else "suspect")
    # exactly 4 steps: one matmul per probe per step (the profiler sees the whole test process)
    top = {o["name"]: o for o in json.loads(ok[1]["summary"])["top"]}
    assert top["aten::mm"]["calls"] == 2 and top["slow_op"]["calls"] == 1 and top["slow_op"]["self_ms"] >= 4
    assert not ctl.active and not any(p._ctl_active for p in served.probes.values())
    assert ctl.metrics.done.labels("ok")._value.get() == 2


def test_probe_stops_at_the_deadline(served):
    pytest.importorskip("torch")
    ctl = served.agent.control
    assert ctl.handle_message(served.cmd([0], steps=200, ttl_s=1.5)) == []
    t0 = time.monotonic()
    rows = _wait_rows(served, n_steps=400, work=lambda r: time.sleep(0.01))
    assert time.monotonic() - t0 < 15
    (r,) = [x for x in rows if x["rank"] == 0]
    assert r["status"] == "ok" and "deadline" in r["detail"] and 0 < r["steps"] < 200, r


def test_probe_runs_py_spy_or_reports_why_not(served, monkeypatch):
    ctl = served.agent.control

    def busy_python_function(rank):
        t = time.perf_counter()
        while time.perf_counter() - t < 0.03:
            sum(range(2000))

    if runner.pyspy_binary() is None:
        pytest.skip("py-spy is not installed")
    assert ctl.handle_message(served.cmd([0], steps=20, kind="py-spy")) == []
    rows = _wait_rows(served, n_steps=200, work=busy_python_function)
    (r,) = [x for x in rows if x["rank"] == 0]
    if r["status"] == "failed" and "ermission" in (r["detail"] or ""):
        # the reason is reported on `profiles`; the sampling itself cannot be checked here: say so
        pytest.skip(f"this machine refuses ptrace to py-spy (see docs/profiling.md): {r['detail']}")
    assert r["status"] == "ok" and r["uri"].endswith(".pyspy.txt"), r
    names = [o["name"] for o in json.loads(r["summary"])["top"][:3]]
    assert any("busy_python_function" in n for n in names), names


def test_py_spy_missing_is_reported_as_failed(served, monkeypatch):
    monkeypatch.setenv("STEPWATCH_PYSPY", "/nonexistent/py-spy")
    assert served.agent.control.handle_message(served.cmd([1], kind="py-spy")) == []
    rows = _wait_rows(served, n_steps=20)
    (r,) = [x for x in rows if x["rank"] == 1]
    assert r["status"] == "failed" and "py-spy is not installed" in r["detail"]


def test_result_datagram_decodes():
    from stepwatch.wire.datagram import HDR, MAGIC, VERSION
    d = HDR.pack(MAGIC, VERSION, T_PROFILE, 7, 3, 0, 0, 0, 0) + b'{"cmd_id":"c","status":"ok"}'
    assert decode(d) == [(T_PROFILE, 7, 3, {"cmd_id": "c", "status": "ok"})]


# ---------------------------------------------------------------------------- agent: trace retention

def _trace(d, name, kib, age_s):
    p = os.path.join(d, name)
    with open(p, "wb") as f:
        f.write(b"x" * (kib << 10))
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


def test_prune_traces_deletes_the_oldest_beyond_the_budget(tmp_path):
    from stepwatch.agents.control import prune_traces
    d = str(tmp_path)
    old = _trace(d, "j-r1-a.json.gz", 400, 300)
    mid = _trace(d, "j-r2-b.pyspy.txt", 400, 200)
    new = _trace(d, "j-r1-c.json.gz", 400, 100)
    running = _trace(d, "j-r3-d.json.gz", 400, 400)      # oldest, but its profile is still running
    other = _trace(d, "notes.txt", 4000, 500)              # not a trace: neither counted nor deleted
    os.mkdir(os.path.join(d, "sub.json.gz"))               # a directory with a trace-like name: ignored
    assert prune_traces(d, 1000 << 10, protect={"j-r3-d.json.gz"}) == (2, 800 << 10)
    assert [os.path.exists(p) for p in (old, mid, new, running, other)] == [False, False, True, True, True]
    assert prune_traces(d, 1000 << 10) == (0, 0)           # within the budget now
    assert prune_traces(str(tmp_path / "missing"), 1) == (0, 0)


def test_agent_keeps_the_trace_directory_within_keep_mb(socket_dir):
    from types import SimpleNamespace
    traces = os.path.join(socket_dir, "traces")
    os.mkdir(traces)
    agent = Agent(None, socket_dir=socket_dir, node=NODE, interval_s=0.2, plugins=[])
    agent.enable_profiling(KEYS, traces, keep_mb=1.0)
    c = agent.control
    try:
        old = [_trace(traces, f"pj-r0-old{i}.json.gz", 512, 1000 - i) for i in range(3)]   # 1.5 MiB at start
        c.take_rows()                                       # the first tick prunes what is already there
        assert [os.path.exists(p) for p in old] == [False, True, True]
        new = _trace(traces, "pj-r1-new.json.gz", 512, 0)
        c.take_rows()
        assert os.path.exists(old[1]), "nothing is pruned until a profile finishes"
        c.on_result(SimpleNamespace(job="pj", rank=1, node=NODE), {"cmd_id": "new", "status": "ok", "kind": "torch"})
        rows = c.take_rows()
        assert [r["status"] for r in rows] == ["ok"]
        assert [os.path.exists(p) for p in old[1:] + [new]] == [False, True, True]
        assert agent.metrics.registry.get_sample_value("stepwatch_agent_profile_traces_deleted_total") == 2
    finally:
        agent.close()
    off = Agent(None, socket_dir=socket_dir, node=NODE, interval_s=0.2, plugins=[]).enable_profiling(KEYS, traces)
    try:
        _trace(traces, "pj-r0-big.json.gz", 4096, 2000)
        off.control.take_rows()
        assert len(os.listdir(traces)) == 3                 # keep_mb 0 (the default): nothing deleted
    finally:
        off.close()

"""The probe's in-flight state (watchdog) and step kinds, on both hot paths (C and pure Python); the agent's
``inflight`` rows; hang localization from in-flight rows (detectors.hang)."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest

from stepwatch.wire import tables as wire
from stepwatch.agents.agent import Agent
from stepwatch.agents.inflight import Liveness, process_state
from stepwatch.agents.probe import eventlog
from stepwatch.agents.probe.watchdog import Watchdog
from stepwatch.wire import datagram
from stepwatch.detectors import hang
from stepwatch.detectors.base import JobContext
from stepwatch.detectors.context import JobTelemetry
from testkit import job_context

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch", reason="the probe's automatic hooks instrument PyTorch")

from probe_helpers import Rx, gloo, probe, rx, split  # noqa: E402,F401 - shared fixtures

# a stand-in collective whose frame looks like torch.distributed's (the watchdog names the op from it)
_SRC = "def all_reduce(tensor, op=None, group=None, async_op=False):\n    return _hook(group)\n"


def _fake_collective(hook):
    ns = {"_hook": hook}
    exec(compile(_SRC, "/fake/torch/distributed/distributed_c10d.py", "exec"), ns)
    return ns["all_reduce"]


def test_sequence_numbers_per_group_op_and_stack_of_a_running_collective(probe, rx, sockdir, gloo):
    dist = gloo
    probe.init(job="seq", socket_dir=sockdir, flush_ms=0)
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=0.1)
    t = torch.ones(8)
    for _ in range(3):                           # 3 steps x (2 all_reduce + 1 broadcast) on the world group
        dist.all_reduce(t)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.barrier(async_op=True).wait()       # Work.wait() is no collective of its own
        w.grad = torch.ones(4)
        opt.step()
    wd = probe.make_watchdog(period_s=0)
    seen = {}

    def inside(group):
        seen.update(wd.state(eventlog._perf()))
        return None
    fake = probe.hooks._wrap_collective(dist, "all_reduce", _fake_collective(inside))
    fake(t)                                      # (events still in the log: the watchdog peeks at them)
    assert seen["state"] == "collective" and seen["op"] == "all_reduce" and seen["group"] == "world"
    assert seen["seq"] == 3 * 4 + 1 and seen["group_size"] == 1   # barrier counts, Work.wait() does not
    assert seen["step"] == 3 and seen["_open"]
    lines = seen["stack"].splitlines()                   # innermost last: the hook called from the collective
    assert lines[-1].endswith("in inside") and lines[-2].endswith("distributed_c10d.py:2 in all_reduce")
    assert lines[-3].startswith(__file__) and "probe.py" not in seen["stack"]       # (no probe frames)
    assert seen["since"] > 0 and seen["t"] >= seen["since"]
    probe.flush()
    assert sum(probe.fold._seq[s] for s in range(len(probe.names.comm_slot)) if s != probe.hooks.wait_slot) == 13


def test_step_kinds_first_eval_checkpoint_and_the_explicit_api(probe, rx, sockdir):
    probe.init(job="kinds", socket_dir=sockdir, flush_ms=0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step():
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    train_step()                                  # step 0: the first step
    train_step()                                  # step 1: plain
    model.eval()                                  # step 2: evaluation
    with torch.no_grad():
        model(torch.ones(1, 4))
    model.train()
    time.sleep(0.02)
    train_step()
    torch.save(model.state_dict(), io.BytesIO())  # step 3: a checkpoint save
    train_step()
    probe.mark_step_kind("eval")                  # step 4: marked by hand
    train_step()
    train_step()                                  # step 5: plain
    hello, names, steps, comm, gcs = split(rx.read())
    kinds = {s["step"]: {names[i]: ms for i, ms in s["phases"] if names[i] in eventlog.KIND_PHASES} for s in steps}
    assert set(kinds[0]) == {"first_step"} and kinds[0]["first_step"] > 0
    assert kinds[1] == {} and kinds[5] == {}
    assert set(kinds[2]) == {"eval"} and kinds[2]["eval"] >= 15           # from model.eval() to the step end
    assert set(kinds[3]) == {"checkpoint"} and kinds[3]["checkpoint"] > 0  # time inside torch.save
    assert set(kinds[4]) == {"eval"}


def test_watchdog_sends_the_state_of_an_overlong_step_and_when_it_ends(probe, rx, sockdir):
    probe.init(job="wd", socket_dir=sockdir, flush_ms=0)
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=0.1)

    def stuck_in_python(s):
        time.sleep(s)
    for i in range(8):
        w.grad = torch.ones(4)
        opt.step()
        time.sleep(0.01)
    wd = probe._wd
    assert isinstance(wd, Watchdog) and wd.thread.is_alive()
    wd.period_s, wd.min_s, wd.factor = 0.1, 0.4, 5.0        # (the next wake takes these)
    model = torch.nn.Linear(2, 2)
    model.eval()                                             # this step is an evaluation
    stuck_in_python(1.2)
    opt.step()
    time.sleep(0.3)
    msgs = [m for m in rx.read() if m[0] == datagram.T_INFLIGHT]
    assert msgs, "no in-flight state sent"
    first, last = msgs[0][3], msgs[-1][3]
    assert first["state"] == "compute" and first["kinds"] == ["eval"] and first["elapsed_ns"] >= 0.4e9
    assert first["stack"].splitlines()[-1].endswith("in stuck_in_python")
    assert first["step"] == 8 and first["pid"] == os.getpid()
    assert last["state"] == "done" and last["step"] == 8
    assert len(msgs) <= 4                                    # not one per wake: when it changes, or every 5 s


def test_agent_turns_in_flight_datagrams_into_rows_and_sees_stopped_processes(sockdir):
    ag = Agent(None, socket_dir=sockdir, node="n1")
    ag.handle(datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, 7, 2, 0, 0, 0, 0) + json.dumps(
        {"job": "j", "rank": 2, "world_size": 4, "pid": 1, "names": {}}).encode())
    body = {"state": "collective", "step": 5, "t": 1_800_000_000_000_000_000, "since": 1_799_999_999_000_000_000,
            "op": "all_reduce", "group": "world", "seq": 9, "group_size": 4, "kinds": ["eval"],
            "elapsed_ns": 2_000_000_000, "stack": "a.py:1 in f", "pid": 123}
    ag.handle(datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_INFLIGHT, 7, 2, 0, 0, 0, 0) + json.dumps(body).encode())
    ag.handle(datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_INFLIGHT, 7, 2, 0, 0, 0, 0) + json.dumps(dict(body, state="x")).encode())
    assert ag.bad == 1                                       # a bad state is refused
    items = {k: pa.table(t) for k, j, t in ag.tick()}
    r = items["inflight"].to_pylist()[0] if False else items["inflight"].drop_columns(["t", "since"]).to_pylist()[0]
    assert r["rank"] == 2 and r["node"] == "n1" and r["op"] == "all_reduce" and r["seq"] == 9
    assert r["step_kind"] == "eval" and r["elapsed_ms"] == 2000.0 and r["source"] == "probe"
    # the agent's own view: a stopped process, a gone one
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(50):
            if process_state(child.pid) == "stopped":
                break
            time.sleep(0.05)
        assert process_state(child.pid) == "stopped"
        ident = ag.idents[7]
        ident.hello["pid"] = child.pid
        rows = Liveness().rows(ag.idents, "n1", time.monotonic(), time.time_ns())
        assert [(x["rank"], x["state"], x["source"]) for x in rows] == [(2, "stopped", "agent")]
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == "gone"


def _ctx(R: int, rows: list[dict]) -> JobContext:
    tel = JobTelemetry()
    t = pa.Table.from_pylist([dict(job="j", node=f"n{r['rank'] // 4}", **r) for r in rows], schema=wire.INFLIGHT)
    tel.add("inflight", t)
    ctx = job_context(R, 4, last_step=np.full(R, 19), last_t_end=np.zeros(R, np.int64))
    tel.attach(ctx)
    return ctx


def _coll(rank, op="all_reduce", seq=21, group="world", t=10):
    return dict(rank=rank, t=t, source="probe", state="collective", step=20, op=op, group=group, seq=seq,
                group_size=8, stack=f"train.py:70 in train\nc10d.py:1 in {op}", since=5)


def test_locate_names_the_ranks_that_never_arrived():
    R = 8
    base = [_coll(r) for r in range(R) if r not in (3, 6)]
    # a rank in compute: named with its stack line
    ctx = _ctx(R, base + [dict(rank=3, t=10, source="probe", state="compute", step=20,
                               stack="train.py:60 in train\ntrain.py:29 in load_next_shard")])
    loc = hang.locate(ctx, 0)
    assert loc["ranks"] == [3, 6]                    # 6 sent nothing at all: named after the compute rank
    c = loc["evidence"]["inflight"]["culprits"]
    assert c[0]["what"] == "compute" and c[0]["at"] == "train.py:29 in load_next_shard" and c[0]["node"] == "n0"
    assert c[1]["what"] == "no_report"
    assert loc["evidence"]["inflight"]["waiting"]["op"] == "all_reduce"
    assert loc["evidence"]["inflight"]["waiting"]["ranks"] == 6 and "load_next_shard" in loc["suggestion"]
    # a mismatch beats an earlier seq; an agent-seen stopped process beats both
    rows = base + [_coll(3, op="broadcast"), _coll(6, seq=20)]
    loc = hang.locate(_ctx(R, rows), 0)
    assert loc["ranks"] == [3, 6] and [c["what"] for c in loc["evidence"]["inflight"]["culprits"]] == \
        ["mismatch", "behind"]
    assert loc["evidence"]["inflight"]["mismatch"] is True
    rows = base + [_coll(3, op="broadcast"), dict(rank=6, t=11, source="agent", state="stopped", pid=99)]
    loc = hang.locate(_ctx(R, rows), 0)
    assert [c["what"] for c in loc["evidence"]["inflight"]["culprits"]] == ["stopped", "mismatch"]
    assert "kill -CONT 99" in loc["suggestion"]
    # the newest row of a rank counts; rows before the hang do not
    rows = base + [_coll(3, op="broadcast", t=10), dict(_coll(3), t=12), _coll(6, t=1)]
    loc = hang.locate(_ctx(R, rows), 5)
    assert loc["ranks"] == [6] and loc["evidence"]["inflight"]["culprits"][0]["what"] == "no_report"
    # step kinds of the step in progress
    ctx = _ctx(R, [dict(_coll(r), step_kind="eval") for r in range(R)])
    assert hang.kinds_in_progress(ctx, 0) == {"eval"}


def test_watchdog_of_a_rank_reports_its_first_step(probe, rx, sockdir):
    """A rank process (RANK known) starts its watchdog at init: a first step that runs long is reported
    with the kind "first" (the processor's hang_first_s applies)."""
    probe.init(job="first", rank=0, world_size=1, socket_dir=sockdir, flush_ms=0)
    wd = probe._wd
    assert isinstance(wd, Watchdog) and wd.thread.is_alive()
    wd.period_s, wd.min_s = 0.1, 0.3
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=0.1)
    probe.begin_step()                            # (explicit mode: the first step opens here)

    def compiling(s):
        time.sleep(s)
    compiling(1.6)                               # (the first wake is 1 s after init)
    probe.end_step()
    time.sleep(0.3)
    msgs = [m[3] for m in rx.read() if m[0] == datagram.T_INFLIGHT]
    assert msgs and msgs[0]["kinds"] == ["first"] and msgs[0]["step"] == 0, msgs
    assert msgs[0]["stack"].splitlines()[-1].endswith("in compiling") and msgs[-1]["state"] == "done"


def test_agent_bounds_in_flight_rows_per_probe_instance(sockdir):
    ag = Agent(None, socket_dir=sockdir, node="n1")
    ag.handle(datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, 9, 0, 0, 0, 0, 0) + json.dumps(
        {"job": "j", "rank": 0, "world_size": 1, "pid": 1, "names": {}}).encode())
    d = datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_INFLIGHT, 9, 0, 0, 0, 0, 0) + json.dumps(
        {"state": "compute", "step": 1, "t": 1_800_000_000_000_000_000}).encode()
    for _ in range(50):                           # a flood in one instant: the burst gets through
        ag.handle(d, now=100.0)
    ag.handle(d, now=102.0)                       # then one a second (2 s later: 2 more)
    ag.handle(d, now=102.1)
    items = {k: pa.table(t) for k, j, t in ag.tick()}
    assert items["inflight"].num_rows == 4 + 2
    assert ag.metrics.value(ag.metrics.dropped, "inflight_rate") == 50 - 4


def test_a_gone_process_is_said_at_the_second_sighting_unless_its_goodbye_came_between():
    """A rank that said goodbye and exited can be gone from /proc while its goodbye still waits in the agent's
    queue (sent just before the exit, received after the tick drained the queue): a clean job's end then read
    as a crash ("ended without a word") about 1 run in 15 on a loaded machine. The agent says ``gone`` at the
    next sighting, dated by the first, and not at all when the goodbye came between."""
    from types import SimpleNamespace
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_state(child.pid) == "gone"
    now, t0 = time.monotonic(), time.time_ns()
    idents = {5: SimpleNamespace(job="j", node="n1", rank=3, t_seen=now - 1.0, peer=None, hello={"pid": child.pid})}
    live = Liveness()
    assert live.rows(idents, "n1", now, t0) == []                         # first sighting: its goodbye may come
    rows = live.rows(idents, "n1", now + 0.5, t0 + 500_000_000)
    assert [(r["rank"], r["state"], r["t"]) for r in rows] == [(3, "gone", t0)]     # dated by the first
    assert live.rows(idents, "n1", now + 10, t0 + 10_000_000_000) == []   # once
    said = Liveness()
    assert said.rows(idents, "n1", now, t0) == []
    said.said_goodbye(5)                                                  # the goodbye, read at the next tick
    assert said.rows(idents, "n1", now + 0.5, t0 + 500_000_000) == []


def test_the_agents_last_look_says_a_process_gone_at_once():
    """An agent stopped within a tick of a rank's death (a GPU run's last job: rank 1 ``os._exit(1)``, the agent
    stopped 2 s later while its ticks waited on an unreachable broker) never made the second sighting: the
    death was lost and the rank that raised for its lost peer was named the crash. The last look, after the
    receiver stopped and the queue was read, says it at once; a goodbye read before it still wins."""
    from types import SimpleNamespace
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    now, t0 = time.monotonic(), time.time_ns()
    idents = {5: SimpleNamespace(job="j", node="n1", rank=1, t_seen=now - 1.0, peer=None, hello={"pid": child.pid})}
    live = Liveness()
    rows = live.rows(idents, "n1", now, t0, final=True)                  # never seen before: said now
    assert [(r["rank"], r["state"], r["t"]) for r in rows] == [(1, "gone", t0)]
    seen = Liveness()
    assert seen.rows(idents, "n1", now, t0) == []                         # seen once by a tick ...
    rows = seen.rows(idents, "n1", now + 0.1, t0 + 100_000_000, final=True)
    assert [(r["rank"], r["state"], r["t"]) for r in rows] == [(1, "gone", t0)]   # ... dated by that sighting
    said = Liveness()
    said.said_goodbye(5)
    assert said.rows(idents, "n1", now, t0, final=True) == []


def test_an_agent_stopped_right_after_a_rank_died_still_says_it_is_gone(sockdir):
    """Through the real agent: a probe's hello from a process that then exits without a goodbye; the agent is
    closed before any tick saw it gone: its last tick says ``gone``."""
    from stepwatch.agents.agent import Agent
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    ag = Agent(None, socket_dir=sockdir, node="n1").start()
    from types import SimpleNamespace
    ag.idents[7] = SimpleNamespace(job="j", node="n1", rank=1, t_seen=time.monotonic(), peer=None,
                                   hello={"pid": child.pid}, dropped=0)
    got = []
    real_tick = ag.tick

    def tick():
        items = real_tick()
        got.extend(items)
        return items
    ag.tick = tick
    ag.close()
    rows = [r for kind, job, t in got if kind == "inflight" for r in pa.table(t).select(["rank", "state"]).to_pylist()]
    assert [(r["rank"], r["state"]) for r in rows] == [(1, "gone")]

"""Issue 16, the agent's ingress: through the real ``agent.sock``, a hostile sender cannot stop the node,
speak for another process's rank, get past the socket's mode and group, or grow the agent's memory.
Senders of other uids run as real child processes (``setpriv``; the tests run as root)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pyarrow as pa
import pytest

from stepwatch.agents.agent import Agent
from stepwatch.agents.probe import Probe
from stepwatch.wire.datagram import HDR, HDR_STEP, MAGIC, T_BATCH, T_HELLO, VERSION

pytestmark = pytest.mark.unit

UID, GID = 20002, 20002          # a training user that is not in the socket's group


@pytest.fixture
def socket_dir():
    d = tempfile.mkdtemp(prefix="sw-ta-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def hello(inst: int, **fields) -> bytes:
    return HDR.pack(MAGIC, VERSION, T_HELLO, inst, 0, 0, 0, 0, 0) + json.dumps(fields).encode()


def step_frame(inst: int, rank: int, step: int) -> bytes:
    t = time.time_ns()
    return HDR_STEP.pack(MAGIC, VERSION, T_BATCH, inst, rank, 1, 0, 0, 0,
                         step, t - 10_000_000, t, 10e6, 0.0, 10e6, 0.0, 0.0, 0.0, 0, -1, -1, -1, 0,
                         -1.0, -1.0, -1.0, -1.0)        # CPU time, run-queue wait, comm total/exposed: not measured


def steps_of(items, job):
    return [r for kind, j, t in items if kind == "steps" and j == job for r in pa.table(t).column("step").to_pylist()]


def run_good(p: Probe, n: int) -> None:
    for _ in range(n):
        p.begin_step()
        p.end_step()


def send_as(path: str, payloads: list[bytes], uid: int | None = None, groups: str = "", expect_ok=True) -> str:
    """Send datagrams from a child process (as ``uid`` with supplementary ``groups`` when given);
    returns its output: 'sent N' or the error."""
    code = textwrap.dedent(f"""
        import socket, sys, json
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        n = 0
        try:
            for p in json.loads(sys.stdin.read()):
                s.sendto(bytes.fromhex(p), {path!r})
                n += 1
            print("sent", n)
        except OSError as e:
            print("error", e.errno)
    """)
    argv = [sys.executable, "-c", code]
    if uid is not None:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}"] + (
            [f"--groups={groups}"] if groups else ["--clear-groups"]) + [
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"] + argv
    r = subprocess.run(argv, input=json.dumps([p.hex() for p in payloads]), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_a_hello_out_of_range_cannot_stop_the_node_and_is_counted(socket_dir):
    """Today: one hello with rank 2^31 makes every later tick raise (int32 overflow building the
    topology table) and the node ships nothing again."""
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[]).start()
    good = Probe().init(job="good", rank=0, world_size=2, socket_dir=socket_dir, auto=False, flush_ms=0)
    try:
        run_good(good, 3)
        bad = [hello(1001, job="evil", rank=2**31, world_size=2**31 + 1), step_frame(1001, 0, 1),
               hello(1002, job="evil", rank=0, world_size=4, dp=2**40),            # int32 overflow in topology
               hello(1003, job="evil", rank=5, world_size=4),                     # rank >= world size
               hello(1004, job="x" * 5000, rank=0, world_size=1),                 # a job name of 5,000 chars
               hello(1005, job="evil", rank=0, world_size=4, node="../../etc"),  # not a host name
               hello(1006, job="evil", rank=0, world_size=4, names={"1": {"nested": 1}}),
               HDR.pack(MAGIC, VERSION, T_HELLO, 1007, 0, 0, 0, 0, 0) + b"[" * 60000]   # deeply nested JSON
        assert send_as(agent.path, bad).startswith("sent")
        got = []
        for i in range(4):
            run_good(good, 5)
            time.sleep(0.25)
            got += steps_of(agent.tick(), "good")              # must not raise
        assert sorted(got) == list(range(23)), got                # the good rank's every step, in 4 ticks
        assert {i.job for i in agent.idents.values()} == {"good"}
        m = agent.metrics
        assert m.value(m.bad_datagrams) == 7                     # each hostile hello counted once
    finally:
        good.shutdown()
        agent.close()


def test_socket_mode_and_group_let_in_only_the_group(socket_dir):
    """Today agent.sock is 0666: any local user (any pod that mounts the directory) can send."""
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[], socket_group=10001).start()
    try:
        st = os.stat(agent.path)
        assert st.st_mode & 0o777 == 0o660 and st.st_gid == 10001
        h = hello(2001, job="other", rank=0, world_size=1)
        assert send_as(agent.path, [h], uid=UID) == "error 13"                  # EACCES: not in the group
        assert send_as(agent.path, [h], uid=UID, groups="10001") == "sent 1"    # a member of the group
        time.sleep(0.2)
        agent.drain()
        (ident,) = agent.idents.values()
        assert ident.job == "other" and ident.peer.uid == UID and ident.peer.pid > 0
    finally:
        agent.close()


def test_allow_uid_refuses_other_senders(socket_dir):
    from stepwatch.agents.socket_trust import IngressLimits
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[], socket_mode=0o666,
                  limits=IngressLimits(allow_uids=frozenset({30003}))).start()
    try:
        assert send_as(agent.path, [hello(2101, job="j", rank=0, world_size=1)], uid=UID) == "sent 1"
        time.sleep(0.2)
        agent.drain()
        assert not agent.idents and agent.metrics.value(agent.metrics.dropped, "peer_not_allowed") == 1
    finally:
        agent.close()


def test_a_sender_cannot_speak_for_another_process_rank(socket_dir):
    """Today any process that can reach the socket can send frames with another probe's instance id,
    or a hello for a rank a live probe holds, and its rows are stored as that job's rank."""
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[]).start()
    good = Probe().init(job="victim", rank=3, world_size=8, socket_dir=socket_dir, auto=False, flush_ms=0)
    try:
        run_good(good, 2)
        time.sleep(0.25)
        assert steps_of(agent.tick(), "victim") == [0, 1]
        inst = good.instance
        forged = [step_frame(inst, 3, 1000 + i) for i in range(5)]                          # frames as the victim
        claim = [hello(3001, job="victim", rank=3, world_size=8), step_frame(3001, 3, 2000)]  # a new claim of rank 3
        retake = [hello(inst, job="victim", rank=3, world_size=8, node="elsewhere")]          # the victim's own id
        assert send_as(agent.path, forged + claim + retake).startswith("sent")
        run_good(good, 2)
        time.sleep(0.25)
        got = steps_of(agent.tick(), "victim")
        assert got == [2, 3], got                          # nothing of the forger's
        m = agent.metrics
        assert m.value(m.dropped, "peer_mismatch") >= 6 and m.value(m.dropped, "identity_conflict") == 1
        assert agent.idents[inst].node == "n1" and agent.idents[inst].peer.pid == os.getpid()
    finally:
        good.shutdown()
        agent.close()


def test_a_rank_restarted_in_a_new_process_is_served_again(socket_dir):
    """The binding does not lock out a legitimate restart: once the old process is gone, its rank may
    be claimed by a new one."""
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[]).start()
    try:
        assert send_as(agent.path, [hello(4001, job="r", rank=0, world_size=1), step_frame(4001, 0, 0)]) == "sent 2"
        assert send_as(agent.path, [hello(4002, job="r", rank=0, world_size=1), step_frame(4002, 0, 1)]) == "sent 2"
        time.sleep(0.25)
        assert steps_of(agent.tick(), "r") == [0, 1]
        assert agent.metrics.value(agent.metrics.dropped, "identity_conflict") == 0
    finally:
        agent.close()


def test_the_receive_queue_is_bounded_in_bytes_and_drops_are_counted(socket_dir):
    from stepwatch.agents.socket_trust import IngressLimits
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[],
                  limits=IngressLimits(max_queue_bytes=256 << 10)).start()
    try:
        big = [hello(5000 + i, job="flood", rank=0, world_size=1, pad="x" * 16000) for i in range(100)]
        assert send_as(agent.path, big) == "sent 100"
        time.sleep(0.5)
        queued = sum(len(d) for d, _ in agent.queue)
        assert queued <= 256 << 10
        assert agent.metrics.value(agent.metrics.dropped, "queue_full") == 100 - len(agent.queue) > 0
        agent.tick()
        assert agent._q_in - agent._q_out == 0                   # the bound is free again once decoded
    finally:
        agent.close()


def test_datagrams_of_unknown_instances_are_bounded(socket_dir):
    """Frames of instances that never say hello wait (bounded in bytes and instances), then go, counted."""
    from stepwatch.agents.socket_trust import IngressLimits
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[],
                  limits=IngressLimits(max_pending_bytes=4096, max_instances=8)).start()
    try:
        assert send_as(agent.path, [step_frame(6000 + i, 0, i) for i in range(50)]) == "sent 50"
        time.sleep(0.3)
        agent.tick()
        assert len(agent.pending) <= 8 and agent._pending_bytes <= 4096
        held = sum(len(p) for p in agent.pending.values())
        assert agent.metrics.value(agent.metrics.dropped, "no_identity") == 50 - held
    finally:
        agent.close()


def test_a_flood_of_made_up_instances_is_bounded(socket_dir):
    from stepwatch.agents.socket_trust import IngressLimits
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[],
                  limits=IngressLimits(max_instances=16)).start()
    try:
        flood = [hello(7000 + i, job=f"made-up-{i}", rank=0, world_size=1) for i in range(200)]
        assert send_as(agent.path, flood) == "sent 200"
        time.sleep(0.3)
        items = agent.tick()
        assert len(agent.idents) == 16 and len(agent._topo_sent) == 16
        assert agent.metrics.value(agent.metrics.dropped, "too_many_instances") == 184
        assert len({j for k, j, _ in items if k == "topology"}) == 16
    finally:
        agent.close()


def test_a_group_member_cannot_speak_for_another_job(socket_dir):
    """Issue 26, finding 4: a member of the socket's group (another uid) said hello for rank 1, and for
    rank 99,999 of 100,000, of another user's job ``victim``; the agent served both, and their rows went
    out as the victim's. A job belongs on the node to the sender (uid, pod/cgroup) whose hello named
    it first: another sender's hellos for it are refused and counted; its own job is served."""
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[], socket_group=10001).start()
    good = Probe().init(job="victim", rank=0, world_size=2, socket_dir=socket_dir, auto=False, flush_ms=0)
    try:
        run_good(good, 2)
        time.sleep(0.25)
        assert steps_of(agent.tick(), "victim") == [0, 1]
        forged = [hello(8001, job="victim", rank=1, world_size=2), step_frame(8001, 1, 50),
                  hello(8002, job="victim", rank=99_999, world_size=100_000), step_frame(8002, 99_999, 50),
                  hello(8003, job="own", rank=0, world_size=1), step_frame(8003, 0, 7)]
        assert send_as(agent.path, forged, uid=UID, groups="10001") == "sent 6"
        run_good(good, 1)
        time.sleep(0.25)
        items = agent.tick()
        assert steps_of(items, "victim") == [2]                     # the victim's rank 0 alone
        assert not [r for k, j, t in items if k == "topology" and j == "victim" for r in pa.table(t).to_pylist()]
        assert steps_of(items, "own") == [7]                        # its own job is served
        assert sorted((i.job, i.rank) for i in agent.idents.values()) == [("own", 0), ("victim", 0)]
        assert agent.metrics.value(agent.metrics.dropped, "job_not_owned") == 2
    finally:
        good.shutdown()
        agent.close()


def test_pods_of_one_job_that_share_its_token_share_the_job(socket_dir, monkeypatch):
    """A job whose ranks run as several senders (pods of one job on a node) shares the job through its
    token (``STEPWATCH_JOB_TOKEN``); a sender without it, of the same uid, is refused."""
    monkeypatch.setenv("STEPWATCH_JOB_TOKEN", "s3cret-of-job-t")
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[], socket_group=10001).start()
    good = Probe().init(job="t", rank=0, world_size=4, socket_dir=socket_dir, auto=False, flush_ms=0)
    try:
        run_good(good, 1)
        time.sleep(0.25)
        assert steps_of(agent.tick(), "t") == [0]
        ok = [hello(8101, job="t", rank=1, world_size=4, job_token="s3cret-of-job-t"), step_frame(8101, 1, 0)]
        bad = [hello(8102, job="t", rank=2, world_size=4), step_frame(8102, 2, 0),
               hello(8103, job="t", rank=3, world_size=4, job_token="guess"), step_frame(8103, 3, 0)]
        assert send_as(agent.path, ok + bad, uid=UID, groups="10001") == "sent 6"
        time.sleep(0.25)
        items = agent.tick()
        assert sorted((i.job, i.rank) for i in agent.idents.values()) == [("t", 0), ("t", 1)]
        assert agent.metrics.value(agent.metrics.dropped, "job_not_owned") == 2
        assert all("s3cret" not in repr(i.hello) for i in agent.idents.values())   # not kept with the hello
        assert not [k for k, j, t in items if b"s3cret" in _ipc(t)]                  # nor shipped
    finally:
        good.shutdown()
        agent.close()


def _ipc(t) -> bytes:
    return t.payload            # the Arrow IPC stream the shipper sends


def test_a_sender_of_the_same_uid_in_another_pod_cannot_speak_for_the_job(socket_dir, tmp_path, monkeypatch):
    """Pods of different tenants often run as the same uid: the pod in the sender's cgroup
    (``$HOST_PROC/<pid>/cgroup``, here a procfs copy with two pods' cgroups) tells them apart."""
    proc = tmp_path / "proc"
    pod_a = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0a1b2c3d_1111_2222_3333_444455556666" \
            ".slice/cri-containerd-aaaa.scope\n"
    pod_b = "12:memory:/kubepods/besteffort/pod9f8e7d6c-1111-2222-3333-444455556666/bbbb\n0::/\n"
    code = textwrap.dedent(f"""
        import socket, sys, os
        print(os.getpid(), flush=True)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for p in sys.stdin.readline().split():
            s.sendto(bytes.fromhex(p), {os.path.join(socket_dir, 'agent.sock')!r})
        print("sent", flush=True)
        sys.stdin.read()                                  # alive (a live owner) until the test ends
    """)
    monkeypatch.setenv("HOST_PROC", str(proc))
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[]).start()
    kids = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(3)]
    try:
        for kid, cg in zip(kids, (pod_a, pod_b, pod_a)):          # the victim, another pod, the victim's 2nd process
            (proc / kid.stdout.readline().strip()).mkdir(parents=True)
            (proc / str(kid.pid) / "cgroup").write_text(cg)
        sends = [[hello(8201, job="victim", rank=0, world_size=4), step_frame(8201, 0, 1)],
                 [hello(8202, job="victim", rank=1, world_size=4), step_frame(8202, 1, 1)],
                 [hello(8203, job="victim", rank=2, world_size=4), step_frame(8203, 2, 1)]]
        for kid, payload in zip(kids, sends):                        # one after the other: the socket keeps order
            kid.stdin.write(" ".join(p.hex() for p in payload) + "\n")
            kid.stdin.flush()
            assert kid.stdout.readline().strip() == "sent"
        deadline = time.monotonic() + 10
        while len(agent.queue) < 6 and time.monotonic() < deadline:   # the receiver thread has them all
            time.sleep(0.02)
        agent.tick()
        assert sorted(i.rank for i in agent.idents.values()) == [0, 2]
        assert agent.metrics.value(agent.metrics.dropped, "job_not_owned") == 1
        owners = {i.owner for i in agent.idents.values()}
        assert owners == {"uid:0 pod0a1b2c3d-1111-2222-3333-444455556666"}, owners
    finally:
        for kid in kids:
            kid.stdin.close()
            kid.wait(10)
        agent.close()


def test_ids_may_not_end_in_a_newline(socket_dir):
    """Issue 26: the id patterns ended in ``$``, which matches before a final newline: a hello's node
    ``"n1\\n"``, a stored row's job ``"victim\\n"`` and a signed command's job, node or id ending in a
    newline all passed."""
    import pyarrow as pa

    from stepwatch.wire import tables as wire
    from stepwatch.wire.decode import validate
    from stepwatch.agents import profiling
    from stepwatch.agents.profiling import protocol
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[]).start()
    try:
        assert send_as(agent.path, [hello(8301, job="j", rank=0, world_size=1, node="n1\n")]) == "sent 1"
        time.sleep(0.2)
        agent.tick()
        assert not agent.idents and agent.metrics.value(agent.metrics.bad_datagrams) == 1
    finally:
        agent.close()
    t = pa.Table.from_pylist([{"job": "victim\n", "rank": 0, "node": "n1", "world_size": 1}],
                             schema=wire.SCHEMAS["topology"])
    ok, reasons, _ = validate("topology", t)
    assert ok.num_rows == 0 and "field 'job'" in reasons[0][1], reasons
    for field, bad in (("job", "cj\n"), ("node", "n1\n"), ("cmd_id", "c1\n")):
        cmd = dict(protocol.new_command("cj", "n1", [0], 2, "py-spy", "t", cmd_id="c1"), **{field: bad})
        with pytest.raises(protocol.BadCommand, match=f"bad {field}"):
            profiling.parse_command(profiling.canonical(cmd))


def _slurm_hook_as(path_dir: str, event: str, state: str, uid: int | None = None, groups: str = "") -> str:
    """The real ``stepwatch slurm prolog|epilog`` (``--state`` given: it sends at once) for job 777, run as
    root or as ``uid`` with supplementary ``groups``; returns its stderr."""
    argv = [sys.executable, "-m", "stepwatch.agents.slurm", event, "--socket-dir", path_dir, "--state", state]
    if uid is not None:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={groups}",
                "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"] + argv
    env = dict(os.environ, SLURM_JOB_ID="777", SLURM_JOB_EXIT_CODE2="0:15", SLURMD_NODENAME="n1")
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_only_root_may_say_a_slurm_job_started_or_ended(socket_dir):
    """A member of the socket's group (any training user) can send on agent.sock, but a scheduler's word on a job
    (``T_SCHED``: the prolog's start, the epilog's end with its Slurm state) from it would let it say its own hung
    job, or another's, was cancelled or timed out: the agent refuses it (``sched_not_root``) and stores nothing;
    the same command run as root (slurmd runs the prolog and epilog as root) is stored."""
    agent = Agent(None, socket_dir=socket_dir, node="n1", interval_s=0.2, plugins=[], socket_group=10001).start()
    m = agent.metrics
    try:
        for event in ("prolog", "epilog"):
            assert _slurm_hook_as(socket_dir, event, "TIMEOUT", uid=UID, groups="10001") == ""   # sent
        t_end = time.monotonic() + 10
        while m.value(m.dropped, "sched_not_root") < 2 and time.monotonic() < t_end:
            agent.drain()
            time.sleep(0.05)
        assert m.value(m.dropped, "sched_not_root") == 2
        assert not agent.rows["inflight"].get("777")
        _slurm_hook_as(socket_dir, "epilog", "CANCELLED")                                          # root
        while not agent.rows["inflight"].get("777") and time.monotonic() < t_end + 10:
            agent.drain()
            time.sleep(0.05)
        (row,) = agent.rows["inflight"]["777"]
        assert (row["source"], row["state"], row["error"], row["signal"]) == ("slurm", "sched_end", "CANCELLED", 15)
        assert m.value(m.dropped, "sched_not_root") == 2
    finally:
        agent.close()

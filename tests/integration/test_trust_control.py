"""Issue 16, the control plane: commands are sealed with Ed25519 (the processor's private key; agents and
probes hold only the public key), verified before anything of them is decoded, by the agent (real
broker) and again by the probe itself (its real control socket); no message stops the agent's control
thread; a replayed command is refused after an agent restart; the probe clamps steps and deadline and
writes only under its own directory."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import pyarrow as pa
import pytest

from stepwatch.agents import profiling
from stepwatch.agents.profiling import protocol
from stepwatch.agents.agent import Agent
from stepwatch.agents.probe import Probe
from stepwatch.kafkaio import make_producer

pytestmark = pytest.mark.integration

NODE = "node-a"
PEM, PUB = protocol.keygen()
PRIV = profiling.load_private_key(env={protocol.ENV_PRIVATE: PEM.decode()})
KEYS = profiling.load_public_keys(env={protocol.ENV_PUBLIC: PUB})
OTHER = profiling.load_private_key(env={protocol.ENV_PRIVATE: protocol.keygen()[0].decode()})


@pytest.fixture(autouse=True)
def probe_env(monkeypatch, tmp_path):
    monkeypatch.setenv(protocol.ENV_PUBLIC, PUB)                 # what the training process is given
    monkeypatch.setenv("STEPWATCH_PROFILE_DIR", str(tmp_path / "traces"))
    monkeypatch.setenv("STEPWATCH_PYSPY", "/nonexistent/py-spy")   # a py-spy command ends at once, 'failed'


def sealed(job, ranks, steps=2, kind="py-spy", key=PRIV, **kw) -> bytes:
    return profiling.seal(protocol.new_command(job, NODE, ranks, steps, kind, "t", **kw), key)


def _wait(cond, timeout=30.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


class Node:
    """A real agent (run loop on a thread) with a real probe of this process."""

    def __init__(self, socket_dir, kafka=None, spool=None, job="cj", rank=0, world=2, **ctl):
        self.agent = Agent(kafka, socket_dir=socket_dir, node=NODE, interval_s=0.1, plugins=[],
                           spool_dir=spool).enable_profiling(KEYS, cooldown_s=0.0, **ctl)
        self.rows: list[dict] = []
        orig = self.agent.control.take_rows
        self.agent.control.take_rows = lambda: self._keep(orig())      # see every outcome row the agent ships
        self.agent.start()
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.agent.run, args=(self.stop,), daemon=True)
        self.t.start()
        self.probe = Probe().init(job=job, rank=rank, world_size=world, socket_dir=socket_dir, auto=False, flush_ms=0)
        self.steps(2)
        _wait(lambda: any(i.rank == rank for i in self.agent.idents.values()), 10, "the hello")
        if kafka is not None:
            _wait(lambda: self.agent.control.consumer is not None and self.agent.control.consumer.assignment(),
                  30, "the control consumer")
            time.sleep(0.5)

    def _keep(self, rows):
        self.rows += rows
        return rows

    def steps(self, n=1):
        for _ in range(n):
            self.probe.begin_step()
            time.sleep(0.005)
            self.probe.end_step()

    def wait_row(self, pred, timeout=30.0, what="a profiles row"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = [r for r in self.rows if pred(r)]
            if hit:
                return hit
            self.steps(1)
            time.sleep(0.02)
        pytest.fail(f"timed out waiting for {what}; rows {self.rows}")

    def close(self):
        self.probe.shutdown()
        self.stop.set()
        self.t.join(10)


def produce(kafka, values, key=NODE):
    p = make_producer(kafka)
    for v in values:
        p.send(kafka.topic("control"), v, key=key.encode())
    p.flush(10)
    p.close(5)


def _flip(env: bytes) -> bytes:
    b = bytearray(env)
    b[-3] ^= 1
    return bytes(b)


def forged_body(body: bytes, key=PRIV) -> bytes:
    """An envelope with a valid signature over an arbitrary body (what only the key holder can make)."""
    kid = protocol.key_id(key.public_key())
    return protocol.MAGIC + kid + key.sign(protocol.DOMAIN + kid + body) + body


# ---------------------------------------------------------------------------- agent side, real broker

def test_no_control_message_can_stop_the_control_thread(kafka, socket_dir, tmp_path):
    """Today one unsigned JSON command with a non-integer rank kills the control thread (the agent
    still looks healthy), and an Arrow command is decoded before its signature is checked."""
    n = Node(socket_dir, kafka, tmp_path / "spool")
    try:
        arrow_cmd = pa.ipc.new_stream  # the old wire format: an Arrow table with an HMAC field
        sink = pa.BufferOutputStream()
        t = pa.table({"cmd_id": ["a"], "node": [NODE], "ranks": [["x"]]})
        with arrow_cmd(sink, t.schema) as w:
            w.write_table(t)
        poison = [b'[{"cmd_id": "p", "node": "node-a", "job": "cj", "ranks": ["x"], "signature": "00"}]',
                  b'{"node": "node-a", "ranks": [1.5], "signature": "ab"}',
                  sink.getvalue().to_pybytes(),
                  os.urandom(300),
                  protocol.MAGIC + bytes(200),                                       # bad signature
                  sealed("cj", [0], key=OTHER),                                      # a key nobody trusts
                  protocol.MAGIC + bytes(64 << 10),                                 # too large
                  _flip(sealed("cj", [0])),                                          # altered after signing
                  forged_body(b'{"ranks": ["x"], "node": "node-a"}'),                # signed, malformed
                  forged_body(b"[" * 3000)]
        produce(kafka, poison)
        good = protocol.new_command("cj", NODE, [0], 2, "py-spy", "after-poison")
        produce(kafka, [profiling.seal(good, PRIV)])
        rows = n.wait_row(lambda r: r["cmd_id"] == good["cmd_id"] and r["status"] == "failed", 60,
                          "the probe's answer to the good command")
        assert "py-spy is not installed" in rows[0]["detail"]           # it reached the probe and ran there
        ctl = n.agent.control
        assert ctl._thread.is_alive()
        reg = n.agent.metrics.registry
        got = {r: reg.get_sample_value("stepwatch_agent_profile_commands_rejected_total", {"reason": r})
               for r in ("bad_envelope", "unknown_key", "too_large", "bad_command", "bad_signature", "internal_error")}
        assert got == {"bad_envelope": 4, "unknown_key": 2, "too_large": 1, "bad_command": 2,
                       "bad_signature": 1, "internal_error": None}, got
        # refusals of unverifiable messages carry nothing of the message but a digest
        refused = [r for r in n.rows if r["status"] == "rejected"]
        assert refused and all(r["cmd_id"].startswith("sha256:") and r["rank"] is None for r in refused)
    finally:
        n.close()


def test_a_replayed_command_is_refused_after_an_agent_restart(kafka, socket_dir, tmp_path):
    """Today the seen-id set is in memory: a captured command is accepted again after a restart."""
    cmd = sealed("cj", [0], steps=2)
    n = Node(socket_dir, kafka, tmp_path / "spool")
    try:
        produce(kafka, [cmd])
        _wait(lambda: n.agent.control.metrics.forwarded._value.get() == 1, 30, "the command forwarded")
    finally:
        n.close()
    assert (tmp_path / "spool" / "control-seen.log").read_text().split()[0] == json.loads(cmd[76:])["cmd_id"]
    n2 = Node(socket_dir, kafka, tmp_path / "spool")                  # the agent restarted, same node disk
    try:
        produce(kafka, [cmd])                                          # the captured command, replayed
        fresh = sealed("cj", [0], steps=2)
        produce(kafka, [fresh])
        cid = json.loads(fresh[76:])["cmd_id"]
        n2.wait_row(lambda r: r["cmd_id"] == cid and r["status"] == "failed", 60, "the fresh command's answer")
        replay = [r for r in n2.rows if r["status"] == "rejected" and "replay" in r["detail"]]
        assert len(replay) == 1 and replay[0]["cmd_id"] == json.loads(cmd[76:])["cmd_id"]
        assert n2.agent.control.metrics.forwarded._value.get() == 1    # the fresh one only
    finally:
        n2.close()


# ---------------------------------------------------------------------------- probe side, its real socket

def _send_ctl(path: str, data: bytes) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(data, path)
    s.close()


def test_the_probe_refuses_unsigned_commands_and_sender_chosen_directories(socket_dir, tmp_path):
    """Today the probe runs any JSON command that reaches its socket, with the sender's ``dir``,
    ``rate``, ``steps`` and ``deadline_ns``."""
    n = Node(socket_dir)
    evil = tmp_path / "evil"
    try:
        ctl = n.probe._ctl.path
        assert os.path.dirname(ctl) == os.path.join(socket_dir, "ctl")
        _send_ctl(ctl, json.dumps({"cmd_id": "evil", "job": "cj", "rank": 0, "kind": "py-spy", "steps": 10**6,
                                   "deadline_ns": time.time_ns() + 10**13, "dir": str(evil), "rate": 100000,
                                   "role": "suspect"}).encode())
        n.steps(5)
        time.sleep(0.2)
        n.steps(5)
        assert not evil.exists() and n.probe._ctl.run is None
        assert n.probe._ctl.rejected == {"bad_envelope": 1}
        rows = n.wait_row(lambda r: r["status"] == "rejected", 10, "the probe's refusal")
        assert "bad_envelope" in rows[0]["detail"]                    # refused visibly, not silently
    finally:
        n.close()


def test_the_probe_verifies_clamps_and_refuses_replays_itself(socket_dir, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("STEPWATCH_PROFILE_MAX_STEPS", "3")
    monkeypatch.setenv("STEPWATCH_PROFILE_MAX_S", "30")
    n = Node(socket_dir)
    try:
        ctl = n.probe._ctl.path
        env = sealed("cj", [0], steps=500, kind="torch", ttl_s=3000)
        cid = json.loads(env[76:])["cmd_id"]
        _send_ctl(ctl, env)                                           # straight to the probe: it checks itself
        n.steps(2)
        run = n.probe._ctl.run
        assert run is not None and run.steps == 3 and run.deadline_ns <= time.time_ns() + 30e9
        (row,) = n.wait_row(lambda r: r["cmd_id"] == cid and r["status"] in ("ok", "failed"), 60, "the profile")
        assert row["status"] == "ok" and row["steps"] == 3, row
        path = row["uri"][len("file://"):]
        assert os.path.dirname(path) == str(tmp_path / "traces") and os.path.getsize(path) == row["bytes"]
        _send_ctl(ctl, env)                                           # the same envelope again
        _send_ctl(ctl, sealed("cj", [1]))                             # another rank's command
        _send_ctl(ctl, sealed("other-job", [0]))                      # another job's
        _send_ctl(ctl, sealed("cj", [0], key=OTHER))                  # a key the probe does not trust
        n.steps(3)
        assert n.probe._ctl.rejected == {"replay": 1, "not_this_rank": 1, "not_this_job": 1, "unknown_key": 1}
        assert n.probe._ctl.run is None
    finally:
        n.close()


def test_a_probe_without_a_public_key_says_so(socket_dir, monkeypatch):
    monkeypatch.delenv(protocol.ENV_PUBLIC)
    n = Node(socket_dir)
    try:
        cmd = sealed("cj", [0])
        assert n.agent.control.handle_message(cmd) == []              # verified by the agent, forwarded
        rows = n.wait_row(lambda r: r["status"] == "rejected", 10, "the probe's refusal")
        assert rows[0]["cmd_id"] == json.loads(cmd[76:])["cmd_id"] and "no public key" in rows[0]["detail"]
        assert not n.agent.control.active                             # matched by the envelope's digest
    finally:
        n.close()


def test_keys_never_appear_in_errors(tmp_path):
    bad = tmp_path / "k"
    bad.write_text("-----BEGIN PRIVATE KEY-----\nQUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo=\n-----END PRIVATE KEY-----\n")
    with pytest.raises(protocol.KeyError_) as e:
        profiling.load_private_key(env={protocol.ENV_PRIVATE_FILE: str(bad)})
    assert "QUJD" not in str(e.value)
    with pytest.raises(protocol.KeyError_, match="no longer used"):
        profiling.load_public_keys(env={"STEPWATCH_PROFILING_KEY": "s" * 32})
    assert profiling.load_public_keys(env={}) is None
    two = profiling.load_public_keys(env={protocol.ENV_PUBLIC: PUB + "," + protocol.public_key_text(OTHER)})
    assert len(two) == 2                                              # a rotation: both verify
    assert profiling.open_envelope(sealed("cj", [0], key=OTHER), two)["ranks"] == [0]


def test_unsolicited_results_are_bounded(socket_dir):
    """A probe (any process with the group) answering commands nobody sent cannot flood `profiles`."""
    n = Node(socket_dir)
    try:
        sent0 = n.probe._ctl.replies
        for i in range(100):
            n.probe._ctl.reply({"cmd_id": f"made-up-{i}", "status": "ok", "uri": "file:///x", "bytes": 1})
            time.sleep(0.002)
        sent = n.probe._ctl.replies - sent0                          # the agent's queue may refuse a few
        assert sent > 40
        time.sleep(0.5)
        made_up = [r for r in n.rows if r["cmd_id"].startswith("made-up-")]
        assert len(made_up) == 30
        reg = n.agent.metrics.registry
        assert reg.get_sample_value("stepwatch_agent_profile_commands_rejected_total",
                                    {"reason": "unsolicited_result"}) == sent - 30
    finally:
        n.close()


def test_a_restarted_probe_refuses_a_command_issued_before_it_started(socket_dir):
    """Issue 26: a probe's seen ids do not survive a restart, so an old valid envelope sent straight to
    the new probe's socket (skipping the agent's durable replay log) started a profile. A command
    issued before the probe's control channel existed (beyond a 5 s clock skew) is refused."""
    old = profiling.seal(protocol.new_command("cj", NODE, [0], 2, "py-spy", "t", ttl_s=3000,
                                               now_ns=time.time_ns() - 60 * 10**9), PRIV)
    n = Node(socket_dir)
    try:
        _send_ctl(n.probe._ctl.path, old)
        n.steps(3)
        assert n.probe._ctl.run is None and n.probe._ctl.rejected == {"before_start": 1}
        rows = n.wait_row(lambda r: r["status"] == "rejected", 10, "the probe's refusal")
        assert "before_start" in rows[0]["detail"]
        fresh = sealed("cj", [0])                                   # one issued now is still served
        _send_ctl(n.probe._ctl.path, fresh)
        n.steps(3)
        cid = json.loads(fresh[76:])["cmd_id"]
        n.wait_row(lambda r: r["cmd_id"] == cid and r["status"] != "rejected", 20, "the fresh command's outcome")
    finally:
        n.close()

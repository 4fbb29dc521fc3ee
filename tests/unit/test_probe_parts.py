"""The probe's parts that used to take the whole probe (the watchdog, the goodbye, the profiling control)
work from the collaborators they are given alone: stand-ins with only the public attributes named in
docs/architecture.md's table, no Probe, and real sockets to receive what they send."""
from __future__ import annotations

import json
import os
import socket
import time
from types import SimpleNamespace

import pytest

from stepwatch.agents.probe import eventlog
from stepwatch.agents.probe.exitwatch import ExitWatch
from stepwatch.agents.probe.fold import Position
from stepwatch.agents.probe.names import Names
from stepwatch.agents.probe.watchdog import Watchdog
from stepwatch.agents.profiling import protocol, seal
from stepwatch.agents.profiling.runner import ProbeControl
from stepwatch.wire.datagram import HDR, MAGIC, T_INFLIGHT, T_PROFILE, VERSION

pytestmark = pytest.mark.unit

OFF = 1_700_000_000_000_000_000               # the transport's wall-clock offset (perf ns -> wall ns)


@pytest.fixture
def agent(socket_dir):
    """A bound datagram socket standing in for the node agent's."""
    path = os.path.join(socket_dir, "agent.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(5.0)
    yield s, path
    s.close()


def _recv(s) -> tuple[tuple, dict]:
    data = s.recv(65536)
    return HDR.unpack_from(data), json.loads(data[HDR.size:])


def _position(step=3, start=1_000, open_=True, seq=None) -> Position:
    return Position(step, start, open_, None, True, (False,) * 8, list(seq or [0] * 16))


def test_watchdog_judges_a_ddp_wait_from_its_collaborators_alone(agent):
    sock, path = agent
    names = Names(lambda: None)
    group = object()                                         # a process group the names already know
    gid = names.intern("dp")
    names.groups[id(group)] = (gid, 4)
    slot = names.comm_slot_for("all_reduce", names.intern("all_reduce"), gid, 4)
    seq = [0] * 16
    seq[slot] = 5                                            # 5 all_reduces of the group replayed
    fold = SimpleNamespace(n_steps=3, position=lambda: _position(seq=seq))
    log = SimpleNamespace(n=0, peek=lambda: [], last_drain=500, in_coll=0, coll_t0=0)
    timer = SimpleNamespace(pending=2, pending_t0=2_000, group=group, size=4)   # DDP buckets launched
    hooks = SimpleNamespace(wait_slot=-1, ddp_timers=[timer])
    transport = SimpleNamespace(wall_off=OFF, path=path, instance=9)
    paused = [True]
    wd = Watchdog(log, fold, names, hooks, transport, SimpleNamespace(rank=3), lambda: [], lambda: paused[0],
                  period_s=0, min_s=0.0)
    assert wd.check(10_000) is None                          # the probe is off or replaying: no look
    paused[0] = False
    st = wd.check(10_000)
    assert st["state"] == "collective" and st["op"] == "all_reduce" and st["group"] == "dp"
    assert st["group_size"] == 4 and st["seq"] == 6 and st["since"] == 2_000 + OFF and st["t"] == 10_000 + OFF
    assert st["step"] == 3 and st["kinds"] == [] and seq[slot] == 5     # (the fold's numbers: copies)
    hdr, body = _recv(sock)
    assert hdr[:5] == (MAGIC, VERSION, T_INFLIGHT, 9, 3)
    assert body["state"] == "collective" and body["seq"] == 6 and not any(k.startswith("_") for k in body)
    timer.pending = 0                                        # the buckets completed, the step goes on
    fold.position = lambda: _position(step=4, open_=False)   # ... and ended
    done = wd.check(20_000)
    assert done["state"] == "done" and done["step"] == 3 and done["t"] == 20_000 + OFF
    assert _recv(sock)[1]["state"] == "done"


def test_the_goodbye_is_built_from_its_collaborators_alone(agent):
    sock, path = agent
    flushed = []
    transport = SimpleNamespace(instance=9, path=path, hello_bytes=b"hello", connected=True, backlog=[],
                                flush_backlog=lambda: True)
    fold = SimpleNamespace(position=lambda: _position(step=42))
    on = [False]
    ew = ExitWatch(transport, SimpleNamespace(rank=3), fold, lambda: flushed.append(1), lambda: on[0])
    ew.at_exit()
    assert not ew.sent and not flushed                       # the probe is off: no goodbye
    on[0] = True
    ew.at_exit()
    hdr, body = _recv(sock)
    assert flushed == [1] and ew.sent                        # the last steps first
    assert hdr[:5] == (MAGIC, VERSION, T_INFLIGHT, 9, 3)
    assert body["state"] == "exited" and body["step"] == 42 and body["exit_code"] == 0
    assert body["pid"] == os.getpid()
    ew.close()


def test_profiling_control_names_itself_and_judges_commands_from_its_collaborators_alone(agent, socket_dir,
                                                                                      monkeypatch):
    sock, path = agent
    pem, pub = protocol.keygen()
    monkeypatch.setenv(protocol.ENV_PUBLIC, pub)             # the keys the control loads (on its own thread)
    key = protocol.load_private_key(env={protocol.ENV_PRIVATE: pem.decode()})
    active = []
    transport = SimpleNamespace(instance=9, path=path)
    pc = ProbeControl(transport, SimpleNamespace(rank=7, job="fz"),
                      lambda inst, rank: HDR.pack(MAGIC, VERSION, T_PROFILE, inst, rank, 0, 0, 0, 0), active.append)
    ctl = pc.ensure_bound(socket_dir)
    assert os.path.basename(ctl) == "probe-9.sock"           # the transport's instance names it
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        for ranks, job in (([5], "fz"), ([7], "other")):     # another rank's command, another job's
            out.sendto(seal(protocol.new_command(job, "n", ranks, 5, "torch", "r"), key), ctl)
        sock.settimeout(0.05)
        replies = []
        deadline = time.monotonic() + 10.0
        while len(replies) < 2 and time.monotonic() < deadline:   # (the keys load on a helper thread)
            pc.poll()
            try:
                replies.append(_recv(sock))
            except TimeoutError:
                pass
    finally:
        out.close()
    assert [h[:5] for h, _ in replies] == [(MAGIC, VERSION, T_PROFILE, 9, 7)] * 2
    assert "this is rank 7" in replies[0][1]["detail"] and replies[0][1]["status"] == "rejected"
    assert pc.rejected == {"not_this_rank": 1, "not_this_job": 1} and pc.run is None and active == []
    run = object()
    pc.run = run
    pc.done(run)                                             # a profile ended: the probe may stop replaying
    assert active == [False]
    pc.close()

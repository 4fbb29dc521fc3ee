"""A rank's goodbye (agents/probe/exitwatch.py): every way a real process ends leaves the right word
with the node agent — a clean exit, ``sys.exit(3)``, an exception, SIGTERM, an abort in teardown after a
clean exit — and what leaves none (``os._exit``, SIGKILL) is seen by the agent as ``gone``. Each case is
a real interpreter running the probe against a real agent."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest

from stepwatch.agents.agent import Agent
from stepwatch.agents.probe import eventlog

pytestmark = pytest.mark.unit

PRELUDE = textwrap.dedent("""
    import os, signal, sys, time
    from stepwatch.agents.probe import Probe
    p = Probe().init(job="j", rank=1, world_size=2, socket_dir=sys.argv[1], auto=False, flush_ms=0)
    for _ in range(5):
        p.begin_step(); p.end_step()
    time.sleep(0.2)
""")

CASES = {
    "clean": ("pass", 0, {"exit_code": 0, "signal": None}),
    "sys_exit": ("sys.exit(3)", 3, {"exit_code": 3, "signal": None}),
    "exception": ("raise ValueError('bad batch 7')", 1, {"exit_code": 1, "signal": None}),
    "sigterm": ("os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)", -signal.SIGTERM,
                {"exit_code": None, "signal": int(signal.SIGTERM)}),
    "abort_in_teardown": ("import ctypes; libc = ctypes.CDLL(None); libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)",
                          -signal.SIGABRT,      # (C's atexit: after the interpreter, like a C++ destructor)
                          {"exit_code": 0, "signal": None}),
    "os_exit": ("os._exit(1)", 1, None),
    "sigkill": ("os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, None),
}


def _run(sockdir: str, body: str) -> tuple[int, list[dict]]:
    a = Agent(None, socket_dir=sockdir, node="n1", plugins=[]).start()
    try:
        a.liveness.every_s = 0.0
        proc = subprocess.run([sys.executable, "-c", PRELUDE + body, sockdir], capture_output=True, timeout=60)
        rows = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.3)
            for kind, job, t in a.tick():
                if kind == "inflight":
                    rows += pa.table(t).select([c for c in pa.table(t).column_names if c not in ("t", "since")]).to_pylist()
            if rows and any(r["state"] in ("exited", "gone") for r in rows) and time.monotonic() > deadline - 3:
                break
    finally:
        a.close()
    return proc.returncode, rows


@pytest.mark.parametrize("case", list(CASES))
def test_every_way_a_rank_ends_leaves_the_right_word(socket_dir, case):
    body, rc, want = CASES[case]
    if want is not None and want.get("signal") and eventlog._fast is None:
        pytest.skip("the signal goodbye needs the probe's C extension, which this build lacks")
    code, rows = _run(socket_dir, body)
    assert code == rc, (case, code)                    # the program ends exactly as it would have
    byes = [r for r in rows if r["state"] == "exited"]
    gone = [r for r in rows if r["state"] == "gone"]
    if want is None:                                   # no word from the process: the agent saw it go
        assert not byes and len(gone) == 1 and gone[0]["rank"] == 1 and gone[0]["source"] == "agent", rows
        return
    assert not gone, rows                              # a goodbye replaces the agent's 'gone'
    assert byes and byes[0]["rank"] == 1 and byes[0]["job"] == "j"
    for k, v in want.items():
        assert byes[0][k] == v, (case, k, byes[0])
    if case == "exception":
        assert byes[0]["error"].startswith("ValueError: bad batch 7") and "Traceback" in byes[0]["stack"]
    if case == "abort_in_teardown":                    # the work finished, then its teardown aborted
        assert len(byes) == 2 and byes[1]["signal"] == int(signal.SIGABRT), byes
    if case == "sigterm":
        assert byes[0]["pid"] and byes[0]["pid"] != os.getpid()


def _probe_and_agent_socket(tmp_path, flush_ms: int):
    """A probe of rank 1 and the socket an 'agent' (the test) reads: (probe, socket, its path)."""
    import socket

    from stepwatch.agents.probe import Probe
    path = str(tmp_path / "agent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    p = Probe().init(job="j", rank=1, world_size=2, socket_dir=str(tmp_path), auto=False, flush_ms=flush_ms)
    return p, srv, path


def _exit_into_a_full_queue(p, srv, path) -> list:
    """Fill the 'agent's' queue (another sender), end the probe (``at_exit``) while a reader drains the
    queue 0.3 s later; returns every datagram the reader got (the filler's ``x`` ones included)."""
    import socket
    import threading

    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    filler.connect(path)
    try:
        try:
            while True:                                  # the agent's queue: full
                filler.send(b"x" * 64)
        except BlockingIOError:
            pass
        got = []

        def drain():
            time.sleep(0.3)
            srv.settimeout(0.2)
            try:
                while True:
                    got.append(srv.recv(65536))
            except (socket.timeout, OSError):
                pass
        t = threading.Thread(target=drain)
        t.start()
        p.transport.connected = True
        p._exitw.at_exit()
        t.join()
        return got
    finally:
        filler.close()


def test_the_goodbye_waits_a_little_for_room_in_a_busy_agents_queue(tmp_path):
    """The agent's socket queue is full when the rank ends (a busy agent: 4 ranks on 2 loaded cores lost a
    goodbye, and a clean end read as a failed exit): the goodbye waits up to GOODBYE_WAIT_S for room
    instead of being dropped; here the 'agent' drains its queue 0.3 s later and gets it."""
    from stepwatch.agents.probe import exitwatch
    from stepwatch.wire.datagram import HDR, T_INFLIGHT

    p, srv, path = _probe_and_agent_socket(tmp_path, flush_ms=0)
    try:
        p.begin_step()
        p.end_step()
        got = _exit_into_a_full_queue(p, srv, path)
        byes = [d for d in got if len(d) > HDR.size and HDR.unpack(d[:HDR.size])[2] == T_INFLIGHT
                and b'"exited"' in d]
        assert len(byes) == 1 and exitwatch.GOODBYE_WAIT_S >= 0.5, (len(got), [d[:40] for d in got[-3:]])
    finally:
        p.shutdown()
        srv.close()


def test_the_last_steps_wait_for_room_too_and_go_before_the_goodbye(tmp_path):
    """A rank ends while the agent's queue is full (CI: both ranks' last 27 steps never stored after rank
    1 crashed): the steps its exit flushes land in the backlog, which nobody would send after the exit.
    They now wait for room as the goodbye does, and go first: every finished step arrives, then the
    goodbye."""
    from stepwatch.agents.probe import decode
    from stepwatch.wire.datagram import HDR, T_BATCH, T_INFLIGHT

    p, srv, path = _probe_and_agent_socket(tmp_path, flush_ms=60_000)
    try:
        p.begin_step()
        p.end_step()
        p.flush()                                        # the hello and step 0
        for _ in range(5):                               # steps 1-5 wait for a flush
            p.begin_step()
            p.end_step()
        got = _exit_into_a_full_queue(p, srv, path)
        kinds = [HDR.unpack(d[:HDR.size])[2] for d in got if len(d) > HDR.size and d[:1] != b"x"]
        steps = [f[3][0][0] for d in got if len(d) > HDR.size and HDR.unpack(d[:HDR.size])[2] == T_BATCH
                 for f in decode(d)]
        assert steps == [0, 1, 2, 3, 4, 5], (steps, kinds)
        assert kinds.index(T_INFLIGHT) > kinds.index(T_BATCH), kinds
    finally:
        p.shutdown()
        srv.close()

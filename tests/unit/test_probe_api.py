"""The in-process probe: datagram layout (and the C and the Python hot path packing the same bytes), the
explicit API, drops when the agent is absent or its queue full. A bound Unix socket stands in for the node
agent (probe_helpers.py). Automatic hooks, fork and zero-code mode: test_probe_hooks.py; collectives and
DDP: test_probe_collectives.py."""
from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from probe_helpers import Rx, probe, rx, split  # noqa: F401 - shared fixtures (sockdir: conftest.py)
from stepwatch.agents.probe import BadDatagram, Probe, decode, eventlog, transfer_ms
from stepwatch.wire import datagram

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch", reason="the automatic hooks instrument PyTorch (pip install torch==2.13.0)")


# --------------------------------------------------------------------------- layout

def test_struct_sizes_are_fixed_and_documented():
    assert (datagram.HDR.size, datagram.STEP.size, datagram.PHASE.size, datagram.COMM.size, datagram.GCREC.size) == (16, 136, 16, 40, 40)
    assert datagram.STEP_V1.size == 104 and datagram.STEP_V2.format.startswith(datagram.STEP_V1.format)    # v2 = v1 + 2 doubles
    assert datagram.STEP_V2.size == 120 and datagram.STEP.format.startswith(datagram.STEP_V2.format)       # v3 = v2 + 2 doubles
    assert datagram.HDR_STEP.size == datagram.HDR.size + datagram.STEP.size
    assert datagram.MAX_FRAME == 16 + 136 + 8 * 16 + 16 * 40 + 16 * 40
    assert datagram.MAX_DATAGRAM >= 10 * datagram.MAX_FRAME


def test_decode_rejects_malformed_datagrams():
    good = datagram.HDR.pack(datagram.MAGIC, 3, datagram.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(datagram.STEP.size)
    assert decode(good)[0][3][0][0] == 0
    assert len(decode(good + good)) == 2                                       # frames back to back
    # a version-1 frame (probes before the CPU fields): read, with the CPU fields null (-1)
    v1 = datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_BATCH, 1, 0, 1, 0, 0, 0) + datagram.STEP_V1.pack(*range(1, 14), 0)
    (_, _, _, (st, _, _, _)), = decode(v1)
    assert len(st) == len(datagram.STEP_FIELDS) and st[:3] == (1, 2, 3) and st[-4:] == (-1.0,) * 4
    # a version-2 frame (probes before the comm total/exposed fields): read, with those null (-1)
    v2 = datagram.HDR.pack(datagram.MAGIC, 2, datagram.T_BATCH, 1, 0, 1, 0, 0, 0) + datagram.STEP_V2.pack(*range(1, 14), 0, 5.0, 6.0)
    (_, _, _, (st, _, _, _)), = decode(v2)
    assert len(st) == len(datagram.STEP_FIELDS) and st[-4:] == (5.0, 6.0, -1.0, -1.0)
    assert len(decode(v1 + v2 + good)) == 3
    bad = [b"", b"xx", good[:-1], good + b"\0",
           struct.pack("<H", 0x1234) + good[2:],                               # magic
           datagram.HDR.pack(datagram.MAGIC, 9, datagram.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(datagram.STEP.size),   # version
           datagram.HDR.pack(datagram.MAGIC, 1, 7, 1, 0, 0, 0, 0, 0),                         # type
           datagram.HDR.pack(datagram.MAGIC, 3, datagram.T_BATCH, 1, 0, 2, 0, 0, 0) + bytes(2 * datagram.STEP.size),  # two steps
           datagram.HDR.pack(datagram.MAGIC, 2, datagram.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(datagram.STEP_V1.size),    # v2 needs 120 bytes
           datagram.HDR.pack(datagram.MAGIC, 3, datagram.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(datagram.STEP_V2.size),    # v3 needs 136 bytes
           datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_BATCH, 1, 0, 0, 99, 0, 0),                 # counts out of range
           datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, 1, 0, 0, 0, 0, 0) + b"{not json",
           datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, 1, 0, 0, 0, 0, 0) + b"[1, 2]",
           datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, 1, 0, 0, 0, 0, 0) + b"\xff\xfe",
           good + datagram.HDR.pack(datagram.MAGIC, 1, datagram.T_HELLO, 1, 0, 0, 0, 0, 0) + b"{}",      # hello after a frame
           good + good[:20]]
    for b in bad:
        with pytest.raises(BadDatagram):
            decode(b)


def test_transfer_estimate_uses_ring_traffic_and_bandwidth():
    mb = 1 << 20
    # all_reduce moves 2(n-1)/n of the payload: 1 MiB over 8 ranks at 25 GB/s
    assert transfer_ms("all_reduce", mb, 8, 25.0) == pytest.approx(2 * 7 / 8 * mb / 25e9 * 1e3)
    assert transfer_ms("all_gather_into_tensor", mb, 4, 10.0) == pytest.approx(3 * mb / 10e9 * 1e3)
    assert transfer_ms("barrier", 0, 8, 25.0) == 0.0
    assert transfer_ms("all_reduce", mb, 8, 0.0) == 0.0          # no model: all time counts as wait


# --------------------------------------------------------------------------- explicit API

def test_explicit_steps_phases_and_counts(probe, rx, sockdir):
    probe.init(job="exp", rank=3, world_size=8, socket_dir=sockdir, auto=False, pp=1, dtype="bf16",
               flush_ms=0)
    for _ in range(3):
        with probe.step(samples=32, tokens=4096):
            with probe.phase("data"):
                time.sleep(0.002)
            with probe.phase("forward"):
                time.sleep(0.003)
                with probe.phase("forward"):          # re-entering a phase is counted once
                    pass
            with probe.phase("backward"):
                time.sleep(0.001)
    probe.begin_step(step=100)
    probe.add_phase("optimizer", 1.5)
    probe.end_step()
    hello, names, steps, comm, gcs = split(rx.read())
    assert hello["job"] == "exp" and hello["rank"] == 3 and hello["world_size"] == 8
    assert hello["pp"] == 1 and hello["dtype"] == "bf16" and hello["framework"].startswith("pytorch-")
    assert [s["step"] for s in steps] == [0, 1, 2, 100]
    for s in steps[:3]:
        ph = {names[i]: ms for i, ms in s["phases"]}
        assert s["rank"] == 3 and s["samples"] == 32 and s["tokens"] == 4096
        assert s["data_ms"] >= 2 and ph["forward"] >= 3 and ph["backward"] >= 1
        assert s["step_ms"] >= s["data_ms"] + ph["forward"] + ph["backward"] - 0.01
        # compute is derived: step - data - comm - wait - gc - run-queue wait (CPU contention)
        assert s["cpu_ms"] is not None and 0 <= s["cpu_ms"] < s["step_ms"]
        # (never below 0: on a loaded machine the run-queue wait, spread over the steps of a replay as a rate,
        # can exceed a short step's remainder)
        assert s["compute_ms"] == pytest.approx(
            max(0.0, s["step_ms"] - s["data_ms"] - s["gc_ms"] - (s["cpu_wait_ms"] or 0)), abs=1e-6)
        assert s["t_end"] - s["t_start"] == pytest.approx(s["step_ms"] * 1e6, rel=0.05, abs=2e6)
        assert s["data_queue"] == -1
    assert {names[i]: ms for i, ms in steps[3]["phases"]} == {"optimizer": 1.5}
    assert steps[3]["samples"] == -1
    assert steps[1]["t_start"] >= steps[0]["t_end"]


def test_no_agent_means_drops_counted_and_training_unblocked(probe, sockdir):
    probe.init(job="gone", rank=0, world_size=1, socket_dir=os.path.join(sockdir, "nowhere"), auto=False,
               flush_ms=0)
    t0 = time.perf_counter()
    for _ in range(200):
        probe.begin_step()
        probe.end_step()
    per_step_us = (time.perf_counter() - t0) / 200 * 1e6
    st = probe.stats()
    assert st["steps"] == 200 and st["sent"] == 0
    assert st["dropped_no_agent"] == 200 and st["dropped"] == 200          # every step counted, once
    assert per_step_us < 2000          # generous: failing sends cost microseconds, never a timeout


def test_full_agent_queue_drops_instead_of_blocking(probe, sockdir):
    rx = Rx(sockdir, listen=False)
    try:
        probe.init(job="full", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=0)
        t0 = time.perf_counter()
        for _ in range(300):             # nobody reads: the kernel queue fills after a few datagrams
            probe.begin_step()
            probe.end_step()
        elapsed = time.perf_counter() - t0
        st = probe.stats()
        # the kernel queue took a few, the backlog holds the next MAX_BACKLOG, the rest is dropped
        assert st["backlog"] == datagram.MAX_BACKLOG and st["dropped_full"] > 0
        assert st["sent"] + st["hellos"] + st["backlog"] + st["dropped_full"] == 300 + 1
        assert elapsed < 3.0
        got = rx.read()                  # what was queued is intact
        assert [m[0] for m in got] == [datagram.T_HELLO] + [datagram.T_BATCH] * (len(got) - 1)
        # once the agent reads again, the backlog goes first, in order, with no gap
        steps = []
        for _ in range(4):
            probe.begin_step()
            probe.end_step()
            steps += [m[3][0][0] for m in rx.read() if m[0] == datagram.T_BATCH]
        assert steps == list(range(300 - datagram.MAX_BACKLOG, 304))
        assert probe.stats()["backlog"] == 0
    finally:
        rx.close()


def test_steps_share_datagrams_until_flush_ms(probe, rx, sockdir):
    probe.init(job="batch", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=60_000)
    for _ in range(3):                  # the first drain sends what it folded (nothing sent yet) ...
        probe.begin_step()
        probe.end_step()
    st = probe.stats()
    assert st["steps"] == 3 and st["sent"] == 3 and st["pending"] == 0 and st["datagrams"] == 1
    for _ in range(3):                  # ... then the steps wait for flush_ms, sharing one datagram
        probe.begin_step()
        probe.end_step()
    st = probe.stats()
    assert st["steps"] == 6 and st["sent"] == 3 and st["pending"] == 3
    probe.flush()
    st = probe.stats()
    assert st["sent"] == 6 and st["pending"] == 0 and st["datagrams"] == 2
    _, _, steps, _, _ = split(rx.read())
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4, 5]
    for _ in range(3):
        probe.begin_step()
        probe.end_step()
    probe.shutdown()                    # sends what waits
    _, _, steps, _, _ = split(rx.read())
    assert [s["step"] for s in steps] == [6, 7, 8]


def test_agent_coming_back_gets_the_identity_again(probe, sockdir):
    probe.init(job="late", rank=1, world_size=2, socket_dir=sockdir, auto=False, flush_ms=0)
    for _ in range(3):
        probe.begin_step()
        probe.end_step()
    assert probe.stats()["dropped_no_agent"] > 0
    r = Rx(sockdir)
    try:
        time.sleep(probe.reconnect_ns / 1e9 + 0.05)     # reconnects are tried once a second
        probe.begin_step()
        probe.end_step()
        msgs = r.read()
    finally:
        r.close()
    assert [m[0] for m in msgs] == [datagram.T_HELLO, datagram.T_BATCH]     # hello first, so the agent can use the batch
    assert msgs[1][3][0][0] == 3


def test_c_and_python_pack_the_same_bytes(sockdir):
    """``_probefast.pack_step`` and ``Probe._pack_py`` write the same frame, byte for byte: no calls,
    one call with a known wait, one to be split by the bandwidth model, several calls over two
    slots, named phases, an explicit compute phase, GC rows."""
    assert eventlog._fast is not None, "the C hot path was not built (README: a C compiler and the Python headers)"
    p = Probe()
    try:
        p.init(job="pack", rank=3, world_size=8, socket_dir=sockdir, auto=False, comm_gbps=10)
        ar, bc, grp = p.names.intern("all_reduce"), p.names.intern("broadcast"), p.names.intern("dp")
        s0 = p.names.comm_slot_for("all_reduce", ar, grp, 8)
        s1 = p.names.comm_slot_for("broadcast", bc, grp, 8)
        fwd = p.names.slot_for_phase("forward")
        p.dropped = (1 << 32) + 5                       # carried modulo 2**32
        cases = [
            ([], [], False, 0),
            ([(s0, 1, 4096, 120_000, 30_000.0)], [fwd], False, 0),
            ([(s0, 1, 1 << 26, 9_000_000, None)], [], True, 0),
            ([(s0, 1, 1 << 20, 500_000, None), (s1, 2, 64, 1_000, 0.0), (s0, 3, 1 << 20, 200_000, None)],
             [fwd], False, 2),
            ([(s1, 1, 1 << 30, 10, None)], [], False, 1),         # the model says more than the wall time
        ]
        for ci, (calls, touched, compute, n_gc) in enumerate(cases):
            cpu = (-1.0, -1.0) if ci == 0 else (41_000_000.0, -1.0) if ci == 1 else (12_345_678.0, 3_456_789.0)
            hidden = 0.0 if ci < 2 else 7_654_321.0 + ci          # DDP buckets' time behind backward
            ph, used = p.fold._ph_ns, p.fold._ph_used
            for i in range(datagram.MAX_PHASES):
                ph[i], used[i] = 0, False
            p.fold._ph_touched[:] = touched
            ph[0] = 1_234_567
            for i in touched:
                ph[i], used[i] = 2_000_000 + i, True
            if compute:
                ph[1], used[1] = 3_000_000, True
            for j in range(n_gc):
                datagram.GCREC.pack_into(p.fold._gcbuf, datagram.HDR.size + j * datagram.GCREC.size, 10**18 + j, 5e5, 2, 100 + j, 0)
            args = (7, 10**18, 10**18 + 50_000_000, 50_000_000, 800_000 if n_gc else 0, n_gc, 3, 32, -1)
            p.transport.buf[:] = bytes(len(p.transport.buf))
            end_py = p.fold._pack_py(0, *args, list(calls), n_gc, *cpu, hidden)
            py = bytes(p.transport.buf[:end_py])
            p.transport.buf[:] = bytes(len(p.transport.buf))
            end_c = eventlog._fast.pack_step(p.transport.buf, 0, p.instance, p.rank, *args[:4], ph[0], ph[1] if used[1] else -1,
                                      *args[4:], p.dropped, p.fold._ph_touched, ph, p.names.phase_ids, list(calls),
                                      p.names.c_traffic, p.fold._ns_per_byte, p.names.comm_key,
                                      p.fold._gcmv[16:16 + n_gc * datagram.GCREC.size] if n_gc else None, *cpu, hidden)
            assert end_c == end_py and bytes(p.transport.buf[:end_c]) == py, (calls, touched, compute, n_gc)
            (typ, inst, rank, (st, phases, comm, gcs)), = decode(py)
            assert rank == 3 and st[0] == 7 and st[13] == 5 and len(comm) == len({c[0] for c in calls})
            assert st[14:16] == cpu
            exposed = st[6] + st[7]                             # comm + wait: what held the step
            assert st[16:] == (exposed + hidden, exposed) and (exposed > 0) == bool(calls)
            assert len(phases) == len(touched) and len(gcs) == n_gc
    finally:
        p.shutdown()


def test_a_probe_with_the_watchdog_off_shuts_down_cleanly(probe, sockdir, monkeypatch):
    """``STEPWATCH_WATCHDOG=0``: no watchdog is started, and shutdown (at exit) does not trip on its
    absence (it called ``.close()`` on False)."""
    monkeypatch.setenv("STEPWATCH_WATCHDOG", "0")
    monkeypatch.setenv("RANK", "0")
    probe.init(job="nowd", rank=0, world_size=1, socket_dir=os.path.join(sockdir, "nowhere"), auto=False,
               flush_ms=0)
    for _ in range(3):
        probe.begin_step()
        probe.end_step()
    probe._start_watchdog()
    assert probe._wd is False
    probe.shutdown()


def test_a_finished_step_waits_at_most_flush_ms_plus_a_step(probe, rx, sockdir):
    """What a crash (``os._exit``, SIGKILL) loses is bounded: the steps not yet sent ended within
    ``flush_ms`` of the moment plus one step. The event log is drained every ``flush_ms`` and the drain
    sends what it folded; when the drain and the send each waited for ``flush_ms`` on their own clocks,
    a folded step could wait a second interval in the buffer (27 steps of >= 20 ms lost in CI)."""
    flush_ms, step_s = 100, 0.004
    probe.init(job="bound", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=flush_ms)
    ends, worst = [], 0.0
    for i in range(150):
        probe.begin_step()
        time.sleep(step_s)
        probe.end_step()
        ends.append(time.perf_counter())
        unsent = probe.stats()["steps"] - probe.stats()["sent"]
        if unsent:
            worst = max(worst, ends[-1] - ends[-unsent])     # the oldest unsent step ended this long ago
    bound = flush_ms / 1e3 + 3 * step_s                      # a step's length: sleep's overshoot allowed
    assert worst <= bound, f"a finished step waited {worst * 1e3:.0f} ms unsent (flush_ms {flush_ms})"


def test_a_datagram_the_full_queue_deferred_goes_at_the_next_step_end(probe, sockdir):
    """The agent's queue (``max_dgram_qlen`` datagrams for every sender on the node) was full at a flush:
    the datagram waits in the backlog. It goes at the next step end once there is room, not one
    ``flush_ms`` later: in CI both ranks' flush at step ~48 hit a full queue and rank 1 died at step 50,
    taking 27 finished steps it had not sent."""
    r = Rx(sockdir, listen=False)
    try:
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        filler.setblocking(False)
        filler.connect(os.path.join(sockdir, datagram.SOCKET_NAME))
        probe.init(job="defer", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=60_000)
        probe.begin_step()
        probe.end_step()                                 # step 0 goes at once with the hello
        try:
            while True:                                  # another sender fills the agent's queue
                filler.send(b"x")
        except BlockingIOError:
            pass
        for _ in range(3):
            probe.begin_step()
            probe.end_step()
        probe.flush()                                    # steps 1-3: EAGAIN, into the backlog
        assert probe.stats()["backlog"] >= 1
        while True:                                      # the agent reads its queue again
            try:
                r.sock.recv(65536)
            except BlockingIOError:
                break
        time.sleep(0.03)
        probe.begin_step()
        probe.end_step()
        st = probe.stats()
        assert st["backlog"] == 0 and st["sent"] == 4, st
    finally:
        filler.close()
        r.close()

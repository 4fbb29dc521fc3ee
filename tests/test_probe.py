"""The in-process probe: datagram layout, explicit API, automatic PyTorch hooks, collectives, drops,
fork, and zero-code mode (``stepwatch wrap``). A bound Unix socket stands in for the node agent."""
from __future__ import annotations

import copy
import gc
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stepwatch.agents import probe as P
from stepwatch.agents.probe import BadDatagram, Probe, decode, transfer_ms

torch = pytest.importorskip("torch", reason="the automatic hooks instrument PyTorch (pip install torch==2.13.0)")


class Rx:
    """A fake agent: a bound datagram socket. ``listen=True`` drains it on a thread (as the agent does:
    the kernel queues only ``net.unix.max_dgram_qlen`` datagrams); otherwise it is read on demand."""

    def __init__(self, d: str, listen: bool = True):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(os.path.join(d, P.SOCKET_NAME))
        self.got: list[bytes] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.th = None
        if listen:
            self.sock.settimeout(0.05)
            self.th = threading.Thread(target=self._loop, daemon=True)
            self.th.start()
        else:
            self.sock.setblocking(False)

    def _loop(self):
        while not self.stop.is_set():
            try:
                data = self.sock.recv(65536)
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            with self.lock:
                self.got.append(data)

    def read(self) -> list[tuple]:
        if self.th is None:
            while True:
                try:
                    self.got.append(self.sock.recv(65536))
                except BlockingIOError:
                    break
        else:
            time.sleep(0.15)
        with self.lock:
            out, self.got = self.got, []
        return [f for b in out for f in decode(b)]

    def close(self):
        self.stop.set()
        if self.th is not None:
            self.th.join(2)
        self.sock.close()


@pytest.fixture
def rx(sockdir):
    r = Rx(sockdir)
    yield r
    r.close()


@pytest.fixture(params=["c", "python"])
def probe(request, monkeypatch):
    """A probe on each hot path: the C one (``_probefast``, built by ``pip install``) and the pure-Python
    fallback; both must produce the same records."""
    if request.param == "c":
        assert P._fast is not None, ("the C hot path (stepwatch.agents._probefast) was not built: "
                                     "pip install needs a C compiler and the Python headers (README)")
    else:
        monkeypatch.setattr(P.eventlog, "_fast", None)     # (the hot path new probes take)
    p = Probe()
    yield p
    p.shutdown()


def split(msgs):
    """(last hello, {name id: name}, [step rows as dicts], [comm], [gc]) of decoded datagrams, durations
    converted from the datagram's ns to ms."""
    hello, steps, comm, gcs = None, [], [], []
    for typ, inst, rank, body in msgs:
        if typ == P.T_HELLO:
            hello = body
            continue
        st, phases, cm, gg = body
        if st is not None:
            d = dict(zip(P.STEP_FIELDS, st))
            for k in ("step", "data", "compute", "comm", "comm_wait", "gc"):
                d[k + "_ms"] = d.pop(k + "_ns") / 1e6           # the datagram carries ns
            for k in ("cpu", "cpu_wait"):                       # -1: not measured
                v = d.pop(k + "_ns")
                d[k + "_ms"] = v / 1e6 if v >= 0 else None
            d["phases"] = [(i, ns / 1e6) for i, ns in phases]
            d["rank"] = rank
            steps.append(d)
            comm += [(st[0],) + c[:4] + (c[4] / 1e6, c[5] / 1e6) for c in cm]
        gcs += [g[:1] + (g[1] / 1e6,) + g[2:] for g in gg]
    names = {int(k): v for k, v in (hello or {}).get("names", {}).items()}
    return hello, names, steps, comm, gcs


# --------------------------------------------------------------------------- layout

def test_struct_sizes_are_fixed_and_documented():
    assert (P.HDR.size, P.STEP.size, P.PHASE.size, P.COMM.size, P.GCREC.size) == (16, 120, 16, 40, 40)
    assert P.STEP_V1.size == 104 and P.STEP.format.startswith(P.STEP_V1.format)    # v2 = v1 + 2 doubles
    assert P.HDR_STEP.size == P.HDR.size + P.STEP.size
    assert P.MAX_FRAME == 16 + 120 + 8 * 16 + 16 * 40 + 16 * 40
    assert P.MAX_DATAGRAM >= 10 * P.MAX_FRAME


def test_decode_rejects_malformed_datagrams():
    good = P.HDR.pack(P.MAGIC, 2, P.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(P.STEP.size)
    assert decode(good)[0][3][0][0] == 0
    assert len(decode(good + good)) == 2                                       # frames back to back
    # a version-1 frame (probes before the CPU fields): read, with the CPU fields null (-1)
    v1 = P.HDR.pack(P.MAGIC, 1, P.T_BATCH, 1, 0, 1, 0, 0, 0) + P.STEP_V1.pack(*range(1, 14), 0)
    (_, _, _, (st, _, _, _)), = decode(v1)
    assert len(st) == len(P.STEP_FIELDS) and st[:3] == (1, 2, 3) and st[-2:] == (-1.0, -1.0)
    assert len(decode(v1 + good)) == 2
    bad = [b"", b"xx", good[:-1], good + b"\0",
           struct.pack("<H", 0x1234) + good[2:],                               # magic
           P.HDR.pack(P.MAGIC, 9, P.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(P.STEP.size),   # version
           P.HDR.pack(P.MAGIC, 1, 7, 1, 0, 0, 0, 0, 0),                         # type
           P.HDR.pack(P.MAGIC, 2, P.T_BATCH, 1, 0, 2, 0, 0, 0) + bytes(2 * P.STEP.size),  # two steps
           P.HDR.pack(P.MAGIC, 2, P.T_BATCH, 1, 0, 1, 0, 0, 0) + bytes(P.STEP_V1.size),    # v2 needs 120 bytes
           P.HDR.pack(P.MAGIC, 1, P.T_BATCH, 1, 0, 0, 99, 0, 0),                 # counts out of range
           P.HDR.pack(P.MAGIC, 1, P.T_HELLO, 1, 0, 0, 0, 0, 0) + b"{not json",
           P.HDR.pack(P.MAGIC, 1, P.T_HELLO, 1, 0, 0, 0, 0, 0) + b"[1, 2]",
           P.HDR.pack(P.MAGIC, 1, P.T_HELLO, 1, 0, 0, 0, 0, 0) + b"\xff\xfe",
           good + P.HDR.pack(P.MAGIC, 1, P.T_HELLO, 1, 0, 0, 0, 0, 0) + b"{}",      # hello after a frame
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
        assert st["backlog"] == P.MAX_BACKLOG and st["dropped_full"] > 0
        assert st["sent"] + st["hellos"] + st["backlog"] + st["dropped_full"] == 300 + 1
        assert elapsed < 3.0
        got = rx.read()                  # what was queued is intact
        assert [m[0] for m in got] == [P.T_HELLO] + [P.T_BATCH] * (len(got) - 1)
        # once the agent reads again, the backlog goes first, in order, with no gap
        steps = []
        for _ in range(4):
            probe.begin_step()
            probe.end_step()
            steps += [m[3][0][0] for m in rx.read() if m[0] == P.T_BATCH]
        assert steps == list(range(300 - P.MAX_BACKLOG, 304))
        assert probe.stats()["backlog"] == 0
    finally:
        rx.close()


def test_steps_share_datagrams_until_flush_ms(probe, rx, sockdir):
    probe.init(job="batch", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=60_000)
    for _ in range(6):                  # the first step goes at once (nothing sent yet), then they wait
        probe.begin_step()
        probe.end_step()
    st = probe.stats()
    assert st["steps"] == 6 and st["sent"] == 1 and st["pending"] == 5
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
    assert [m[0] for m in msgs] == [P.T_HELLO, P.T_BATCH]     # hello first, so the agent can use the batch
    assert msgs[1][3][0][0] == 3


# --------------------------------------------------------------------------- automatic hooks

class SlowDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        time.sleep(0.001)
        return torch.randn(8), torch.randn(2)


def test_automatic_steps_from_optimizer_dataloader_wait_and_gc(probe, rx, sockdir):
    probe.init(job="auto", rank=0, world_size=1, socket_dir=sockdir, flush_ms=0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)    # a second optimizer
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=4)
    for i, (x, y) in enumerate(loader):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if i == 2:
            gc.collect()
        opt.step()
        other.step()
        if i == 5:
            break
    hello, names, steps, comm, gcs = split(rx.read())
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4, 5]       # the second optimizer does not split steps
    for s in steps:
        ph = {names[i]: ms for i, ms in s["phases"]}
        assert s["data_ms"] >= 4.0                                  # 4 samples x 1 ms in __next__
        assert ph["optimizer"] > 0
        assert s["step_ms"] >= s["data_ms"]
    # step i runs from the end of step i-1's optimizer step to the end of its own
    assert all(b["t_start"] == a["t_end"] for a, b in zip(steps, steps[1:]))
    assert steps[2]["gc_count"] >= 1 and steps[2]["gc_ms"] > 0
    assert any(g[2] == 2 for g in gcs)                              # the full collection, as a gc row
    assert hello["device"] == "cpu" and hello["world_size"] == 1
    assert hello["model_params"] == 8 * 2 + 2                      # the primary optimizer's parameters
    assert all(s["data_queue"] == 0 for s in steps)                # single-process loader: nothing prefetched


def test_dataloader_queue_depth_with_workers(probe, rx, sockdir):
    probe.init(job="queue", rank=0, world_size=1, socket_dir=sockdir, flush_ms=0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 2)),
                                         batch_size=4, num_workers=1, prefetch_factor=4)
    for i, (x, y) in enumerate(loader):
        ((model(x) - y) ** 2).mean().backward()
        time.sleep(0.03)                       # slow compute: the worker fills the queue
        opt.step()
    msgs = rx.read()
    _, _, steps, _, _ = split(msgs)
    assert len(steps) == 16
    assert {m[1] for m in msgs} == {probe.instance}              # the forked worker sent nothing
    assert all(s["data_queue"] >= 0 for s in steps)
    assert max(s["data_queue"] for s in steps[2:]) >= 1


@pytest.fixture
def gloo(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def test_collectives_timed_per_op_with_bytes(probe, rx, sockdir, gloo):
    dist = gloo
    orig = dist.all_reduce
    probe.init(job="coll", socket_dir=sockdir, comm_gbps=0.0, flush_ms=0)   # no transfer model: all wait
    assert dist.all_reduce is not orig
    w = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.SGD([w], lr=0.1)
    t = torch.ones(1000)
    for _ in range(2):
        for _ in range(3):
            dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.barrier()
        dist.all_gather_object([None], {"a": 1})                      # built on all_gather: counted once
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        w.grad = torch.ones(10)
        opt.step()
    hello, names, steps, comm, gcs = split(rx.read())
    assert hello["rank"] == 0 and hello["world_size"] == 1           # resolved from torch.distributed
    assert hello["group_sizes"] == {"world": 1}
    assert len(steps) == 2
    by = {}
    for step, op, grp, cnt, nbytes, t_ms, w_ms in comm:
        if step == 1:
            by[(names[op], names[grp])] = (cnt, nbytes, t_ms, w_ms)
    assert by[("all_reduce", "world")][:2] == (4, 4 * 4000)
    assert by[("broadcast", "world")][:2] == (1, 4000)
    assert by[("barrier", "world")][0] == 1
    assert ("all_gather", "world") not in by                         # inside all_gather_object: not re-counted
    assert by[("all_gather_object", "world")][:2] == (1, 0)
    assert by[("wait", "async")][0] == 1
    for cnt, nbytes, t_ms, w_ms in by.values():
        assert 0 <= w_ms <= t_ms + 1e-9
    s = steps[1]
    total = sum(v[2] for v in by.values())
    assert s["comm_ms"] + s["comm_wait_ms"] == pytest.approx(total, rel=1e-6)
    assert s["comm_wait_ms"] == pytest.approx(sum(v[3] for v in by.values()), rel=1e-6)
    # comm_gbps=0: no transfer part; only the launch of the async all_reduce is not wait
    assert by[("broadcast", "world")][3] == by[("broadcast", "world")][2]
    assert by[("wait", "async")][3] == by[("wait", "async")][2]
    probe.shutdown()
    assert dist.all_reduce is orig                                   # patches are undone


def test_fork_child_is_a_new_silent_instance(probe, rx, sockdir):
    probe.init(job="fork", socket_dir=sockdir, auto=False, flush_ms=0)           # rank resolved lazily
    probe.begin_step()
    probe.end_step()
    pid = os.fork()
    if pid == 0:                                                     # child: one step, then leave
        try:
            os.environ["RANK"] = "0"
            probe.rank = 7                                           # as a launcher's child would learn it
            probe.begin_step()
            probe.end_step()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    msgs = rx.read()
    insts = {m[1] for m in msgs}
    assert len(insts) == 2 and probe.instance in insts
    child = [m for m in msgs if m[1] != probe.instance]
    assert [m[0] for m in child] == [P.T_HELLO, P.T_BATCH]
    assert child[0][3]["rank"] == 7 and child[1][3][0][0] == 0       # its own numbering from 0


# --------------------------------------------------------------------------- zero-code mode

def test_wrap_instruments_torch_processes_and_leaves_others_alone(rx, sockdir, tmp_path):
    other_site = tmp_path / "othersite"
    other_site.mkdir()
    (other_site / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE_RAN'] = '1'\n")
    env = dict(os.environ, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", PYTHONPATH=str(other_site))
    script = ("import sys, torch\n"
              "m = torch.nn.Linear(4, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              "for _ in range(3):\n"
              "    m(torch.randn(2, 4)).sum().backward(); o.step()\n"
              "import os; print(os.environ.get('OTHER_SITE_RAN'), 'stepwatch.agents.probe' in sys.modules)\n")
    cmd = [sys.executable, "-m", "stepwatch.agents.wrap", "--job", "wrapped", "--socket-dir", sockdir, "--",
           sys.executable, "-c", script]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "True"]          # the shadowed sitecustomize still ran
    hello, names, steps, comm, gcs = split(rx.read())
    assert hello["job"] == "wrapped" and hello["rank"] == 5 and hello["world_size"] == 8
    assert hello["local_rank"] == 1
    assert [s["step"] for s in steps] == [0, 1, 2] and all(s["rank"] == 5 for s in steps)
    # a process that never imports torch does not load the probe
    plain = "import sys; print('stepwatch.agents.probe' in sys.modules, 'torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-m", "stepwatch.agents.wrap", "--", sys.executable, "-c", plain],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["False", "False"], p.stderr
    assert rx.read() == []


def test_init_before_torch_is_imported_hooks_it_on_import(rx, sockdir):
    script = ("import sys\n"
              "from stepwatch import probe\n"
              f"probe.init(job='early', rank=0, world_size=1, socket_dir={sockdir!r})\n"
              "assert 'torch' not in sys.modules\n"          # init imports nothing heavy
              "import torch\n"
              "m = torch.nn.Linear(2, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              "for _ in range(2):\n"
              "    m(torch.ones(1, 2)).sum().backward(); o.step()\n"
              "print(probe.stats()['steps'])\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["2"], p.stderr
    hello, names, steps, comm, gcs = split(rx.read())
    assert hello["job"] == "early" and [s["step"] for s in steps] == [0, 1]


def test_wrap_without_command_is_a_usage_error():
    p = subprocess.run([sys.executable, "-m", "stepwatch.agents.wrap", "--job", "x"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "give a command" in p.stderr


def test_stepwatch_probe_reexports_the_module_api():
    from stepwatch import probe as sp
    assert sp.init is P.init and sp.step is P.step and sp.stats is P.stats and sp.phase is P.phase
    assert Path(sp.__file__).name == "probe.py"


def test_a_step_with_very_many_collectives_is_summed_in_bounded_memory(probe, rx, sockdir):
    """Calls are kept raw until the step is packed at a flush; past MAX_CALLS in one step they are
    summed per (op, group) on the spot. The frame's totals are the same either way."""
    probe.init(job="many", rank=0, world_size=4, socket_dir=sockdir, auto=False, flush_ms=0)
    ar, bc, grp = probe._intern("all_reduce"), probe._intern("broadcast"), probe._intern("dp")
    n = 3 * P.MAX_CALLS + 7
    probe.begin_step()
    for i in range(n):
        probe._record_comm(ar if i % 3 else bc, grp, 1000, 2000, 500.0)
        # the event log is bounded (a full one is replayed at once), and so are the replayed calls
        assert probe._log.n <= P.LOG_CAP and len(probe._calls) < P.MAX_CALLS
    assert n > P.LOG_CAP
    probe.end_step()
    assert probe.stats()["events_lost"] == 0
    hello, names, steps, comm, gcs = split(rx.read())
    assert len(steps) == 1
    by_op = {names[c[1]]: c for c in comm}
    n_bc = len(range(0, n, 3))
    assert by_op["broadcast"][3] == n_bc and by_op["all_reduce"][3] == n - n_bc        # counts
    assert by_op["all_reduce"][4] == (n - n_bc) * 1000                                  # bytes
    assert by_op["all_reduce"][5] == pytest.approx((n - n_bc) * 2000 / 1e6)            # time, ms
    assert by_op["all_reduce"][6] == pytest.approx((n - n_bc) * 500 / 1e6)             # wait, ms
    s = steps[0]
    assert s["comm_wait_ms"] == pytest.approx(n * 500 / 1e6) and s["comm_ms"] == pytest.approx(n * 1500 / 1e6)


def test_a_collective_between_explicit_steps_is_not_added_to_the_finished_step(probe, rx, sockdir):
    probe.init(job="between", rank=0, world_size=2, socket_dir=sockdir, auto=False)   # (flush at 500 ms)
    ar, grp = probe._intern("all_reduce"), probe._intern("dp")
    probe.begin_step()
    probe.end_step()                                      # the first step goes out at once, with the hello
    probe.begin_step()
    probe._record_comm(ar, grp, 100, 1000, 0.0)
    probe.end_step()                                      # this one waits for the flush
    probe._record_comm(ar, grp, 100, 1000, 0.0)          # after end_step, before the next begin_step
    probe.begin_step()
    probe.end_step()
    probe.flush()
    hello, names, steps, comm, gcs = split(rx.read())
    assert len(steps) == 3 and [c[3] for c in comm if c[0] == steps[1]["step"]] == [1]


def test_wrappers_keep_the_wrapped_calls_exceptions_and_still_record_them(probe, rx, sockdir):
    """A collective that raises, and a DataLoader iterator that ends, raise exactly what they raised
    without the probe (on both hot paths); the time spent is still recorded."""
    probe.init(job="exc", rank=0, world_size=2, socket_dir=sockdir, auto=False, flush_ms=0)
    probe._explicit = True

    class Dist:
        @staticmethod
        def get_world_size(group=None):
            return 2

    def all_reduce(tensor, op=None, group=None, async_op=False):
        raise RuntimeError("peer gone: " + str(tensor.nbytes))

    class It:
        n = 0

        def __next__(self):
            self.n += 1
            if self.n > 2:
                raise StopIteration
            return self.n

    ar = probe._wrap_collective(Dist, "all_reduce", all_reduce)
    it_cls = type("It", (It,), {})
    probe._patch_dataloader(it_cls)
    it = it_cls()
    probe.begin_step()
    with pytest.raises(RuntimeError, match="peer gone: 64"):
        ar(torch.zeros(16), group=None, async_op=False)
    assert [next(it), next(it)] == [1, 2]
    with pytest.raises(StopIteration):
        next(it)
    assert list(iter(lambda: next(it, None), None)) == []
    probe.end_step()
    hello, names, steps, comm, gcs = split(rx.read())
    assert len(steps) == 1 and steps[0]["data_ms"] > 0
    (c,) = comm
    assert names[c[1]] == "all_reduce" and c[3] == 1 and c[4] == 64


class _DevTensor:
    """A tensor on an accelerator, as the wrapper sees it (this machine has none)."""
    is_cpu = False
    nbytes = 4096

    class device:
        type = "fakedev"


def test_collectives_on_a_device_are_timed_by_device_events(probe, rx, sockdir):
    """On CUDA/NPU the host only launches a collective: a synchronous call on a device tensor is
    bracketed by the device module's timing events (``torch.cuda.Event`` there; a stand-in with the
    same methods here), read at the replay without synchronising. Events are pooled; one whose end
    has not completed at the replay leaves the host time (counted); CPU tensors and async calls are
    timed by the host as before."""
    made = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.records, self.ready = 0, True
            made.append(self)

        def record(self):
            self.records += 1

        def query(self):
            return self.ready

        def elapsed_time(self, end):
            return 7.5                                   # ms on the device

    class Dist:
        @staticmethod
        def get_world_size(group=None):
            return 2

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    probe.init(job="dev", rank=0, world_size=2, socket_dir=sockdir, auto=False, flush_ms=0)
    probe._dev_mods["fakedev"] = type("FakeDevModule", (), {"Event": Event})
    ar0 = probe._wrap_collective(Dist, "all_reduce", all_reduce)
    probe.begin_step()
    ar0(_DevTensor())                      # no CUDA context, no torch_npu: the payload is not even looked at
    probe.end_step()
    assert made == [] and probe.stats()["dev_timed"] == 0
    probe._log.dev_on = 1                  # what a CUDA context or torch_npu turns on (at the next replay)
    ar = probe._wrap_collective(Dist, "all_reduce", all_reduce)
    for _ in range(2):                                  # two steps of two calls: 2 event pairs, reused
        probe.begin_step()
        ar(_DevTensor())
        ar(_DevTensor(), group=None)
        probe.end_step()
    assert len(made) == 4 and all(e.records == 2 for e in made)
    for e in made:
        e.ready = False                                 # the device is behind: host time, counted
    probe.begin_step()
    ar(_DevTensor())
    ar(_DevTensor(), async_op=True)                     # async: the launch, by the host, no events
    ar(torch.zeros(16))                                 # a CPU tensor: the host's time
    probe.end_step()
    st = probe.stats()
    assert st["dev_timed"] == 4 and st["dev_unready"] == 1 and len(made) == 4
    hello, names, steps, comm, gcs = split(rx.read())
    assert len(steps) == 4
    steps = steps[1:]
    by_step = {}
    for c in comm:
        by_step.setdefault(c[0], []).append(c)
    for s in steps[:2]:
        (c,) = by_step[s["step"]]
        assert names[c[1]] == "all_reduce" and c[3] == 2 and c[4] == 8192
        assert c[5] == pytest.approx(15.0)                           # 2 x 7.5 ms, from the device
        assert s["comm_ms"] + s["comm_wait_ms"] == pytest.approx(15.0)
    (c,) = by_step[steps[2]["step"]]
    assert c[3] == 3 and c[4] == 4096 * 2 + 64 and c[5] < 5.0        # host times: microseconds


def test_c_and_python_pack_the_same_bytes(sockdir):
    """``_probefast.pack_step`` and ``Probe._pack_py`` write the same frame, byte for byte: no calls,
    one call with a known wait, one to be split by the bandwidth model, several calls over two
    slots, named phases, an explicit compute phase, GC rows."""
    assert P._fast is not None, "the C hot path was not built (README: a C compiler and the Python headers)"
    p = Probe()
    try:
        p.init(job="pack", rank=3, world_size=8, socket_dir=sockdir, auto=False, comm_gbps=10)
        ar, bc, grp = p._intern("all_reduce"), p._intern("broadcast"), p._intern("dp")
        s0 = p._comm_slot_for("all_reduce", ar, grp, 8)
        s1 = p._comm_slot_for("broadcast", bc, grp, 8)
        fwd = p._slot_for_phase("forward")
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
            ph, used = p._ph_ns, p._ph_used
            for i in range(P.MAX_PHASES):
                ph[i], used[i] = 0, False
            p._ph_touched[:] = touched
            ph[0] = 1_234_567
            for i in touched:
                ph[i], used[i] = 2_000_000 + i, True
            if compute:
                ph[1], used[1] = 3_000_000, True
            for j in range(n_gc):
                P.GCREC.pack_into(p._gcbuf, P.HDR.size + j * P.GCREC.size, 10**18 + j, 5e5, 2, 100 + j, 0)
            args = (7, 10**18, 10**18 + 50_000_000, 50_000_000, 800_000 if n_gc else 0, n_gc, 3, 32, -1)
            p._buf[:] = bytes(len(p._buf))
            end_py = p._pack_py(0, *args, list(calls), n_gc, *cpu)
            py = bytes(p._buf[:end_py])
            p._buf[:] = bytes(len(p._buf))
            end_c = P._fast.pack_step(p._buf, 0, p.instance, p.rank, *args[:4], ph[0], ph[1] if used[1] else -1,
                                      *args[4:], p.dropped, p._ph_touched, ph, p._phase_ids, list(calls),
                                      p._c_traffic, p._ns_per_byte, p._comm_key,
                                      p._gcmv[16:16 + n_gc * P.GCREC.size] if n_gc else None, *cpu)
            assert end_c == end_py and bytes(p._buf[:end_c]) == py, (calls, touched, compute, n_gc)
            (typ, inst, rank, (st, phases, comm, gcs)), = decode(py)
            assert rank == 3 and st[0] == 7 and st[13] == 5 and len(comm) == len({c[0] for c in calls})
            assert st[14:] == cpu
            assert len(phases) == len(touched) and len(gcs) == n_gc
    finally:
        p.shutdown()


# --------------------------------------------------------------------------- DDP (issue 15)

def _ddp_steps(ddp, opt, n, x, y):
    import torch.nn.functional as F
    for _ in range(n):
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()


def test_ddp_bucket_all_reduces_are_timed_through_a_comm_hook(probe, rx, sockdir, gloo):
    """DDP's reducer all-reduces from C++; the probe's comm hook keeps the default reduction (same
    gradients as without the probe) and reports one all_reduce per step with the buckets' bytes."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stepwatch.agents import ddp_hooks
    assert ddp_hooks.K_BUCKET == P.K_BUCKET
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                              torch.nn.ReLU(), torch.nn.Linear(1024, 8))
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    plain = DDP(copy.deepcopy(ref))                          # before init: DDP's own reduction
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    _ddp_steps(plain, opt_p, 3, x, y)
    probe.init(job="ddp", socket_dir=sockdir, flush_ms=0)
    ddp = DDP(copy.deepcopy(ref), bucket_cap_mb=1)           # 4.5 MB of gradients: 2 buckets from step 1
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _ddp_steps(ddp, opt, 3, x, y)
    assert ddp._stepwatch_timer.registered and ddp.logger is not None
    for a, b in zip(plain.parameters(), ddp.parameters()):    # the same training
        assert torch.equal(a, b)
    hello, names, steps, comm, gcs = split(rx.read())
    assert len(steps) == 3
    n_bytes = 4 * sum(p.numel() for p in ref.parameters())
    for s in steps[1:]:
        rows = [c for c in comm if c[0] == s["step"]]
        assert [(names[c[1]], names[c[2]]) for c in rows] == [("all_reduce", "world")], rows
        _, _, _, cnt, nbytes, t_ms, w_ms = rows[0]
        assert cnt >= 2 and nbytes == n_bytes                  # every bucket, counted and summed
        assert 0 <= w_ms <= t_ms and 0 < t_ms < s["step_ms"]   # the tail after backward, not the buckets' sum
        assert s["comm_ms"] + s["comm_wait_ms"] == pytest.approx(t_ms, rel=1e-6)
        assert s["cpu_ms"] is not None and s["cpu_ms"] > 0
    probe.shutdown()
    assert DDP.__init__ is not ddp_hooks.patch and not getattr(DDP.__init__, "_stepwatch", False)


def test_ddp_user_comm_hook_runs_inside_the_probes_and_is_timed(probe, rx, sockdir, gloo):
    """A hook the user registers (before the first forward, or after it: the probe's hook is then already
    in the reducer, which takes one hook only) is the one that runs, timed; a built-in one after the
    probe's is run as its Python equivalent."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    calls = []

    def my_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    probe.init(job="ddp-hook", socket_dir=sockdir, flush_ms=0)
    x, y = torch.randn(16, 32), torch.randn(16, 4)
    early, late = DDP(torch.nn.Linear(32, 4)), DDP(torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(list(early.parameters()) + list(late.parameters()), lr=0.1)   # one optimizer: one step each
    early.register_comm_hook(None, my_hook)                   # before the first forward
    _ddp_steps(early, opt, 2, x, y)
    assert len(calls) == 2 and early._stepwatch_timer.user is my_hook
    _ddp_steps(late, opt, 1, x, y)                            # the probe's own hook is registered here
    late.register_comm_hook(None, my_hook)                    # DDP alone would accept this too
    _ddp_steps(late, opt, 1, x, y)
    assert len(calls) == 3
    late._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    _ddp_steps(late, opt, 1, x, y)
    assert len(calls) == 3 and late._stepwatch_timer.user is None
    hello, names, steps, comm, gcs = split(rx.read())
    assert all(names[c[1]] == "all_reduce" and c[3] == 1 for c in comm)   # one bucket per step, every step timed
    assert len({c[0] for c in comm}) == len(steps) == 5


def test_bucket_tail_is_the_exposed_part_split_by_the_bandwidth_model(probe, sockdir):
    """Replay: the step's buckets become one call whose time is from the last launch to the last
    completion; the transfer part is the last bucket's payload at comm_gbps, the rest is wait."""
    probe.init(job="tail", rank=0, world_size=2, socket_dir=sockdir, auto=False, comm_gbps=1.0)
    s = probe._comm_slot_for("all_reduce", probe._intern("all_reduce"), probe._intern("world"), 2)
    calls = []
    buckets = {s: [3, 3000, 2_000_000, 9_000_000, 1000]}      # last launch at 2 ms, last done at 9 ms
    probe._bucket_calls(calls, buckets)
    assert buckets == {}
    (slot, cnt, nbytes, t, w), = calls
    tr = 1000 * 1.0 * 1.0                                     # all_reduce over 2 ranks: 1 byte on the wire per byte; 1 B/ns
    assert (slot, cnt, nbytes, t) == (s, 3, 3000, 7_000_000) and w == pytest.approx(7_000_000 - tr)

"""The in-process probe's collectives: per-op timing with bytes, bounded memory, the wrapped calls'
exceptions, device-event timing, and DDP's bucket all-reduces through a comm hook (issue 15). A bound Unix
socket stands in for the node agent (probe_helpers.py)."""
from __future__ import annotations

import copy

import pytest

from probe_helpers import gloo, probe, rx, split  # noqa: F401 - shared fixtures (sockdir: conftest.py)
from stepwatch.agents.probe import eventlog
from stepwatch.wire import datagram

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch", reason="the automatic hooks instrument PyTorch (pip install torch==2.13.0)")




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


def test_a_step_with_very_many_collectives_is_summed_in_bounded_memory(probe, rx, sockdir):
    """Calls are kept raw until the step is packed at a flush; past MAX_CALLS in one step they are
    summed per (op, group) on the spot. The frame's totals are the same either way."""
    probe.init(job="many", rank=0, world_size=4, socket_dir=sockdir, auto=False, flush_ms=0)
    ar, bc, grp = probe.names.intern("all_reduce"), probe.names.intern("broadcast"), probe.names.intern("dp")
    n = 3 * datagram.MAX_CALLS + 7
    probe.begin_step()
    for i in range(n):
        probe.hooks._record_comm(ar if i % 3 else bc, grp, 1000, 2000, 500.0)
        # the event log is bounded (a full one is replayed at once), and so are the replayed calls
        assert probe._log.n <= eventlog.LOG_CAP and len(probe.fold._calls) < datagram.MAX_CALLS
    assert n > eventlog.LOG_CAP
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
    ar, grp = probe.names.intern("all_reduce"), probe.names.intern("dp")
    probe.begin_step()
    probe.end_step()                                      # the first step goes out at once, with the hello
    probe.begin_step()
    probe.hooks._record_comm(ar, grp, 100, 1000, 0.0)
    probe.end_step()                                      # this one waits for the flush
    probe.hooks._record_comm(ar, grp, 100, 1000, 0.0)          # after end_step, before the next begin_step
    probe.begin_step()
    probe.end_step()
    probe.flush()
    hello, names, steps, comm, gcs = split(rx.read())
    assert len(steps) == 3 and [c[3] for c in comm if c[0] == steps[1]["step"]] == [1]


def test_wrappers_keep_the_wrapped_calls_exceptions_and_still_record_them(probe, rx, sockdir):
    """A collective that raises, and a DataLoader iterator that ends, raise exactly what they raised
    without the probe (on both hot paths); the time spent is still recorded."""
    probe.init(job="exc", rank=0, world_size=2, socket_dir=sockdir, auto=False, flush_ms=0)
    probe.fold._explicit = True

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

    ar = probe.hooks._wrap_collective(Dist, "all_reduce", all_reduce)
    it_cls = type("It", (It,), {})
    probe.hooks._patch_dataloader(it_cls)
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
    probe.timing.mods["fakedev"] = type("FakeDevModule", (), {"Event": Event})
    ar0 = probe.hooks._wrap_collective(Dist, "all_reduce", all_reduce)
    probe.begin_step()
    ar0(_DevTensor())                      # no CUDA context, no torch_npu: the payload is not even looked at
    probe.end_step()
    assert made == [] and probe.stats()["dev_timed"] == 0
    probe._log.dev_on = 1                  # what a CUDA context or torch_npu turns on (at the next replay)
    ar = probe.hooks._wrap_collective(Dist, "all_reduce", all_reduce)
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

    from stepwatch.agents.probe import ddp_hooks
    assert ddp_hooks.K_BUCKET == eventlog.K_BUCKET
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
    """Folding: the step's buckets become one call whose time is from the last launch to the last
    completion; the transfer part is the last bucket's payload at comm_gbps, the rest is wait."""
    probe.init(job="tail", rank=0, world_size=2, socket_dir=sockdir, auto=False, comm_gbps=1.0)
    s = probe.names.comm_slot_for("all_reduce", probe.names.intern("all_reduce"), probe.names.intern("world"), 2)
    calls = []
    # last launch at 2 ms, last done at 9 ms; the buckets were in flight 0-1.5 ms and 1.8-9 ms
    buckets = {s: [3, 3000, 2_000_000, 9_000_000, 1000,
                   [(1_800_000, 8_000_000), (0, 1_500_000), (2_000_000, 9_000_000), (500_000, 1_000_000)]]}
    hidden = probe.fold._bucket_calls(calls, buckets)
    assert buckets == {}
    assert hidden == (1_500_000 + 7_200_000) - 7_000_000      # the union less the tail: behind backward
    (slot, cnt, nbytes, t, w), = calls
    tr = 1000 * 1.0 * 1.0                                     # all_reduce over 2 ranks: 1 byte on the wire per byte; 1 B/ns
    assert (slot, cnt, nbytes, t) == (s, 3, 3000, 7_000_000) and w == pytest.approx(7_000_000 - tr)


# --------------------------------------------------------------------------- step times on a device (issue 25)

class _Device:
    """A device that runs the host's work late: every event recorded completes ``per_step_ms`` after
    the previous one on the device's clock, and only once the test lets the device reach it
    (``done``: the number of events completed so far). What ``torch.cuda`` gives: ``Event(enable_timing)``
    with ``record``/``query``/``elapsed_time``."""

    def __init__(self, per_step_ms: float):
        self.per, self.n, self.done = per_step_ms, 0, 0
        dev = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.i = -1

            def record(self):
                self.i, dev.n = dev.n, dev.n + 1

            def query(self):
                return self.i < dev.done

            def elapsed_time(self, end):
                assert self.query() and end.query()
                return (end.i - self.i) * dev.per

        self.Event = Event


def _host_alternating_steps(probe, n):
    import time
    for i in range(n):
        probe.begin_step()
        time.sleep(0.001 if i % 2 else 0.008)          # the host's time swings: 1 ms, 8 ms ...
        probe.end_step()


def test_step_times_on_a_device_are_the_devices_time_between_step_boundaries(probe, rx, sockdir):
    """On CUDA/NPU the host runs ahead of the device until something synchronises, so the host's time
    between step ends swings (2.7 / 9.0 ms alternating on an H200, one rank on NCCL: 13 false alerts on
    a clean job) while the device's is steady. At each step boundary the probe records a device event;
    a step's time is the device's time between its boundaries' events. A boundary whose event has not
    completed waits (held) for the next replay instead of folding with the host's time; a flush folds
    everything."""
    probe.init(job="devstep", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=0)
    dev = _Device(per_step_ms=4.0)
    probe.timing.step_mod = dev
    probe._log.dev_on = 1
    for k in range(8):
        _host_alternating_steps(probe, 1)
        dev.done = max(dev.n - 2, 0)                     # the device runs two boundaries behind the host
    st = probe.stats()
    assert st["held"] > 0 and st["dev_steps_unready"] == 0
    hello, names, steps, comm, gcs = split(rx.read())
    assert len(steps) < 8                                # the last steps wait for their device events
    dev.done = dev.n                                     # the device catches up
    probe.flush()
    hello, names, steps2, comm, gcs = split(rx.read())
    steps += steps2
    assert [s["step"] for s in steps] == list(range(8))
    st = probe.stats()
    assert st["dev_steps_unready"] == 0 and st["dev_steps_timed"] == 8 and st["held"] == 0
    assert [round(s["step_ms"], 3) for s in steps] == [4.0] * 8       # the device's, not 8 / 1 ms


def test_a_device_that_stops_completing_holds_steps_no_longer_than_the_bound(probe, rx, sockdir, monkeypatch):
    """A device that stopped (a hung kernel) or lags far: the held boundaries fold with the host's
    times (counted in ``dev_steps_unready``) once the first waited ``HOLD_NS``: steps are late by at
    most that, never lost."""
    from stepwatch.agents.probe import core
    monkeypatch.setattr(core, "HOLD_NS", 30_000_000)
    probe.init(job="devstop", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=0)
    dev = _Device(per_step_ms=4.0)
    probe.timing.step_mod = dev
    probe._log.dev_on = 1
    _host_alternating_steps(probe, 12)                   # ~54 ms of steps; the device never completes one
    st = probe.stats()
    assert st["dev_steps_unready"] > 0 and st["dev_steps_timed"] == 0
    hello, names, steps, comm, gcs = split(rx.read())
    assert steps and [s["step"] for s in steps] == list(range(len(steps)))
    assert max(s["step_ms"] for s in steps) > 7.0        # host times
    probe.flush()
    hello, names, steps2, comm, gcs = split(rx.read())
    assert [s["step"] for s in steps + steps2] == list(range(12))


def test_automatic_steps_on_a_device_take_the_devices_time_between_primary_optimizer_steps(probe, rx, sockdir):
    """Automatic mode: the primary optimizer's post-hook (C or Python) records the device event; a
    second optimizer's step records none and does not split the step."""
    import time
    probe.init(job="devauto", rank=0, world_size=1, socket_dir=sockdir, flush_ms=0)
    dev = _Device(per_step_ms=6.0)
    probe.timing.step_mod = dev
    probe._log.dev_on = 1
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    for i in range(7):
        time.sleep(0.001 if i % 2 else 0.009)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        other.step()
        dev.done = max(dev.n - 1, 0)
    assert dev.n == 7                  # one event per primary step end (the first step's time: the host's)
    dev.done = dev.n
    probe.flush()
    hello, names, steps, comm, gcs = split(rx.read())
    assert [s["step"] for s in steps] == list(range(7))
    st = probe.stats()
    assert st["dev_steps_timed"] == 6 and st["dev_steps_unready"] == 0
    assert [round(s["step_ms"], 3) for s in steps[1:]] == [6.0] * 6


def test_data_waits_the_devices_backlog_hid_are_not_the_steps(probe, rx, sockdir):
    """The host ran ahead of the device (a 100 ms device step, a few ms on the host, 2 ms of them
    waiting for data): the device had work queued, so the host's data wait did not hold it. The probe
    keeps the device's backlog (each step adds the device's interval less the host's, never below 0)
    and sends as ``data_ms`` only the wait beyond it. On an H200 such hidden waits read as a starved
    DataLoader (16 % of the step) on both clean 1-rank NCCL jobs."""
    import time
    probe.init(job="devdata", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=0)
    dev = _Device(per_step_ms=100.0)
    probe.timing.step_mod = dev
    probe._log.dev_on = 1

    def step(data_s):
        probe.begin_step()
        with probe.phase("data"):
            time.sleep(data_s)
        time.sleep(0.001)
        probe.end_step()
        dev.done = dev.n

    for _ in range(5):
        step(0.002)
    step(0.8)                           # a stall longer than the work the device has queued (<= 500 ms)
    probe.flush()
    hello, names, steps, comm, gcs = split(rx.read())
    assert [s["step"] for s in steps] == list(range(6))
    assert all(round(s["step_ms"], 3) == 100.0 for s in steps)
    assert steps[0]["data_ms"] >= 2.0                  # no backlog yet: all of it held the step
    assert all(s["data_ms"] == 0 for s in steps[1:5])  # the backlog (~95 ms a step) hid it
    lag = 0.0                                          # the backlog as the probe counts it, from the host's
    for s in steps[:5]:                                # intervals the frames carry
        lag = max(0.0, lag + 100.0 - (s["t_end"] - s["t_start"]) / 1e6)
    # the stall's wait less that backlog: at least the 800 ms slept (a loaded machine's sleep overruns,
    # never underruns), at most the host's whole interval of that step
    host5 = (steps[5]["t_end"] - steps[5]["t_start"]) / 1e6
    assert 800.0 - lag - 0.5 <= steps[5]["data_ms"] <= host5 - lag + 0.5, (steps[5], lag)


@pytest.mark.parametrize("gap_ms", [1, 13, 26])
def test_a_drain_sends_what_it_folded_once_flush_ms_passed(probe, sockdir, monkeypatch, gap_ms):
    """The steps a drain folds leave once ``flush_ms`` passed since the last send, whichever event the
    drain came at (a step's end, or the next step's begin after time outside any step). The send used to
    wait for a folded step that itself ended ``flush_ms`` after the last send, so a drain that came just
    before one kept them in the buffer until the next drain: up to twice ``flush_ms`` (a real 2-rank DDP
    job: 28 steps, 730 ms, never stored, on the rank that crashed and on the one a SIGTERM then ended)."""
    from probe_helpers import Rx
    from stepwatch.agents.probe import core
    clock = [10**12]
    monkeypatch.setattr(core, "_perf", lambda: clock[0])
    rx = Rx(sockdir, listen=False)
    try:
        probe.init(job="drain", rank=0, world_size=1, socket_dir=sockdir, auto=False, flush_ms=500)
        ends, worst = [], 0
        delivered = -1
        for k in range(120):
            probe.begin_step()
            clock[0] += 26_000_000 - gap_ms * 1_000_000 + 1_000_000
            probe.end_step()
            ends.append(clock[0])
            got = split(rx.read())[2]
            if got:
                delivered = max(delivered, max(s["step"] for s in got))
            # how long the oldest step not yet sent has waited since its end
            waited = clock[0] - ends[delivered + 1] if delivered + 1 < len(ends) else 0
            worst = max(worst, waited)
            clock[0] += gap_ms * 1_000_000
        assert delivered >= 100
        # a drain comes at the first event flush_ms after the last one (<= one 27 ms cycle late), and sends
        # (before: 945 ms)
        assert worst <= 500_000_000 + 27_000_000, worst / 1e6
    finally:
        rx.close()

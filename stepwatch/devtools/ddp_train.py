"""A standard DistributedDataParallel training script (gloo, CPU) for the real-run tests: it knows
nothing of stepwatch and runs unchanged under ``stepwatch wrap``.

Started as one rank (``RANK``, ``WORLD_SIZE`` and ``MASTER_PORT`` set: by torchrun, or by ``stepwatch wrap``
under ``srun``) it trains as that rank (``env://``). Else ``python ddp_train.py`` forks ``SW_NPROC`` (2) ranks that rendezvous over 127.0.0.1 on a free port (what
torchrun would do, without importing torch once per rank). Each rank pins itself to its own core
(``os.sched_setaffinity``: rank r on the r-th core this process may use) and uses one intra-op thread,
wraps an MLP in ``DistributedDataParallel`` and trains it with SGD on random data from a ``DataLoader``.
Unless ``SW_PAD_MS`` is set, nothing pads the steps: the step time is the rank's real compute and the
all-reduce.

Settings (environment):

- ``SW_STEPS`` (300) steps; ``SW_WIDTH`` (384) hidden width; ``SW_DEPTH`` (1) hidden width x width layers;
  ``SW_BATCH`` (64); ``SW_LOADER`` ``items`` (default: a ``DataLoader`` that reads and collates ``SW_BATCH``
  items a step on the rank's thread) or ``batches`` (whole batches sliced from tensors made in advance, pinned
  on CUDA: a loader that does not bound a GPU step);
- ``SW_BUCKET_MB`` (DDP's default, 25): DDP's gradient bucket size (``bucket_cap_mb``): small buckets are
  all-reduced one by one while backward goes on (their communication overlaps compute);
- ``SW_PAD_MS`` (0): every forward pass also sleeps this long (time on a device, as the host sees it:
  the rank's thread waits off the CPU);
- ``SW_SLEEP_RANK`` / ``SW_SLEEP_MS`` / ``SW_SLEEP_FROM``: that rank's forward pass sleeps that long
  from that step on (a slow accelerator, as the host sees it: the rank waits off the CPU);
- ``SW_CRASH_RANK`` / ``SW_CRASH_STEP`` / ``SW_CRASH_HOW``: that rank ends before that step: ``exit``
  (``os._exit(1)``, default), ``kill`` (SIGKILL) or ``raise`` (an exception);
- ``SW_GC_RANK`` / ``SW_GC_FROM``: from that step that rank (``-2``: every rank) keeps a growing heap of
  small containers and builds reference cycles every step (``SW_GC_CYCLES``, 3,000), then collects them
  (``gc.collect()``, as a loop that collects every step would): real collections, seen by the probe's
  ``gc.callbacks``; nothing sleeps for them;
- ``SW_DATA_RANK`` / ``SW_DATA_MS`` / ``SW_DATA_FROM``: from that step every batch that rank (``-2``:
  every rank) reads takes that much longer to read (a slow file system: the dataset's ``__getitem__``
  blocks);
- ``SW_HANG_RANK`` / ``SW_HANG_STEP`` / ``SW_HANG_S``: that rank is stuck for that long in a Python
  function (``load_next_shard``) before that step's forward, while the others wait in the all-reduce;
- ``SW_DEVICE`` (``cpu``) / ``SW_BACKEND`` (``gloo``): ``cuda`` and ``nccl`` on a GPU (NCCL takes one rank per
  GPU; gloo ranks can share one);
- ``SW_MODE`` ``ddp`` (default), ``fsdp`` (FSDP1 ``FullyShardedDataParallel``), ``fsdp2``
  (``fully_shard``) or ``manual`` (no wrapper, no DataLoader: batches made by hand and gradients
  all-reduced by a loop over the parameters);
- ``SW_NETNS`` / ``SW_NETNS_RANKS`` (``1``) / ``SW_MASTER_ADDR`` / ``SW_IFNAMES`` (``<this side>,<inside>``):
  those ranks run in that network namespace (root), the rendezvous is at that address and gloo's sockets
  use those interfaces: the ranks' collectives cross a real link (a veth pair whose bandwidth the caller
  can cut: ``stepwatch/devtools/netlink.py``);
- ``SW_PROGRESS``: a file where rank 1 writes its step number every step (the tests start a foreign
  process from a given step);
- ``SW_OUT``: where each rank writes ``rank<r>.json`` (its step end times, its main thread's CPU time and
  its forward passes' time off the CPU at each step end and, when a probe is loaded, its counters).
"""
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class SleepyForward(torch.nn.Module):
    """The model; its forward sleeps ``sleep_ms`` once ``armed`` (the injected fault)."""

    def __init__(self, width: int, depth: int = 1):
        super().__init__()
        hidden = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
        self.net = torch.nn.Sequential(torch.nn.Linear(128, width), torch.nn.ReLU(), *hidden,
                                       torch.nn.Linear(width, 10))
        self.sleep_ms = 0.0
        self.off_s = 0.0           # wall time the forward passes spent off the CPU (the pad's sleep, its late
                                   # wake-up, waiting for a core): work time the thread's CPU clock does not see

    def forward(self, x):
        t0, c0 = time.perf_counter(), time.thread_time()
        if self.sleep_ms > 0:
            time.sleep(self.sleep_ms / 1e3)
        y = self.net(x)
        self.off_s += max((time.perf_counter() - t0) - (time.thread_time() - c0), 0.0)
        return y


class Batches(torch.utils.data.Dataset):
    """Whole batches, sliced from tensors made in advance (pre-batched shards: the loader does no per-item
    work)."""

    def __init__(self, xs, ys, batch: int):
        self.xs, self.ys, self.batch = xs, ys, batch

    def __len__(self):
        return len(self.xs) // self.batch

    def __getitem__(self, i):
        b = self.batch
        return self.xs[i * b:(i + 1) * b], self.ys[i * b:(i + 1) * b]


class SlowReads(torch.utils.data.Dataset):
    """A dataset whose items from ``slow_from`` on take ``ms`` longer to read (a slow file system)."""

    def __init__(self, inner, ms: float, slow_from: int):
        self.inner, self.ms, self.slow_from = inner, ms, slow_from

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if i >= self.slow_from:
            time.sleep(self.ms / 1e3)
        return self.inner[i]


def load_next_shard(seconds: float) -> None:
    """A rank stuck in a Python function (a hung read of the next data shard)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)


def garbage_step(heap: list, cycles: int, size: int = 120_000) -> None:
    """GC pressure: a live heap of ``size`` small containers (built once; what the process held before is
    frozen, so the pause is this heap's), reference cycles built every step, then a full collection."""
    if not heap:
        gc.freeze()
        heap.extend({"k": [i]} for i in range(size))
    for _ in range(cycles):
        a, b = [], []
        a.append(b)
        b.append(a)
    gc.collect()


def train() -> None:
    steps = int(os.environ.get("SW_STEPS", "300"))
    width = int(os.environ.get("SW_WIDTH", "384"))
    batch = int(os.environ.get("SW_BATCH", "64"))
    sleep_rank = int(os.environ.get("SW_SLEEP_RANK", "-1"))
    sleep_ms = float(os.environ.get("SW_SLEEP_MS", "0"))
    sleep_from = int(os.environ.get("SW_SLEEP_FROM", "0"))
    pad_ms = float(os.environ.get("SW_PAD_MS", "0"))
    mode = os.environ.get("SW_MODE", "ddp")
    progress = os.environ.get("SW_PROGRESS")
    gc_rank, gc_from = int(os.environ.get("SW_GC_RANK", "-1")), int(os.environ.get("SW_GC_FROM", "0"))
    gc_cycles = int(os.environ.get("SW_GC_CYCLES", "3000"))
    data_rank, data_from = int(os.environ.get("SW_DATA_RANK", "-1")), int(os.environ.get("SW_DATA_FROM", "0"))
    data_ms = float(os.environ.get("SW_DATA_MS", "0"))
    hang_rank, hang_step = int(os.environ.get("SW_HANG_RANK", "-1")), int(os.environ.get("SW_HANG_STEP", "-1"))
    hang_s = float(os.environ.get("SW_HANG_S", "0"))
    heap = []
    dist.init_process_group(os.environ.get("SW_BACKEND", "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(os.environ.get("SW_DEVICE", "cpu"))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = SleepyForward(width, int(os.environ.get("SW_DEPTH", "1"))).to(dev)
    model.sleep_ms = pad_ms
    if mode == "ddp":
        bucket_mb = os.environ.get("SW_BUCKET_MB")
        net = torch.nn.parallel.DistributedDataParallel(
            model, **({"bucket_cap_mb": float(bucket_mb)} if bucket_mb else {}))
    elif mode == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        net = FullyShardedDataParallel(model, device_id=None)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
        net = model
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    if mode == "manual":
        loader = None
        xs = torch.randn(steps * batch, 128, generator=g)
        ys = torch.randint(0, 10, (steps * batch,), generator=g)
    else:
        xs, ys = torch.randn(steps * batch, 128, generator=g), torch.randint(0, 10, (steps * batch,), generator=g)
        if os.environ.get("SW_LOADER", "items") == "batches":
            data = Batches(xs, ys, batch)
            if data_rank in (rank, -2) and data_ms > 0:
                data = SlowReads(data, data_ms, data_from)
            loader = iter(DataLoader(data, batch_size=None, pin_memory=dev.type == "cuda"))
        else:
            data = TensorDataset(xs, ys)
            if data_rank in (rank, -2) and data_ms > 0:
                data = SlowReads(data, data_ms / batch, data_from * batch)
            loader = iter(DataLoader(data, batch_size=batch))
    ends, cpu, off = [], [], []    # the script's own clock, its main thread's CPU time and its forward
                                   # passes' time off the CPU (cumulative) at each step end
    crash_rank = int(os.environ.get("SW_CRASH_RANK", "-1"))
    crash_step = int(os.environ.get("SW_CRASH_STEP", "-1"))
    crash_how = os.environ.get("SW_CRASH_HOW", "exit")
    for i in range(steps):
        if rank == crash_rank and i == crash_step:
            if crash_how == "raise":
                raise RuntimeError(f"injected failure in rank {rank} at step {i}")
            if crash_how == "kill":
                os.kill(os.getpid(), 9)
            os._exit(1)
        if rank == hang_rank and i == hang_step:
            load_next_shard(hang_s)
        if gc_rank in (rank, -2) and i >= gc_from:
            garbage_step(heap, gc_cycles)
        if rank == sleep_rank and i == sleep_from:
            model.sleep_ms = pad_ms + sleep_ms
        if loader is not None:
            x, y = next(loader)
        else:
            x, y = xs[i * batch:(i + 1) * batch], ys[i * batch:(i + 1) * batch]
        if dev.type != "cpu":
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        if mode == "manual":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        ends.append(time.time())
        cpu.append(time.thread_time())
        off.append(model.off_s)
        if progress and rank == 1:
            with open(progress + ".tmp", "w") as f:
                f.write(str(i))
            os.replace(progress + ".tmp", progress)
    dist.barrier()
    mod = sys.modules.get("stepwatch.agents.probe") or sys.modules.get("stepwatch_probe")
    report = {"rank": rank, "ends": ends, "cpu": cpu, "off": off, "probe": {"rank": rank, **mod.stats()} if mod is not None else None}
    if report["probe"]:
        print("probe", json.dumps({k: report["probe"].get(k) for k in (
            "rank", "steps", "sent", "dropped", "dev_timed", "dev_unready", "dev_steps_timed", "dev_steps_unready")}),
            file=sys.stderr, flush=True)
    out = os.environ.get("SW_OUT")
    if out:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def _enter_netns(name: str) -> None:
    """This freshly forked (single-threaded) rank into network namespace ``name`` (``setns(2)``)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:                    # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns({name})")
    finally:
        os.close(fd)


def _worker(rank: int, world: int, port: int) -> None:
    addr = os.environ.get("SW_MASTER_ADDR", "127.0.0.1")
    netns = os.environ.get("SW_NETNS")
    if netns:
        inside = rank in {int(r) for r in os.environ.get("SW_NETNS_RANKS", "1").split(",")}
        host_if, ns_if = os.environ["SW_IFNAMES"].split(",")
        if inside:
            _enter_netns(netns)
        os.environ["GLOO_SOCKET_IFNAME"] = ns_if if inside else host_if
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    train()


if __name__ == "__main__":
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE") and os.environ.get("MASTER_PORT"):
        train()                    # started as one rank (torchrun; srun under stepwatch wrap: docs/baremetal.md)
        sys.exit(0)
    import socket

    import torch.multiprocessing as mp
    world = int(os.environ.get("SW_NPROC", "2"))
    with socket.socket() as s:
        s.bind((os.environ.get("SW_MASTER_ADDR", "127.0.0.1"), 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, port), nprocs=world, start_method="fork")

"""A small real training run: ``stepwatch demo --real`` and tests/test_distributed.py run it under
``stepwatch wrap``. It knows nothing of stepwatch (unless ``SW_EXPLICIT=1``).

``python demo_train.py`` imports torch once and forks ``SW_NPROC`` (4) ranks that rendezvous over
127.0.0.1 on a free port (what torchrun would do, without importing torch once per rank: on a small
shared test machine that costs ~15 s).

A 2-layer MLP on random data, data-parallel over torch.distributed (gloo, CPU): gradients are
flattened and all-reduced, then SGD steps. Each step's compute is padded with a sleep to
``SW_STEP_MS`` (standing in for device time, so CPU contention on a small test machine does not
turn into step-time noise); rank ``SW_SLOW_RANK`` sleeps ``SW_SLOW_EXTRA_MS`` more. The script itself
knows nothing of stepwatch unless ``SW_EXPLICIT=1`` (then it uses the explicit probe API); under
``stepwatch wrap`` the probe instruments it automatically. At the end each rank writes
``$SW_OUT/rank<r>.json`` (or prints it): the wall time at the end of each step and, when a probe is
loaded, its counters (``probe.stats()``).

GC pressure (``SW_GC_RANK`` R, or ``--gc-rank R``): rank R keeps a large live heap of small tracked
containers (``SW_GC_HEAP`` dict+list pairs, default 120,000) and each step, after the padded compute,
builds ``SW_GC_CYCLES`` (default 2,000) small reference cycles and runs a full ``gc.collect()``, as a
training loop that collects every step would. The pauses are real collections (the automatic gen-0/1
ones the cycles trigger, then a full one that traverses the heap: ~20-30 ms on a small CPU; what the
process held before, torch's objects, is ``gc.freeze()``-d so it does not set the pause length), seen by
the probe through ``gc.callbacks``; nothing sleeps for them. The other ranks do none of this.
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


def make_model(lr: float = 0.05, sync: bool = True):
    """The runs' model and optimiser: a 2-layer MLP (64 -> 128 -> 10), the same on every rank (seed 0;
    ``sync``: rank 0's weights broadcast too, as DDP does). Also used by tests/hang_train.py and
    tests/profile_train.py."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    if sync:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def pad_step(t0: float, ms: float) -> None:
    """Sleep until ``ms`` milliseconds after ``t0`` (``time.perf_counter``): stands in for device time."""
    pad = ms - (time.perf_counter() - t0) * 1e3
    if pad > 0:
        time.sleep(pad / 1e3)


def flat_grads(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def average_grads(params, flat: torch.Tensor, world: int) -> None:
    """All-reduce the flattened gradients (:func:`flat_grads`) and write their mean back."""
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[off:off + n].view_as(p))
        off += n


def train() -> None:
    steps = int(os.environ.get("SW_STEPS", "80"))
    step_ms = float(os.environ.get("SW_STEP_MS", "50"))
    slow = int(os.environ.get("SW_SLOW_RANK", "-1"))
    extra_ms = float(os.environ.get("SW_SLOW_EXTRA_MS", "20"))
    explicit = os.environ.get("SW_EXPLICIT") == "1"
    gc_rank = int(os.environ.get("SW_GC_RANK", "-1"))
    if "--gc-rank" in sys.argv:
        gc_rank = int(sys.argv[sys.argv.index("--gc-rank") + 1])
    gc_heap = int(os.environ.get("SW_GC_HEAP", "120000"))
    gc_cycles = int(os.environ.get("SW_GC_CYCLES", "2000"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    heap = None
    if rank == gc_rank:             # long-lived objects every full collection has to traverse
        gc.freeze()                 # but not torch's (~1M objects from the parent): the pause stays ours
        heap = [{"i": i, "l": [i]} for i in range(gc_heap)]
    probe = None
    if explicit:
        from stepwatch import probe
        probe.init(auto=False)
    model, opt = make_model()
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(steps * 16, 64, generator=g), torch.randint(0, 10, (steps * 16,), generator=g))
    nw = int(os.environ.get("SW_NUM_WORKERS", "0"))     # DataLoader workers (0: single-process, no prefetch)
    loader = DataLoader(data, batch_size=16, num_workers=nw,
                        **({"prefetch_factor": 4, "persistent_workers": True} if nw else {}))
    params = list(model.parameters())
    it = iter(loader)
    ends = []
    for i in range(steps):
        if probe:
            probe.begin_step()
        t0 = time.perf_counter()
        if probe:
            with probe.phase("data"):
                x, y = next(it)
        else:
            x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        pad_step(t0, step_ms + (extra_ms if rank == slow else 0.0))
        if heap is not None:        # after the pad, so the pauses add to this rank's step
            for _ in range(gc_cycles):
                a = {}
                b = [a]
                a["b"] = b          # a cycle: only the collector frees it
            del a, b
            gc.collect()
        average_grads(params, flat_grads(params), world)
        opt.step()
        if probe:
            probe.count(samples=len(x))
            probe.end_step()
        ends.append(time.time())
    dist.barrier()
    mod = sys.modules.get("stepwatch.agents.probe") or sys.modules.get("stepwatch_probe")
    report = {"rank": rank, "ends": ends, "probe": {"rank": rank, **mod.stats()} if mod is not None else None}
    out = os.environ.get("SW_OUT")
    if out:                       # one file per rank: forked ranks share stdout, long lines interleave
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    else:
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, fn) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    fn()


def run_ranks(fn) -> None:
    """Fork ``$SW_NPROC`` (4) ranks on a free loopback port, each running ``fn`` (also used by
    tests/profile_train.py)."""
    import socket
    import torch.multiprocessing as mp
    import torch._dynamo  # noqa: F401 - imported lazily by the first backward: once here, not once per rank
    world = int(os.environ.get("SW_NPROC", "4"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, port, fn), nprocs=world, start_method="fork")


if __name__ == "__main__":
    run_ranks(train)

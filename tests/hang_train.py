"""A real gloo training run (4 ranks, CPU) in which one rank hangs: tests/realrun/test_hang_real.py runs it under
``stepwatch wrap`` with a node agent, the broker and the processor. It knows nothing of stepwatch.

``SW_HANG`` says how rank ``SW_HANG_RANK`` hangs at step ``SW_HANG_STEP`` while the others block in the
step's ``all_reduce``:

* ``python``: it sleeps ``SW_HANG_S`` seconds inside :func:`load_next_shard` (a Python function), then
  goes on (the hang ends);
* ``mismatch``: it calls ``broadcast`` where its peers call ``all_reduce`` (a rank-dependent branch), and
  stays blocked there;
* ``sigstop``: it stops itself with SIGSTOP (the test resumes it with SIGCONT).

Each rank writes ``$SW_OUT/pid<r>`` at start, and ``$SW_OUT/rank<r>.json`` (its step end times) at the end.
"""
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from stepwatch.devtools.demo_train import average_grads, flat_grads, make_model, pad_step, run_ranks


def load_next_shard(seconds: float) -> None:
    """Stands in for a rank stuck in Python (a slow read, a lock, a rank-dependent loop)."""
    time.sleep(seconds)


def train() -> None:
    steps = int(os.environ.get("SW_STEPS", "40"))
    step_ms = float(os.environ.get("SW_STEP_MS", "50"))
    mode = os.environ.get("SW_HANG", "python")
    hang_rank = int(os.environ.get("SW_HANG_RANK", "3"))
    hang_step = int(os.environ.get("SW_HANG_STEP", "20"))
    hang_s = float(os.environ.get("SW_HANG_S", "12"))
    out = os.environ.get("SW_OUT", ".")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    model, opt = make_model(sync=False)
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(steps * 16, 64, generator=g), torch.randint(0, 10, (steps * 16,), generator=g))
    params = list(model.parameters())
    it = iter(DataLoader(data, batch_size=16))
    ends = []
    for i in range(steps):
        t0 = time.perf_counter()
        x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        pad_step(t0, step_ms)
        flat = flat_grads(params)
        if i == hang_step and rank == hang_rank:
            if mode == "python":
                load_next_shard(hang_s)
            elif mode == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif mode == "mismatch":
                dist.broadcast(flat, src=hang_rank)       # its peers call all_reduce
        average_grads(params, flat, world)
        opt.step()
        ends.append(time.time())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "ends": ends}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_ranks(train)

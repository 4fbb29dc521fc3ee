"""A small real gloo training run for tests/test_profiling_e2e.py and ``stepwatch bench profiling`` (not a
test itself): ``SW_NPROC`` ranks forked from one parent (as stepwatch/devtools/demo_train.py does), a small MLP, a
step padded with a sleep to ``SW_STEP_MS``; rank ``SW_SLOW_RANK`` does ``SW_SLOW_EXTRA_MS`` of extra work
inside ``torch.profiler.record_function("slow_op")`` (a matmul loop then a sleep), the injected slow
operation a profile must find (from step ``SW_SLOW_FROM``, default 0). The run goes on until ``SW_STEPS`` steps or until the file ``SW_STOP``
exists (checked every 10 steps with one all_reduce, so every rank stops at the same step). Each rank
writes ``$SW_OUT/rank<r>.json`` with the wall time at the end of each step."""
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stepwatch.devtools.demo_train import make_model, pad_step, run_ranks   # the plain training run's model and launcher


def train() -> None:
    steps = int(os.environ.get("SW_STEPS", "2000"))
    step_ms = float(os.environ.get("SW_STEP_MS", "50"))
    slow = int(os.environ.get("SW_SLOW_RANK", "-1"))
    slow_from = int(os.environ.get("SW_SLOW_FROM", "0"))     # the slow rank is slow from this step on
    extra_ms = float(os.environ.get("SW_SLOW_EXTRA_MS", "30"))
    stop = os.environ.get("SW_STOP", "")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = make_model(lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    m = torch.randn(96, 96, generator=g)
    ends = []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        pad_step(t0, step_ms)
        if rank == slow and i >= slow_from:     # on top of the padded step: this rank is extra_ms slower
            with torch.profiler.record_function("slow_op"):
                t1 = time.perf_counter()
                for _ in range(4):
                    m = torch.tanh(m @ m)
                rest = extra_ms - (time.perf_counter() - t1) * 1e3
                if rest > 0:
                    time.sleep(rest / 1e3)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        ends.append(time.time())
        if stop and i % 10 == 9:
            flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
    out = os.environ.get("SW_OUT")
    if out:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "ends": ends}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_ranks(train)

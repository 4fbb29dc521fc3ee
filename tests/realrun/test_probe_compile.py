"""The probe and ``torch.compile`` (issue 27, item 5): two real gloo ranks on CPU, each with its own probe
(rank 0 on the C hot path, rank 1 on the pure-Python one). A compiled function calling ``dist.all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor`` or a functional all-reduce breaks the graph as often
under the probe as without it (the compiled graph's collectives are not timed; the same calls in eager
code are); FSDP2's ``clip_grad_norm_`` all-reduce (a functional collective on DTensors) is recorded; and
the default process group has one name, ``world``, whether DDP, FSDP2 or ``group=None`` passes it."""
from __future__ import annotations

import datetime
import multiprocessing
import os
import traceback

import pytest

from probe_helpers import rx, split  # noqa: F401 - shared fixtures (sockdir: conftest.py)
from stepwatch.agents import probe as P
from stepwatch.agents.probe import eventlog

pytestmark = [pytest.mark.realrun, pytest.mark.slow]

torch = pytest.importorskip("torch", reason="the automatic hooks instrument PyTorch (pip install torch==2.13.0)")

WORLD = 2


def _f_all_reduce(x):
    import torch.distributed as dist
    y = x * 2
    dist.all_reduce(y)
    return y + 1


def _f_all_gather_into_tensor(x):
    import torch.distributed as dist
    out = x.new_empty(x.numel() * WORLD)
    dist.all_gather_into_tensor(out, x * 2)
    return out + 1


def _f_reduce_scatter_tensor(x):
    import torch.distributed as dist
    out = x.new_empty(x.numel() // WORLD)
    dist.reduce_scatter_tensor(out, x * 2)
    return out + 1


def _f_functional_all_reduce(x):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1


FNS = {"all_reduce": (_f_all_reduce, 2 * WORLD + 1),                  # (function, every element of its result)
       "all_gather_into_tensor": (_f_all_gather_into_tensor, 2 + 1),
       "reduce_scatter_tensor": (_f_reduce_scatter_tensor, 2 * WORLD + 1),
       "functional_all_reduce": (_f_functional_all_reduce, 2 * WORLD + 1)}


def _compiled(fn, x):
    """(graph breaks, result) of a fresh ``torch.compile`` of ``fn`` run on ``x``."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend="eager")(x)
    return sum(counters["graph_break"].values()), out


def _rank(rank: int, store: str, sockdir: str, q) -> None:
    try:
        os.environ["STEPWATCH_PROFILING"] = "0"
        import torch.distributed as dist
        if rank == 1:
            eventlog._fast = None           # the pure-Python hot path
        dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        x = torch.ones(4)
        res = {name: [_compiled(fn, x)[0]] for name, (fn, _) in FNS.items()}      # no probe
        p = P.Probe()
        p.init(job="compiled", socket_dir=sockdir, flush_ms=0)
        assert dist.all_reduce is not dist.all_reduce.__wrapped__
        p.begin_step()                        # step 0: the compiled functions
        for name, (fn, want) in FNS.items():
            n, out = _compiled(fn, x)
            res[name] += [n, bool((out == want).all())]
        p.end_step()
        p.begin_step()                        # step 1: the same, eager
        for fn, _ in FNS.values():
            fn(x)
        p.end_step()
        from torch.distributed.fsdp import fully_shard
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in m:
            fully_shard(layer)
        fully_shard(m)
        m(torch.ones(2, 8)).sum().backward()
        p.begin_step()                        # step 2: FSDP2's clip_grad_norm_ (its all-reduce only)
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        res["norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        p.end_step()
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        p.begin_step()                        # step 3: DDP's bucket (its default group) and group=None
        ddp(torch.ones(2, 8)).sum().backward()
        dist.all_reduce(torch.ones(4), group=None)
        p.end_step()
        p.shutdown()
        dist.destroy_process_group()
        q.put((rank, res))
    except BaseException:  # noqa: BLE001 - the parent reports it
        q.put((rank, traceback.format_exc()))
    q.close()
    q.join_thread()
    os._exit(0)                               # (torch's own exit after a compile takes ~5 s)


def test_compiled_collectives_do_not_break_graphs_and_eager_ones_are_recorded(rx, sockdir, tmp_path):
    assert eventlog._fast is not None, "the C hot path (stepwatch.agents._probefast) was not built"
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), sockdir, q)) for r in range(WORLD)]
    for pr in procs:
        pr.start()
    try:
        got = dict(q.get(timeout=120) for _ in procs)
    finally:
        for pr in procs:
            pr.join(30)
            if pr.is_alive():
                pr.kill()
    failed = {r: v for r, v in got.items() if not isinstance(v, dict)}
    assert not failed, "\n".join(f"rank {r}: {v}" for r, v in sorted(failed.items()))
    for r in range(WORLD):
        for name in FNS:
            off, on, right = got[r][name]
            assert on == off == 0, (r, name, off, on)     # as many graph breaks as without the probe
            assert right, (r, name)
    assert got[0]["norm"] == pytest.approx(got[1]["norm"]) and got[0]["norm"] > 0

    msgs = rx.read()
    for r in range(WORLD):
        hello, names, steps, comm, _ = split([m for m in msgs if m[2] == r])
        assert hello["group_sizes"] == {"world": WORLD}            # one name for the default group
        assert [s["step"] for s in steps] == [0, 1, 2, 3]
        by = {}
        for step, op, grp, cnt, nbytes, t_ms, w_ms in comm:
            by.setdefault(step, {})[(names[op], names[grp])] = (cnt, nbytes)
        assert {g for rows in by.values() for _, g in rows} <= {"world", "async"}
        assert 0 not in by                    # the compiled graphs' collectives: not timed (docs/agents.md)
        assert by[1][("all_reduce", "world")] == (2, 2 * 16)        # dist.all_reduce + funcol.all_reduce
        assert by[1][("all_gather_into_tensor", "world")] == (1, 16)
        assert by[1][("reduce_scatter_tensor", "world")] == (1, 16)
        assert by[1][("wait", "async")][0] >= 1                     # funcol.wait_tensor
        assert by[2][("all_reduce", "world")][0] >= 1               # clip_grad_norm_'s, on DTensors
        assert {op for op, _ in by[2]} <= {"all_reduce", "wait"}
        assert by[3][("all_reduce", "world")][0] == 2               # DDP's bucket tail + group=None

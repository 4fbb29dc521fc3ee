"""Helpers shared by the test modules of every kind (tests/unit, tests/integration, tests/realrun):
the tests' paths, a free loopback port, synthetic jobs (``JobContext``) and their step blocks, a
detector fed block by block, and a steps table for the store. Importable from any test module:
pytest puts tests/ (the folder of tests/conftest.py) on ``sys.path``."""
from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.detectors.base import JobContext, StepBlock
from stepwatch.devtools.broker import free_port  # noqa: F401 - the one free-port helper (tests use it from here)

TESTS = Path(__file__).resolve().parent      # the helper modules and scripts (hang_train.py, ...) and data/
ROOT = TESTS.parent                          # the repository (docs/, helm/)
DATA = TESTS / "data"
TOOLS = ROOT / "tools"                       # the repository's tools, outside the package (README: layout)


def tool(name: str):
    """The module ``tools/<name>.py`` (a script of the repository, not importable from the package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def job_context(R: int, per_node: int = 8, pp: int = 1, job: str = "j", node: str = "n{}", **kw) -> JobContext:
    """A job of ``R`` ranks, ``per_node`` to a node named ``node.format(rank // per_node)``, in ``pp``
    pipeline stages of consecutive ranks (stage 0 everywhere for pp=1); ``kw`` goes to JobContext."""
    nodes = np.array([node.format(r // per_node) for r in range(R)], dtype=object)
    return JobContext(job=job, world_size=R, nodes=nodes, stage=(np.arange(R) * pp // R).astype(np.int32), **kw)


def make_ctx(R: int, per_node: int = 8, pp: int = 1, job: str = "job-a") -> JobContext:
    """The slow-rank tests' job: nodes node000, node001, ..."""
    return job_context(R, per_node, pp, job=job, node="node{:03d}")


def make_block(steps, compute, data=5.0, comm=10.0, gc=0.0, host=2.0, step_ns=100_000_000) -> StepBlock:
    """Synchronous steps: each rank's own work (data + compute + gc + host gap) then a collective of
    ``comm`` ms; the step ends when the slowest rank arrives, so step_ms = max over ranks of
    (own + comm) and comm_wait = step_ms - own - comm. NaN compute = the rank did not report."""
    compute = np.asarray(compute, dtype=np.float64)
    S, R = compute.shape

    def full(v):
        return np.broadcast_to(np.asarray(v, dtype=np.float64), (S, R)).copy()

    data, comm, gc, host = full(data), full(comm), full(gc), full(host)
    own = data + compute + gc + host
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN steps
        step_row = np.nanmax(own + comm, axis=1, keepdims=True) if R else np.zeros((S, 1))
    step = np.broadcast_to(step_row, (S, R)).copy()
    missing = np.isnan(compute)
    step[missing] = np.nan
    for a in (data, comm, gc):
        a[missing] = np.nan
    steps = np.asarray(steps, dtype=np.int64)
    return StepBlock(steps=steps, t_end=(steps + 1) * step_ns, step_ms=step, data_ms=data,
                     compute_ms=compute, comm_ms=comm, comm_wait_ms=step - own - comm, gc_ms=gc)


def step_blocks(arrays: dict, size: int, step_ns: int = 10**8, start: int = 0, stop: int | None = None):
    """StepBlocks of ``size`` steps from per-field (S, R) arrays, steps ``start``..``stop`` (their own
    numbers), each step ending at (step + 1) * ``step_ns``."""
    stop = arrays["step_ms"].shape[0] if stop is None else stop
    for i in range(start, stop, size):
        steps = np.arange(i, min(stop, i + size), dtype=np.int64)
        yield StepBlock(steps=steps, t_end=(steps + 1) * step_ns, **{k: v[steps] for k, v in arrays.items()})


def alerts_of(det, ctx: JobContext, blocks, strict: bool = False) -> list:
    """Every alert of ``det`` over ``blocks``; ``strict``: a warning (numpy's) is an error."""
    out = []
    with warnings.catch_warnings():
        if strict:
            warnings.simplefilter("error")           # the detector must not leak numpy warnings
        for b in blocks:
            out += det.update(ctx, b)
    return out


def store_steps(job, step0, n, ranks=4) -> pa.Table:
    """A steps table (wire.STEPS) of ``n`` steps from ``step0`` of ``ranks`` ranks on node n0, 100 ms each."""
    s = np.repeat(np.arange(step0, step0 + n), ranks)
    r = np.tile(np.arange(ranks), n)
    t = pa.table({"job": [job] * len(s), "node": ["n0"] * len(s), "rank": r.astype("int32"), "step": s,
                  "t_end": pa.array(1_795_000_000_000_000_000 + s * 10**9).cast(wire.TS),
                  "step_ms": np.full(len(s), 100.0)})
    return conform(t, wire.STEPS)

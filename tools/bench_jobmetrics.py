"""Cost of the per-job metrics: ``python tools/bench_jobmetrics.py [--ranks 1024,16384,100000]``
(a tool of the repository, not part of the package).

Prints the CPU time of :meth:`JobMetrics.on_block` per closed block (1 and 4 steps, one rank 30% slow)
and of one scrape of all jobs. CPU time (``time.process_time``), so that other processes on a shared
machine inflate it less than wall time.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from stepwatch.detectors.base import JobContext, StepBlock
from stepwatch.stream.jobmetrics import JobMetrics


def _block(steps: np.ndarray, R: int, rng) -> StepBlock:
    S = len(steps)
    compute = 100 + rng.normal(0, 1.0, (S, R))
    compute[:, R // 3] *= 1.3
    own = compute + 7.0
    step = np.broadcast_to((own + 10.0).max(axis=1, keepdims=True), (S, R)).copy()
    full = np.full((S, R), 5.0)
    return StepBlock(steps=steps, t_end=(steps + 1) * 100_000_000, step_ms=step, data_ms=full, compute_ms=compute,
                     comm_ms=full * 2, comm_wait_ms=step - own - 10.0, gc_ms=np.zeros((S, R)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/bench_jobmetrics.py")
    ap.add_argument("--ranks", default="1024,16384,100000")
    ap.add_argument("--blocks", type=int, default=30)
    a = ap.parse_args(argv)
    reg = CollectorRegistry()
    jm = JobMetrics(reg)
    rng = np.random.default_rng(0)
    for R in (int(x) for x in a.ranks.split(",")):
        ctx = JobContext(job=f"bench{R}", world_size=R, nodes=np.array([f"n{r // 8}" for r in range(R)], dtype=object),
                         stage=np.zeros(R, dtype=np.int32))
        for S in (1, 4):
            ts = []
            for i in range(a.blocks):
                blk = _block(np.arange(S) + S * i + 1000 * S, R, rng)
                t0 = time.process_time()
                jm.on_block(ctx, blk)
                ts.append(time.process_time() - t0)
            med = float(np.median(ts)) * 1e3
            print(f"ranks {R:>7,}  block of {S} step(s): {med:6.2f} ms CPU ({med / S:.2f} ms per step)")
    t0 = time.process_time()
    for _ in range(20):
        n = len(generate_latest(reg))
    print(f"scrape of {len(jm.jobs())} jobs: {(time.process_time() - t0) / 20 * 1e3:.2f} ms CPU, {n:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

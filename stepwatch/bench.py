"""``stepwatch bench ingest``: step rows/s through the broker into Parquet, and end-to-end lag.

1. Throughput: a simulated job of ``--ranks`` ranks x ``--steps`` steps is produced to the embedded
   broker first; then one processor (``stepwatch process`` in a child process pinned to ONE core)
   consumes it. Reported: step rows/s from its first message to its last flush, and the same
   including the consumer-group join.
2. Lag: a fresh job is sent live, one step per second (each step at its ``t_end``), to a fresh
   processor (again pinned to one core). A watcher asks DuckDB for the newest stored step every
   100 ms; lag = time the step became queryable - its ``t_end``. Reported: p50/p95/max.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def _processor(bootstrap: str, prefix: str, data: Path, group: str, core: int, idle_exit: float | None,
               flush_interval: float = 1.0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stepwatch.cli", "process", "--bootstrap", bootstrap, "--topic-prefix", prefix,
           "--data-dir", str(data), "--group", group, "-q", "--stats-json", str(data / "_stats.json"),
           "--flush-interval", str(flush_interval)]
    if idle_exit:
        cmd += ["--idle-exit", str(idle_exit)]
    env = dict(os.environ, OMP_NUM_THREADS="1", ARROW_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, preexec_fn=lambda: os.sched_setaffinity(0, {core}),
                            stdout=subprocess.DEVNULL, stderr=open(data / "_processor.log", "wb"))


def run_bench(a) -> int:
    from stepwatch.agents.simsend import send_simulation
    from stepwatch.agents.simulate import Simulation
    from stepwatch.stream.broker import EmbeddedBroker
    from stepwatch.stream.kafkaio import KafkaSettings, ensure_topics, make_producer

    base = Path(a.data_dir or tempfile.mkdtemp(prefix="stepwatch-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    ncpu = os.cpu_count() or 1
    core = ncpu - 1
    print(f"stepwatch bench ingest: {a.ranks:,} ranks, {ncpu} CPUs; processor pinned to CPU {core}; data in {base}")
    with EmbeddedBroker(log_path=base / "broker.log") as broker:
        # ---------------------------------------------------------------- throughput
        s = KafkaSettings(bootstrap=broker.bootstrap, prefix="tput.", partitions=4)
        ensure_topics(s)
        sim = Simulation(job="bench-tput", ranks=a.ranks, steps=a.steps, seed=1)
        prod = make_producer(s)
        t0 = time.perf_counter()
        sent = send_simulation(sim, prod, s, chunk=4, rows_per_message=a.rows_per_message)
        t_prod = time.perf_counter() - t0
        prod.close()
        print(f"produced {sent['steps']:,} step rows (+{sent['host']:,} host, {sent['gc']:,} gc) "
              f"in {t_prod:.1f}s ({sent['steps'] / t_prod:,.0f} step rows/s incl. simulation)")
        d1 = base / "tput"
        d1.mkdir(exist_ok=True)
        t_spawn = time.time()
        p = _processor(broker.bootstrap, s.prefix, d1, "bench-tput", core, idle_exit=3.0)
        p.wait(600)
        st = json.loads((d1 / "_stats.json").read_text())
        rows = st["rows_out_steps"]
        span = st["t_last_flush"] - st["t_first_data"]
        total = st["t_last_flush"] - t_spawn
        print("\nthroughput (one processor, one core):")
        print(f"  step rows stored        {rows:,.0f} of {sent['steps']:,} sent "
              f"(all tables: {st['rows_out']:,.0f} rows)")
        print(f"  first message -> last flush  {span:.2f}s  => {rows / span:,.0f} step rows/s "
              f"({st['rows_out'] / span:,.0f} rows/s all tables)")
        print(f"  incl. process start + group join {total:.2f}s => {rows / total:,.0f} step rows/s")
        if rows != sent["steps"]:
            print(f"  WARNING: stored {rows} != sent {sent['steps']}")

        # ---------------------------------------------------------------- lag
        s2 = KafkaSettings(bootstrap=broker.bootstrap, prefix="lag.", partitions=4)
        ensure_topics(s2)
        d2 = base / "lag"
        d2.mkdir(exist_ok=True)
        p2 = _processor(broker.bootstrap, s2.prefix, d2, "bench-lag", core, idle_exit=None)
        time.sleep(4.0)   # let it join the group before the live stream starts
        n = a.lag_seconds
        sim2 = Simulation(job="bench-lag", ranks=a.ranks, steps=n, seed=2,
                          t0_ns=(time.time_ns() // 1_000_000_000 + 1) * 1_000_000_000)
        ends = sim2.step_times(0, n) if hasattr(sim2, "step_times") else None
        seen: dict[int, float] = {}
        stop = threading.Event()

        def watch():
            import duckdb
            con = duckdb.connect()
            glob = str(d2 / "steps" / "job=bench-lag" / "*" / "*.parquet")
            while not stop.is_set():
                try:
                    m = con.execute(f"SELECT max(step) FROM read_parquet('{glob}')").fetchall()[0][0]
                except Exception:  # noqa: BLE001 - no file yet
                    m = None
                now = time.time()
                if m is not None:
                    for k in range(int(m) + 1):
                        seen.setdefault(k, now)
                stop.wait(0.1)
        w = threading.Thread(target=watch, daemon=True)
        w.start()
        prod2 = make_producer(s2, linger_ms=5)
        send_simulation(sim2, prod2, s2, pace=True, rows_per_message=a.rows_per_message)
        prod2.close()
        deadline = time.time() + 15
        while time.time() < deadline and len(seen) < n:
            time.sleep(0.1)
        stop.set()
        w.join()
        p2.terminate()
        p2.wait(30)
        t_end = sim2.generate(0, n)["steps"].group_by("step").aggregate([("t_end", "max")]).sort_by("step")
        tend = {int(k): v.value / 1e9 for k, v in zip(t_end.column("step"), t_end.column("t_end_max"))}
        lags = np.array([seen[k] - tend[k] for k in sorted(seen) if k in tend])
        print(f"\nlag at {a.ranks:,} ranks x 1 step/s ({n} steps, step end -> row queryable in DuckDB):")
        if len(lags):
            print(f"  p50 {np.percentile(lags, 50):.2f}s   p95 {np.percentile(lags, 95):.2f}s   "
                  f"max {lags.max():.2f}s   ({len(lags)}/{n} steps seen)")
        else:
            print("  no step became queryable (see the processor log)")
    return 0

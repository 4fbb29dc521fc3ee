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
            from stepwatch.storage.views import connect
            con = None
            while not stop.is_set():
                try:        # every query reads the lake's newest snapshot
                    con = con or connect(d2)
                    m = con.execute("SELECT max(step) FROM steps WHERE job = 'bench-lag'").fetchall()[0][0]
                except Exception:  # noqa: BLE001 - no lake yet
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


# ------------------------------------------------------------------------------------ query bench
def _comm_from_steps(steps):
    """One all_reduce row per rank per step, derived from the step rows (bench data only)."""
    import pyarrow as pa

    from stepwatch import schema as wire
    n = steps.num_rows
    cols = {"job": steps.column("job"), "node": steps.column("node"), "rank": steps.column("rank"),
            "step": steps.column("step"), "op": pa.array(["all_reduce"] * 1, pa.string()).take(pa.array(np.zeros(n, np.int64))),
            "group": pa.array(["dp0"], pa.string()).take(pa.array(np.zeros(n, np.int64))),
            "count": pa.array(np.full(n, 12, np.int64)), "bytes": pa.array(np.full(n, 1 << 30, np.int64)),
            "time_ms": steps.column("comm_ms"), "wait_ms": steps.column("comm_wait_ms"),
            "group_size": pa.nulls(n, pa.int32())}
    return pa.Table.from_arrays(list(cols.values()), schema=wire.COMM)


def build_query_store(root: Path, ranks: int, seconds: int, chunk: int = 60, seed: int = 11) -> dict:
    """One hour (by default) of a ``ranks``-rank job at 1 step/s, written as the compacted store
    would hold it (one file per table per ``chunk`` steps), with alerts from the real detectors."""
    import pyarrow as pa

    from stepwatch import schema as wire
    from stepwatch.agents.simulate import Simulation
    from stepwatch.detectors.registry import build
    from stepwatch.storage.store import ParquetStore
    from stepwatch.stream.align import JobState

    st = ParquetStore(root, fsync=False).init()
    job = "bench-hour"
    sim = Simulation(job=job, ranks=ranks, steps=seconds, seed=seed,
                     t0_ns=(time.time_ns() // 3_600_000_000_000 - 2) * 3_600_000_000_000,
                     faults=[f"slow-rank:rank={ranks // 3},pct=20,start={seconds // 4},end={seconds // 2}",
                             f"regression:start={2 * seconds // 3},pct=12,cause=communication"])
    state = JobState(job, capacity=128)
    state.set_topology(sim.topology())
    dets = build()
    ctx = state.context()
    alerts = []
    st.write_flush({"topology": [sim.topology()]}, {})
    counts = {"steps": 0, "host": 0, "gc": 0, "comm": 0}
    t0 = time.perf_counter()
    for a in range(0, seconds, chunk):
        g = sim.generate(a, min(seconds, a + chunk))
        _, blocks = state.ingest(g["steps"])
        for blk in blocks:
            for d in dets:
                alerts += d.update(ctx, blk)
        comm = _comm_from_steps(g["steps"])
        st.write_flush({"steps": [g["steps"]], "host": [g["host"]], "gc": [g["gc"]], "comm": [comm]}, {})
        for k in counts:
            counts[k] += (comm if k == "comm" else g[k]).num_rows
        done = min(seconds, a + chunk)
        el = time.perf_counter() - t0
        print(f"\r  generated {done}/{seconds} steps, {counts['steps']:,} step rows "
              f"({el:.0f}s, ~{el / done * (seconds - done):.0f}s left)", end="", file=sys.stderr, flush=True)
    for blk in state.close_ready(force=True):
        for d in dets:
            alerts += d.update(ctx, blk)
    if alerts:
        st.write_flush({"alerts": [pa.Table.from_pylist([x.row() for x in alerts], schema=wire.ALERTS)]}, {})
    print(file=sys.stderr)
    counts["alerts"] = len(alerts)
    return counts


def run_query_bench(a) -> int:
    import duckdb

    from stepwatch.storage import queries
    from stepwatch.storage.views import connect

    base = Path(a.data_dir or tempfile.mkdtemp(prefix="stepwatch-qbench-"))
    seconds = a.seconds
    print(f"stepwatch bench query: {a.ranks:,} ranks x {seconds:,} steps (1 step/s) -> {base}")
    if (base / "lake.sqlite").exists() and connect(base).execute(
            "SELECT count(*) FROM steps WHERE job = 'bench-hour'").fetchall()[0][0]:
        print("  reusing the store already there (delete it to regenerate)")
        counts = None
    else:
        t = time.perf_counter()
        counts = build_query_store(base, a.ranks, seconds)
        print(f"  wrote {counts} in {time.perf_counter() - t:.0f}s")
    con = connect(base)
    nrows = con.execute("SELECT count(*) FROM steps WHERE job = 'bench-hour'").fetchall()[0][0]
    info = dict(con.execute("SELECT table_name, file_size_bytes + delete_file_size_bytes "
                            "FROM ducklake_table_info('lake')").fetchall())
    size = info.get("steps", 0)                    # (one job in this lake)
    total = sum(info.values())
    print(f"  steps: {nrows:,} rows, {size / 1e9:.2f} GB => {size / max(nrows, 1):.1f} bytes per step row "
          f"(whole store {total / 1e9:.2f} GB, {total / max(nrows, 1):.1f} B per step row incl. host/gc/comm)")
    alert = con.execute("SELECT step_first FROM alerts WHERE job='bench-hour' AND kind='regression' "
                        "ORDER BY step_first LIMIT 1").fetchall()
    step = alert[0][0] if alert else seconds // 2
    tr = con.execute("SELECT min(t_end) + INTERVAL 10 MINUTE, min(t_end) + INTERVAL 40 MINUTE "
                     "FROM steps WHERE job='bench-hour'").fetchall()[0]
    runs = [
        ("slowest_ranks", {}), ("slowest_ranks", {"t_from": tr[0], "t_to": tr[1]}),
        ("change_points", {}), ("jitter_per_hour", {}), ("host_contention", {}),
        ("gc_share_per_rank", {}), ("card_hours_lost", {}), ("before_after", {"step": step}),
    ]
    print(f"\n  {'query':<20} {'range':<12} {'rows':>5} {'cold s':>8} {'warm s':>8}")
    worst = 0.0
    for name, extra in runs:
        times = []
        for _ in range(2):
            c = connect(base)          # a fresh connection each time: no cached metadata
            t = time.perf_counter()
            cols, rows = queries.run(c, name, job="bench-hour", **extra)
            times.append(time.perf_counter() - t)
            c.close()
        worst = max(worst, max(times))
        rng = "30 min" if "t_from" in extra else ("±30 steps" if name == "before_after" else "whole hour")
        print(f"  {name:<20} {rng:<12} {len(rows):>5} {times[0]:>8.2f} {times[1]:>8.2f}")
    print(f"\n  slowest query: {worst:.2f}s (target < 2 s); store {size / max(nrows, 1):.1f} B/step row (target < 40)")
    return 0

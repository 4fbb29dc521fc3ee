"""``stepwatch bench ingest``: step rows/s through the broker into Parquet, and end-to-end lag.

1. Throughput: a simulated job of ``--ranks`` ranks x ``--steps`` steps is produced to the embedded
   broker first; then one processor (``stepwatch process`` in a child process pinned to ONE core)
   consumes it. Reported: step rows/s from its first message to its last flush, and the same
   including the consumer-group join.
2. Lag: a fresh job is sent live, one step per second (each step at its ``t_end``), to a fresh
   processor (again pinned to one core). A watcher asks DuckDB for the newest stored step every
   100 ms; lag = time the step became queryable - its ``t_end``. Reported: p50/p95/max.
3. Burst: one store flush holding ``--burst-jobs`` (1,000) jobs never seen before: its time and the
   data files it wrote (one per table, not one per job).
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
               flush_interval: float = 1.0, extra: tuple = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stepwatch.cli", "process", "--bootstrap", bootstrap, "--topic-prefix", prefix,
           "--data-dir", str(data), "--group", group, "-q", "--stats-json", str(data / "_stats.json"),
           "--flush-interval", str(flush_interval)]
    if idle_exit:
        cmd += ["--idle-exit", str(idle_exit)]
    cmd += list(extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", ARROW_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, preexec_fn=lambda: os.sched_setaffinity(0, {core}),
                            stdout=subprocess.DEVNULL, stderr=open(data / "_processor.log", "wb"))


def run_bench(a) -> int:
    from stepwatch.devtools.simsend import send_simulation
    from stepwatch.devtools.simulate import Simulation
    from stepwatch.devtools.broker import EmbeddedBroker
    from stepwatch.kafkaio import KafkaSettings, ensure_topics, make_producer

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
        if st.get("cpu_last_flush") is not None and st.get("cpu_first_data") is not None:
            cpu = st["cpu_last_flush"] - st["cpu_first_data"]
            print(f"  processor CPU over that span {cpu:.2f}s => {rows / cpu:,.0f} step rows per CPU-second "
                  f"(on a shared machine the wall figure above is lower); in the store's flushes {st['flush_s']:.2f}s "
                  f"wall ({st['flush_s'] / span:.0%} of the span)")
        if rows != sent["steps"]:
            print(f"  WARNING: stored {rows} != sent {sent['steps']}")
        _stored_bytes(d1, rows)

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
    burst_flush(base / "burst", a.burst_jobs)
    return 0


def _stored_bytes(root: Path, rows: float) -> None:
    """Bytes of the lake's data files per stored step row: the ``steps`` table's, and all tables'."""
    from stepwatch.storage.views import connect
    info = dict(connect(root).execute("SELECT table_name, file_size_bytes + delete_file_size_bytes "
                                      "FROM ducklake_table_info('lake')").fetchall())
    n = max(rows, 1)
    print(f"  stored {info.get('steps', 0) / n:.1f} B per step row in the steps table's Parquet files "
          f"({sum(info.values()) / n:.1f} B per step row with host, gc, rank_minutes and the rest)")


def burst_flush(root: Path, jobs: int = 1000, ranks: int = 16) -> None:
    """One store flush holding ``jobs`` jobs the lake has never seen (``ranks`` ranks x 2 steps of
    step rows, their host rows and topology each): its wall and CPU time and the data files it wrote
    (a lake partitioned by job wrote a file per job and table: 4,006 files, 95-290 s)."""
    import pyarrow as pa

    from stepwatch.devtools.simulate import Simulation
    from stepwatch.storage.store import LakeStore, Marker
    parts: dict[str, list] = {"steps": [], "host": [], "topology": []}
    for j in range(jobs):
        sim = Simulation(job=f"burst-{j:05d}", ranks=ranks, steps=2, seed=j)
        g = sim.generate(0, 2)
        parts["steps"].append(g["steps"])
        parts["host"].append(g["host"])
        parts["topology"].append(sim.topology())
    st = LakeStore(root, threads=1).init()
    st.write_flush({"steps": [Simulation(job="warm", ranks=ranks, steps=1, seed=0).generate(0, 1)["steps"]]},
                   {("bench", 0): Marker(1, [])}, generation=1)
    before = sum(len(f) for _, _, f in os.walk(root / "lake"))
    t, cpu = time.perf_counter(), time.process_time()
    n = st.write_flush({k: [pa.concat_tables(v)] for k, v in parts.items()}, {("bench", 0): Marker(2, [])}, generation=1)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    files = sum(len(f) for _, _, f in os.walk(root / "lake")) - before
    print(f"\none flush holding {jobs:,} new jobs ({n:,} rows, all tables): {wall:.2f}s wall, {cpu:.2f}s CPU, "
          f"{files} data files written")


# ------------------------------------------------------------------------------------ query bench
def _comm_from_steps(steps):
    """One all_reduce row per rank per step, derived from the step rows (bench data only)."""
    import pyarrow as pa

    from stepwatch.wire import tables as wire
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

    from stepwatch.wire import tables as wire
    from stepwatch.devtools.simulate import Simulation
    from stepwatch.detectors.registry import build
    from stepwatch.storage.store import LakeStore
    from stepwatch.stream.align import JobState

    st = LakeStore(root, fsync=False).init()
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


_NEW_PROCESS_QUERY = """
import json, sys, time
from stepwatch.storage import queries
from stepwatch.storage.views import connect
a = json.loads(sys.argv[1])
t0 = time.perf_counter()
con = connect(a["base"])
t1 = time.perf_counter()
queries.run(con, a["name"], job="bench-hour", **a["extra"])
print(json.dumps([t1 - t0, time.perf_counter() - t1]))
"""


def run_query_bench(a) -> int:
    from stepwatch.storage import queries
    from stepwatch.storage.views import connect

    base = Path(a.data_dir or tempfile.mkdtemp(prefix="stepwatch-qbench-"))
    seconds = a.seconds or 3600
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
    print(f"\n  {'query':<20} {'range':<12} {'rows':>5} {'new proc s':>10} {'cold s':>8} {'warm s':>8}"
          f"   {'CPU s (cold, warm; all DuckDB threads)'}")
    worst, attach = 0.0, []
    for name, extra in runs:
        # new process: a DuckDB that never saw the lake (attach timed apart); cold: the first run on a
        # fresh connection of this process; warm: the same query again
        out = subprocess.run([sys.executable, "-c", _NEW_PROCESS_QUERY, json.dumps(
            {"base": str(base), "name": name, "extra": {k: v if isinstance(v, (int, float)) else str(v) for k, v in extra.items()}})],
            capture_output=True, text=True, check=True).stdout
        t_attach, t_new = json.loads(out.strip().splitlines()[-1])
        attach.append(t_attach)
        times, cpus = [t_new], []
        for _ in range(2):
            c = connect(base)          # a fresh connection each time: no cached metadata
            t, cpu = time.perf_counter(), time.process_time()
            cols, rows = queries.run(c, name, job="bench-hour", **extra)
            times.append(time.perf_counter() - t)
            cpus.append(time.process_time() - cpu)
            c.close()
        worst = max(worst, max(times))
        rng = "30 min" if "t_from" in extra else ("±30 steps" if name == "before_after" else "whole hour")
        print(f"  {name:<20} {rng:<12} {len(rows):>5} {times[0]:>10.2f} {times[1]:>8.2f} {times[2]:>8.2f}"
              f"   {cpus[0]:>6.2f} {cpus[1]:>6.2f}")
    print(f"  (a new process first loads the extensions and attaches the lake: median {np.median(attach):.2f}s, "
          f"not included above)")
    print(f"\n  slowest query: {worst:.2f}s (target < 2 s); store {size / max(nrows, 1):.1f} B/step row (target < 30)")
    return 0


# ------------------------------------------------------------------------------ change-point bench
#: families of :func:`changepoint_series` (each drawn with and without mean shifts, except ``smooth``)
CP_FAMILIES = ("steptime", "trend", "seasonal", "ar1", "smooth")


def changepoint_series(per_family: int = 48, seed: int = 2024) -> list[dict]:
    """Labelled series for judging offline change-point finders, written for this project (not taken
    from any annotated benchmark). ``per_family`` series per family, half of them with mean shifts
    (``smooth``: none); each item is ``{"name", "family", "y", "cps"}`` with ``cps`` the indices where
    a new level begins. Shifts are clear (>= 3 noise sd, or >= 5% of a step time) and segments >= 25
    points, so a human would mark them; nothing else is a change.

    - ``steptime``: a step time of 80-300 ms, 1-3% Gaussian + Student-t(3) noise, single-step spikes
      (+30-80%) on 1-3% of the steps, sometimes a checkpoint spike every 50 or 100 steps; shifts of
      5-25% up or down.
    - ``trend``: a linear or slowly curving drift (total 2-12 noise sd) over white noise; shifts 3-8 sd.
    - ``seasonal``: a sine of period 12-90 points and amplitude 1-3 sd over white noise; shifts 3-8 sd.
    - ``ar1``: AR(1) noise, coefficient 0.3-0.85 (unit marginal sd); shifts 3-6 marginal sd.
    - ``smooth``: no change at all: growth curves (exponential, logistic) with 0.2-1% noise, and trend +
      seasonal curves with small AR(1) noise (a population or a CO2 record has this shape).
    """
    rng = np.random.default_rng(seed)
    out = []

    def shifts(n, k, min_seg=25):
        for _ in range(100):
            c = np.sort(rng.choice(np.arange(min_seg, n - min_seg), size=k, replace=False))
            if k == 0 or np.all(np.diff(np.r_[0, c, n]) >= min_seg):
                return [int(x) for x in c]
        return []

    def levels(n, cps, size):
        lv = np.zeros(n)
        for c in cps:
            lv[c:] += size() * rng.choice((-1.0, 1.0))
        return lv

    for fam in CP_FAMILIES:
        for i in range(per_family):
            n = int(rng.integers(100, 1001))
            with_cp = fam != "smooth" and i % 2 == 1
            k = int(rng.integers(1, 4)) if with_cp else 0
            cps = shifts(n, k)
            t = np.arange(n, dtype=np.float64)
            if fam == "steptime":
                base = float(rng.uniform(80, 300))
                lv = np.ones(n)
                for c in cps:
                    lv[c:] *= 1.0 + float(rng.uniform(0.05, 0.25)) * rng.choice((-1.0, 1.0))
                sd = float(rng.uniform(0.01, 0.03))
                y = base * lv * (1.0 + sd * rng.standard_normal(n) + 0.3 * sd * rng.standard_t(3, n))
                spk = rng.random(n) < rng.uniform(0.01, 0.03)
                y[spk] *= 1.0 + rng.uniform(0.3, 0.8, spk.sum())
                if rng.random() < 0.5:
                    p = int(rng.choice((50, 100)))
                    y[int(rng.integers(0, p))::p] *= 1.4
            elif fam == "trend":
                amp = float(rng.uniform(2, 12)) * rng.choice((-1.0, 1.0))
                drift = amp * (t / n if rng.random() < 0.5 else (t / n) ** 2)
                y = 10.0 + drift + levels(n, cps, lambda: rng.uniform(3, 8)) + rng.standard_normal(n)
            elif fam == "seasonal":
                per = float(rng.uniform(12, 90))
                y = (float(rng.uniform(1, 3)) * np.sin(2 * np.pi * t / per + rng.uniform(0, 6.3))
                     + levels(n, cps, lambda: rng.uniform(3, 8)) + rng.standard_normal(n))
            elif fam == "ar1":
                phi = float(rng.uniform(0.3, 0.85))
                e = rng.standard_normal(n) * np.sqrt(1 - phi * phi)
                u = np.empty(n)
                u[0] = rng.standard_normal()
                for j in range(1, n):
                    u[j] = phi * u[j - 1] + e[j]
                y = 5.0 + levels(n, cps, lambda: rng.uniform(3, 6)) + u
            else:   # smooth
                kind = i % 3
                if kind == 0:
                    y = 1000.0 * np.exp(float(rng.uniform(1, 3)) * t / n)
                elif kind == 1:
                    y = 1000.0 / (1.0 + np.exp(-(t - n * rng.uniform(0.3, 0.7)) / (n * rng.uniform(0.08, 0.2))))
                    y += 50.0
                else:
                    phi = float(rng.uniform(0.3, 0.8))
                    u = np.zeros(n)
                    for j in range(1, n):
                        u[j] = phi * u[j - 1] + rng.standard_normal()
                    y = (300.0 + 0.02 * t + 0.00002 * t * t * rng.uniform(0, 2)
                         + 3.0 * np.sin(2 * np.pi * t / 12) + 0.2 * u)
                if kind < 2:
                    y = y * (1.0 + float(rng.uniform(0.002, 0.01)) * rng.standard_normal(n))
            out.append({"name": f"{fam}-{i:03d}", "family": fam, "y": np.asarray(y, dtype=np.float64),
                        "cps": cps})
    return out


def cp_f1(true_cps, pred_cps, n: int, margin: int = 5) -> float:
    """F1 of predicted change points against the true ones, a prediction within ``margin`` points of a
    true change counting once. As in the usual benchmark convention, index 0 (the start of the series)
    counts as a change in both sets, so a series without changes scored with no prediction gets 1."""
    T = sorted({0, *[int(c) for c in true_cps if 0 < c < n]})
    P = sorted({0, *[int(c) for c in pred_cps if 0 < c < n]})
    used, tp = set(), 0
    for t in T:
        best = None
        for j, p in enumerate(P):
            if j not in used and abs(p - t) <= margin and (best is None or abs(p - t) < abs(P[best] - t)):
                best = j
        if best is not None:
            used.add(best)
            tp += 1
    prec, rec = tp / len(P), tp / len(T)
    return 0.0 if prec + rec == 0 else 2 * prec * rec / (prec + rec)


def cp_cover(true_cps, pred_cps, n: int) -> float:
    """Segmentation covering of the true segmentation by the predicted one: the sum over true segments
    of their length times the best Jaccard index with a predicted segment, over ``n``."""
    def segs(c):
        e = [0, *sorted({int(x) for x in c if 0 < x < n}), n]
        return list(zip(e[:-1], e[1:]))
    S = segs(pred_cps)
    total = 0.0
    for a, b in segs(true_cps):
        best = 0.0
        for c, d in S:
            inter = max(0, min(b, d) - max(a, c))
            if inter:
                best = max(best, inter / (max(b, d) - min(a, c)))
        total += (b - a) * best
    return total / n


def cp_methods() -> dict:
    """The finders compared by ``stepwatch bench changepoint``: ``find()`` with its defaults, ruptures'
    binary segmentation and PELT with textbook settings (l2 cost, ruptures' default ``min_size=2`` and
    ``jump=5``, the BIC penalty ``2 sigma^2 log n`` with sigma from the MAD of the first differences),
    and predicting no change. ``find() white`` is ``find()`` with a
    white-noise penalty, no local-trend confirmation)."""
    import ruptures as rpt

    from stepwatch.detectors.cpsearch import find, noise_sigma

    def rpt_method(cls):
        def f(y):
            s = noise_sigma(y)
            if not s > 0:
                return []
            pen = 2.0 * s * s * np.log(len(y))
            return [int(b) for b in cls(model="l2").fit(y).predict(pen=pen)[:-1]]
        return f

    return {"find()": find,
            "find() white": lambda y: find(y, autocorr=False, trend=False),
            "binseg (BIC)": rpt_method(rpt.Binseg), "PELT (BIC)": rpt_method(rpt.Pelt),
            "no change": lambda y: []}


def run_changepoint_bench(a) -> int:
    """``stepwatch bench changepoint``: F1 (5-point margin) and cover of the finders of :func:`cp_methods`
    on the families of :func:`changepoint_series`, per family and overall."""
    per = max(2, int(getattr(a, "cp_series", 0) or 48))
    series = changepoint_series(per_family=per, seed=int(getattr(a, "cp_seed", 0) or 2024))
    methods = cp_methods()
    res = {m: {fam: [] for fam in CP_FAMILIES} for m in methods}
    secs = {m: 0.0 for m in methods}
    ncp = {m: 0 for m in methods}
    for s in series:
        n = len(s["y"])
        for m, f in methods.items():
            t = time.perf_counter()
            pred = f(s["y"])
            secs[m] += time.perf_counter() - t
            ncp[m] += len(pred)
            res[m][s["family"]].append((cp_f1(s["cps"], pred, n), cp_cover(s["cps"], pred, n)))
    true_n = sum(len(s["cps"]) for s in series)
    print(f"stepwatch bench changepoint: {len(series)} generated series ({per} per family: "
          f"{', '.join(CP_FAMILIES)}), {true_n} true change points; F1 with a 5-point margin, cover")
    head = f"  {'method':<14} {'F1':>6} {'cover':>6}  " + "  ".join(f"{fam:>13}" for fam in CP_FAMILIES)
    print(head + f"  {'changes':>7} {'s':>6}")
    for m in methods:
        allv = np.array([v for fam in CP_FAMILIES for v in res[m][fam]])
        fams = "  ".join(f"{np.mean([v[0] for v in res[m][fam]]):>6.2f}/{np.mean([v[1] for v in res[m][fam]]):<6.2f}"
                         for fam in CP_FAMILIES)
        print(f"  {m:<14} {allv[:, 0].mean():>6.3f} {allv[:, 1].mean():>6.3f}  {fams}  {ncp[m]:>7} {secs[m]:>6.2f}")
    print("  (per family: F1/cover; 'changes': change points predicted in all series; s: seconds in all)")
    return 0

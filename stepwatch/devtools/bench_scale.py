"""``stepwatch bench scale``: one big job, live, end to end; does one processor keep up?

A simulated job of ``--ranks`` ranks at 1 step/s, with its comm rows (two per rank and step), host and
GC rows, is sent to the embedded broker as node agents would send it, each step when the wall clock
reaches its end (paced: the bench measures keeping up, not draining a backlog), for ``--seconds``
seconds. One processor (``stepwatch process`` in a child process pinned to one core, as deployed)
consumes it into a lake. Alongside:

* a side thread asks the lake, on a new DuckDB connection every 0.5 s (as Grafana and ``stepwatch sql``
  do), how many step rows each step not yet complete has: a step is *queryable* once all its rows are
  returned; step end -> queryable = that moment - the producer's wall clock when it sent the step;
* every second: the processor's RSS and CPU time (psutil) and its consumer lag, the
  ``stepwatch_processor_lag_messages`` gauge its Prometheus endpoint exports (summed over partitions;
  divided by the messages one step takes, it is the number of steps, i.e. seconds, it is behind);
* at the end: its time in decode, alignment, detectors and store flushes (its own histograms).

It *kept up* when every row sent is stored, every step became queryable, its step end -> queryable p99
stayed under 10 s, and that latency did not grow over the run by more than 3 s (a line fitted to it
over the steps; the flush interval alone moves it by up to 1 s: a processor short of 5% of the rate
it needs falls 15 s behind in 5 minutes, 3 s in one). The producer's own delay
(a step sent after its end) is reported apart: where it is large, this machine could not even generate
the load, and the figures are for less than the nominal rate.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

JOB = "scale"
WARM_JOB = "scale-warm"
MAX_P99_S = 10.0          # step end -> queryable p99 over this: not kept up
MAX_GROWTH_S = 3.0        # latency gained over the run (fitted line) over this: falling behind


def _metrics(port: int) -> dict:
    """The processor's Prometheus samples: name -> list of (labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _lake_counts(con, job: str, lo: int) -> dict[int, int]:
    rows = con.execute("SELECT step, count(*) FROM steps WHERE job = ? AND step >= ? GROUP BY step",
                       [job, lo]).fetchall()
    return {int(s): int(n) for s, n in rows}


def _pct(x, q) -> float:
    return float(np.percentile(np.asarray(x, float), q)) if len(x) else float("nan")


def run_scale_bench(a) -> int:
    from stepwatch.devtools.bench import _processor
    from stepwatch.devtools.broker import EmbeddedBroker, free_port
    from stepwatch.kafkaio import KafkaSettings, ensure_topics

    ranks, seconds = int(a.ranks), int(a.seconds or 300)
    if ranks < 1 or seconds < 1:
        raise SystemExit(f"stepwatch bench scale: --ranks ({ranks}) and --seconds ({seconds}) must be >= 1")
    rpm = int(a.rows_per_message)
    base = Path(a.data_dir or tempfile.mkdtemp(prefix="stepwatch-scale-"))
    base.mkdir(parents=True, exist_ok=True)
    data = base / "lake"
    data.mkdir(exist_ok=True)
    ncpu = os.cpu_count() or 1
    core = ncpu - 1
    print(f"stepwatch bench scale: {ranks:,} ranks x 1 step/s for {seconds} s (steps, 2 comm rows per rank "
          f"and step, host, gc), one processor pinned to CPU {core} of {ncpu}; data in {base}", flush=True)
    port = free_port()
    res: dict = {"ranks": ranks, "seconds": seconds, "cpus": ncpu}
    with EmbeddedBroker(log_path=base / "broker.log") as broker:
        s = KafkaSettings(bootstrap=broker.bootstrap, prefix="scale.", partitions=4)
        ensure_topics(s)
        p = _processor(broker.bootstrap, s.prefix, data, "bench-scale", core, idle_exit=None,
                       extra=("--metrics-port", str(port)))
        try:
            res.update(_run(a, p, s, data, port, ranks, seconds, rpm))
        finally:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(120)
            except Exception:  # noqa: BLE001
                p.kill()
                p.wait()
    st_path = data / "_stats.json"
    if st_path.exists():
        st = json.loads(st_path.read_text())
        res["processor_rows_out"] = st["rows_out"]
    _report(res)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=float))
    return 0


def _run(a, p, s, data: Path, port: int, ranks: int, seconds: int, rpm: int) -> dict:
    """The live job against the running processor ``p``; returns the figures."""
    import psutil

    from stepwatch.devtools.simsend import send_simulation
    from stepwatch.devtools.simulate import Simulation
    from stepwatch.kafkaio import make_producer
    from stepwatch.storage.views import connect

    # ---------------------------------------------------------------- ready: a tiny job stored
    prod = make_producer(s, linger_ms=5)
    send_simulation(Simulation(job=WARM_JOB, ranks=8, steps=1, seed=0), prod, s, rows_per_message=rpm)
    t_ready0 = time.time()
    while True:
        if p.poll() is not None:
            raise SystemExit(f"stepwatch bench scale: the processor exited with code {p.returncode} "
                             f"(see {data / '_processor.log'})")
        try:
            if _lake_counts(connect(data), WARM_JOB, 0).get(0) == 8:
                break
        except Exception:  # noqa: BLE001 - no lake yet
            pass
        if time.time() - t_ready0 > 180:
            raise SystemExit("stepwatch bench scale: the processor stored nothing in 180 s "
                             f"(see {data / '_processor.log'})")
        time.sleep(0.2)
    print(f"processor ready (group joined, first flush stored) after {time.time() - t_ready0:.1f}s", flush=True)

    proc = psutil.Process(p.pid)
    sim = Simulation(job=JOB, ranks=ranks, steps=seconds, seed=3, comm=True, checkpoint_every=None,
                     t0_ns=(time.time_ns() // 1_000_000_000 + 3) * 1_000_000_000)
    sent_at: dict[int, float] = {}
    seen: dict[int, float] = {}
    poll_s: list[float] = []
    samples: list[tuple] = []             # (t, rss, cpu, lag messages, producing, lag per topic)
    producing = threading.Event()
    stop = threading.Event()
    errors: list[str] = []

    def watch():                          # step end -> queryable, on a new connection each time
        lo = 0
        while not stop.is_set():
            t = time.time()
            try:
                counts = _lake_counts(connect(data), JOB, lo)
            except Exception as e:  # noqa: BLE001 - a busy catalog: the next poll
                errors.append(f"{type(e).__name__}: {e}"[:200])
                counts = {}
            now = time.time()
            poll_s.append(now - t)
            for k, n in counts.items():
                if n >= ranks and k not in seen:
                    seen[k] = now
            while lo in seen:
                lo += 1
            stop.wait(max(0.0, 0.5 - (time.time() - t)))

    def sample():                         # RSS, CPU, consumer lag each second
        while not stop.is_set():
            t = time.time()
            try:
                rss = proc.memory_info().rss
                c = proc.cpu_times()
                cpu = c.user + c.system
            except psutil.Error:
                break
            per: dict = {}
            try:
                for lb, v in _metrics(port).get("stepwatch_processor_lag_messages", []):
                    kind = lb.get("topic", "?")[len(s.prefix):]
                    per[kind] = per.get(kind, 0) + v
                lag = sum(per.values())
            except Exception:  # noqa: BLE001 - endpoint busy: no lag sample this time
                lag = float("nan")
            samples.append((t, rss, cpu, lag, producing.is_set(), per))
            stop.wait(max(0.0, 1.0 - (time.time() - t)))

    threads = [threading.Thread(target=watch, daemon=True), threading.Thread(target=sample, daemon=True)]
    for th in threads:
        th.start()

    def on_chunk(step, sent):
        sent_at[step - 1] = time.time()
        if step == 1 or step % 10 == 0 or step == seconds:
            print(f"\r  sent step {step}/{seconds}, queryable {len(seen)}", end="", flush=True)

    producing.set()
    t_send0 = time.time()
    sent = send_simulation(sim, prod, s, pace=True, rows_per_message=rpm, on_chunk=on_chunk)
    t_send1 = time.time()
    producing.clear()
    prod.close()
    print(flush=True)
    deadline = time.time() + float(a.drain)
    while len(seen) < seconds and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    t_drained = time.time()
    # the other tables' rows of the last steps may still be on their way: wait for them too (same deadline)
    want = {k: int(v) for k, v in sent.items() if k in ("steps", "comm", "host", "gc")}
    stored: dict = {}
    while True:
        try:
            con = connect(data)
            stored = {t: con.execute(f"SELECT count(*) FROM {t} WHERE job = ?", [JOB]).fetchall()[0][0]
                      for t in want}
        except Exception as e:  # noqa: BLE001 - a busy catalog: ask again
            errors.append(f"count: {e}"[:200])
        if stored == want or time.time() >= deadline or p.poll() is not None:
            break
        time.sleep(0.5)
    t_stored = time.time()
    try:
        final = _metrics(port)
    except Exception:  # noqa: BLE001
        final = {}
    stop.set()
    for th in threads:
        th.join(10)
    p.terminate()

    # ---------------------------------------------------------------- figures
    ends = getattr(sim, "_ends", np.zeros(0))
    late = [sent_at[k] - ends[k] / 1e9 for k in sent_at if k < len(ends)]
    lat = {k: seen[k] - sent_at[k] for k in seen if k in sent_at}
    ks = np.array(sorted(lat))
    lv = np.array([lat[k] for k in ks])
    slope = float(np.polyfit(ks, lv, 1)[0]) if len(ks) >= 2 else 0.0
    growth = slope * (seconds - 1)
    rows_sent = {k: int(v) for k, v in sent.items() if k != "topology"}
    msgs_per_step = sum(math.ceil(v / seconds / rpm) for v in rows_sent.values() if v)
    run = [x for x in samples if x[4]]
    lag = [x[3] for x in run if x[3] == x[3]]
    kinds = sorted({k for x in run for k in x[5]})
    lag_topic = {k: {"p50": _pct([x[5].get(k, 0) for x in run], 50), "p99": _pct([x[5].get(k, 0) for x in run], 99),
                     "end": samples[-1][5].get(k, 0) if samples else 0} for k in kinds}
    quarters = [{"steps": f"{q[0]}-{q[-1]}", "p50": _pct([lat[k] for k in q], 50), "p99": _pct([lat[k] for k in q], 99)}
                for q in (list(c) for c in np.array_split(ks, 4)) if q]
    wall = (max(sent_at.values()) - sim.t0_ns / 1e9) if sent_at else t_send1 - t_send0   # from step 0's start
    cpu = (run[-1][2] - run[0][2]) / (run[-1][0] - run[0][0]) if len(run) >= 2 else float("nan")
    hist = {}
    for name, key in (("decode", "stepwatch_processor_decode_seconds_sum"),
                      ("align", "stepwatch_processor_align_seconds_sum"),
                      ("flush", "stepwatch_processor_flush_seconds_sum")):
        hist[name] = sum(v for _, v in final.get(key, []))
    dets = {lb.get("detector", "?"): v for lb, v in final.get("stepwatch_processor_detector_seconds_sum", [])}
    hist["detectors"] = sum(dets.values())
    complete = len(seen) == seconds and stored.get("steps") == rows_sent.get("steps") \
        and all(stored.get(t) == rows_sent.get(t) for t in ("comm", "host", "gc") if rows_sent.get(t))
    p99 = _pct(lv, 99)
    kept = bool(complete and p99 <= MAX_P99_S and not (growth > MAX_GROWTH_S))
    t_last = t_stored - sim.t0_ns / 1e9
    return {
        "rows_sent": rows_sent, "rows_stored": stored, "steps_queryable": len(seen),
        "produce_s": wall, "rows_sent_per_s": sum(rows_sent.values()) / wall if wall > 0 else float("nan"),
        "producer_late_p50_s": _pct(late, 50), "producer_late_p99_s": _pct(late, 99),
        "queryable_p50_s": _pct(lv, 50), "queryable_p99_s": p99,
        "queryable_max_s": float(lv.max()) if len(lv) else float("nan"), "queryable_slope_s_per_step": slope,
        "queryable_growth_s": growth,
        "rows_stored_per_s": sum(stored.values()) / t_last if t_last > 0 else float("nan"),
        "poll_query_p50_s": _pct(poll_s, 50), "poll_query_max_s": max(poll_s) if poll_s else float("nan"),
        "lag_by_topic": lag_topic, "queryable_by_quarter": quarters, "producer_late_last_s": late[-1] if late else 0.0,
        "lag_messages_p50": _pct(lag, 50), "lag_messages_p99": _pct(lag, 99), "messages_per_step": msgs_per_step,
        "lag_steps_p50": _pct(lag, 50) / msgs_per_step if msgs_per_step else float("nan"),
        "lag_steps_p99": _pct(lag, 99) / msgs_per_step if msgs_per_step else float("nan"),
        "rss_peak_mb": max((x[1] for x in samples), default=0) / 1e6,
        "rss_end_mb": samples[-1][1] / 1e6 if samples else 0.0,
        "processor_cpu_share": cpu, "time_s": hist, "detector_s": dets,
        "drain_s": t_drained - t_send1, "all_tables_stored_s": t_stored - t_send1, "complete": bool(complete), "kept_up": kept, "errors": errors[:5],
    }


def _report(r: dict) -> None:
    sent, stored = r.get("rows_sent", {}), r.get("rows_stored", {})
    wall = r.get("produce_s", float("nan"))
    print(f"\nsent {sum(sent.values()):,} rows in {wall:.1f}s (from step 0's start) => {r.get('rows_sent_per_s', 0):,.0f} rows/s "
          f"({', '.join(f'{k} {v:,}' for k, v in sent.items())})")
    print(f"  producer: step sent after its end p50 {r['producer_late_p50_s']:.2f}s p99 "
          f"{r['producer_late_p99_s']:.2f}s, last {r['producer_late_last_s']:.2f}s"
          + ("  (it fell behind the 1 step/s pace: this machine could not generate the load)"
             if r["producer_late_last_s"] > 2.0 else ""))
    print(f"stored ({r['all_tables_stored_s']:.1f}s after the last step was sent): "
          f"{', '.join(f'{k} {v:,}' for k, v in stored.items())} => {r['rows_stored_per_s']:,.0f} rows/s "
          f"(step 0's start to every row stored; the processor wrote {r.get('processor_rows_out', 0):,.0f} "
          f"rows in all tables, its own and the warm-up job's included)")
    print(f"step end -> queryable (new DuckDB connection, polled every 0.5 s; a poll took p50 "
          f"{r['poll_query_p50_s']:.2f}s, max {r['poll_query_max_s']:.2f}s): p50 {r['queryable_p50_s']:.2f}s "
          f"p99 {r['queryable_p99_s']:.2f}s max {r['queryable_max_s']:.2f}s, grew "
          f"{r['queryable_growth_s']:+.2f}s over the run (fitted); {r['steps_queryable']}/{r['seconds']} steps queryable, "
          f"{r['drain_s']:.1f}s after the last was sent")
    print("  by quarter of the run: " + "; ".join(f"steps {q['steps']} p50 {q['p50']:.2f}s p99 {q['p99']:.2f}s"
                                                 for q in r["queryable_by_quarter"]))
    print(f"consumer lag (processor's gauge, while producing): p50 {r['lag_messages_p50']:.0f} p99 "
          f"{r['lag_messages_p99']:.0f} messages = {r['lag_steps_p50']:.1f} / {r['lag_steps_p99']:.1f} steps "
          f"behind ({r['messages_per_step']} messages a step)")
    print("  by topic, p50/p99/at the end: " + ", ".join(f"{k} {v['p50']:.0f}/{v['p99']:.0f}/{v['end']:.0f}"
                                                        for k, v in r["lag_by_topic"].items()))
    t = r["time_s"]
    top = sorted(r["detector_s"].items(), key=lambda kv: -kv[1])[:3]
    print(f"processor: RSS peak {r['rss_peak_mb']:,.0f} MB (end {r['rss_end_mb']:,.0f} MB); CPU "
          f"{r['processor_cpu_share']:.0%} of one core while producing; over the run "
          f"decode {t['decode']:.1f}s, align {t['align']:.1f}s, detectors {t['detectors']:.1f}s "
          f"({', '.join(f'{k} {v:.1f}s' for k, v in top)}), store flushes {t['flush']:.1f}s of {wall:.0f}s")
    why = []
    if not r["complete"]:
        why.append("not every row stored / step queryable")
    if r["queryable_p99_s"] > MAX_P99_S:
        why.append(f"p99 over {MAX_P99_S:.0f}s")
    if r["queryable_growth_s"] > MAX_GROWTH_S:
        why.append(f"latency grew {r['queryable_growth_s']:.1f}s over the run")
    print(f"kept up: {'yes' if r['kept_up'] else 'no (' + '; '.join(why) + ')'}")
    for e in r.get("errors", []):
        print(f"  (a poll failed: {e})")

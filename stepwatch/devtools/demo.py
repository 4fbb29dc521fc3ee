"""``stepwatch demo``: the whole flow on one laptop.

Starts the embedded broker, a processor (in this process, on a thread), streams a simulated
1,024-rank job with an injected slow rank and an injected job-wide regression, prints alerts as they
fire, then a post-mortem over the Parquet store and a comparison with the ground truth.
"""
from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path

from stepwatch.storage.queries import format_table


def _say(msg: str = "") -> None:
    print(msg, flush=True)


class Progress:
    """One status line: rewritten in place on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, every_s: float = 3.0):
        self.tty = sys.stdout.isatty()
        self.every_s = every_s
        self.last = 0.0

    def show(self, text: str) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K" + text)
            sys.stdout.flush()
        elif time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            print(text, flush=True)

    def clear(self) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()


def _alert_printer() -> tuple[Progress, object]:
    """A status line and an ``on_alert`` callback for the processor that prints each alert above it."""
    lock = threading.Lock()
    bar = Progress()

    def on_alert(a):
        with lock:
            bar.clear()
            print(a.line(), flush=True)
    return bar, on_alert


def run_demo(ranks: int = 1024, steps: int = 300, data_dir: str = "./stepwatch-data/demo", slow_rank: int = 613,
             regression_step: int = 200, seed: int = 7, quiet: bool = False) -> int:
    from stepwatch.devtools.simsend import send_simulation
    from stepwatch.devtools.simulate import Simulation
    from stepwatch.devtools.broker import EmbeddedBroker
    from stepwatch.kafkaio import KafkaSettings, ensure_topics, make_producer
    from stepwatch.stream.processor import Processor

    t_begin = time.monotonic()
    root = Path(data_dir)
    if root.exists():
        shutil.rmtree(root)      # the embedded broker is fresh too: start from an empty store
    root.mkdir(parents=True)
    slow_rank = min(slow_rank, ranks - 1)
    faults = [f"slow-rank:rank={slow_rank},pct=25,start=80",
              f"regression:start={regression_step},pct=15,cause=io"]
    job = "demo-llama-1k"
    sim = Simulation(job=job, ranks=ranks, ranks_per_node=8, steps=steps, faults=faults, seed=seed)
    sim.write_labels(root / "labels.json")
    _say(f"stepwatch demo: {ranks} ranks on {ranks // 8} nodes, {steps} steps of ~1 s (replayed as fast as possible)")
    _say(f"  injected: {faults[0]}  ({sim.nodes[slow_rank]})")
    _say(f"  injected: {faults[1]}")

    with EmbeddedBroker(log_path=root / "broker.log") as broker:
        _say(f"  broker:   Tansu on {broker.bootstrap} (in-memory)")
        s = KafkaSettings(bootstrap=broker.bootstrap, partitions=2)
        ensure_topics(s)
        bar, on_alert = _alert_printer()

        proc = Processor(s, root, group="stepwatch-demo", flush_interval_s=0.5, lateness_s=5,
                         on_alert=on_alert, idle_close_s=2.0)
        stop = threading.Event()
        th = threading.Thread(target=proc.run, kwargs={"stop_event": stop}, name="processor", daemon=True)
        th.start()
        prod = make_producer(s)
        sent_steps = [0]

        def progress(step, sent):
            sent_steps[0] = sent["steps"]
            st = proc.stats()
            bar.show(f"  sending step {step}/{steps}  stored {st['rows_out']:,.0f} rows  alerts {st['alerts']}")
        sent = send_simulation(sim, prod, s, chunk=4, rows_per_message=4096, on_chunk=progress)
        prod.close()
        # wait until every step row is stored and the last steps are closed
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and th.is_alive():
            st = proc.stats()
            stored = proc.metrics.value(proc.metrics.records_out, "steps")
            bar.show(f"  processing: stored {stored:,.0f}/{sent['steps']:,} step rows  alerts {st['alerts']}")
            rt = proc.jobs.get(job)
            if stored >= sent["steps"] and rt is not None and rt.state.open_steps() == 0 and not st["lag"]:
                break                   # (lag 0: the host/gc messages are in too)
            time.sleep(0.25)
        time.sleep(0.6)   # one more flush so the alerts of the last steps are stored
        stop.set()
        th.join(30)
        bar.clear()
    ok = _post_mortem(root, job, sim, sent, t_begin)
    return 0 if ok else 1


def _post_mortem(root: Path, job: str, sim, sent: dict, t_begin: float) -> bool:
    from stepwatch.storage.views import connect
    con = connect(root)
    _say("")
    _say("─" * 100)
    _say(f"post-mortem of job {job}")
    counts = {t: con.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0]
              for t in ("steps", "topology", "host", "gc", "alerts", "deadletter")}
    _say("rows stored: " + ", ".join(f"{t} {n:,}" for t, n in counts.items())
         + f"   (sent: steps {sent['steps']:,}, host {sent['host']:,}, gc {sent['gc']:,})")
    _say("\nslowest ranks (median busy time = step time - comm wait):")
    q = """SELECT rank, node, round(busy_ms, 1) AS busy_ms,
                  round(100 * (busy_ms / median(busy_ms) OVER () - 1), 1) AS vs_median_pct,
                  round(compute_ms, 1) AS compute_ms, round(comm_wait_ms, 1) AS comm_wait_ms
           FROM rank_busy WHERE job = ? ORDER BY busy_ms DESC LIMIT 5"""
    cur = con.execute(q, [job])
    _say(format_table([d[0] for d in cur.description], cur.fetchall()))
    _say("\nalerts:")
    cur = con.execute("""SELECT kind, status, step_first, step_detected, ranks, nodes, cause, round(cost_pct, 1) AS cost_pct
                         FROM alerts WHERE job = ? ORDER BY step_detected, kind""", [job])
    rows = cur.fetchall()
    _say(format_table([d[0] for d in cur.description], rows) if rows else "  (none)")
    jit = con.execute("""
        WITH s AS (SELECT step, step_ms, median(step_ms) OVER (ORDER BY step ROWS BETWEEN 10 PRECEDING AND 10 FOLLOWING) AS med
                   FROM job_steps WHERE job = ?)
        SELECT avg(CASE WHEN step_ms > 1.1 * med THEN 1.0 ELSE 0.0 END), count(*) FROM s""", [job]).fetchall()[0]
    _say(f"\njitter ratio (steps > 1.1x the median of the 21 steps around them): {100 * (jit[0] or 0):.1f}% of {jit[1]} steps")
    eff = con.execute("""
        SELECT median(mfu), sum(productive_ms) / nullif(sum(wall_ms), 0), any_value(peak_tflops),
               max(devices), count(mfu)
        FROM efficiency WHERE job = ?""", [job]).fetchall()[0]
    if eff[4]:
        _say(f"efficiency: MFU median {100 * eff[0]:.1f}% (peak {eff[2]:,.0f} TFLOPS per device x {eff[3]:,} "
             f"devices); goodput {100 * (eff[1] or 0):.1f}% of wall time in productive steps")
    # ground truth
    labels = json.loads((root / "labels.json").read_text())
    found_all = True
    _say("\nground truth vs findings:")
    for lab in labels:
        if lab["kind"] == "slow-rank":
            hit = [r for r in rows if r[0] == "slow_rank" and r[1] == "firing" and lab["ranks"][0] in (r[4] or [])]
            ok = bool(hit) and hit[0][5] and hit[0][5][0] == lab["nodes"][0]
            desc = f"slow rank {lab['ranks'][0]} on {lab['nodes'][0]} from step {lab['start']}"
            got = f"alert names rank {hit[0][4]} on {hit[0][5]} from step {hit[0][2]}" if hit else "not found"
        else:
            hit = [r for r in rows if r[0] == "regression" and abs(r[2] - lab["start"]) <= 10]
            ok = bool(hit)
            desc = f"regression from step {lab['start']} (cause {lab['cause']})"
            got = f"alert from step {hit[0][2]}, cause {hit[0][6]}" if hit else "not found within 10 steps"
        found_all &= ok
        _say(f"  {'FOUND ' if ok else 'MISSED'} {desc}: {got}")
    try:
        from stepwatch.report import build
        (root / "report.html").write_text(build(root, job).html, encoding="utf-8")
        _say(f"\nreport: {(root / 'report.html').absolute()}  (open it in a browser)")
    except Exception as e:  # noqa: BLE001 - the report is a bonus; the demo's result stands without it
        _say(f"\n(report not written: {e})")
    _say(f"data: {root.absolute()}  (a DuckLake: catalog lake.sqlite, Parquet under lake/; labels.json is the ground truth)")
    _say(f"try:  stepwatch sql --data-dir {root} \"SELECT step, step_ms, data_ms FROM job_steps "
         f"WHERE job = '{job}' ORDER BY step DESC LIMIT 5\"")
    _say(f"demo finished in {time.monotonic() - t_begin:.0f} s")
    con.close()
    return found_all


# ---------------------------------------------------------------------------- demo --real

def run_real_demo(ranks: int = 4, steps: int = 200, slow_rank: int = 2, gc_rank: int = 1, step_ms: float = 50.0,
                  slow_extra_ms: float = 20.0, data_dir: str = "./stepwatch-data/demo-real") -> int:
    """``stepwatch demo --real``: real PyTorch training, not a simulation. ``ranks`` gloo processes on
    CPU train a small MLP (``stepwatch.devtools.demo_train``, which knows nothing of stepwatch) under
    ``stepwatch wrap``; a node agent receives their probes' records and ships them through the
    embedded broker to a processor, which stores them and raises alerts. Two runs, one after the
    other, each its own job: in the first, rank ``slow_rank`` is made ``slow_extra_ms`` slower per
    step; in the second, rank ``gc_rank`` collects a large heap every step (-1 skips a run). Returns
    0 when each injected fault was named by a ``slow_rank`` alert on the right rank."""
    import importlib.util
    import os
    import socket as socketmod
    import subprocess
    import tempfile

    if importlib.util.find_spec("torch") is None:
        _say("stepwatch demo --real trains a real PyTorch model: install torch first "
             "(pip install torch==2.13.0, or pip install 'stepwatch[torch]')")
        return 2
    if ranks < 2:
        _say(f"stepwatch demo --real: --ranks must be at least 2 (a slow rank needs peers), got {ranks}")
        return 2
    for name, r in (("--slow-rank", slow_rank), ("--gc-rank", gc_rank)):
        if r >= ranks or r < -1:
            _say(f"stepwatch demo --real: {name} {r} is not one of the {ranks} ranks (0..{ranks - 1}, or -1 for none)")
            return 2
    runs = [(f"demo-real-slow-r{slow_rank}", {"SW_SLOW_RANK": slow_rank, "SW_SLOW_EXTRA_MS": slow_extra_ms},
             f"rank {slow_rank} sleeps {slow_extra_ms:.0f} ms more per step", slow_rank, None)] if slow_rank >= 0 else []
    if gc_rank >= 0:
        runs.append((f"demo-real-gc-r{gc_rank}", {"SW_GC_RANK": gc_rank},
                     f"rank {gc_rank} builds reference cycles and runs gc.collect() on a large heap every step",
                     gc_rank, "gc"))
    if not runs:
        _say("stepwatch demo --real: nothing to inject (--slow-rank -1 and --gc-rank -1)")
        return 2
    from stepwatch.agents.agent import Agent
    from stepwatch.agents.wrap import wrap_env
    from stepwatch.devtools.broker import EmbeddedBroker
    from stepwatch.kafkaio import KafkaSettings, ensure_topics
    from stepwatch.stream.processor import Processor

    t_begin = time.monotonic()
    root = Path(data_dir)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    node = socketmod.gethostname()
    sock_dir = tempfile.mkdtemp(prefix="sw-demo-", dir="/tmp")       # AF_UNIX paths are short
    _say(f"stepwatch demo --real: {ranks} gloo ranks on CPU train an MLP for {steps} steps of ~{step_ms:.0f} ms, "
         f"instrumented by `stepwatch wrap` (no code change); {len(runs)} run(s)")
    bar, on_alert = _alert_printer()

    results = []
    try:
        with EmbeddedBroker(log_path=root / "broker.log") as broker:
            _say(f"  broker:   Tansu on {broker.bootstrap} (in-memory)")
            s = KafkaSettings(bootstrap=broker.bootstrap, partitions=2)
            ensure_topics(s)
            agent = Agent(s, socket_dir=sock_dir, node=node, interval_s=1.0, spool_dir=root / "_agent_spool").start()
            proc = Processor(s, root, group="stepwatch-demo-real", flush_interval_s=0.5, on_alert=on_alert)
            stop_agent, stop_proc = threading.Event(), threading.Event()
            t_agent = threading.Thread(target=agent.run, args=(stop_agent,), name="agent", daemon=True)
            t_proc = threading.Thread(target=proc.run, kwargs={"stop_event": stop_proc}, name="processor", daemon=True)
            t_agent.start()
            t_proc.start()
            _say(f"  agent:    {sock_dir}/agent.sock on node {node}; processor writing {root}")
            train = importlib.util.find_spec("stepwatch.devtools.demo_train").origin
            cmd = [sys.executable, "-m", "stepwatch.agents.wrap", "--", sys.executable, train]
            stored = lambda: proc.metrics.value(proc.metrics.records_out, "steps")  # noqa: E731
            expect = 0
            for job, inject, what, _, _ in runs:
                _say(f"\nrun {job}: {what}")
                _say(f"  training: python -m stepwatch.agents.wrap -- python {os.path.relpath(train)}")
                env = wrap_env(job=job, socket_dir=sock_dir)
                env.update({k: str(v) for k, v in {"SW_NPROC": ranks, "SW_STEPS": steps, "SW_STEP_MS": step_ms,
                                                   **inject}.items()})
                with open(root / f"{job}.log", "w") as out:
                    p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
                    while p.poll() is None:
                        bar.show(f"  training: stored {stored() - expect:,.0f}/{ranks * steps:,} step rows of this run, "
                                 f"alerts {proc.stats()['alerts']}")
                        time.sleep(0.25)
                expect += ranks * steps
                if p.returncode != 0:
                    bar.clear()
                    _say(f"  the training run failed (exit {p.returncode}); its output: {root / (job + '.log')}")
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and t_proc.is_alive():
                    rt = proc.jobs.get(job)
                    if stored() >= expect and rt is not None and rt.state.open_steps() == 0:
                        break
                    bar.show(f"  processing: stored {stored():,.0f}/{expect:,} step rows")
                    time.sleep(0.25)
                time.sleep(0.6)            # one more flush so the alerts of the last steps are stored
                bar.clear()
                results.append(p.returncode == 0)
            stop_agent.set()
            t_agent.join(30)
            stop_proc.set()
            t_proc.join(30)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    ok = all(results) and len(results) == len(runs)
    for job, _, what, rank, cause in runs:
        ok &= _post_mortem_real(root, job, ranks * steps, what, rank, cause)
    _say(f"\ndata: {root.absolute()}  (Parquet; each run's training output in <job>.log)")
    _say(f"try:  stepwatch sql --data-dir {root} \"SELECT job, rank, median(step_ms), median(comm_wait_ms), "
         f"sum(gc_ms) FROM steps GROUP BY ALL ORDER BY ALL\"")
    _say(f"demo finished in {time.monotonic() - t_begin:.0f} s")
    return 0 if ok else 1


def _post_mortem_real(root: Path, job: str, expect: int, what: str, rank: int, cause: str | None) -> bool:
    from stepwatch.storage.views import connect
    con = connect(root)
    _say("")
    _say("─" * 100)
    _say(f"post-mortem of job {job} ({what})")
    n = con.execute("SELECT count(*) FROM steps WHERE job = ?", [job]).fetchone()[0]
    _say(f"step rows stored: {n:,} of {expect:,}")
    _say("per rank (medians over the run; busy = step - comm wait: the slow rank waits least):")
    cur = con.execute("""SELECT rank, round(median(step_ms), 1) AS step_ms, round(median(data_ms), 2) AS data_ms,
                                round(median(comm_wait_ms), 1) AS comm_wait_ms,
                                round(median(step_ms - comm_wait_ms), 1) AS busy_ms, round(sum(gc_ms), 0) AS gc_ms_total,
                                sum(gc_count) AS collections
                         FROM steps WHERE job = ? AND step > 0 GROUP BY rank ORDER BY rank""", [job])
    _say(format_table([d[0] for d in cur.description], cur.fetchall()))
    cur = con.execute("""SELECT kind, status, step_first, step_detected, ranks, nodes, cause, round(cost_pct, 1) AS cost_pct
                         FROM alerts WHERE job = ? ORDER BY step_detected, kind""", [job])
    rows = cur.fetchall()
    _say("alerts:")
    _say(format_table([d[0] for d in cur.description], rows) if rows else "  (none)")
    hit = [r for r in rows if r[0] == "slow_rank" and (r[4] or []) == [rank] and (cause is None or r[6] == cause)]
    got = f"slow_rank alert names rank {hit[0][4]} on {hit[0][5]}, cause {hit[0][6]}" if hit else "not found"
    _say(f"{'FOUND ' if hit else 'MISSED'} {what}: {got}")
    con.close()
    return bool(hit) and n == expect

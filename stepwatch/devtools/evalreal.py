"""``stepwatch eval --real``: the detectors measured on real training runs with real injected faults.

Each run is the unchanged DDP training script :mod:`stepwatch.devtools.ddp_train` (gloo, CPU: 2 or 4 ranks
forked and pinned to this machine's cores, a DataLoader, 20 ms of device-like sleep per forward) under
``stepwatch wrap``, with a node agent, the embedded broker and a processor on threads, started before the
job as on a cluster. The fault is real and labelled by what was injected and when:

* clean runs that end normally (DDP on 2 and 4 ranks, FSDP2 on 2 ranks), and one stopped by SIGTERM to
  every process the way a scheduler ends a job;
* a foreign busy process on rank 1's core (from a step the driver sees rank 1 reach), as urgent as the
  training job (see :data:`stepwatch.devtools.realrun.HOG`);
* a sleep in rank 1's forward (a slow device, as the host sees it);
* GC pressure in rank 1 (real collections every step);
* slow reads in rank 1's dataset, and in every rank's;
* rank 1 ending: ``os._exit(1)``, SIGKILL, an exception;
* rank 1 stuck in a Python function (a hang), and rank 1 stopped by SIGSTOP (then the job is killed);
* a communication slowdown on a real link: rank 1 in its own network namespace, joined to rank 0's by a
  veth pair with a token bucket (:mod:`stepwatch.devtools.netlink`), whose rate is cut from 1 Gbit/s to
  100 Mbit/s mid-run (root only; elsewhere the run says it could not be made).

The alerts the processor emits are scored by the same scorer as the scenario families
(:func:`stepwatch.devtools.eval.score`), against the labels: one incident per fault naming the right rank
and cause within 10 steps (hangs within the hang threshold + 5 s, crashes within 5 s), and no alert on a
clean run, its end included, but a jitter warning that the training script's own clock confirms (its
step times by the jitter detector's rule: the issue's one exception, listed apart, not scored). The job
owns its cores once it runs (every thread at ``SCHED_RR`` 1 where allowed), as on a training node: the
processor and the broker share this small machine's cores and do not on a cluster. The step axis is the
steps the processor stored. What may report each fault
is :data:`REAL_COMPATIBLE`: the families' table, plus a job-wide ``regression`` for the CPU hog (on a
2-core machine the foreign process slows both ranks alike: a job-level change with cause ``cpu`` is a
fair answer). A run whose lead-in the machine disturbed counts as it is: nothing is re-run.

The hang threshold is 15 s here (``stall.hang_s``; the product's default is 30 s) so that the suite takes
minutes; the lifecycle and every other setting are the defaults.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from stepwatch.devtools.ddp_train_path import ddp_train_file
from stepwatch.devtools.eval import Emitted, score
from stepwatch.devtools.evalsuite import COMPATIBLE
from stepwatch.devtools.realrun import HOG, jitter_is_real, realtime, step_times_around

HANG_S = 15.0
STEPS = 240
FAULT_AT = 120
NODE = "node-a"

#: what may report each fault kind on these real runs (see the module docs)
REAL_COMPATIBLE = {**COMPATIBLE, "cpu-contention": COMPATIBLE["cpu-contention"] | {"regression", "mfu_regression"}}
#: the goals for the real runs: a clean run raises no alert, a fault is one incident naming its rank and cause
REAL_TARGETS = [("recall", ">=", 0.99), ("precision", ">=", 0.99), ("localised", ">=", 0.99), ("cause", ">=", 0.9),
                ("median_delay_steps", "<=", 10), ("clean_alerts", "==", 0), ("false_job_hang", "==", 0),
                ("incidents_per_fault_max", "<=", 1), ("hang_delay_max_s", "<=", HANG_S + 5.0),
                ("crash_delay_max_s", "<=", 5.0)]


def _lab(kind: str, ranks=(1,), scope: str = "rank", cause: str | None = None, pct: float = 50.0,
         start: int = FAULT_AT, end: int = STEPS) -> dict:
    return {"kind": kind, "start": start, "end": end, "ranks": list(ranks), "nodes": [NODE] * min(len(ranks), 1),
            "scope": scope, "cause": cause, "pct": pct, "every": None, "phase": None}


@dataclasses.dataclass
class RealRun:
    name: str
    env: dict = dataclasses.field(default_factory=dict)
    faults: list = dataclasses.field(default_factory=list)
    nproc: int = 2
    hog_from: int | None = None          # a busy process on rank 1's core from this step
    sigstop_from: int | None = None      # rank 1 stopped at this step
    sigterm_at: int | None = None        # every process of the job SIGTERMed at this step
    kill_after_s: float | None = None    # the job SIGKILLed this long after its fault began (a hang)
    link: tuple[str, str] | None = None  # rank 1 behind a real link of this rate, cut to the second at the fault
    note: str = ""
    steps: int = STEPS
    pp: int = 1
    large: bool = False
    seed: int = 0

    @property
    def ranks(self) -> int:
        return self.nproc


def runs() -> list[RealRun]:
    F = FAULT_AT
    return [
        RealRun("clean-ddp-2", note="DDP, 2 ranks, ends normally"),
        RealRun("clean-ddp-4", nproc=4, note="DDP, 4 ranks on 2 cores, ends normally"),
        RealRun("clean-fsdp2-2", env={"SW_MODE": "fsdp2"}, note="FSDP2 (fully_shard), 2 ranks, ends normally"),
        RealRun("clean-sigterm", env={"SW_STEPS": 2000}, sigterm_at=F,
                note="SIGTERM to every process at step 120, as a scheduler ends a job"),
        RealRun("cpu-hog-r1", hog_from=F, faults=[_lab("cpu-contention", cause="cpu", pct=20)],
                note="a busy process pinned to rank 1's core"),
        RealRun("sleep-r1", env={"SW_SLEEP_RANK": 1, "SW_SLEEP_MS": 15, "SW_SLEEP_FROM": F},
                faults=[_lab("slow-rank", cause="computation", pct=50)], note="15 ms sleep in rank 1's forward"),
        RealRun("gc-r1", env={"SW_GC_RANK": 1, "SW_GC_FROM": F},
                faults=[_lab("gc-storm", cause="gc", pct=30)], note="GC pressure in rank 1"),
        RealRun("data-r1", env={"SW_DATA_RANK": 1, "SW_DATA_MS": 15, "SW_DATA_FROM": F},
                faults=[_lab("data-stall", cause="io", pct=50)], note="slow reads in rank 1's dataset (+15 ms/batch)"),
        RealRun("data-all", env={"SW_DATA_RANK": -2, "SW_DATA_MS": 15, "SW_DATA_FROM": F},
                faults=[_lab("data-stall", ranks=(), scope="job", cause="io", pct=50)],
                note="slow reads on every rank (+15 ms/batch)"),
        RealRun("crash-exit-r1", env={"SW_CRASH_RANK": 1, "SW_CRASH_STEP": F},
                faults=[_lab("crash", pct=100)], note="rank 1 calls os._exit(1)"),
        RealRun("crash-kill-r1", env={"SW_CRASH_RANK": 1, "SW_CRASH_STEP": F, "SW_CRASH_HOW": "kill"},
                faults=[_lab("crash", pct=100)], note="rank 1 is SIGKILLed"),
        RealRun("crash-raise-r1", env={"SW_CRASH_RANK": 1, "SW_CRASH_STEP": F, "SW_CRASH_HOW": "raise"},
                faults=[_lab("crash", pct=100)], note="rank 1 raises an exception"),
        RealRun("hang-python-r1", env={"SW_HANG_RANK": 1, "SW_HANG_STEP": F, "SW_HANG_S": 600},
                faults=[_lab("job-hang", cause=None, pct=100)], kill_after_s=HANG_S + 12,
                note="rank 1 stuck in a Python function; the job is killed after the hang"),
        RealRun("sigstop-r1", env={"SW_STEPS": 2000}, sigstop_from=F, kill_after_s=HANG_S + 12,
                faults=[_lab("job-hang", cause=None, pct=100)], note="rank 1 stopped by SIGSTOP; then killed"),
        RealRun("link-slow", link=("1gbit", "100mbit"),
                faults=[_lab("regression", ranks=(), scope="job", cause="communication", pct=50)],
                note="rank 1 behind a real link (netns + veth + tbf) cut from 1 Gbit/s to 100 Mbit/s"),
    ]


def _rank_pids(launcher: int, nproc: int) -> dict[int, int]:
    """The ranks' pids: the launcher's children, by the core each pinned itself to (rank r on core r)."""
    import psutil
    cores = sorted(os.sched_getaffinity(0))
    out = {}
    try:
        for ch in psutil.Process(launcher).children():
            try:
                aff = ch.cpu_affinity()
            except psutil.Error:
                continue
            if len(aff) == 1 and nproc <= len(cores):
                out[cores.index(aff[0])] = ch.pid
    except psutil.Error:
        pass
    return out


def run_one(run: RealRun, kafka, data: Path, socket_dir: str, log=print) -> dict:
    """One real run through an agent and a processor; returns the scorer's ``res`` dict."""
    from stepwatch.agents.agent import Agent
    from stepwatch.agents.wrap import wrap_env
    from stepwatch.stream.processor import Processor

    emitted: list[Emitted] = []
    proc: Processor | None = None

    def on_alert(a):
        rt = proc.jobs.get(a.job) if proc else None
        st = rt.state if rt else None
        host = rt.telemetry.host_event_ns if rt else 0
        emitted.append(Emitted(a, int(st.max_step) if st else -1, max(int(st.max_t_end) if st else 0, host),
                               time.time_ns(), int(st.max_t_end) if st else 0))

    agent = Agent(kafka, socket_dir=socket_dir, node=NODE, interval_s=0.5).start()
    proc = Processor(kafka, data, group=f"g-{run.name}", flush_interval_s=0.3, on_alert=on_alert,
                     detector_settings={"stall": {"hang_s": HANG_S}})
    stops = threading.Event(), threading.Event()
    threads = [threading.Thread(target=agent.run, args=(stops[0],), daemon=True),
               threading.Thread(target=proc.run, kwargs={"stop_event": stops[1]}, daemon=True)]
    for t in threads:
        t.start()
    out = tempfile.mkdtemp(prefix="sw-real-")
    progress = os.path.join(out, "progress")
    env = wrap_env(job=run.name, socket_dir=socket_dir)
    env.update({"SW_STEPS": str(run.steps), "SW_PAD_MS": "20", "SW_WIDTH": "256", "SW_NPROC": str(run.nproc),
                "SW_OUT": out, "SW_PROGRESS": progress})
    env.update({k: str(v) for k, v in run.env.items()})
    hog = None
    t_fault = None
    link = None
    try:
        if run.link is not None:
            from stepwatch.devtools.netlink import SlowLink
            link = SlowLink(run.link[0]).__enter__()
            env.update(link.env())
        p = subprocess.Popen([sys.executable, ddp_train_file], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 300
        acted = rt = rt_ok = False
        while p.poll() is None and time.monotonic() < deadline:
            try:
                step = int(Path(progress).read_text() or -1)
            except (OSError, ValueError):
                step = -1
            if not rt and step >= 2:          # the job owns its cores, as on a training node
                rt, rt_ok = True, realtime(p.pid)
            at = run.hog_from if run.hog_from is not None else run.sigstop_from if run.sigstop_from is not None \
                else run.sigterm_at if run.sigterm_at is not None else FAULT_AT if link is not None else None
            if not acted and at is not None and step >= at:
                acted, t_fault = True, time.monotonic()
                if link is not None:
                    link.rate(run.link[1])
                elif run.hog_from is not None:
                    core = sorted(os.sched_getaffinity(0))[1]
                    hog = subprocess.Popen([sys.executable, "-c", HOG, str(core), "rt" if rt_ok else "plain",
                                            os.path.join(out, "hog-started")])
                elif run.sigstop_from is not None:
                    pid = _rank_pids(p.pid, run.nproc).get(1)
                    if pid:
                        os.kill(pid, signal.SIGSTOP)
                else:
                    os.killpg(p.pid, signal.SIGTERM)
            if t_fault is None and run.faults and run.faults[0]["kind"] == "job-hang" and step >= FAULT_AT - 1:
                t_fault = time.monotonic()
            if run.kill_after_s is not None and t_fault is not None and \
                    time.monotonic() - t_fault > run.kill_after_s:
                os.killpg(p.pid, signal.SIGKILL)
            time.sleep(0.05)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
        time.sleep(HANG_S + 4)                  # a false hang at the job's end would come by now
        # the one exception to "no alert on a clean run": jitter the script's own clock shows
        real_jitter = [e for e in emitted if e.alert.kind == "jitter" and jitter_is_real(out, e.alert.step_detected)]
        emitted = [e for e in emitted if e not in real_jitter]
        at = next((f["start"] for f in run.faults if "start" in f), None)
        around = step_times_around(out, int(at)) if at is not None else None
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        if link is not None:
            link.__exit__(None, None, None)
        for s, t in zip(stops, threads):
            s.set()
            t.join(30)
        shutil.rmtree(out, ignore_errors=True)
    starts, step_ms = _step_axis(data, run.name, run.steps)
    return {"scenario": run, "emitted": emitted, "labels": run.faults, "step_starts": starts, "step_ms": step_ms,
            "nodes": np.array([NODE] * run.nproc, dtype=object), "stage": np.zeros(run.nproc, np.int32),
            "busiest_stage": None, "events": [a for a in proc.events if a.job == run.name], "rc": p.returncode,
            "real_jitter": real_jitter, "around": around}


def _step_axis(data: Path, job: str, steps: int) -> tuple[np.ndarray, float]:
    """Per step, its start (ns) from the stored steps (later steps: the last end), and the median step."""
    from stepwatch.storage.views import connect
    con = connect(data)
    try:
        rows = con.execute("SELECT step, min(epoch_ns(t_start)), max(epoch_ns(t_end)), median(step_ms) FROM steps "
                           "WHERE job = ? GROUP BY step ORDER BY step", [job]).fetchall()
    finally:
        con.close()
    starts = np.zeros(steps + 1, dtype=np.int64)
    last = 0
    by = {int(s): (int(a), int(b)) for s, a, b, _ in rows}
    for i in range(steps + 1):
        if i in by:
            starts[i], last = by[i][0], by[i][1]
        else:
            starts[i] = last
    med = float(np.median([r[3] for r in rows])) if rows else 30.0
    return starts, med


def _spooled_jobs(data: Path) -> set[str]:
    """The jobs that have stored steps."""
    from stepwatch.storage.views import connect
    con = connect(data)
    try:
        return {r[0] for r in con.execute("SELECT DISTINCT job FROM steps").fetchall()}
    finally:
        con.close()


def _comm_summary(data: Path, job: str) -> str:
    """The job's timed collectives and its bus bandwidth rows: every job whose collectives are timed gets
    ``comm_bw`` rows (docs/efficiency.md)."""
    from stepwatch.storage.views import connect
    con = connect(data)
    try:
        calls, timed = con.execute('SELECT coalesce(sum("count"), 0), count(*) FROM comm WHERE job = ?', [job]).fetchone()
        n, bw, algbw = con.execute("SELECT count(*), median(busbw_gbps), median(algbw_gbps) FROM comm_bw WHERE job = ?",
                                   [job]).fetchone()
    except Exception as e:  # noqa: BLE001 - a store without the table says so
        return f"comm: {type(e).__name__}: {str(e)[:120]}"
    finally:
        con.close()
    if not n:
        return f"{int(calls)} collective call(s) in {timed} comm row(s), no comm_bw rows"
    return (f"{int(calls)} collective call(s) in {timed} comm row(s), {n} comm_bw row(s): median bus bandwidth "
            f"{bw or 0:.1f} GB/s (algorithm {algbw or 0:.1f} GB/s)")


def run_real(a) -> int:
    if getattr(a, "spool", None):
        return run_spool(a)
    return _run_real(a)


def _run_real(a) -> int:
    """``stepwatch eval --real``: every run of :func:`runs` (``--only`` filters), scored and reported."""
    from stepwatch.devtools.broker import EmbeddedBroker
    from stepwatch.devtools.evalreport import report
    from stepwatch.kafkaio import KafkaSettings, ensure_topics

    only = getattr(a, "only", None)
    todo = [r for r in runs() if not only or any(o in r.name for o in only.split(","))]
    base = Path(a.data_dir) if getattr(a, "data_dir", None) else Path(tempfile.mkdtemp(prefix="stepwatch-real-"))
    base.mkdir(parents=True, exist_ok=True)
    scored = []
    t0 = time.perf_counter()
    print(f"stepwatch eval --real: {len(todo)} real training runs (2-4 gloo ranks on this machine's cores; hang "
          f"threshold {HANG_S:g} s; data in {base})", flush=True)
    with EmbeddedBroker(log_path=base / "broker.log") as broker:
        for i, run in enumerate(todo):
            kafka = KafkaSettings(bootstrap=broker.bootstrap, prefix=f"real{i}.", partitions=2)
            ensure_topics(kafka)
            sock = tempfile.mkdtemp(prefix="sw-", dir="/tmp")
            t1 = time.perf_counter()
            try:
                res = run_one(run, kafka, base / run.name, sock)
            finally:
                shutil.rmtree(sock, ignore_errors=True)
            s = score(res, REAL_COMPATIBLE)
            scored.append((res, s))
            ends = ", ".join(f"job_end {e.evidence.get('outcome')}" for e in res["events"]) or "no job_end"
            rj = len({e.alert.alert_id for e in res["real_jitter"]})
            print(f"  {run.name:<16} {run.nproc} ranks: {time.perf_counter() - t1:.0f}s, exit {res['rc']}, "
                  f"{len(s['firing'])} alert(s), {ends}" + (f", {rj} jitter warning(s) the script's own clock "
                                                             f"confirms (not scored)" if rj else "")
                  + f"  ({run.note})" + (f"; the script's steps {res['around'][0]:.1f} -> {res['around'][1]:.1f} ms "
                                         f"around the fault" if res.get("around") else ""), flush=True)
            if getattr(a, "show_alerts", False) or s["false"]:
                for e in res["emitted"]:
                    print(f"      [{e.alert.incident_id}] {e.alert.line()[:300]}")
    print("")
    t = report(scored, targets=REAL_TARGETS)
    print(f"({time.perf_counter() - t0:.0f}s)")
    if getattr(a, "json", None):
        from stepwatch.devtools.evalreport import COLUMNS, table_rows
        Path(a.json).write_text(json.dumps({"totals": t, "columns": COLUMNS, "rows": table_rows(scored)},
                                           indent=2, default=str) + "\n")
    if not getattr(a, "data_dir", None) and not getattr(a, "keep", False):
        shutil.rmtree(base, ignore_errors=True)
    return 0 if t["targets_met"] else 1


#: the runs ``stepwatch eval --real --spool`` scores: what a GPU machine ran (see docs/eval.md), labelled
GPU_RUNS = {
    "g-clean-nccl-1": [], "g-clean-gloo-2": [], "g-clean-fsdp2-2": [],
    "g-sleep-r1": [_lab("slow-rank", cause="computation", pct=100, start=200, end=400)],
    "g-crash-r1": [_lab("crash", pct=100, start=200, end=400)],
    # one rank: its 15 ms sleep (host) on a ~9 ms device step is the job's regression
    "g-sleep-nccl-1": [_lab("regression", ranks=(), scope="job", cause="computation", pct=100, start=200, end=400)],
    "g-raise-r1": [_lab("crash", pct=100, start=200, end=400)],
    "g-hang-r1": [_lab("job-hang", cause=None, pct=100, start=200, end=400)],
}


def run_spool(a) -> int:
    """``stepwatch eval --real --spool DIR``: score runs a node agent spooled elsewhere (a GPU machine with no
    broker): a local agent ships the spool to the embedded broker, a processor (default settings) reads it,
    and the alerts are scored against :data:`GPU_RUNS`' labels, as the CPU runs are."""
    from stepwatch.agents.agent import Agent
    from stepwatch.devtools.broker import EmbeddedBroker
    from stepwatch.devtools.evalreport import report
    from stepwatch.kafkaio import KafkaSettings, ensure_topics
    from stepwatch.stream.processor import Processor

    spool = Path(a.spool)
    base = Path(tempfile.mkdtemp(prefix="stepwatch-spool-"))
    work = base / "spool"
    shutil.copytree(spool, work)                    # the agent empties the spool it ships
    emitted: dict[str, list] = {}
    proc = None

    def on_alert(al):
        rt = proc.jobs.get(al.job) if proc else None
        st = rt.state if rt else None
        host = rt.telemetry.host_event_ns if rt else 0
        emitted.setdefault(al.job, []).append(Emitted(al, int(st.max_step) if st else -1,
                                                      max(int(st.max_t_end) if st else 0, host), 0,
                                                      int(st.max_t_end) if st else 0))

    with EmbeddedBroker(log_path=base / "broker.log") as broker:
        kafka = KafkaSettings(bootstrap=broker.bootstrap, prefix="spool.", partitions=2)
        ensure_topics(kafka)
        sock = tempfile.mkdtemp(prefix="sw-", dir="/tmp")
        agent = Agent(kafka, socket_dir=sock, node="replay", job="replay-host", interval_s=1.0,
                      spool_dir=work, plugins=[]).start()
        proc = Processor(kafka, base / "data", group="g-spool", flush_interval_s=0.5, on_alert=on_alert)
        stops = threading.Event(), threading.Event()
        threads = [threading.Thread(target=agent.run, args=(stops[0],), daemon=True),
                   threading.Thread(target=proc.run, kwargs={"stop_event": stops[1]}, daemon=True)]
        for t in threads:
            t.start()
        last, quiet = -1, 0
        while quiet < 20:                           # until the spool is shipped and nothing new is stored
            time.sleep(1.0)
            m = proc.metrics
            n = m.value(m.records_out)
            left = sum(1 for f in work.iterdir() if f.suffix in (".arrow", ".arrows"))   # older and newer agents
            quiet = quiet + 1 if n == last and left == 0 else 0
            last = n
        for st, t in zip(stops, threads):
            st.set()
            t.join(30)
        shutil.rmtree(sock, ignore_errors=True)
    scored = []
    ran = _spooled_jobs(base / "data")
    for job, labels in GPU_RUNS.items():
        if job not in ran:
            continue                                # not run on that machine (bench gpu --jobs)
        run = RealRun(job, faults=labels, nproc=1 if "nccl-1" in job else 2, steps=400)
        starts, step_ms = _step_axis(base / "data", job, run.steps)
        res = {"scenario": run, "emitted": emitted.get(job, []), "labels": labels, "step_starts": starts,
               "step_ms": step_ms, "nodes": np.array(["gpu0"] * run.nproc, dtype=object),
               "stage": np.zeros(run.nproc, np.int32), "busiest_stage": None}
        s = score(res, REAL_COMPATIBLE)
        scored.append((res, s))
        ends = ", ".join(f"job_end {e.evidence.get('outcome')}" for e in proc.events if e.job == job) or "no job_end"
        print(f"  {job:<16} step {step_ms:.1f} ms: {len(s['firing'])} alert(s), {ends}")
        print(f"      {_comm_summary(base / 'data', job)}")
        for e in emitted.get(job, []):
            print(f"      [{e.alert.incident_id}] {e.alert.line()[:260]}")
    print("")
    t = report(scored, targets=REAL_TARGETS)
    if getattr(a, "keep", False):
        print(f"the replay's store is kept: {base / 'data'}")
    else:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if t["targets_met"] else 1

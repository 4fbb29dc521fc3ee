"""Issue 15, what it must show: a standard DistributedDataParallel job (gloo, 2 CPU ranks, each pinned to its
own core) runs unchanged under ``stepwatch wrap`` with the node agent, the real broker and the processor.

- From a step on, a foreign busy process is pinned to rank 1's core: one incident, named by a
  ``slow_rank`` alert for rank 1 and its node within 10 steps of the fault, cause ``cpu`` with that process
  (name, pid, CPU share) in the alert's own evidence (stored and sent); the healthy rank's comm wait is not
  zero (DDP's bucket all-reduces are timed by the probe's comm hook); no other alert: every alert of the
  job is in that incident (the job got slower, its step time jitters: consequences inside it) and none
  fired before the fault, except a job-wide change of this machine's own speed before the fault that the
  training script's own clock confirms over the steps alerted (``_machine_changes``), as an incident of
  its own.
- The same with a sleep injected in rank 1's forward pass (time off the CPU, as a slow device looks to
  the host): cause ``computation``.
- FSDP2 (``fully_shard``, its collectives are ``all_gather_single``/``reduce_scatter_single``): comm seen.

The training script is stepwatch/devtools/ddp_train.py: it knows nothing of stepwatch. Each forward pass also sleeps
30 ms (``SW_PAD_MS``: device time, as the host sees it), so a rank uses about a quarter of its core. A
training node gives its ranks their cores; this test machine is small and shared by many busy sessions
(a load of 10-20 on its 2 cores), whose contention is as real as the injected one: a run-queue wait of
1-20 ms per step that comes and goes on both ranks (measured: a job-wide host-gap regression, correctly
reported). So once the ranks run, the test gives every thread of the job ``SCHED_RR`` priority 1 (where
it may: root or CAP_SYS_NICE; measured here: run-queue wait 0 against a median of 1 ms, p90 5 ms, max
75 ms at autogroup nice -10): each rank owns its core. The foreign process runs at the same priority on
rank 1's core, busy 12 ms of every 18 (a daemon at ~65% of a core): a real-time process busy all the time
would trip the kernel's real-time throttling (measured: rank 1 then stalls off the CPU for up to 0.8 s,
which no probe can tell from a slow device). Without the permission the ranks and a busy-looping foreign
process run in sessions whose scheduling group is raised to ``nice -10`` (less isolated). The system under test (agent, broker, processor) starts and joins its
consumer group before the job, as on a cluster. The test prints every alert it saw.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from stepwatch.devtools.ddp_train_path import ddp_train_file
from stepwatch.devtools.realrun import HOG, jitter_in, realtime
from stepwatch.agents.wrap import wrap_env
from stepwatch.storage.views import connect

pytestmark = [pytest.mark.realrun, pytest.mark.slow]

pytest.importorskip("torch", reason="the DDP tests train a real PyTorch model (pip install torch==2.13.0)")

from test_distributed import Running  # noqa: E402 - tests/test_distributed.py: agent + processor on threads

SCRIPT = Path(ddp_train_file)
def _own_group() -> None:
    """In the child before exec, in its new session: raise the session's scheduling group to nice -10
    (``/proc/self/autogroup``; where that is not allowed, the default group)."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("-10")
    except OSError:
        pass


def _train(socket_dir: str, job: str, env: dict, hog_from: int | None = None, timeout: float = 240.0):
    """Run stepwatch/devtools/ddp_train.py under ``python -m stepwatch.agents.wrap``; with ``hog_from``, start the foreign
    process on rank 1's core once rank 1 reached that step. Returns (per-rank report, hog pid, (wall time in
    s of the hog's fork, and of when it had taken the core))."""
    out = tempfile.mkdtemp(prefix="sw-ddp-")
    # rank 1 writes and renames this file every step: on a disk, a rename can wait for the journal behind
    # the other sessions' I/O (tens of ms on this loaded machine), which is rank 1's own host time: rank 1
    # was named slow before any fault, 1 run in 3 at a load of 40. In memory (tmpfs) where there is one.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    pdir = tempfile.mkdtemp(prefix="sw-ddp-progress-", dir=shm)
    progress = os.path.join(pdir, "progress")
    hog_mark = os.path.join(pdir, "hog-started")     # the foreign process writes when it takes the core
    full = wrap_env(job=job, socket_dir=socket_dir)
    full.update({k: str(v) for k, v in env.items()})
    full.update(SW_OUT=out, SW_PROGRESS=progress)
    p = subprocess.Popen([sys.executable, "-m", "stepwatch.agents.wrap", "--", sys.executable, str(SCRIPT)],
                         env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=_own_group)
    hog = None
    t_hog = None
    rt = None
    try:
        deadline = time.monotonic() + timeout
        while (rt is None or (hog_from is not None and hog is None)) and p.poll() is None \
                and time.monotonic() < deadline:
            try:
                step = int(Path(progress).read_text() or -1)
            except (OSError, ValueError):
                step = -1
            if rt is None and step >= 2:           # the ranks run (pinned): they own their cores from here
                rt = realtime(p.pid)
            if hog_from is not None and hog is None and step >= hog_from:
                core = sorted(os.sched_getaffinity(0))[1 % len(os.sched_getaffinity(0))]   # as ddp_train.py
                # pinned from its start (its interpreter's start-up must not run on rank 0's core); as
                # urgent as the training (the same real-time priority) where that is allowed. The fault
                # starts with the fork (nothing may be said of rank 1 before it); it is at full strength
                # once the process has taken the core, which it writes down: its start-up (at normal
                # priority, below the training's) took 0.1-0.5 s on this loaded machine, up to 6 steps
                # in which rank 1 was not slower or only a few % (its caches shared; measured), which
                # the detector's 10 steps are not counted from
                t_hog = time.time()
                hog = subprocess.Popen([sys.executable, "-c", HOG, str(core), "rt" if rt else "-", hog_mark],
                                       start_new_session=True,
                                       preexec_fn=lambda c=core: (os.sched_setaffinity(0, {c}), _own_group()))
            time.sleep(0.01)
        _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert p.returncode == 0, err[-3000:]
        t_core = float(Path(hog_mark).read_text()) if hog is not None else None
        reports = {}
        for f in sorted(Path(out).glob("rank*.json")):
            d = json.loads(f.read_text())
            reports[d["rank"]] = d
        return reports, (hog.pid if hog else None), (t_hog, t_core)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        if p.poll() is None:
            p.kill()
            p.wait()
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(pdir, ignore_errors=True)


def _alerts(con, job: str) -> list[dict]:
    """The job's alerts (its lifecycle events, severity info, are not alerts: the job's end is checked apart)."""
    rows = con.execute("SELECT alert_id, kind, status, ranks, nodes, cause, step_first, step_detected, evidence, "
                       "incident_id FROM alerts WHERE job = ? AND severity IS DISTINCT FROM 'info' "
                       "ORDER BY step_detected, kind", [job]).fetchall()
    ends = con.execute("SELECT evidence FROM alerts WHERE job = ? AND kind = 'job_end'", [job]).fetchall()
    assert len(ends) == 1 and '"outcome": "finished"' in ends[0][0], f"the job's end: {ends}"
    keys = ("alert_id", "kind", "status", "ranks", "nodes", "cause", "step_first", "step_detected", "evidence",
            "incident_id")
    return [dict(zip(keys, r)) for r in rows]


def _size(a: dict) -> str:
    """What the incident grouping weighs: a localised alert's excess busy time over its peers, a job-wide
    change's levels, and the role the alert got in its incident."""
    ev = json.loads(a["evidence"]) if isinstance(a["evidence"], str) else (a["evidence"] or {})
    role = (ev.get("incident") or {}).get("role", "")
    if "busy_ms" in ev and "peer_median_ms" in ev:
        return f" excess {ev['busy_ms']}-{ev['peer_median_ms']} ms ({role})"
    if "median_before_ms" in ev:
        return f" {ev.get('series')} {ev['median_before_ms']}->{ev['median_after_ms']} ms ({role})"
    return f" ({role})"


def _show(alerts: list[dict]) -> str:
    return "\n".join(f"  {a['status']:8s} {a['kind']:12s} ranks={a['ranks']} nodes={a['nodes']} cause={a['cause']} "
                     f"steps {a['step_first']}->{a['step_detected']} {a['incident_id']}{_size(a)}" for a in alerts)


def _step_ms(reports: dict) -> np.ndarray:
    """The job's step time by step, from the training script's own clock (not the probe's): per step the
    median over ranks of the time between its end and the previous step's end (ms; NaN for step 0)."""
    ends = np.array([reports[r]["ends"] for r in sorted(reports)], dtype=float)
    d = np.full(ends.shape, np.nan)
    d[:, 1:] = np.diff(ends, axis=1) * 1e3
    return np.median(d, axis=0)


def _machine_changes(alerts: list[dict], reports: dict, fault: int, window: int = 20) -> list[dict]:
    """Job-wide changes the test machine itself made before the fault, confirmed by the job's own clock.

    This 2-core machine (CI: a shared VM) is not a training node; its speed can change under the job.
    CI printed a job-wide compute regression of 45.8 -> 51.0 ms at steps 64->71 of the clean lead-in,
    the ranks at real-time priority on their own cores, and a local full run printed 41.4 -> 48.2 ms at
    steps 66->71: the store showed both ranks' CPU time per step up 35 % (12.2 -> 16.5 ms) and their step
    time 44.5 -> 51.6 ms for those 8 steps, then back (a slower CPU for 0.4 s: a hypervisor or a sibling
    thread). The change-point detector decides from 4 steps after a change (for its median delay of 3
    steps), so a burst that long is reported as a regression; see the closing notes.

    Such an alert is not counted against the fault's incident when all of this holds: it came before the
    fault, names no rank or node (job-wide), is a regression or a recovery, and the training script's
    own step times (not the probe's) moved the same way by at least half the alerted change over the
    steps the detector decided on (its first step to the step it was detected at, at least 4), against
    the median of up to ``window`` steps before (at least 8). A job-wide ``jitter`` warning before the
    fault counts the same when the script's own step times show jitter by the detector's rule
    (:func:`~stepwatch.devtools.realrun.jitter_in`; the issue's one exception: 2026-11-28 a clean lead-in
    printed a jitter at steps 69->81). An alert the job's own clock does not show still fails the test."""
    step = _step_ms(reports)
    out = []
    for x in alerts:
        if (x["kind"] == "jitter" and x["step_detected"] < fault and not x["ranks"] and not x["nodes"]
                and jitter_in([reports[r].get("ends") or [] for r in reports], x["step_detected"])):
            out.append(dict(x, seen_ms=("jitter", "confirmed")))    # the one exception: a jitter
            continue                                                # the run's own step times show
        if x["step_detected"] >= fault or x["ranks"] or x["nodes"] or x["kind"] not in ("regression", "recovery"):
            continue
        ev = json.loads(x["evidence"]) if isinstance(x["evidence"], str) else (x["evidence"] or {})
        if "median_before_ms" not in ev:
            continue
        s = int(x["step_first"])
        before = step[max(1, s - window):s]
        after = step[s:min(fault, int(x["step_detected"]) + 1)]
        if len(before) < 8 or len(after) < 4:
            continue
        said = float(ev["median_after_ms"]) - float(ev["median_before_ms"])
        seen = float(np.median(after) - np.median(before))
        if said * seen > 0 and abs(seen) >= 0.5 * abs(said):
            out.append(dict(x, seen_ms=(round(float(np.median(before)), 3), round(float(np.median(after)), 3))))
    return out


def _machine_slowed(alerts: list[dict], reports: dict, rank: int, share: float = 0.05) -> list[dict]:
    """Stragglers other than ``rank`` that the machine really made, confirmed by the training script's own
    clock: a ``slow_rank`` naming one other rank whose main-thread CPU time per step (the same work each
    step) over the steps alerted (its first step to the step it was detected at) is above its median over
    the 20 steps before by at least ``share`` of the job's median step time.

    CI (a shared 2-vCPU VM, whose two vCPUs can be one physical core's two hyperthreads) printed rank 0
    named slow, cause computation, excess 44.4 against 39.8 ms at steps 99->101 as the foreign process came
    to rank 1's core, resolved at 113, then rank 1 named for the hog at 104: a busy sibling slows the
    other's work. That is a real slowdown of rank 0, rightly named, and the test's subject is the fault on
    rank 1; one the script's clock does not show still fails the test."""
    cpu = {r: np.diff(np.asarray(reports[r].get("cpu") or [], dtype=float)) * 1e3 for r in reports}
    step = float(np.nanmedian(_step_ms(reports)[1:]))
    out = []
    for x in alerts:
        if x["kind"] != "slow_rank" or len(x["ranks"] or []) != 1 or x["ranks"][0] == rank:
            continue
        c = cpu.get(int(x["ranks"][0]))
        lo, hi = max(int(x["step_first"]) - 1, 0), int(x["step_detected"])
        if c is None or hi > len(c) or hi - lo < 3 or lo < 10:
            continue
        rise = float(np.median(c[lo:hi]) - np.median(c[max(lo - 20, 0):lo]))
        if rise >= share * step:
            out.append(dict(x, seen_ms=(round(float(np.median(c[max(lo - 20, 0):lo])), 3),
                                        round(float(np.median(c[lo:hi])), 3))))
    return out


def _one_incident(alerts: list[dict], a: dict, sent: list[dict], t_fault: float, cause: str,
                  machine: list[dict] = ()) -> dict:
    """Every alert of the job is in ``a``'s incident, which ``a`` names (its kind and cause), and none
    was sent before the fault began (wall time ``t_fault``; by step it can look earlier: the probe reads
    its run-queue wait every ~500 ms and spreads it over the steps of that interval); returns the
    incident as the sinks were last told of it. The exception is ``machine``: job-wide changes the test
    machine made before the fault, confirmed by the job's own clock (``_machine_changes``); each must be
    an incident of its own, not the fault's.

    The incident is read from what was *last* said of it (the newest message the sinks got, and ``a``'s
    own stored row), not from the row of the alert with the highest step: ``a``'s cause can be decided
    again seconds after it was sent, once its node's host samples come (stream/hostwait.py, re-sent
    with the same id), and a consequence stored in between carries the incident as it stood then."""
    assert all(x["incident_id"] != a["incident_id"] for x in machine), f"the fault's incident began before it:\n{_show(alerts)}"
    if machine:
        print("changes the machine made, the job's own clock confirms (its median before -> after):\n"
              + "\n".join(f"{_show([x])}; script's clock {x['seen_ms'][0]}->{x['seen_ms'][1]} ms" for x in machine))
    # such a change's incident (its recovery too) is the machine's, not the fault's
    own = {x["incident_id"] for x in machine}
    env = {x["alert_id"] for x in alerts if x["incident_id"] in own} | {x["alert_id"] for x in machine}
    ids = {x["incident_id"] for x in alerts if x["alert_id"] not in env}
    assert ids == {a["incident_id"]} and a["incident_id"], f"alerts outside the incident:\n{_show(alerts)}"
    early = [x for x in sent if x["sent_at"] < t_fault and x["alert_id"] not in env]
    assert not early, f"alerts sent before the fault:\n{_show(early)}"
    said = [json.loads(x["evidence"])["incident"] for x in sent if x.get("incident_id") == a["incident_id"]]
    assert said, sent
    for inc in (said[-1], json.loads(a["evidence"])["incident"]):
        assert (inc["kind"], inc["cause"], inc["ranks"], inc["nodes"]) == ("slow_rank", cause, [1], ["node-a"]), inc
    return said[-1]


def _no_other_rank_named(alerts: list[dict], rank: int, machine: list[dict] = ()) -> None:
    """No alert blames a healthy rank (job-level alerts name no rank; see the note in the CPU test), but for
    the slowdowns the training script's own clock confirms (``machine``: :func:`_machine_slowed`)."""
    ok = {x["alert_id"] for x in machine}
    wrong = [x for x in alerts if x["ranks"] and x["ranks"] != [rank] and x["alert_id"] not in ok]
    assert not wrong, f"alerts naming another rank:\n{_show(wrong)}"


def _ready(run: Running, timeout: float = 60.0) -> None:
    """The system under test runs before the job starts, as on a cluster: the processor holds its partitions
    (a consumer group join takes seconds; a processor that joins mid-job reads its backlog in one burst of
    CPU, here on the ranks' two cores, which is then the ranks' run-queue wait)."""
    deadline = time.monotonic() + timeout
    while not run.proc.progress:
        assert time.monotonic() < deadline, "the processor was not assigned its partitions"
        assert run.t_proc.is_alive()
        time.sleep(0.1)
    time.sleep(0.5)                    # its first fetch


def _lead_in_shift(reports: dict, fault: int, alert_effect: float = 0.08) -> str | None:
    """Whether this machine changed one rank's speed against the others before the fault, from the training
    script's own measurements: each rank's main-thread CPU time per step for the same work, less the median
    of the other ranks'. Over the lead-in (steps 10 to the fault) its rolling 8-step median must stay within
    half the least excess the detector alerts on in a stage this small (``small_alert_effect``, 8 % of the
    step time) of its lead-in median. Returns what moved, or None.

    This 2-core machine is shared (CI: a VM): a full run here had rank 1's CPU time per step go from 18 to
    23 ms for steps 30-82 while rank 0's went from 18 to 15 (the same work: its core ran slower), so rank 1
    was a real 15-20 % straggler before the CPU hog came, and the detector's pairwise baseline learned it;
    another had rank 0 6-14 % slower than rank 1 for steps 70-79, and it was named. Printed with a failed
    judgement, which still counts as it is (the detector must cope with such a lead-in)."""
    ranks = sorted(reports)
    if any(len(reports[r].get("cpu") or []) < fault for r in ranks):
        return None
    c = np.diff(np.array([reports[r]["cpu"] for r in ranks], dtype=float), axis=1) * 1e3   # ms per step
    step = float(np.nanmedian(_step_ms(reports)[10:fault]))
    lim = 0.5 * alert_effect * step
    lo, hi = 10, fault - 1
    worst = (0.0, 0, 0)
    for i, r in enumerate(ranks):
        others = np.median(np.delete(c, i, axis=0), axis=0)
        x = (c[i] - others)[lo:hi]
        roll = np.array([np.median(x[j:j + 8]) for j in range(len(x) - 7)])
        dev = roll - np.median(x)
        j = int(np.argmax(np.abs(dev)))
        if abs(dev[j]) >= abs(worst[0]):
            worst = (float(dev[j]), r, lo + j)
    said = (f"rank {worst[1]}'s CPU time per step against the others moved by {worst[0]:+.1f} ms at steps "
            f"{worst[2]}-{worst[2] + 7} (limit +-{lim:.1f} ms: half of 8 % of the {step:.1f} ms step)")
    print(f"lead-in: {said}")
    return said if abs(worst[0]) > lim else None


def _run_fault(kafka, tmp_path, socket_dir, job: str, env: dict, hog_from: int | None, steps: int, world: int = 2,
               fault: int | None = None, judge=None):
    """Run the job under the agent and processor, then ``judge(con, reports, hog_pid, t_hog, sent, job)``
    (the test's assertions) if given. One run, judged as it is (issue 25: a run whose lead-in the machine
    disturbed counts as it is, and the detector must cope with it: the first run is the one judged).
    When the judgement fails, what the machine did before the fault (:func:`_lead_in_shift`) is printed
    with it. Returns (store, reports, hog pid, hog times, what the sinks got for the job, the job name)."""
    run = Running(kafka, tmp_path, socket_dir, node="node-a", group=f"g-{job}")
    sent = []           # what the sinks (Alertmanager, Grafana annotations) are handed for the job, as it was then
    run.proc.on_alert = lambda a: a.job == job and sent.append(
        dict(json.loads(json.dumps(a.row(), default=str)), sent_at=time.time()))
    try:
        _ready(run)
        reports, hog_pid, t_hog = _train(socket_dir, job, dict(env, SW_NPROC=world, SW_STEPS=steps), hog_from)
        assert sorted(reports) == list(range(world))
        for r in reports.values():
            assert r["probe"]["steps"] == steps and r["probe"]["dropped"] == 0, r["probe"]
        run.wait_stored(world * steps, job, timeout=90)
        run.wait_job_end(job)
    finally:
        run.close()
    out = (connect(tmp_path), reports, hog_pid, t_hog, sent, job)
    if judge is not None:
        try:
            judge(*out)
        except AssertionError:
            shift = _lead_in_shift(reports, fault) if fault is not None else None
            print(f"the machine before the fault: {shift or 'quiet'}")
            raise
    return out


def _check_comm(con, job: str, onset: int) -> dict:
    """DDP's gradient all-reduces are seen: one all_reduce row per rank and step with the buckets' bytes,
    comm wait on the healthy rank after the fault, above the slow rank's."""
    n_ar = con.execute("SELECT count(*) FROM comm WHERE job = ? AND op = 'all_reduce' AND bytes > 0 AND step > 0",
                       [job]).fetchone()[0]
    n_steps = con.execute("SELECT count(*) FROM steps WHERE job = ? AND step > 0", [job]).fetchone()[0]
    assert n_ar == n_steps, (n_ar, n_steps)
    waits = dict(con.execute("SELECT rank, median(comm_wait_ms) FROM steps WHERE job = ? AND step > ? GROUP BY rank",
                             [job, onset + 3]).fetchall())
    assert all(waits[r] > 0 and waits[r] > waits[1] for r in waits if r != 1), waits
    return waits


def _sleep_named(con, job: str, fault: int) -> tuple[list[dict], dict]:
    """The sleep faults' common judgement: DDP's all-reduces seen, and the first firing slow_rank alert
    naming rank 1 at or after the fault, on node-a with cause computation. Returns (all alerts, it)."""
    waits = _check_comm(con, job, fault)
    alerts = _alerts(con, job)
    print(f"comm wait medians {waits}\n{_show(alerts)}")
    mine = [a for a in alerts if a["status"] == "firing" and a["kind"] == "slow_rank" and a["ranks"] == [1] and a["step_detected"] >= fault]
    assert mine, f"no alert names rank 1:\n{_show(alerts)}"
    a = mine[0]
    assert a["kind"] == "slow_rank" and a["nodes"] == ["node-a"] and a["cause"] == "computation", _show(alerts)
    return alerts, a


def test_ddp_cpu_contention_on_one_rank_is_one_alert_with_the_foreign_process(kafka, tmp_path, socket_dir):
    job, steps, fault = "ddp-hog", 240, 100

    def judge(con, reports, hog_pid, t_hog, sent, job):
        assert hog_pid is not None
        ends = reports[1]["ends"]
        t_hog, t_core = t_hog
        onset = next(i for i, t in enumerate(ends) if t > t_hog)       # the step rank 1 was in when the hog came
        full = next(i for i, t in enumerate(ends) if t > t_core)       # ... when it had taken the core
        waits = _check_comm(con, job, onset)
        # the probe's CPU signal: rank 1 waited for its core once the hog shared it, rank 0 did not more than before
        cw = dict(con.execute("SELECT rank, median(cpu_wait_ms) FILTER (WHERE step > ?) - median(cpu_wait_ms) FILTER "
                              "(WHERE step < ?) FROM steps WHERE job = ? GROUP BY rank", [onset + 3, onset, job]).fetchall())
        alerts = _alerts(con, job)
        print(f"onset step {onset} (core taken at {full}), comm wait medians {waits}, run-queue wait rise {cw}\n{_show(alerts)}")
        assert cw[1] > 5.0 and cw[1] > cw[0] + 5.0, cw
        mine = [a for a in alerts if a["status"] == "firing" and a["kind"] == "slow_rank" and a["ranks"] == [1]
                and a["step_detected"] >= onset]
        assert mine, f"no alert names rank 1:\n{_show(alerts)}"
        a = mine[0]
        assert a["kind"] == "slow_rank" and a["nodes"] == ["node-a"] and a["cause"] == "cpu", _show(alerts)
        assert a["step_detected"] - full <= 10, (onset, full, a["step_detected"])
        # the foreign process in the alert's own evidence: its name, pid and CPU share, in the store ...
        ev = json.loads(a["evidence"])
        hog = [p for p in ev["host"]["foreign"] if p["pid"] == hog_pid]
        assert hog and hog[0]["name"] == "cpu-hog" and hog[0]["cpu_pct"] >= 20.0 and hog[0]["node"] == "node-a", ev
        assert f"cpu-hog (pid {hog_pid})" in ev["cause_reason"], ev["cause_reason"]
        # ... and in what the sinks got for that alert last (the same alert id: an update, not a new alert)
        last = [x for x in sent if x["alert_id"] == a["alert_id"] and x["status"] == "firing"][-1]
        assert f"cpu-hog (pid {hog_pid})" in json.loads(last["evidence"])["cause_reason"] and last["cause"] == "cpu"
        slowed = _machine_slowed(alerts, reports, 1)
        inc = _one_incident(alerts, a, sent, t_hog, "cpu", _machine_changes(alerts, reports, onset) + slowed)
        print(f"slow_rank at step {a['step_detected']} ({a['step_detected'] - onset} after the fork, "
              f"{a['step_detected'] - full} after the core was taken): "
              f"{ev['cause_reason']}; host wait {ev.get('host_wait')}; incident {inc['id']} of {inc['alerts']} alerts")
        _no_other_rank_named(alerts, 1, slowed)

    _run_fault(kafka, tmp_path, socket_dir, job, {"SW_WIDTH": 1024, "SW_PAD_MS": 30}, fault, steps, fault=fault, judge=judge)


def test_ddp_sleep_in_one_ranks_forward_is_one_alert_with_cause_computation(kafka, tmp_path, socket_dir):
    job, steps, fault = "ddp-sleep", 240, 100

    def judge(con, reports, hog_pid, t_hog, sent, job):
        alerts, a = _sleep_named(con, job, fault)
        assert a["step_detected"] - fault <= 10, a["step_detected"]
        slowed = _machine_slowed(alerts, reports, 1)
        inc = _one_incident(alerts, a, sent, reports[1]["ends"][fault - 1], "computation",
                            _machine_changes(alerts, reports, fault) + slowed)
        print(f"slow_rank at step {a['step_detected']} ({a['step_detected'] - fault} after the fault); "
              f"incident {inc['id']} of {inc['alerts']} alerts")
        _no_other_rank_named(alerts, 1, slowed)

    _run_fault(kafka, tmp_path, socket_dir, job, {"SW_WIDTH": 1024, "SW_PAD_MS": 30, "SW_SLEEP_RANK": 1, "SW_SLEEP_MS": 15,
                                                  "SW_SLEEP_FROM": fault}, None, steps, fault=fault, judge=judge)


def test_fsdp2_collectives_are_seen(kafka, tmp_path, socket_dir):
    job, steps = "fsdp2", 30
    con, _, _, _, _, job = _run_fault(kafka, tmp_path, socket_dir, job, {"SW_MODE": "fsdp2", "SW_WIDTH": 256}, None, steps)
    ops = dict(con.execute("SELECT op, sum(bytes) FROM comm WHERE job = ? GROUP BY op", [job]).fetchall())
    assert ops.get("all_gather_single", 0) > 0 and ops.get("reduce_scatter_single", 0) > 0, ops
    per_step = con.execute("SELECT rank, min(comm_ms + comm_wait_ms), median(comm_ms + comm_wait_ms) FROM steps "
                           "WHERE job = ? AND step > 0 GROUP BY rank", [job]).fetchall()
    assert len(per_step) == 2 and all(lo > 0 for _, lo, _ in per_step), per_step
    cpu = con.execute("SELECT count(*) FILTER (WHERE cpu_ms > 0), count(*) FILTER (WHERE cpu_wait_ms IS NOT NULL), "
                      "count(*) FROM steps WHERE job = ? AND step > 0", [job]).fetchone()
    assert cpu[0] == cpu[1] == cpu[2], cpu
    print(f"ops {ops}, comm + wait per rank (min, median) {per_step}")
    assert np.isfinite([m for _, _, m in per_step]).all()


def test_ddp_sleep_in_one_of_four_ranks_is_one_alert_with_cause_computation(kafka, tmp_path, socket_dir):
    """The same fault with 4 ranks (two per core of this machine): a stage the slow_rank detector judges
    (it needs 4 reporting ranks per stage). The node also runs busy foreign processes (this machine is
    shared, and the ranks themselves use their cores): with the run-queue wait measured, they do not make
    the cause cpu.

    Two ranks per core is this machine's limit, not a training node's (each rank has its own device), and
    at real-time priority it is a fault of its own: two ``SCHED_RR`` threads of one priority on a core run
    in 100 ms slices, so the one queued first runs its whole forward and backward pass before the other
    starts, and the one that keeps losing that race waits its neighbour's CPU time every step. With a
    hidden width of 512 (about 5 ms of CPU a step) that was 12 % of the step: rank 1 named slow before
    any fault, or ranks 1 and 2 (one loser per core) named a slow node, 1 run in 3. A width of 256 (about
    1.5 ms: 4 % of the step, below the detector's 5 % per-step effect) keeps each rank's CPU work small
    beside its device time (``SW_PAD_MS``), as on a node; the injected fault (15 ms) is unchanged."""
    job, steps, fault = "ddp-sleep-4", 200, 100

    def judge(con, reports, hog_pid, t_hog, sent, job):
        alerts, a = _sleep_named(con, job, fault)
        assert json.loads(a["evidence"])["host"].get("cpu_wait_reported") is True
        assert a["step_detected"] - fault <= 10, a["step_detected"]
        # Four ranks on this machine's two cores: while rank 1 sleeps the other three share the cores with
        # each other, and a rank can measurably wait for CPU. Such an alert may name another rank only as
        # CPU contention, after the fault, inside the fault's own incident; none before it, none other.
        inc = a.get("incident_id")
        other = [x for x in alerts if x["ranks"] and x["ranks"] != [1]]
        wrong = [x for x in other if x["cause"] != "cpu" or x["step_first"] < fault or x.get("incident_id") != inc]
        assert not wrong, f"alerts naming another rank outside rank 1's incident:\n{_show(wrong)}"

    _run_fault(kafka, tmp_path, socket_dir, job, {"SW_WIDTH": 256, "SW_PAD_MS": 30, "SW_SLEEP_RANK": 1, "SW_SLEEP_MS": 15,
                                                  "SW_SLEEP_FROM": fault}, None, steps, world=4, fault=fault, judge=judge)

"""Issue 15, what it must show: a standard DistributedDataParallel job (gloo, 2 CPU ranks, each pinned to its
own core) runs unchanged under ``stepwatch wrap`` with the node agent, the real broker and the processor.

- From a step on, a foreign busy process is pinned to rank 1's core: one alert names rank 1 and its node,
  cause ``cpu`` with that process in its evidence, within 10 steps of the fault; the healthy rank's comm
  wait is not zero (DDP's bucket all-reduces are timed by the probe's comm hook); no other alert.
- The same with a sleep injected in rank 1's forward pass (time off the CPU, as a slow device looks to
  the host): cause ``computation``.
- FSDP2 (``fully_shard``, its collectives are ``all_gather_single``/``reduce_scatter_single``): comm seen.

The training script is tests/ddp_train.py: it knows nothing of stepwatch. Each forward pass also sleeps
30 ms (``SW_PAD_MS``: device time, as the host sees it), so a rank uses about a quarter of its core. A
training node gives its ranks their cores; this test machine is small and shared, and Linux schedules each
session as one group (``sched_autogroup``) whatever its processes' nice values. So the training job and the
foreign process each run in a session of their own whose group the test raises to ``nice -10`` (where it
may: root or CAP_SYS_NICE): the fault is then the foreign process on rank 1's core, not whatever else the
machine runs meanwhile. The test prints every alert it saw.
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

from stepwatch.agents.wrap import wrap_env
from stepwatch.storage.views import connect

pytest.importorskip("torch", reason="the DDP tests train a real PyTorch model (pip install torch==2.13.0)")

from test_distributed import Running  # noqa: E402 - tests/test_distributed.py: agent + processor on threads

SCRIPT = Path(__file__).with_name("ddp_train.py")
HOG = ("import ctypes, os, sys\n"
       "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
       "ctypes.CDLL(None).prctl(15, b'cpu-hog', 0, 0, 0)\n"        # PR_SET_NAME: its name in /proc/<pid>/stat
       "while True:\n    pass\n")


def _own_group() -> None:
    """In the child before exec, in its new session: raise the session's scheduling group to nice -10
    (``/proc/self/autogroup``; where that is not allowed, the default group)."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("-10")
    except OSError:
        pass


def _train(socket_dir: str, job: str, env: dict, hog_from: int | None = None, timeout: float = 240.0):
    """Run tests/ddp_train.py under ``python -m stepwatch.agents.wrap``; with ``hog_from``, start the foreign
    process on rank 1's core once rank 1 reached that step. Returns (per-rank report, hog pid, hog start
    wall time in s)."""
    out = tempfile.mkdtemp(prefix="sw-ddp-")
    progress = os.path.join(out, "progress")
    full = wrap_env(job=job, socket_dir=socket_dir)
    full.update({k: str(v) for k, v in env.items()})
    full.update(SW_OUT=out, SW_PROGRESS=progress)
    p = subprocess.Popen([sys.executable, "-m", "stepwatch.agents.wrap", "--", sys.executable, str(SCRIPT)],
                         env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=_own_group)
    hog = None
    t_hog = None
    try:
        deadline = time.monotonic() + timeout
        while hog_from is not None and hog is None and p.poll() is None and time.monotonic() < deadline:
            try:
                step = int(Path(progress).read_text() or -1)
            except (OSError, ValueError):
                step = -1
            if step >= hog_from:
                core = sorted(os.sched_getaffinity(0))[1 % len(os.sched_getaffinity(0))]   # as ddp_train.py
                # pinned from its start (its interpreter's start-up must not run on rank 0's core)
                hog = subprocess.Popen([sys.executable, "-c", HOG, str(core)], start_new_session=True,
                                       preexec_fn=lambda c=core: (os.sched_setaffinity(0, {c}), _own_group()))
                t_hog = time.time()
            time.sleep(0.01)
        _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert p.returncode == 0, err[-3000:]
        reports = {}
        for f in sorted(Path(out).glob("rank*.json")):
            d = json.loads(f.read_text())
            reports[d["rank"]] = d
        return reports, (hog.pid if hog else None), t_hog
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        if p.poll() is None:
            p.kill()
            p.wait()
        shutil.rmtree(out, ignore_errors=True)


def _alerts(con, job: str) -> list[dict]:
    rows = con.execute("SELECT alert_id, kind, status, ranks, nodes, cause, step_first, step_detected, evidence "
                       "FROM alerts WHERE job = ? ORDER BY step_detected, kind", [job]).fetchall()
    keys = ("alert_id", "kind", "status", "ranks", "nodes", "cause", "step_first", "step_detected", "evidence")
    return [dict(zip(keys, r)) for r in rows]


def _show(alerts: list[dict]) -> str:
    return "\n".join(f"  {a['status']:8s} {a['kind']:12s} ranks={a['ranks']} nodes={a['nodes']} cause={a['cause']} "
                     f"steps {a['step_first']}->{a['step_detected']}" for a in alerts)


def _no_other_rank_named(alerts: list[dict], rank: int) -> None:
    """No alert blames a healthy rank (job-level alerts name no rank; see the note in the CPU test)."""
    wrong = [x for x in alerts if x["ranks"] and x["ranks"] != [rank]]
    assert not wrong, f"alerts naming another rank:\n{_show(wrong)}"


def _run_fault(kafka, tmp_path, socket_dir, job: str, env: dict, hog_from: int | None, steps: int, world: int = 2):
    run = Running(kafka, tmp_path, socket_dir, node="node-a", group=f"g-{job}")
    try:
        reports, hog_pid, t_hog = _train(socket_dir, job, dict(env, SW_NPROC=world, SW_STEPS=steps), hog_from)
        assert sorted(reports) == list(range(world))
        for r in reports.values():
            assert r["probe"]["steps"] == steps and r["probe"]["dropped"] == 0, r["probe"]
        run.wait_stored(world * steps, job, timeout=90)
    finally:
        run.close()
    return connect(tmp_path), reports, hog_pid, t_hog


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


def test_ddp_cpu_contention_on_one_rank_is_one_alert_with_the_foreign_process(kafka, tmp_path, socket_dir):
    job, steps, fault = "ddp-hog", 240, 100
    con, reports, hog_pid, t_hog = _run_fault(kafka, tmp_path, socket_dir, job, {"SW_WIDTH": 1024, "SW_PAD_MS": 30},
                                              fault, steps)
    assert hog_pid is not None
    ends = reports[1]["ends"]
    onset = next(i for i, t in enumerate(ends) if t > t_hog)       # the step rank 1 was in when the hog came
    waits = _check_comm(con, job, onset)
    # the probe's CPU signal: rank 1 waited for its core once the hog shared it, rank 0 did not more than before
    cw = dict(con.execute("SELECT rank, median(cpu_wait_ms) FILTER (WHERE step > ?) - median(cpu_wait_ms) FILTER "
                          "(WHERE step < ?) FROM steps WHERE job = ? GROUP BY rank", [onset + 3, onset, job]).fetchall())
    alerts = _alerts(con, job)
    print(f"onset step {onset}, comm wait medians {waits}, run-queue wait rise {cw}\n{_show(alerts)}")
    assert cw[1] > 5.0 and cw[1] > cw[0] + 5.0, cw
    mine = [a for a in alerts if a["status"] == "firing" and a["kind"] == "slow_rank" and a["ranks"] == [1]
            and a["step_detected"] >= onset]
    assert mine, f"no alert names rank 1:\n{_show(alerts)}"
    a = mine[0]
    assert a["kind"] == "slow_rank" and a["nodes"] == ["node-a"] and a["cause"] == "cpu", _show(alerts)
    assert a["step_detected"] - onset <= 10, (onset, a["step_detected"])
    # the node agent sampled the foreign process (host.top_procs). Not yet asserted, issue 15 still open: the
    # hog in the alert's own evidence (its first host sample naming it lands ~0.6 s after the alert is built),
    # and "no other alert" (job-level jitter/change-point alerts on this shared machine's noise are printed)
    seen = con.execute("SELECT count(*) FROM (SELECT unnest(top_procs) AS p FROM host WHERE job = ?) "
                       "WHERE p.pid = ? AND p.name = 'cpu-hog'", [job, hog_pid]).fetchone()[0]
    assert seen > 0, "the agent's host samples never named the foreign process"
    _no_other_rank_named(alerts, 1)


def test_ddp_sleep_in_one_ranks_forward_is_one_alert_with_cause_computation(kafka, tmp_path, socket_dir):
    job, steps, fault = "ddp-sleep", 240, 100
    con, reports, _, _ = _run_fault(kafka, tmp_path, socket_dir, job,
                                    {"SW_WIDTH": 1024, "SW_PAD_MS": 30, "SW_SLEEP_RANK": 1, "SW_SLEEP_MS": 15,
                                     "SW_SLEEP_FROM": fault},
                                    None, steps)
    waits = _check_comm(con, job, fault)
    alerts = _alerts(con, job)
    print(f"comm wait medians {waits}\n{_show(alerts)}")
    mine = [a for a in alerts if a["status"] == "firing" and a["kind"] == "slow_rank" and a["ranks"] == [1] and a["step_detected"] >= fault]
    assert mine, f"no alert names rank 1:\n{_show(alerts)}"
    a = mine[0]
    assert a["kind"] == "slow_rank" and a["nodes"] == ["node-a"] and a["cause"] == "computation", _show(alerts)
    assert a["step_detected"] - fault <= 10, a["step_detected"]
    _no_other_rank_named(alerts, 1)


def test_fsdp2_collectives_are_seen(kafka, tmp_path, socket_dir):
    job, steps = "fsdp2", 30
    con, _, _, _ = _run_fault(kafka, tmp_path, socket_dir, job, {"SW_MODE": "fsdp2", "SW_WIDTH": 256}, None, steps)
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
    the cause cpu."""
    job, steps, fault = "ddp-sleep-4", 200, 100
    con, reports, _, _ = _run_fault(kafka, tmp_path, socket_dir, job,
                                    {"SW_WIDTH": 512, "SW_PAD_MS": 30, "SW_SLEEP_RANK": 1, "SW_SLEEP_MS": 15,
                                     "SW_SLEEP_FROM": fault}, None, steps, world=4)
    waits = _check_comm(con, job, fault)
    alerts = _alerts(con, job)
    print(f"comm wait medians {waits}\n{_show(alerts)}")
    mine = [a for a in alerts if a["status"] == "firing" and a["kind"] == "slow_rank" and a["ranks"] == [1] and a["step_detected"] >= fault]
    assert mine, f"no alert names rank 1:\n{_show(alerts)}"
    a = mine[0]
    assert a["kind"] == "slow_rank" and a["nodes"] == ["node-a"] and a["cause"] == "computation", _show(alerts)
    assert json.loads(a["evidence"])["host"].get("cpu_wait_reported") is True
    assert a["step_detected"] - fault <= 10, a["step_detected"]
    _no_other_rank_named(alerts, 1)

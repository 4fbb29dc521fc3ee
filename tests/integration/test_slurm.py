"""stepwatch under a real Slurm (issue 30): Debian's slurm-wlm + munge, one node on free loopback ports
(tests/slurmcluster.py), with the node agent, the embedded broker and a processor.

* ``srun -n 2 stepwatch wrap -- python ddp_train.py``, from the shell and as the step of an ``sbatch``
  script: the ranks take their identity and ``env://`` rendezvous from Slurm (no torchrun); rank 1 sleeps
  in its forward pass from step 100; in the store the job id is the Slurm job id, ranks 0 and 1 stepped,
  an incident names rank 1, and the epilog's end of the job (``sched_end``, exit 0) is stored and raises
  no alert.
"""
from __future__ import annotations

import sys
import threading
import time

import pytest

from slurmcluster import started, why_not
from stepwatch.agents.agent import Agent
from stepwatch.devtools.ddp_train_path import ddp_train_file
from stepwatch.storage.views import connect
from stepwatch.stream.processor import Processor

_WHY = why_not()
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]


@pytest.fixture(scope="module")
def slurm():
    yield from started()


def _poll(con_dir, sql: str, args: list, ok, timeout_s: float = 30.0):
    t_end = time.monotonic() + timeout_s
    rows = None
    while time.monotonic() < t_end:
        try:
            con = connect(con_dir)
            try:
                rows = con.execute(sql, args).fetchall()
            finally:
                con.close()
        except Exception as e:  # noqa: BLE001 - the table may not exist before the first flush
            rows = e
        if not isinstance(rows, Exception) and ok(rows):
            return rows
        time.sleep(0.3)
    raise AssertionError(f"timed out: {sql} -> {rows!r}")


@pytest.mark.parametrize("launcher", ["srun", "sbatch"])
def test_srun_ranks_are_the_slurm_job_and_its_end_is_the_epilogs(slurm, kafka, tmp_path, socket_dir, launcher):
    """``launcher`` srun: ``srun -n 2`` from the login shell; sbatch: a batch script whose step is that
    srun, submitted and waited for, as most jobs are."""
    pytest.importorskip("torch", reason="trains a real PyTorch model")
    slurm.hooks(STEPWATCH_SOCKET_DIR=socket_dir)
    agent = Agent(kafka, socket_dir=socket_dir, node=slurm.node, interval_s=0.5).start()
    alerts = []
    proc = Processor(kafka, tmp_path, group="g-slurm", flush_interval_s=0.3, on_alert=alerts.append)
    stops = threading.Event(), threading.Event()
    threads = [threading.Thread(target=agent.run, args=(stops[0],), daemon=True),
               threading.Thread(target=proc.run, kwargs={"stop_event": stops[1]}, daemon=True)]
    for t in threads:
        t.start()
    name = f"sw-{time.monotonic_ns()}"
    try:
        env = {"SW_STEPS": "200", "SW_PAD_MS": "30", "SW_WIDTH": "256", "SW_SLEEP_RANK": "1",
               "SW_SLEEP_MS": "15", "SW_SLEEP_FROM": "100"}
        step = [sys.executable, "-m", "stepwatch.agents.wrap", "--socket-dir", socket_dir, "--", sys.executable,
                ddp_train_file]
        if launcher == "srun":
            r = slurm.run("srun", "-n", "2", "-J", name, *step, timeout=120, check=False, env=env)
        else:
            script = tmp_path / "job.sbatch"
            script.write_text("#!/bin/bash\n#SBATCH -n 2\n" + "srun " + " ".join(step) + "\n")
            # (not `sbatch --wait`: it polls the job's state at growing intervals, ~30 s more here)
            sub = slurm.run("sbatch", "--parsable", "-J", name, "-o", str(tmp_path / "job.out"), str(script),
                            timeout=30, env=env)
            jid = sub.stdout.strip().split(";")[0]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                st = slurm.run("scontrol", "-o", "show", "job", jid, check=False, timeout=10).stdout
                state = next((w.split("=", 1)[1] for w in st.split() if w.startswith("JobState=")), "")
                if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                    break
                time.sleep(0.5)
            code = next((w.split("=", 1)[1] for w in st.split() if w.startswith("ExitCode=")), "?")
            r = type(sub)(sub.args, 0 if state == "COMPLETED" and code.startswith("0:") else 1,
                          (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else "",
                          f"{state} {code}")
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
        job = slurm.run("squeue", "-h", "-t", "all", "-n", name, "-o", "%i").stdout.split()
        assert len(job) == 1 and job[0].isdigit(), job
        job = job[0]
        ranks = _poll(tmp_path, "SELECT DISTINCT rank FROM steps WHERE job = ? ORDER BY rank", [job],
                      lambda rows: len(rows) == 2)
        assert ranks == [(0,), (1,)]
        ends = _poll(tmp_path, "SELECT state, exit_code, error, node FROM inflight WHERE job = ? AND source = 'slurm' "
                     "ORDER BY t", [job], lambda rows: any(x[0] == "sched_end" for x in rows))
        assert ("sched_end", 0, None, slurm.node) in ends, ends      # (the epilog reads COMPLETING: no state)
        assert any(x[0] == "sched_start" for x in ends), ends          # the prolog's word
        stored = _poll(tmp_path, "SELECT kind, status, ranks, evidence FROM alerts WHERE job = ?", [job],
                       lambda rows: any(k == "job_end" for k, *_ in rows) and
                       any(k == "slow_rank" and list(rk or []) == [1] for k, _, rk, _ in rows))
    finally:
        for s, t in zip(stops, threads):
            s.set()
            t.join(30)
    for a in alerts:
        print(a.line())
    kinds = {k for k, *_ in stored}
    assert not kinds & {"rank_crash", "job_hang", "exit_failed"}, stored     # the end raised no alert
    import json
    end = [json.loads(ev) for k, _, _, ev in stored if k == "job_end"]
    assert [e["outcome"] for e in end] == ["finished"], end

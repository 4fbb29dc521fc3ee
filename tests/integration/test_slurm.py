"""stepwatch under a real Slurm (issue 30): Debian's slurm-wlm + munge, one node on free loopback ports
(tests/slurmcluster.py), with the node agent, the embedded broker and a processor.

* ``srun -n 2 stepwatch wrap -- python ddp_train.py``, from the shell and as the step of an ``sbatch``
  script: the ranks take their identity and ``env://`` rendezvous from Slurm (no torchrun); rank 1 sleeps
  in its forward pass from step 100; in the store the job id is the Slurm job id, ranks 0 and 1 stepped,
  an incident names rank 1, and the epilog's end of the job (``sched_end``, exit 0, COMPLETED) is stored and
  raises no alert.
* an ``sbatch`` job whose ranks step until Slurm ends it, by ``scancel`` or at its time limit: the epilog's end
  says CANCELLED / TIMEOUT (read once Slurm settled it: the epilog itself runs while the job is COMPLETING), the
  job's end is ``cancelled`` / ``time_limit`` and no hang alert fires; the ranks' topology rows name the Slurm
  job and step (``sacct -j <job>.0``).
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
        # torch's gloo ranks sometimes abort in their teardown after the last step (SIGABRT, "terminate called
        # without an active exception"): the job's work finished and its exit failed, which stepwatch must say
        aborted = r.returncode != 0 and "terminate called without an active exception" in r.stdout + r.stderr
        assert r.returncode == 0 or aborted, (r.stdout[-2000:], r.stderr[-3000:])
        job = slurm.run("squeue", "-h", "-t", "all", "-n", name, "-o", "%i").stdout.split()
        assert len(job) == 1 and job[0].isdigit(), job
        job = job[0]
        ranks = _poll(tmp_path, "SELECT DISTINCT rank FROM steps WHERE job = ? ORDER BY rank", [job],
                      lambda rows: len(rows) == 2)
        assert ranks == [(0,), (1,)]
        ends = _poll(tmp_path, "SELECT state, exit_code, error, node FROM inflight WHERE job = ? AND source = 'slurm' "
                     "ORDER BY t", [job], lambda rows: any(x[0] == "sched_end" for x in rows))
        if not aborted:
            assert ("sched_end", 0, "COMPLETED", slurm.node) in ends, ends   # (the state once Slurm settled it)
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
    import json
    end = [json.loads(ev) for k, _, _, ev in stored if k == "job_end"]
    if aborted:                          # one warning that the work finished and the exit failed, no crash or hang
        assert not kinds & {"rank_crash", "job_hang"}, stored
        assert [e["outcome"] for e in end] == ["exit_failed"] and "exit_failed" in kinds, (end, stored)
        return
    assert not kinds & {"rank_crash", "job_hang", "exit_failed"}, stored     # the end raised no alert
    assert [e["outcome"] for e in end] == ["finished"], end


RANKS_PY = """import sys, time
from stepwatch import probe
probe.init(socket_dir=sys.argv[1], auto=False, flush_ms=0)      # job, rank, world: Slurm's (srun)
while True:
    with probe.step():
        time.sleep(0.05)
"""
HANG_S = 4.0


@pytest.mark.parametrize("end", ["scancel", "time_limit"])
def test_a_job_slurm_cancelled_or_timed_out_is_that_not_a_hang(slurm, kafka, tmp_path, socket_dir, end):
    """Two ranks (``srun -n 2`` in an ``sbatch`` job) step until Slurm ends the job: ``scancel``, or its time
    limit (``scontrol update EndTime=`` one second ahead: slurmctld checks limits every 30 s). The epilog runs
    while the job is COMPLETING; the end it sends, once Slurm settled the state, says CANCELLED / TIMEOUT, and
    the job's end is ``cancelled`` / ``time_limit``, with no hang alert (the hang threshold is 4 s) and no crash."""
    slurm.hooks(STEPWATCH_SOCKET_DIR=socket_dir)
    agent = Agent(kafka, socket_dir=socket_dir, node=slurm.node, interval_s=0.5).start()
    proc = Processor(kafka, tmp_path, group=f"g-slurm-{end}", flush_interval_s=0.3, on_alert=lambda a: None,
                     detector_settings={"stall": {"hang_s": HANG_S}})
    stops = threading.Event(), threading.Event()
    threads = [threading.Thread(target=agent.run, args=(stops[0],), daemon=True),
               threading.Thread(target=proc.run, kwargs={"stop_event": stops[1]}, daemon=True)]
    for t in threads:
        t.start()
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_PY)
    jid = None
    try:
        sub = slurm.run("sbatch", "--parsable", "-n", "2", "-o", str(tmp_path / "job.out"), "--wrap",
                        f"srun {sys.executable} {script} {socket_dir}", timeout=30)
        jid = sub.stdout.strip().split(";")[0]
        _poll(tmp_path, "SELECT rank, count(*) FROM steps WHERE job = ? GROUP BY rank", [jid],
              lambda rows: len(rows) == 2 and all(n >= 5 for _, n in rows))
        topo = _poll(tmp_path, "SELECT DISTINCT rank, slurm_job, slurm_step FROM topology WHERE job = ? ORDER BY rank",
                     [jid], lambda rows: len(rows) == 2)
        assert topo == [(0, int(jid), 0), (1, int(jid), 0)], topo       # sacct -j <job>.0: the srun step
        if end == "scancel":
            slurm.run("scancel", jid)
            want_state, want_outcome = "CANCELLED", "cancelled"
        else:
            soon = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 1))
            slurm.run("scontrol", "update", f"jobid={jid}", f"EndTime={soon}")
            want_state, want_outcome = "TIMEOUT", "time_limit"
        ends = _poll(tmp_path, "SELECT error, exit_code, node FROM inflight WHERE job = ? AND source = 'slurm' "
                     "AND state = 'sched_end'", [jid], lambda rows: len(rows) == 1, timeout_s=45)
        assert ends[0][0] == want_state and ends[0][2] == slurm.node, ends
        q = "SELECT kind, evidence FROM alerts WHERE job = ?"
        _poll(tmp_path, q, [jid], lambda rows: any(k == "job_end" for k, _ in rows))
        t_end = time.monotonic() + HANG_S + 2      # a false hang alert would have fired by now (no event to wait on)
        while time.monotonic() < t_end:
            time.sleep(0.5)
        stored = _poll(tmp_path, q, [jid], lambda rows: True)
    finally:
        if jid:
            slurm.run("scancel", jid, check=False)
        for s, t in zip(stops, threads):
            s.set()
            t.join(30)
    import json
    kinds = [k for k, _ in stored]
    assert not set(kinds) & {"job_hang", "rank_crash", "exit_failed"}, stored
    end_ev = [json.loads(ev) for k, ev in stored if k == "job_end"]
    assert [e["outcome"] for e in end_ev] == [want_outcome], end_ev
    assert end_ev[0]["scheduler"]["state"] == want_state, end_ev

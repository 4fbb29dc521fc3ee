"""Slurm: who a rank is when ``srun`` started it, and the job's start and end told by a prolog/epilog.

**Identity** (:func:`rank_env`): a task that ``srun`` starts directly (no ``torchrun``) has
``SLURM_JOB_ID``, ``SLURM_STEP_ID``, ``SLURM_PROCID`` (its rank), ``SLURM_NTASKS`` (world size),
``SLURM_LOCALID`` (local rank), ``SLURMD_NODENAME`` and ``SLURM_STEP_NODELIST``. ``stepwatch wrap`` adds
what ``torch.distributed``'s ``env://`` needs when nothing else set it: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` (the first host of the step's node list, by ``scontrol show hostnames``;
``127.0.0.1`` for a one-node step) and ``MASTER_PORT`` (derived from the job id, so every task of the step
agrees without talking), and ``STEPWATCH_JOB`` = the Slurm job id, ``STEPWATCH_NODE`` = the node's Slurm
name: alerts and SQL join ``sacct`` on the job id. A launcher (``torchrun``, ``python -m
torch.distributed.run``) under ``srun`` gets only the job and node: it sets its workers' ranks itself.

**Life** (:func:`sched_message`): ``stepwatch slurm prolog|epilog`` (run by slurmd as root) sends the node's
agent one ``T_SCHED`` datagram: the job started, or ended with its exit code and Slurm state (``COMPLETED``,
``FAILED``, ``CANCELLED``, ``TIMEOUT``, ...: ``scontrol show job`` once the job is no longer ``COMPLETING``,
read by a child the epilog leaves behind, :func:`final_state`). The agent makes it an ``inflight`` row with
``source`` = ``slurm`` (see :mod:`stepwatch.detectors.lifecycle`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time

PORT_BASE, PORT_SPAN = 20000, 10000       # MASTER_PORT = 20000 + job id mod 10000 (below the ephemeral range)
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
#: Slurm end states that are the scheduler's or a user's decision, not the job's failure
SCHED_STOPS = {"TIMEOUT": "time_limit", "CANCELLED": "cancelled", "PREEMPTED": "preempted",
               "DEADLINE": "time_limit", "NODE_FAIL": "node_fail", "BOOT_FAIL": "node_fail"}
_STATE = re.compile(r"^[A-Z_]{1,32}\Z")                   # \Z: "$" lets a final newline in


def in_step(env) -> bool:
    """A task started by ``srun`` (a job step): it has a Slurm job id and a task rank."""
    return bool(env.get("SLURM_JOB_ID")) and bool(env.get("SLURM_PROCID"))


def is_launcher(cmd: list[str]) -> bool:
    """``torchrun …`` or ``python -m torch.distributed.run …``: it sets its workers' identity itself."""
    if not cmd:
        return False
    if os.path.basename(cmd[0]) == "torchrun":
        return True
    return any(a == "-m" and i + 1 < len(cmd) and cmd[i + 1] in LAUNCHERS[1:] for i, a in enumerate(cmd[:3]))


def first_host(nodelist: str, scontrol: str | None = None) -> str | None:
    """The first host of a Slurm node list (``node[01-04],gpu7``), expanded by ``scontrol show hostnames``
    (None when scontrol is missing or fails)."""
    exe = scontrol or shutil.which("scontrol")
    if not nodelist or not exe:
        return None
    try:
        out = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    hosts = out.stdout.split() if out.returncode == 0 else []
    return hosts[0] if hosts else None


def master_port(job_id: str) -> int:
    try:
        return PORT_BASE + int(job_id) % PORT_SPAN
    except ValueError:
        raise ValueError(f"SLURM_JOB_ID: not a number: {job_id!r}") from None


def rank_env(env: dict, launcher: bool = False) -> dict:
    """What ``stepwatch wrap`` adds to a Slurm task's environment (only keys not already set)."""
    if not in_step(env):
        return {}
    job = env["SLURM_JOB_ID"]
    add = {"STEPWATCH_JOB": job}
    if env.get("SLURMD_NODENAME"):
        add["STEPWATCH_NODE"] = env["SLURMD_NODENAME"]
    if not launcher:
        for k, s in (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"), ("LOCAL_RANK", "SLURM_LOCALID")):
            if env.get(s):
                add[k] = env[s]
        if not env.get("MASTER_ADDR"):
            nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or "1"
            nl = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
            host = "127.0.0.1" if nodes == "1" else first_host(nl)
            if host:
                add["MASTER_ADDR"] = host
        add["MASTER_PORT"] = str(master_port(job))
    return {k: v for k, v in add.items() if not env.get(k)}


# -- prolog / epilog ---------------------------------------------------------------------------------
#: ``Reason=`` of a job Slurm is ending for its time limit (FAIL_TIMEOUT) or its deadline (FAIL_DEADLINE)
_LIMIT_REASONS = {"TimeLimit": "TIMEOUT", "DeadLine": "DEADLINE"}


def show_job(job_id: str, scontrol: str | None = None) -> tuple[str, str] | str | None:
    """``(JobState, Reason)`` of ``scontrol show job -o <id>``; ``"gone"`` when the controller no longer
    knows the job (``MinJobAge`` passed); None when scontrol is missing or failed."""
    exe = scontrol or shutil.which("scontrol")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\bJobState=([A-Z_]+)", out.stdout)
    if m:
        r = re.search(r"\bReason=(\S+)", out.stdout)
        return m.group(1), r.group(1) if r else ""
    return "gone" if "Invalid job id" in out.stderr else None


def _settled(st) -> str | None:
    """The end state a ``show_job`` answer names (None: not yet known). A job still ``COMPLETING`` (the node's
    Epilog runs then) whose Reason is ``TimeLimit``/``DeadLine`` is ending for that: ``TIMEOUT``/``DEADLINE``."""
    if not isinstance(st, tuple):
        return None
    state, reason = st
    return _LIMIT_REASONS.get(reason) if state == "COMPLETING" else state


def job_state(job_id: str, scontrol: str | None = None) -> str | None:
    """The job's Slurm state now (``JobState=`` of ``scontrol show job -o``), e.g. ``CANCELLED``; None while
    it is ``COMPLETING`` (unless its Reason says time limit: ``TIMEOUT``) or when it cannot be read."""
    return _settled(show_job(job_id, scontrol))


def final_state(job_id: str, wait_s: float = 60.0, scontrol: str | None = None, poll_s: float = 0.1) -> str | None:
    """The job's end state once Slurm has settled it. slurmd's ``Epilog`` runs while the job is
    ``COMPLETING``, and Slurm 22.05 prints that flag, not the end state, until every node's Epilog and the
    ``EpilogSlurmctld`` are done (neither gets the state in its environment): so this polls ``scontrol show
    job`` (every 0.1 s, growing to 2 s) until the job is no longer ``COMPLETING``, for at most ``wait_s``.
    None when it never settled (or the controller forgot it) and its Reason did not name the time limit."""
    exe = scontrol or shutil.which("scontrol")
    if not exe:
        return None
    t_end = time.monotonic() + wait_s
    best = None
    while True:
        st = show_job(job_id, exe)
        if isinstance(st, tuple) and st[0] != "COMPLETING":
            return st[0]
        best = _settled(st) or best
        if st == "gone" or time.monotonic() + poll_s > t_end:
            return best
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, 2.0)


def sched_body(event: str, env: dict, state: str | None = None) -> dict:
    """The JSON body of a ``T_SCHED`` datagram from a prolog's (``start``) or epilog's (``end``) environment.
    Raises ValueError naming the field when the environment lacks what it needs."""
    if event not in ("start", "end"):
        raise ValueError(f"event: {event!r} is not start or end")
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job or not job.isdigit():
        raise ValueError(f"SLURM_JOB_ID: {job!r} is not a Slurm job id")
    body = {"event": event, "job": job, "t": time.time_ns(), "scheduler": "slurm"}
    if env.get("SLURMD_NODENAME"):
        body["node"] = env["SLURMD_NODENAME"]
    if event == "end":
        ec2 = env.get("SLURM_JOB_EXIT_CODE2") or ""          # "<exit>:<signal>"
        m = re.fullmatch(r"(\d+):(\d+)", ec2)
        if m:
            body["exit_code"], sig = int(m.group(1)), int(m.group(2))
            if sig:
                body["signal"] = sig
        elif (env.get("SLURM_JOB_EXIT_CODE") or "").isdigit():
            st = int(env["SLURM_JOB_EXIT_CODE"])             # a wait(2) status
            body["exit_code"] = (st >> 8) & 0xFF
            if st & 0x7F:
                body["signal"] = st & 0x7F
        if state:
            body["state"] = state
    return body


def check_sched(body: dict) -> dict:
    """The agent's check of a ``T_SCHED`` body: returns the clean fields; raises ValueError naming the bad one."""
    ev = body.get("event")
    if ev not in ("start", "end"):
        raise ValueError(f"scheduler event: bad event {ev!r}")
    job = body.get("job")
    if not isinstance(job, str) or not job.isdigit() or len(job) > 20:
        raise ValueError(f"scheduler event: bad job {job!r}")
    st = body.get("state")
    if st is not None and not (isinstance(st, str) and _STATE.match(st)):
        raise ValueError(f"scheduler event: bad state {st!r}")
    out = {"event": ev, "job": job, "state": st}
    for k, lo, hi in (("exit_code", 0, 255), ("signal", 1, 127), ("t", 1, 1 << 62)):
        v = body.get(k)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi):
            raise ValueError(f"scheduler event: bad {k} {v!r}")
        out[k] = v
    return out


def send(body: dict, socket_dir: str | None = None) -> None:
    """Send one ``T_SCHED`` datagram to the node agent's socket (raises OSError when it is not there)."""
    from stepwatch.wire.datagram import HDR, MAGIC, SOCKET_NAME, T_SCHED, VERSION, default_socket_dir
    path = os.path.join(socket_dir or default_socket_dir(), SOCKET_NAME)
    data = HDR.pack(MAGIC, VERSION, T_SCHED, 0, 0, 0, 0, 0, 0) + json.dumps(body).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, path)


def detach(work) -> bool:
    """Run ``work()`` in a child that outlives this process (the epilog returns at once): its own session (slurmd
    kills the epilog's process group when the epilog ends), stdin/stdout on /dev/null (slurmd may read the
    epilog's output until it closes), stderr kept only when it is a file. True in the parent once the child
    has left the process group; the child never returns."""
    import stat
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        os.read(r, 1)                                     # the child has its own session
        os.close(r)
        return True
    code = 0
    try:
        os.close(r)
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        if not stat.S_ISREG(os.fstat(2).st_mode):
            os.dup2(null, 2)
        os.write(w, b"1")
        os.close(w)
        work()
    except BaseException as e:  # noqa: BLE001 - the child ends here, whatever happened
        code = 1
        try:
            print(f"stepwatch slurm epilog: {e}", file=__import__("sys").stderr, flush=True)
        except Exception:  # noqa: BLE001
            pass
    finally:
        os._exit(code)


def cmd_slurm(a) -> int:
    """``stepwatch slurm prolog|epilog``: tell this node's agent the job started / ended (never fails the job:
    a prolog that exits non-zero drains the node, so every error is printed and 0 returned). The epilog, unless
    given ``--state`` or ``--wait-s 0``, leaves a detached child that sends the end once Slurm has settled the
    job's state (:func:`final_state`: after this epilog has returned) and returns at once."""
    import sys
    env = dict(os.environ)
    try:
        if a.event == "prolog":
            send(sched_body("start", env), a.socket_dir)
            return 0
        body = sched_body("end", env, a.state)           # checked now: errors go to the epilog's stderr
        if a.state or a.wait_s <= 0:
            if not a.state:
                st = job_state(body["job"])
                if st:
                    body["state"] = st
            send(body, a.socket_dir)
            return 0

        def follow():
            st = final_state(body["job"], a.wait_s)
            if st:
                body["state"] = st
            send(body, a.socket_dir)
        detach(follow)
    except (ValueError, OSError) as e:
        print(f"stepwatch slurm {a.event}: {e}", file=sys.stderr)
    return 0


def add_slurm_args(p) -> None:
    p.add_argument("event", choices=("prolog", "epilog"), help="which script runs this (slurmd's Prolog/Epilog)")
    p.add_argument("--socket-dir", default=None, help="the node agent's socket directory (env STEPWATCH_SOCKET_DIR)")
    p.add_argument("--state", default=None, help="epilog: the job's Slurm state (TIMEOUT, CANCELLED, ...), sent at "
                                                 "once (default: Slurm's, once it has settled: see --wait-s)")
    p.add_argument("--wait-s", type=float, default=60.0,
                   help="epilog: how long a detached child waits for Slurm to settle the job's end state (it reads "
                        "COMPLETING while the epilogs run) before sending the end without it (default 60; 0: send "
                        "at once, no state unless the Reason names the time limit)")


def main(argv: list[str] | None = None) -> int:
    """``python -m stepwatch.agents.slurm prolog|epilog`` (the same as ``stepwatch slurm``, faster to start)."""
    import argparse
    p = argparse.ArgumentParser(prog="stepwatch slurm")
    add_slurm_args(p)
    return cmd_slurm(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

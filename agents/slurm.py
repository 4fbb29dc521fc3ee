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
``FAILED``, ``CANCELLED``, ``TIMEOUT``, ...; ``scontrol show job``). The agent makes it an ``inflight`` row
with ``source`` = ``slurm`` (see :mod:`stepwatch.detectors.lifecycle`).
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
_STATE = re.compile(r"^[A-Z_]{1,32}$")


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
def job_state(job_id: str, scontrol: str | None = None) -> str | None:
    """The job's Slurm state (``JobState=`` of ``scontrol show job -o``), e.g. ``CANCELLED``."""
    exe = scontrol or shutil.which("scontrol")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\bJobState=([A-Z_]+)", out.stdout)
    # slurmd's Epilog runs while the job is COMPLETING (Slurm 22.05 prints that flag, not the final state):
    # no state then (give it with --state, e.g. from an EpilogSlurmctld that knows it)
    return m.group(1) if m and m.group(1) != "COMPLETING" else None


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
    from stepwatch.agents.probe.wire import HDR, MAGIC, SOCKET_NAME, T_SCHED, VERSION, default_socket_dir
    path = os.path.join(socket_dir or default_socket_dir(), SOCKET_NAME)
    data = HDR.pack(MAGIC, VERSION, T_SCHED, 0, 0, 0, 0, 0, 0) + json.dumps(body).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, path)


def cmd_slurm(a) -> int:
    """``stepwatch slurm prolog|epilog``: tell this node's agent the job started / ended (never fails the job:
    a prolog that exits non-zero drains the node, so every error is printed and 0 returned)."""
    import sys
    env = dict(os.environ)
    try:
        state = (a.state or job_state(env.get("SLURM_JOB_ID", ""))) if a.event == "epilog" else None
        body = sched_body("start" if a.event == "prolog" else "end", env, state)
        send(body, a.socket_dir)
    except (ValueError, OSError) as e:
        print(f"stepwatch slurm {a.event}: {e}", file=sys.stderr)
    return 0


def add_slurm_args(p) -> None:
    p.add_argument("event", choices=("prolog", "epilog"), help="which script runs this (slurmd's Prolog/Epilog)")
    p.add_argument("--socket-dir", default=None, help="the node agent's socket directory (env STEPWATCH_SOCKET_DIR)")
    p.add_argument("--state", default=None, help="epilog: the job's Slurm state (TIMEOUT, CANCELLED, ...; default: "
                                                 "scontrol show job's JobState, unless it reads COMPLETING)")


def main(argv: list[str] | None = None) -> int:
    """``python -m stepwatch.agents.slurm prolog|epilog`` (the same as ``stepwatch slurm``, faster to start)."""
    import argparse
    p = argparse.ArgumentParser(prog="stepwatch slurm")
    add_slurm_args(p)
    return cmd_slurm(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

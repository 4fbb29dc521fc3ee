"""A real one-node Slurm (Debian's ``slurm-wlm`` 22.05) and ``munge`` for the tests, on free loopback ports.

Everything lives in a private temporary directory: munge's key and socket (``AuthInfo=socket=``), the
controller's state, slurmd's spool, the logs and the prolog/epilog. The daemons run as root (``SlurmUser=root``;
``proctrack/linuxproc`` and ``task/none``: no cgroups needed), are ready when ``sinfo`` shows the node idle,
and are stopped by their pids. The prolog and epilog run ``stepwatch slurm prolog|epilog`` with the
variables written to ``<dir>/hooks.env`` (the agent's socket directory of the test that runs).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol")


def why_not() -> str | None:
    """Why a Slurm cannot be started here (None: it can)."""
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        return f"Slurm/munge not installed (apt-get install slurm-wlm munge): missing {', '.join(missing)}"
    if os.getuid() != 0:
        return "the test Slurm runs its daemons as root (SlurmUser=root); not root here"
    return None


class SlurmCluster:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="sw-slurm-", dir="/tmp"))
        self.dir.chmod(0o755)
        self.node = socket.gethostname().split(".")[0]
        self.env = dict(os.environ, SLURM_CONF=str(self.dir / "slurm.conf"))
        self.pids: dict[str, int] = {}

    def start(self, timeout_s: float = 30.0) -> "SlurmCluster":
        d = self.dir
        for sub in ("munge", "state", "spool", "log"):
            (d / sub).mkdir()
        (d / "munge").chmod(0o755)
        key = d / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for ev in ("prolog", "epilog"):
            f = d / f"{ev}.sh"
            f.write_text(f"#!/bin/sh\n[ -r {d}/hooks.env ] && . {d}/hooks.env && export STEPWATCH_SOCKET_DIR\n"
                         f"exec {sys.executable} -m stepwatch.agents.slurm {ev} 2>>{d}/log/{ev}.err\n")
            f.chmod(0o755)
        ctl, sd = free_port(), free_port()
        (d / "slurm.conf").write_text(f"""ClusterName=swtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctl}
SlurmdPort={sd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
KillWait=2
InactiveLimit=0
MinJobAge=300
Prolog={d}/prolog.sh
Epilog={d}/epilog.sh
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 2} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        m = d / "munge"
        self._daemon("munged", ["munged", "-F", "-f", f"--key-file={key}", f"--socket={m}/sock",
                                f"--pid-file={m}/pid", f"--log-file={m}/log", f"--seed-file={m}/seed"])
        self._wait(lambda: (m / "sock").exists(), timeout_s, "munged's socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(d / "slurm.conf")])
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(d / "slurm.conf")])
        self._wait(lambda: self.node_state() == "idle", timeout_s, "the node idle in sinfo")
        return self

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")
        p = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.pids[name] = p.pid
        self._procs = getattr(self, "_procs", []) + [p]

    def _wait(self, ok, timeout_s: float, what: str) -> None:
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            for p in getattr(self, "_procs", []):
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited ({p.returncode}) waiting for {what}: {self.logs()}")
            if ok():
                return
            time.sleep(0.1)
        raise RuntimeError(f"timed out waiting for {what}: {self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            out.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-1500:])
        return "\n".join(out)

    def run(self, *argv: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        env = dict(self.env, **kw.pop("env", {}))
        r = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} -> {r.returncode}: {r.stdout[-2000:]} {r.stderr[-2000:]}")
        return r

    def node_state(self) -> str:
        r = self.run("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else ""

    def hooks(self, **env: str) -> None:
        """Variables the prolog and epilog see (e.g. the agent's STEPWATCH_SOCKET_DIR)."""
        (self.dir / "hooks.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))

    def stop(self) -> None:
        for p in reversed(getattr(self, "_procs", [])):      # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def started():
    """A module fixture's body: the cluster, started (the test skips, saying why, where it cannot be),
    stopped after its tests: ``yield from started()``."""
    import pytest
    why = why_not()
    if why:
        pytest.skip(why)
    c = SlurmCluster()
    try:
        c.start()
    except RuntimeError as e:
        c.stop()
        pytest.skip(f"the test Slurm did not start: {e}")
    yield c
    c.stop()

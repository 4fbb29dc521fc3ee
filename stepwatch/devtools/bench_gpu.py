"""``stepwatch bench gpu``: the GPU check, in one command, for a machine with no network.

What it runs, in order, with one node agent that spools (no broker is reachable from such a machine; the
spool is what comes back):

1. :mod:`stepwatch.devtools.gpubench` (a GPT of GPT-2-124M's shape, bf16) plain, wrapped, plain, wrapped:
   the median step of each, wrap's overhead (the wrapped runs' mean against the plain ones'), and MFU's
   FLOPs per token counted by the probe (``FlopCounterMode``) against ``6N + 12·L·H·Q·T``;
2. :mod:`stepwatch.devtools.ddp_train` under ``stepwatch wrap``: a 1-rank job (NCCL on a GPU), a 2-rank gloo
   job, and a 2-rank job whose rank 1 sleeps 15 ms per step from the middle on: their collectives are
   device-timed on a GPU, and every such job must get bus-bandwidth rows;
3. the spool, packed as ``<out>/spool.tgz``: ``stepwatch eval --real --spool DIR`` replays it elsewhere
   through an agent, the broker and a processor, and prints each job's alerts, end, comm and ``comm_bw``
   rows.

It prints one JSON summary (also ``<out>/summary.json``). On a GPU it exits 1 when a goal is missed: the
counted FLOPs more than 5 % off the analytic count, or wrap's overhead above 0.5 % of the step. Without
CUDA it runs the same on the CPU with tiny shapes (the figures are then the script's, not a GPU's) and
judges nothing. docs/efficiency.md ("Checked on a GPU") says how a session ran it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

#: the goals of the GPU check (issue: efficiency figures that match an independent count)
FLOPS_GOAL_PCT = 5.0
OVERHEAD_GOAL_PCT = 0.5


def add_gpu_args(p) -> None:
    p.add_argument("--out", default=None, help="folder for the spool, the logs and summary.json "
                                               "(default: a new temporary folder)")
    p.add_argument("--steps", type=int, default=400, help="steps of each ddp_train job (default %(default)s)")
    p.add_argument("--gpt-steps", type=int, default=None,
                   help="timed steps of each gpubench run (default: 60 on a GPU, 6 on a CPU)")
    p.add_argument("--jobs", default="clean-1,clean-2,sleep-r1",
                   help="which ddp_train jobs (comma-separated of clean-1, clean-2, sleep-r1, fsdp2-2, crash-r1; '' for none; "
                        "default %(default)s)")
    p.add_argument("--no-gpt", action="store_true", help="skip the gpubench runs")


def _cuda() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _stepwatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "stepwatch.cli", *args]


def _run(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[int, str]:
    with open(log, "wb") as f:
        try:
            r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=f, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124, ""
    return r.returncode, r.stdout.decode(errors="replace")


def _gpt(out: Path, sock: str, cuda: bool, steps: int | None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if steps is not None:
        env["SW_STEPS"] = str(steps)
    runs = []
    for i, wrapped in enumerate((False, True, False, True)):
        cmd = [sys.executable, "-m", "stepwatch.devtools.gpubench"]
        if wrapped:
            cmd = _stepwatch("wrap", "--socket-dir", sock, "--job", f"gpt-{i}", "--", *cmd)
        name = f"gpt-{'wrapped' if wrapped else 'plain'}-{i // 2 + 1}"
        t0 = time.monotonic()
        rc, stdout = _run(cmd, env, out / f"{name}.log", timeout=600)
        line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("{")), None)
        res = json.loads(line) if line else {}
        print(f"  {name}: rc={rc} {res.get('step_ms_median')} ms/step ({time.monotonic() - t0:.0f} s)", flush=True)
        runs.append({"name": name, "rc": rc, "wrapped": wrapped, **res})
    ok = [r for r in runs if r["rc"] == 0 and r.get("step_ms_median")]
    plain = [r["step_ms_median"] for r in ok if not r["wrapped"]]
    wrap = [r["step_ms_median"] for r in ok if r["wrapped"]]
    out_d: dict = {"runs": runs}
    if plain and wrap:
        out_d["overhead_pct"] = round(100.0 * (statistics.mean(wrap) / statistics.mean(plain) - 1), 3)
        out_d["plain_spread_pct"] = round(100.0 * (max(plain) / min(plain) - 1), 3)
    if ok:
        first = ok[0]
        out_d.update(device=first.get("device"), counted_vs_analytic_pct=first.get("counted_vs_analytic_pct"),
                     mfu_pct=first.get("mfu_pct"), flops_per_token=first.get("flops_per_token"))
    return out_d


#: the ddp_train jobs: name -> environment (``stepwatch eval --real --spool`` knows their labels)
def _jobs(cuda: bool, steps: int) -> dict[str, dict]:
    common = {"SW_DEVICE": "cuda" if cuda else "cpu", "SW_PAD_MS": "0", "SW_STEPS": str(steps)}
    if cuda:
        # batches sliced in advance: a loader reading and collating 4,096 items a step bound the first GPU
        # runs (75-80 ms steps, 30-84 % of them waiting for data): data-wait alerts on every clean run
        common.update(SW_WIDTH="4096", SW_BATCH="4096", SW_LOADER="batches")
    return {
        "clean-1": ("g-clean-nccl-1", {**common, "SW_NPROC": "1", "SW_BACKEND": "nccl" if cuda else "gloo"}),
        "clean-2": ("g-clean-gloo-2", {**common, "SW_NPROC": "2"}),
        "sleep-r1": ("g-sleep-r1", {**common, "SW_NPROC": "2", "SW_SLEEP_RANK": "1", "SW_SLEEP_MS": "15",
                                    "SW_SLEEP_FROM": str(steps // 2)}),
        "sleep-1": ("g-sleep-nccl-1", {**common, "SW_NPROC": "1", "SW_BACKEND": "nccl" if cuda else "gloo",
                                       "SW_SLEEP_RANK": "0", "SW_SLEEP_MS": "15", "SW_SLEEP_FROM": str(steps // 2)}),
        "fsdp2-2": ("g-clean-fsdp2-2", {**common, "SW_NPROC": "2", "SW_MODE": "fsdp2"}),
        "crash-r1": ("g-crash-r1", {**common, "SW_NPROC": "2", "SW_CRASH_RANK": "1",
                                    "SW_CRASH_STEP": str(steps // 2)}),
    }


def job_ended_as_it_should(name: str, rc: int) -> bool:
    """A job ran as meant: exit 0, except a crash job (``g-crash-*``), whose launcher must fail (a rank exits 1)
    and not time out (124)."""
    if name.startswith("g-crash-"):
        return rc not in (0, 124)
    return rc == 0


def run_gpu_bench(a) -> int:
    cuda = _cuda()
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="stepwatch-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    spool = out / "spool"
    sock = tempfile.mkdtemp(prefix="sw-gpu-", dir="/tmp")
    print(f"stepwatch bench gpu: {'CUDA' if cuda else 'no CUDA: tiny shapes on the CPU, nothing judged'}; "
          f"output in {out}", flush=True)
    # no broker can be reached from such a machine: the agent spools what it cannot send (port 9, discard,
    # refuses at once on loopback); the spool is replayed elsewhere (stepwatch eval --real --spool)
    agent = subprocess.Popen(_stepwatch("agent", "--bootstrap", "127.0.0.1:9", "--socket-dir", sock,
                                        "--spool-dir", str(spool), "--node", "gpu0", "--interval", "0.5",
                                        "--no-profiling"),
                             stdout=subprocess.DEVNULL, stderr=open(out / "agent.log", "wb"))
    summary: dict = {"cuda": cuda, "out": str(out)}
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(sock, "agent.sock")):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"stepwatch bench gpu: the node agent did not start (see {out / 'agent.log'})")
            time.sleep(0.1)
        if not a.no_gpt:
            summary["gpt"] = _gpt(out, sock, cuda, a.gpt_steps)
        jobs = _jobs(cuda, a.steps)
        wanted = [j for j in a.jobs.split(",") if j]
        unknown = [j for j in wanted if j not in jobs]
        if unknown:
            raise SystemExit(f"stepwatch bench gpu: --jobs {','.join(unknown)!r}: not a job; one of {', '.join(jobs)}")
        summary["jobs"] = {}
        for key in wanted:
            name, env = jobs[key]
            t0 = time.monotonic()
            rc, _ = _run(_stepwatch("wrap", "--socket-dir", sock, "--job", name, "--", sys.executable, "-m",
                                    "stepwatch.devtools.ddp_train"),
                         dict(os.environ, PYTHONUNBUFFERED="1", **env), out / f"{name}.log", timeout=600)
            summary["jobs"][name] = {"rc": rc, "seconds": round(time.monotonic() - t0, 1)}
            print(f"  {name}: rc={rc} ({time.monotonic() - t0:.0f} s)", flush=True)
            time.sleep(2.0)                          # its goodbyes and last rows reach the spool
        # the agent's host samples of the last job move its event time past the lifecycle's settle and
        # grace (1 + 2 s), as a node's agent that keeps running does: its end is judged in the replay
        time.sleep(4.0)
    finally:
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
        shutil.rmtree(sock, ignore_errors=True)
    files = sorted(spool.glob("*")) if spool.exists() else []
    summary["spool_files"] = len(files)
    if files:
        with tarfile.open(out / "spool.tgz", "w:gz") as tar:
            tar.add(spool, arcname="spool")
        summary["replay"] = f"tar xzf spool.tgz && stepwatch eval --real --spool spool   (in {out})"
    goals = []
    g = summary.get("gpt", {})
    if cuda:
        if not a.no_gpt:                         # --no-gpt: the GPT goals are not judged, not failed
            c = g.get("counted_vs_analytic_pct")
            goals.append(("counted FLOPs within 5 % of 6N + 12LHQT", c is not None and abs(c) <= FLOPS_GOAL_PCT))
            o = g.get("overhead_pct")
            goals.append(("wrap overhead <= 0.5 % of the step", o is not None and o <= OVERHEAD_GOAL_PCT))
        goals.append(("every job ended as it should", all(job_ended_as_it_should(name, j["rc"])
                                                          for name, j in summary.get("jobs", {}).items())))
        summary["goals"] = {k: v for k, v in goals}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if all(v for _, v in goals) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m stepwatch.devtools.bench_gpu``: the same check where the package is a checkout on
    ``PYTHONPATH`` and not installed (a lent GPU machine: no entry points, so no ``stepwatch bench``)."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m stepwatch.devtools.bench_gpu", description=__doc__.split("\n\n")[0])
    add_gpu_args(p)
    return run_gpu_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

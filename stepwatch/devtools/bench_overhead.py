"""``stepwatch bench overhead``: what the probe costs a training step, and what the node agent costs
its node.

1. **Probe overhead per step.** Two real PyTorch loops run in this process, single-process gloo so
   the collective wrapper is exercised: ``minimal`` (DataLoader ``__next__``, one tiny parameter,
   one all_reduce, ``optimizer.step()``: nearly nothing but the instrumented calls) and ``mlp`` (a
   2-layer MLP forward/backward on a 32x64 batch, all_reduce of the flattened gradients, SGD). Each
   loop runs in blocks of ``--block-steps`` steps under three conditions, side by side and
   interleaved (the order rotates every round, so drift of a shared machine hits all three alike;
   the loop is pinned to CPU 0 and the agent to the last CPU):
   ``off`` (no probe), ``on`` (probe, a real agent listening in another process) and ``no-agent``
   (probe, nobody listening: every datagram dropped and counted). Reported, for the process CPU time
   (what the probe adds to the rank; immune to other processes taking the core) and the wall time:
   median block step time per condition, and the overhead = median over rounds of (condition - off)
   in µs per step, with its quartiles. A block ends with ``flush()`` inside the timed part: the
   probe's deferred work (its events replayed into steps, frames packed and sent, which it does
   every ~500 ms or few hundred events) is paid by the steps that caused it. Also per loop: the wall
   time inside each instrumented call and in that flush, condition - off (median over rounds, per
   call; their sum is the probe's direct cost, free of the variance of the rest of the step, which
   on the ``mlp`` loop is far larger than the probe). Then the *isolated* cost: the probe's real
   wrappers and hooks around no-op stand-ins (one DataLoader ``__next__``, one all_reduce, the
   optimizer hooks that end the step) minus the same calls unwrapped, best of 7 x 20,000 steps: the
   figure without training noise. Targets: <= 20 µs/step, <= 0.5 % of a 100 ms step; judged on the
   isolated cost, the ``minimal`` loop's whole step, and both loops' in-call sums. The first line
   says which hot path ran (C, or the pure-Python fallback).
2. **Agent cost.** ``stepwatch agent`` (the DaemonSet's command, through the ``stepwatch`` entry point)
   runs as a child process sending to the embedded broker (or, with ``--no-broker``, sending
   nowhere), all host plug-ins at 1 Hz, while ``--agent-ranks`` (8)
   probes in this process report one step every ``--agent-step-ms`` (100 ms) each, with two
   collectives and a phase per step and a GC row every tenth step. After a warm-up, the agent's CPU
   time over ``--agent-seconds`` (30 s) is reported as % of one core, and its peak RSS. Targets:
   <= 1 % of a core, <= 80 MB (every MB is taken from every node of the cluster).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TARGET_US, TARGET_PCT, TARGET_CPU, TARGET_RSS_MB = 20.0, 0.5, 1.0, 80.0
SETTLE_STEPS = 10          # untimed steps after each (re)install (hello, connect, patching): one-time, not per step


def add_overhead_args(p: argparse.ArgumentParser) -> None:
    """Options of ``stepwatch bench overhead`` (and of ``python -m stepwatch.devtools.bench_overhead``)."""
    p.add_argument("--rounds", type=int, default=80, help="rounds of interleaved blocks per loop (default %(default)s)")
    p.add_argument("--block-steps", type=int, default=100, help="steps per block (default %(default)s)")
    p.add_argument("--agent-ranks", type=int, default=8, help="probes served by the agent (default %(default)s)")
    p.add_argument("--agent-seconds", type=float, default=30.0, help="measured agent run, s (default %(default)s)")
    p.add_argument("--agent-step-ms", type=float, default=100.0,
                   help="step period of the served probes, ms (default %(default)s)")
    p.add_argument("--no-broker", action="store_true", help="agent without Kafka (decode and count only)")
    p.add_argument("--skip-agent", action="store_true", help="only the probe overhead")
    p.add_argument("--skip-probe", action="store_true", help="only the agent cost")


def _agent_cmd(socket_dir: str, bootstrap: str | None, metrics_port: int, plugins: str | None = None) -> list[str]:
    # the command the DaemonSet runs (`stepwatch agent`): its entry point, not the agents' module alone
    cmd = [sys.executable, "-m", "stepwatch.cli", "agent", "--socket-dir", socket_dir, "--interval", "1",
           "--job", "bench-agent", "--metrics-port", str(metrics_port), "--topic-prefix", "bench.",
           "--spool-dir", os.path.join(socket_dir, "spool")]
    cmd += ["--bootstrap", bootstrap] if bootstrap else ["--no-kafka"]
    if plugins:
        cmd += ["--plugins", plugins]
    return cmd


def _wait_socket(path: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited with code {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"the agent did not create {path} within {timeout}s")


def _scrape(port: int) -> dict[str, float]:
    """Sum of each counter family (``name_total``) from the agent's /metrics."""
    out: dict[str, float] = {}
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return out
    for line in body.splitlines():
        m = re.match(r"^(stepwatch_agent_[a-z_]+_total)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


# ---------------------------------------------------------------------------- 1. probe overhead

CALLS = ("DataLoader next", "all_reduce", "optimizer.step", "replay+send")


def _loops(dist, calls: list[int] | None = None):
    """The two loops; ``minimal`` also adds the wall time of each of its three instrumented calls
    to ``calls`` (ns), so the overhead can be split between them."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    def minimal():
        w = torch.nn.Parameter(torch.zeros(16))
        opt = torch.optim.SGD([w], lr=0.0)
        w.grad = torch.zeros(16)
        loader = DataLoader(TensorDataset(torch.zeros(1 << 16, 4)), batch_size=1)
        it = iter(loader)
        t = torch.zeros(16)
        acc = calls if calls is not None else [0, 0, 0]
        pc = time.perf_counter_ns

        def step():
            a = pc()
            next(it)
            b = pc()
            dist.all_reduce(t)
            c = pc()
            opt.step()
            d = pc()
            acc[0] += b - a
            acc[1] += c - b
            acc[2] += d - c
        return step

    def mlp():
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        params = list(model.parameters())
        loader = DataLoader(TensorDataset(torch.randn(1 << 14, 64), torch.randint(0, 10, (1 << 14,))),
                            batch_size=32)
        state = {"it": iter(loader)}
        acc = calls if calls is not None else [0, 0, 0]
        pc = time.perf_counter_ns

        def step():
            a = pc()
            try:
                x, y = next(state["it"])
            except StopIteration:
                state["it"] = iter(loader)
                x, y = next(state["it"])
            b = pc()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            c = pc()
            dist.all_reduce(flat)
            d = pc()
            opt.step()
            e = pc()
            acc[0] += b - a
            acc[1] += d - c
            acc[2] += e - d
        return step

    return {"minimal": minimal, "mlp": mlp}


def _stats(per: dict[str, list[float]]) -> dict:
    """Median per condition, and median over rounds of (condition - off) with quartiles."""
    res = {"step_us": {c: statistics.median(v) for c, v in per.items()}}
    for c in ("on", "no-agent"):
        diffs = sorted(a - b for a, b in zip(per[c], per["off"]))
        q = statistics.quantiles(diffs, n=4) if len(diffs) >= 4 else [diffs[0], 0.0, diffs[-1]]
        res[c] = {"overhead_us": statistics.median(diffs), "q1": q[0], "q3": q[2]}
    return res


def isolated_cost(agent_dir: str, empty_dir: str, n: int = 20000, repeats: int = 7) -> dict[str, float]:
    """The probe's own CPU per step, without training noise: one DataLoader ``__next__``, one
    all_reduce of a 4 MiB tensor over 8 ranks, one optimizer pre/post hook pair (which ends the step:
    pack + send), through the probe's real wrappers around no-op stand-ins; minus the same calls
    unwrapped. Best of ``repeats`` runs of ``n`` steps, µs per step."""
    import torch

    from stepwatch.agents import probe as P

    class Dist:                                         # what the wrapper asks torch.distributed
        @staticmethod
        def get_world_size(group=None):
            return 8

    class It:
        def __next__(self):
            return None

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    t = torch.zeros(1 << 20)
    opt = object()
    out = {}
    for cond, d in (("off", None), ("on", agent_dir), ("no-agent", empty_dir)):
        p = P.Probe()
        it_cls = type("It", (It,), {})
        ar = all_reduce
        pre = post = (lambda *a: None)
        if d is not None:
            p.init(job="iso", rank=0, world_size=8, socket_dir=d, auto=False)
            p.fold._explicit = False
            p.hooks._patch_dataloader(it_cls)
            ar = p.hooks._wrap_collective(Dist, "all_reduce", all_reduce)
            pre, post = p._log.opt_pre, p._log.opt_post
        it = it_cls()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time_ns()
            for _ in range(n):
                next(it)
                ar(t)
                pre(opt, (), {})
                post(opt, (), {})
            best = min(best, (time.process_time_ns() - t0) / n / 1e3)
            time.sleep(0.05)                            # let the agent drain its queue
        out[cond] = best
        p.shutdown()
    return {"on": out["on"] - out["off"], "no-agent": out["no-agent"] - out["off"], "off": out["off"]}


def probe_overhead(rounds: int, block_steps: int, out=print) -> dict:
    import torch
    import torch.distributed as dist

    from stepwatch.agents import probe as P
    from stepwatch.agents.probe import eventlog
    from stepwatch.wire import datagram
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="sw-bench-"))
    agent_dir, empty_dir = str(work / "agent"), str(work / "empty")
    os.makedirs(empty_dir)
    port = _free_port()
    # the loop on one CPU, the agent on another (the agent wakes for every step: thousands a second
    # with these tiny steps, which would otherwise compete with the loop for its CPU)
    ncpu = os.cpu_count() or 1
    pin = ncpu >= 2 and hasattr(os, "sched_setaffinity")
    if pin:
        own = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {0})
    agent = subprocess.Popen(_agent_cmd(agent_dir, None, port, plugins="cpu,load,mem"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             preexec_fn=(lambda: os.sched_setaffinity(0, {ncpu - 1})) if pin else None)
    dist.init_process_group("gloo", store=dist.FileStore(str(work / "store"), 1), rank=0, world_size=1)
    results: dict = {}
    p = P.Probe()
    try:
        _wait_socket(os.path.join(agent_dir, datagram.SOCKET_NAME), agent)
        conds = {"off": None, "on": agent_dir, "no-agent": empty_dir}
        calls = [0, 0, 0, 0]
        per_call = {n: {c: [] for c in conds} for n in ("minimal", "mlp")}
        for name, make in _loops(dist, calls).items():
            step = make()

            def block(cond: str) -> tuple[float, float]:
                if conds[cond] is None:
                    p.shutdown()
                else:
                    p.init(job="bench", rank=0, world_size=1, socket_dir=conds[cond])
                for _ in range(SETTLE_STEPS):       # one-time costs of (re)installing: not per step
                    step()
                calls[:] = [0, 0, 0, 0]
                c0, w0 = time.process_time_ns(), time.perf_counter_ns()
                for _ in range(block_steps):
                    step()
                # the block's deferred work (events replayed into steps, frames packed and sent) counts:
                # the probe does it every ~500 ms or ~100 steps, and at the end of the block here
                f0 = time.perf_counter_ns()
                p.flush()
                c1, w1 = time.process_time_ns(), time.perf_counter_ns()
                calls[3] += w1 - f0
                p.shutdown()
                per_call[name][cond].append([x / block_steps / 1e3 for x in calls])
                return (c1 - c0) / block_steps / 1e3, (w1 - w0) / block_steps / 1e3

            for c in conds:                     # warm-up: first calls, allocator, hooks
                block(c)
            cpu = {c: [] for c in conds}
            wall = {c: [] for c in conds}
            order = list(conds)
            for _ in range(rounds):
                order = order[1:] + order[:1]
                for c in order:
                    a, b = block(c)
                    cpu[c].append(a)
                    wall[c].append(b)
            results[name] = {"cpu": _stats(cpu), "wall": _stats(wall)}
        results["isolated"] = iso = isolated_cost(agent_dir, empty_dir)
    finally:
        if pin:
            os.sched_setaffinity(0, own)
        p.shutdown()
        dist.destroy_process_group()
        agent.terminate()
        agent.wait(10)
        shutil.rmtree(work, ignore_errors=True)

    def cell(o):
        return f"{o['overhead_us']:7.1f} [{o['q1']:6.1f},{o['q3']:6.1f}]"
    out(f"probe overhead per step ({'C' if eventlog.FAST else 'pure-Python (C extension not built)'} hot path): "
        f"training loops, {rounds} rounds x {block_steps} steps per condition, "
        "interleaved (µs; overhead = median over rounds of condition - off [quartiles])")
    out(f"  {'loop':<8} {'clock':<5} {'off':>8} {'on':>8} {'no-agent':>9}   {'overhead on':>24}   "
        f"{'overhead no-agent':>24}")
    for name in ("minimal", "mlp"):
        for clock in ("cpu", "wall"):
            r = results[name][clock]
            s_ = r["step_us"]
            out(f"  {name:<8} {clock:<5} {s_['off']:8.1f} {s_['on']:8.1f} {s_['no-agent']:9.1f}   "
                f"{cell(r['on']):>24}   {cell(r['no-agent']):>24}")
    # the time inside the instrumented calls (+ the block's replay and send): the probe's direct cost,
    # free of the variance of the rest of the step (which the whole-step figures above carry)
    out("  time in the instrumented calls + the deferred replay/send, condition - off, µs per step: the sum of "
        "the per-call medians over rounds (robust to one noisy call), [quartiles of the per-round sums], split:")
    for name in ("minimal", "mlp"):
        pcs = per_call[name]
        sums = {c: [sum(x) for x in pcs[c]] for c in conds}
        st = _stats(sums)
        split = {c: [statistics.median(a[i] - b[i] for a, b in zip(pcs[c], pcs["off"])) for i in range(len(CALLS))]
                 for c in ("on", "no-agent")}
        for c in ("on", "no-agent"):
            st[c]["overhead_us"] = sum(split[c])
        results[name]["calls"] = {"on": st["on"], "no-agent": st["no-agent"], "split": split}
        out(f"  {name:<8} on {cell(st['on'])}  no-agent {cell(st['no-agent'])}   on: "
            + ", ".join(f"{k} {split['on'][i]:+.1f}" for i, k in enumerate(CALLS)))
    out(f"  isolated probe cost (1 DataLoader next + 1 all_reduce + optimizer hooks ending the step, "
        f"best of 7 x 20,000 steps, process CPU): on {iso['on']:.1f} µs = {iso['on'] / 1e3:.4f} % of a 100 ms "
        f"step; no agent {iso['no-agent']:.1f} µs = {iso['no-agent'] / 1e3:.4f} %")
    worst_iso = max(iso["on"], iso["no-agent"])
    conds2 = ("on", "no-agent")
    whole = max(results["minimal"]["cpu"][c]["overhead_us"] for c in conds2)
    incalls = {n: max(results[n]["calls"][c]["overhead_us"] for c in conds2) for n in ("minimal", "mlp")}
    mlp_iqr = max(results["mlp"]["cpu"][c]["q3"] - results["mlp"]["cpu"][c]["q1"] for c in conds2)
    ok_iso = worst_iso <= TARGET_US
    ok_loop = whole <= TARGET_US and all(v <= TARGET_US for v in incalls.values())
    loop = {"minimal": whole, **{f"{n} calls": v for n, v in incalls.items()}}
    out(f"  target <= {TARGET_US:.0f} µs/step: isolated {'met' if ok_iso else 'MISSED'} (worst {worst_iso:.1f} µs); "
        f"in the loops {'met' if ok_loop else 'MISSED'} (worst medians: minimal whole step {whole:.1f} µs, "
        f"in the calls + replay: minimal {incalls['minimal']:.1f} µs, mlp {incalls['mlp']:.1f} µs; the mlp "
        f"whole-step difference is below this machine's noise: quartiles {mlp_iqr:.0f} µs apart)")
    worst_pct = max(worst_iso, *loop.values()) / 1e3
    out(f"  target <= {TARGET_PCT} % of a 100 ms step: {'met' if worst_pct <= TARGET_PCT else 'MISSED'} "
        f"(worst {worst_pct:.3f} %)")
    ok = ok_iso and ok_loop and worst_pct <= TARGET_PCT
    results["ok"] = ok
    return results


def _free_port() -> int:
    from stepwatch.devtools.broker import free_port
    return free_port()


# ---------------------------------------------------------------------------- 2. agent cost

def agent_cost(ranks: int, seconds: float, step_ms: float, broker: bool, out=print) -> dict:
    import psutil

    from stepwatch.agents import probe as P
    from stepwatch.wire import datagram
    work = Path(tempfile.mkdtemp(prefix="sw-bench-agent-"))
    sock_dir = str(work / "sock")
    port = _free_port()
    b = None
    probes: list = []
    agent = None
    try:
        if broker:
            from stepwatch.devtools.broker import EmbeddedBroker
            b = EmbeddedBroker(log_path=work / "broker.log").start()
        agent = subprocess.Popen(_agent_cmd(sock_dir, b.bootstrap if b else None, port),
                                 stdout=subprocess.DEVNULL, stderr=open(work / "agent.log", "wb"))
        _wait_socket(os.path.join(sock_dir, datagram.SOCKET_NAME), agent)
        ps = psutil.Process(agent.pid)
        probes = [P.Probe().init(job="bench-agent", rank=r, world_size=ranks, socket_dir=sock_dir, auto=False)
                  for r in range(ranks)]
        ops = [(p.names.intern("all_reduce"), p.names.intern("dp0"), p.names.intern("broadcast")) for p in probes]
        period = step_ms / 1e3
        warm = 5.0
        t_start = time.monotonic()
        t_meas = t_start + warm
        t_end = t_meas + seconds
        cpu0 = None
        rss_max = 0
        nxt = t_start
        k = 0
        last_rss = 0.0
        while True:
            now = time.monotonic()
            if now >= t_end:
                break
            if cpu0 is None and now >= t_meas:
                c = ps.cpu_times()
                cpu0 = (c.user + c.system, now)
            if cpu0 is not None and now - last_rss >= 1.0:
                rss_max = max(rss_max, ps.memory_info().rss)
                last_rss = now
            for p, (ar, grp, bc) in zip(probes, ops):
                p.begin_step()
                p.hooks._record_comm(ar, grp, 40 << 20, 3_000_000, 2_500_000)
                p.hooks._record_comm(bc, grp, 4096, 200_000, 150_000)
                p.add_phase("forward", step_ms * 0.3)
                if k % 10 == 0:
                    p._gc_cb("start", {})
                    p._gc_cb("stop", {"generation": 0, "collected": 100, "uncollectable": 0})
                p.end_step()
            k += 1
            nxt += period
            time.sleep(max(0.0, nxt - time.monotonic()))
        c = ps.cpu_times()
        cpu_pct = (c.user + c.system - cpu0[0]) / (time.monotonic() - cpu0[1]) * 100.0
        rss_max = max(rss_max, ps.memory_info().rss)
        time.sleep(1.5)                        # the last batch
        counters = _scrape(port)
    finally:
        for p in probes:
            p.shutdown()
        if agent is not None:
            agent.terminate()
            try:
                agent.wait(15)
            except subprocess.TimeoutExpired:
                agent.kill()
        if b is not None:
            b.stop()
        shutil.rmtree(work, ignore_errors=True)
    sent = sum(p.sent for p in probes)
    datagrams = sum(p.datagrams for p in probes)
    dropped = sum(p.dropped for p in probes)
    rss_mb = rss_max / 2 ** 20
    out(f"node agent serving {ranks} ranks (1 step / {step_ms:.0f} ms each, 2 collectives + 1 phase per step, "
        f"GC row every 10th), all host plug-ins at 1 Hz, {'embedded broker' if broker else 'no Kafka'}, "
        f"{seconds:.0f} s measured:")
    out(f"  CPU {cpu_pct:.2f} % of one core (target <= {TARGET_CPU} %), peak RSS {rss_mb:.1f} MB "
        f"(target <= {TARGET_RSS_MB:.0f} MB)")
    out(f"  step frames sent {sent:,} in {datagrams:,} datagrams, dropped by the probes {dropped:,}; agent records in "
        f"{counters.get('stepwatch_agent_records_in_total', 0):,.0f}, out to Kafka "
        f"{counters.get('stepwatch_agent_records_out_total', 0):,.0f}, dropped "
        f"{counters.get('stepwatch_agent_records_dropped_total', 0):,.0f}")
    ok = cpu_pct <= TARGET_CPU and rss_mb <= TARGET_RSS_MB
    out(f"  targets: {'met' if ok else 'MISSED'}")
    return {"cpu_pct": cpu_pct, "rss_mb": rss_mb, "sent": sent, "datagrams": datagrams, "dropped": dropped,
            "counters": counters, "ok": ok}


def run_overhead_bench(a) -> int:
    """Entry point of ``stepwatch bench overhead`` (options: :func:`add_overhead_args`)."""
    g = lambda k, d: getattr(a, k, d)   # noqa: E731 - a Namespace without the options runs the defaults
    print(f"stepwatch bench overhead: {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    if not g("skip_probe", False):
        if importlib.util.find_spec("torch") is None:
            print("  probe overhead skipped: torch is not installed (pip install torch==2.13.0)")
        else:
            probe_overhead(g("rounds", 80), g("block_steps", 100))
    if not g("skip_agent", False):
        agent_cost(g("agent_ranks", 8), g("agent_seconds", 30.0), g("agent_step_ms", 100.0),
                   broker=not g("no_broker", False))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stepwatch bench overhead", description=__doc__.split("\n\n")[0])
    add_overhead_args(p)
    return run_overhead_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

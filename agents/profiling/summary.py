"""Profiles' summaries and their side-by-side diff (:mod:`stepwatch.agents.profiling`): top operators of a
torch profile or a Chrome trace, top functions of a py-spy recording, ``diff``/``format_diff``, and the
child process that summarises a trace off the training process (``python -m stepwatch.agents.profiling
summarize``). Standard library only."""
from __future__ import annotations

import json
import os
import subprocess
import sys

TOP_N = 25                       # entries kept in a summary


def torch_summary(key_averages, steps: int, top: int = TOP_N) -> dict:
    """Top operators (and ``record_function`` ranges) by self time, in ms per profiled step.
    ``key_averages`` is ``profile.key_averages()``; device self time is added when present."""
    steps = max(int(steps), 1)
    ops = []
    total = 0.0
    for e in key_averages:
        name = str(e.key)
        if name.startswith("ProfilerStep"):
            continue
        cpu = float(getattr(e, "self_cpu_time_total", 0.0) or 0.0) / 1e3
        dev = float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0) / 1e3
        total += cpu + dev
        ops.append({"name": name, "self_ms": round((cpu + dev) / steps, 4), "cpu_ms": round(cpu / steps, 4),
                    "device_ms": round(dev / steps, 4), "calls": round(int(e.count) / steps, 3)})
    ops.sort(key=lambda o: (-o["self_ms"], o["name"]))
    return {"profiler": "torch", "unit": "ms/step", "steps": steps, "total_self_ms": round(total / steps, 4),
            "top": ops[:top]}


# trace events whose duration is an operator's (CPU side) or a device activity's own time
_CPU_CATS = frozenset(("cpu_op", "user_annotation", "python_function"))
_DEVICE_CATS = frozenset(("kernel", "gpu_memcpy", "gpu_memset"))


def trace_summary(trace: dict, steps: int, top: int = TOP_N) -> dict:
    """The :func:`torch_summary` of a Chrome trace written by ``export_chrome_trace``: self time per
    operator / ``record_function`` range = its duration minus its direct children's on the same
    thread; device kernels and copies count their whole duration. Computed from the file (in a
    separate process, see :func:`summarize_in_subprocess`) so the training process never runs the
    profiler's Python post-processing, which would compete with training for the GIL."""
    steps = max(int(steps), 1)
    threads: dict[tuple, list] = {}
    dev: dict[str, list] = {}
    for e in trace.get("traceEvents", ()):
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        name = str(e.get("name", ""))
        if cat in _CPU_CATS:
            if name.startswith("ProfilerStep"):
                continue
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(
                (float(e.get("ts", 0.0)), float(e.get("dur", 0.0)), name))
        elif cat in _DEVICE_CATS:
            a = dev.setdefault(name, [0.0, 0])
            a[0] += float(e.get("dur", 0.0))
            a[1] += 1
    cpu: dict[str, list] = {}
    for evs in threads.values():
        evs.sort(key=lambda x: (x[0], -x[1]))
        stack: list[list] = []                     # [end, self_us, name] of the open ranges
        for ts, dur, name in evs:
            while stack and stack[-1][0] <= ts:
                _close(stack.pop(), cpu)
            if stack:
                stack[-1][1] -= dur                # a direct child: not the parent's own time
            stack.append([ts + dur, dur, name])
        while stack:
            _close(stack.pop(), cpu)
    ops, total = [], 0.0
    for name in set(cpu) | set(dev):
        c_us, n = cpu.get(name, (0.0, 0))
        d_us, dn = dev.get(name, (0.0, 0))
        c, d = max(c_us, 0.0) / 1e3, d_us / 1e3
        total += c + d
        ops.append({"name": name, "self_ms": round((c + d) / steps, 4), "cpu_ms": round(c / steps, 4),
                    "device_ms": round(d / steps, 4), "calls": round((n or dn) / steps, 3)})
    ops.sort(key=lambda o: (-o["self_ms"], o["name"]))
    return {"profiler": "torch", "unit": "ms/step", "steps": steps, "total_self_ms": round(total / steps, 4),
            "top": ops[:top]}


def _close(item: list, acc: dict) -> None:
    a = acc.setdefault(item[2], [0.0, 0])
    a[0] += item[1]
    a[1] += 1


def summarize_in_subprocess(path: str, steps: int, timeout_s: float = 120.0, gzip_to: str | None = None) -> dict:
    """:func:`trace_summary` of the trace file at ``path`` computed by a child Python process (its
    CPU and its GIL are not the training process's). With ``gzip_to`` the child also writes the trace
    gzip-compressed there and removes ``path``: compressing in the training process (kineto's own
    ``.gz`` export) took ~0.5-1 s per 10 steps here, against ~5 ms for the plain JSON."""
    argv = [sys.executable, "-m", "stepwatch.agents.profiling", "summarize", path, str(int(steps))]
    if gzip_to:
        argv.append(gzip_to)
    r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s, close_fds=True)
    if r.returncode != 0:
        err = r.stderr.decode("utf-8", "replace").strip().splitlines()
        raise RuntimeError("trace summary failed: " + (err[-1] if err else f"exit code {r.returncode}"))
    return json.loads(r.stdout)


def _func_name(frame: str) -> str:
    """``fn (file.py:12)`` -> ``fn (file.py)``: aggregate a function over its lines."""
    frame = frame.strip()
    if frame.endswith(")") and "(" in frame:
        head, _, loc = frame.rpartition(" (")
        path = loc[:-1].rsplit(":", 1)[0]
        return f"{head} ({os.path.basename(path)})"
    return frame


def pyspy_summary(raw: str, steps: int, rate: int, top: int = TOP_N) -> dict:
    """Top Python functions by self samples from ``py-spy record --format raw`` output (one
    ``frame;frame;...;leaf count`` line per distinct stack), in ms per profiled step."""
    steps = max(int(steps), 1)
    self_s: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        leaf = _func_name(stack.rsplit(";", 1)[-1])
        self_s[leaf] = self_s.get(leaf, 0) + int(n)
        total += int(n)
    ms = 1e3 / max(rate, 1)
    ops = [{"name": k, "self_ms": round(v * ms / steps, 4), "samples": v} for k, v in self_s.items()]
    ops.sort(key=lambda o: (-o["self_ms"], o["name"]))
    return {"profiler": "py-spy", "unit": "ms/step", "steps": steps, "rate": rate, "samples": total,
            "total_self_ms": round(total * ms / steps, 4), "top": ops[:top]}


def diff(suspect: dict, reference: dict, top: int = 10) -> dict:
    """Which operators/functions the suspect spends more self time in than the reference, most first:
    ``slower`` entries (``name, suspect_ms, reference_ms, delta_ms, ratio``; ms per step; ``ratio`` is
    None for an entry the reference does not have) and the totals."""
    s = {o["name"]: o["self_ms"] for o in suspect.get("top", [])}
    r = {o["name"]: o["self_ms"] for o in reference.get("top", [])}
    rows = []
    for name in set(s) | set(r):
        a, b = s.get(name, 0.0), r.get(name, 0.0)
        rows.append({"name": name, "suspect_ms": round(a, 4), "reference_ms": round(b, 4),
                     "delta_ms": round(a - b, 4), "ratio": round(a / b, 3) if b > 0 else None})
    rows.sort(key=lambda x: -x["delta_ms"])
    st, rt = float(suspect.get("total_self_ms") or 0.0), float(reference.get("total_self_ms") or 0.0)
    return {"slower": [x for x in rows if x["delta_ms"] > 0][:top],
            "faster": sorted([x for x in rows if x["delta_ms"] < 0], key=lambda x: x["delta_ms"])[:3],
            "suspect_total_ms": round(st, 4), "reference_total_ms": round(rt, 4),
            "delta_total_ms": round(st - rt, 4), "unit": "ms/step"}


def format_diff(d: dict) -> str:
    lines = [f"self time per step: suspect {d['suspect_total_ms']:.2f} ms, reference {d['reference_total_ms']:.2f} ms "
             f"({d['delta_total_ms']:+.2f} ms)", "", f"{'operator / function':<48} {'suspect':>10} {'reference':>10} "
             f"{'delta':>10} {'ratio':>7}"]
    for x in d["slower"]:
        ratio = f"{x['ratio']:.2f}x" if x["ratio"] is not None else "new"
        lines.append(f"{x['name'][:48]:<48} {x['suspect_ms']:>10.3f} {x['reference_ms']:>10.3f} "
                     f"{x['delta_ms']:>+10.3f} {ratio:>7}")
    if not d["slower"]:
        lines.append("(nothing slower on the suspect)")
    return "\n".join(lines)


def trace_name(job: str, rank: int, cmd_id: str, kind: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{job}-r{rank}-{cmd_id}")
    return safe + (".json.gz" if kind == "torch" else ".pyspy.txt")


def _main(argv: list[str]) -> int:
    """``python -m stepwatch.agents.profiling summarize TRACE.json[.gz] STEPS [GZ_OUT]``: the summary
    as JSON on stdout; with ``GZ_OUT`` the trace is also written there gzip-compressed (atomically,
    through a ``mkstemp`` file of its directory) and the plain ``TRACE`` is removed."""
    import gzip
    import tempfile
    if len(argv) not in (3, 4) or argv[0] != "summarize":
        sys.stderr.write("usage: python -m stepwatch.agents.profiling summarize TRACE STEPS [GZ_OUT]\n")
        return 2
    path, steps = argv[1], int(argv[2])
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    summary = trace_summary(json.loads(raw), steps)
    if len(argv) == 4:
        out = argv[3]
        # an unpredictable name, created O_EXCL|O_NOFOLLOW 0600 (mkstemp): a link planted at a
        # predictable ``<out>.tmp`` by another user of a shared directory is never followed
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(out) + ".", suffix=".tmp",
                                   dir=os.path.dirname(os.path.abspath(out)))
        try:
            with os.fdopen(fd, "wb") as raw_f, gzip.GzipFile(fileobj=raw_f, mode="wb", compresslevel=6) as f:
                f.write(raw)
            os.replace(tmp, out)                        # replaces a link at ``out``, never follows it
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if os.path.abspath(out) != os.path.abspath(path):
            os.unlink(path)
    json.dump(summary, sys.stdout)
    return 0

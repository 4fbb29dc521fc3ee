"""Targeted fine-grained profiling (DESIGN §9): signing, summaries, diffs, and the probe-side runner.

Everything here imports only the standard library at module level (the probe loads it into the
training process); torch is used only when a ``torch`` profile runs, and ``py-spy`` is a separate
binary.

Commands. A ``control`` row (:data:`stepwatch.schema.CONTROL`) asks one node's agent to profile
``steps`` steps of some ranks of a job. It is signed with HMAC-SHA256 over :func:`canonical` (the
signed fields as sorted, compact JSON) with a shared secret read by :func:`load_key` from
``STEPWATCH_PROFILING_KEY`` or the file named by ``STEPWATCH_PROFILING_KEY_FILE`` (the Helm chart
mounts a Secret there). The secret is never logged or put into any row. :func:`verify` compares
with :func:`hmac.compare_digest`.

Probe side. :class:`ProbeControl` owns a non-blocking ``AF_UNIX``/``SOCK_DGRAM`` socket
``<socket_dir>/probe-<instance>.sock`` (mode 0600, or ``STEPWATCH_CTL_SOCKET_MODE``), announced in the
probe's hello as ``ctl``. The probe polls it with one non-blocking ``recv`` when it flushes (at most
every ``flush_ms``), never per step. An accepted command becomes a :class:`ProfileRun`: it starts at
the first step boundary after the profiler is ready, profiles exactly ``steps`` steps (or stops at the
command's deadline, whichever comes first), then writes the trace and its summary on a background
thread and answers the agent with a ``T_PROFILE`` datagram (header + JSON).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

ENV_KEY = "STEPWATCH_PROFILING_KEY"
ENV_KEY_FILE = "STEPWATCH_PROFILING_KEY_FILE"
PROFILER_KINDS = ("torch", "py-spy")
STATUSES = ("ok", "failed", "rejected", "expired", "busy")
SIGNED_FIELDS = ("cmd_id", "job", "node", "ranks", "reference", "steps", "kind", "reason", "issued_at", "expires_at")
CTL_PREFIX = "probe-"
TOP_N = 25                       # entries kept in a summary
PYSPY_RATE = 200                 # py-spy samples per second


class KeyError_(ValueError):
    """No usable profiling key."""


# ---------------------------------------------------------------------------- secret and signing

def load_key(path: str | None = None, env=None) -> bytes | None:
    """The shared HMAC key: ``$STEPWATCH_PROFILING_KEY``, else the content of ``path`` or of the file
    named by ``$STEPWATCH_PROFILING_KEY_FILE`` (surrounding whitespace stripped). None when neither is
    set; raises KeyError_ when a file is named but unreadable or the key is shorter than 16 bytes."""
    env = os.environ if env is None else env
    k = env.get(ENV_KEY)
    p = path or env.get(ENV_KEY_FILE)
    if not k and p:
        try:
            with open(p, "rb") as f:
                k = f.read().strip()
        except OSError as e:
            raise KeyError_(f"cannot read the profiling key file {p}: {e.strerror}") from None
    if not k:
        return None
    k = k.encode() if isinstance(k, str) else k
    if len(k) < 16:
        raise KeyError_("the profiling key is shorter than 16 bytes")
    return k


def _ints(v) -> list[int]:
    return sorted(int(x) for x in (v or []))


def canonical(cmd: dict) -> bytes:
    """The bytes a signature covers: the signed fields, normalised (ranks sorted, times as int ns),
    as sorted compact JSON."""
    d = {}
    for k in SIGNED_FIELDS:
        v = cmd.get(k)
        if k in ("ranks", "reference"):
            v = _ints(v)
        elif k in ("steps", "issued_at", "expires_at"):
            v = int(v) if v is not None else None
        else:
            v = "" if v is None else str(v)
        d[k] = v
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def sign(cmd: dict, key: bytes) -> str:
    return hmac.new(key, canonical(cmd), hashlib.sha256).hexdigest()


def verify(cmd: dict, key: bytes) -> str | None:
    """None when the signature is right, else the reason: ``unsigned`` or ``bad_signature``."""
    sig = cmd.get("signature")
    if not sig:
        return "unsigned"
    want = sign(cmd, key)
    if not hmac.compare_digest(want.encode(), str(sig).encode()):
        return "bad_signature"
    return None


def new_command(job: str, node: str, ranks, steps: int, kind: str = "torch", reason: str = "",
                reference=(), ttl_s: float = 120.0, key: bytes | None = None, now_ns: int | None = None,
                cmd_id: str | None = None) -> dict:
    """A control row (signed when ``key`` is given). ``expires_at`` = now + ``ttl_s``: the command is
    refused after it, and a profile still running at that instant stops."""
    if kind not in PROFILER_KINDS:
        raise ValueError(f"unknown profile kind {kind!r} (one of {', '.join(PROFILER_KINDS)})")
    now = time.time_ns() if now_ns is None else int(now_ns)
    cmd = {"cmd_id": cmd_id or uuid.uuid4().hex[:16], "job": job, "node": node, "ranks": _ints(ranks),
           "steps": int(steps), "kind": kind, "reason": reason or "", "issued_at": now,
           "expires_at": now + int(ttl_s * 1e9), "reference": _ints(reference), "signature": None}
    if key is not None:
        cmd["signature"] = sign(cmd, key)
    return cmd


# ---------------------------------------------------------------------------- summaries and diffs

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


# ---------------------------------------------------------------------------- probe side

def _torch_activities():
    """(profile factory, activities): torch_npu's profiler when torch_npu is already imported, else
    torch.profiler with CPU plus CUDA when a GPU is in use."""
    npu = sys.modules.get("torch_npu")
    if npu is not None:
        p = npu.profiler
        return p.profile, [p.ProfilerActivity.CPU, p.ProfilerActivity.NPU]
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU]
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            acts.append(ProfilerActivity.CUDA)
    except Exception:  # noqa: BLE001
        pass
    return profile, acts


def _warm_torch_profiler() -> None:
    """What the first ``profile.start()`` would import on the training thread (``torch._inductor``,
    ~2 s on a small CPU): done on a helper thread before the profile begins."""
    import torch
    if hasattr(torch, "_inductor"):
        import torch._inductor.config  # noqa: F401


def pyspy_binary() -> str | None:
    p = os.environ.get("STEPWATCH_PYSPY")
    if p:
        return p if os.access(p, os.X_OK) else None
    cand = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(cand, os.X_OK):
        return cand
    return shutil.which("py-spy")


class ProfileRun:
    """One profile in a probe. States: ``warming`` (helper thread prepares the profiler) -> ``ready``
    -> ``running`` (from a step boundary) -> ``finishing`` (trace written off the training thread) ->
    ``done``. ``on_step`` is called at every step boundary by the training thread."""

    def __init__(self, ctl: "ProbeControl", cmd: dict):
        self.ctl, self.cmd = ctl, cmd
        self.cmd_id = str(cmd.get("cmd_id"))
        self.kind = cmd.get("kind") or "torch"
        self.steps = max(1, int(cmd.get("steps") or 1))
        self.deadline_ns = int(cmd.get("deadline_ns") or (time.time_ns() + 60_000_000_000))
        self.state = "warming"
        self.n = 0
        self.prof = None
        self.proc = None
        self.path = ""
        self.started_at = self.finished_at = None
        self.step_first = None
        self.error = None
        self.t_ready = None
        if self.kind == "torch":
            threading.Thread(target=self._warm, name="stepwatch-profile-warm", daemon=True).start()
        else:
            self.state = "ready"

    def _warm(self) -> None:
        try:
            _warm_torch_profiler()
        except Exception as e:  # noqa: BLE001
            self.error = f"torch profiler unavailable: {e!r}"
        self.t_ready = time.time_ns()
        self.state = "ready"

    # --------------------------------------------------------------- training thread
    def on_step(self, step: int) -> bool:
        """A step boundary (``step`` = number of the step that starts now). Returns False when the
        run no longer needs step boundaries."""
        st = self.state
        now = time.time_ns()
        if st == "warming":
            if now >= self.deadline_ns:
                self._finish("expired", "deadline passed before the profiler was ready")
                return False
            return True
        if st == "ready":
            if self.error:
                self._finish("failed", self.error)
                return False
            if now >= self.deadline_ns:
                self._finish("expired", "deadline passed before a step boundary")
                return False
            try:
                self._start()
            except Exception as e:  # noqa: BLE001 - a profiler that fails never fails training
                self._finish("failed", f"could not start the {self.kind} profiler: {e!r}")
                return False
            self.step_first = step
            self.started_at = time.time_ns()
            self.state = "running"
            return True
        if st == "running":
            self.n += 1
            if self.kind == "torch":
                try:
                    self.prof.step()
                except Exception:  # noqa: BLE001
                    pass
            if self.n >= self.steps or now >= self.deadline_ns:
                self._stop(truncated=self.n < self.steps)
                return False
            return True
        return False

    def check_deadline(self) -> None:
        """From the flush poll: a run whose deadline passed without a step boundary stops there."""
        if self.state == "running" and time.time_ns() >= self.deadline_ns:
            self._stop(truncated=True)
        elif self.state in ("warming", "ready") and time.time_ns() >= self.deadline_ns:
            self._finish("expired", "deadline passed before the profile could start")

    def _start(self) -> None:
        c = self.cmd
        d = c.get("dir") or "."
        os.makedirs(d, exist_ok=True)
        self.path = os.path.join(d, trace_name(str(c.get("job")), int(c.get("rank", 0)), self.cmd_id, self.kind))
        if self.kind == "torch":
            factory, acts = _torch_activities()
            self.prof = factory(activities=acts)
            self.prof.start()
            return
        exe = pyspy_binary()
        if exe is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy, or set STEPWATCH_PYSPY)")
        dur = max(1, int((self.deadline_ns - time.time_ns()) / 1e9))
        rate = int(c.get("rate") or PYSPY_RATE)
        self.proc = subprocess.Popen(
            [exe, "record", "--pid", str(os.getpid()), "--format", "raw", "--rate", str(rate), "--duration",
             str(dur), "--nonblocking", "-o", self.path], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, close_fds=True)

    def _stop(self, truncated: bool) -> None:
        self.finished_at = time.time_ns()
        self.state = "finishing"
        if self.kind == "torch":
            try:
                self.prof.stop()
            except Exception as e:  # noqa: BLE001
                self._finish("failed", f"profiler stop failed: {e!r}")
                return
        elif self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGINT)       # py-spy writes what it sampled and exits
            except OSError:
                pass
        note = (f"stopped at the deadline after {self.n} of {self.steps} steps" if truncated else "")
        threading.Thread(target=self._export, args=(note,), name="stepwatch-profile-export", daemon=True).start()

    # --------------------------------------------------------------- helper thread
    def _export(self, note: str) -> None:
        try:
            t0 = time.perf_counter()
            if self.kind == "torch":
                plain = self.path[:-3] if self.path.endswith(".gz") else self.path + ".json"
                self.prof.export_chrome_trace(plain)          # kineto writes plain JSON (C++, milliseconds)
                self.prof = None
                # a child process summarises it and compresses it into self.path
                summary = summarize_in_subprocess(plain, max(self.n, 1), gzip_to=self.path)
            else:
                try:
                    _, err = self.proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    _, err = self.proc.communicate()
                if not os.path.exists(self.path):
                    msg = (err or b"").decode("utf-8", "replace").strip().splitlines()
                    raise RuntimeError("py-spy failed: " + (msg[-1] if msg else f"exit code {self.proc.returncode}"))
                with open(self.path, encoding="utf-8", errors="replace") as f:
                    summary = pyspy_summary(f.read(), max(self.n, 1), int(self.cmd.get("rate") or PYSPY_RATE))
            summary["export_s"] = round(time.perf_counter() - t0, 4)
            summary["step_first"] = self.step_first
            self._finish("ok", note, summary=summary, size=os.path.getsize(self.path))
        except Exception as e:  # noqa: BLE001
            self._finish("failed", f"{e}" if isinstance(e, RuntimeError) else f"export failed: {e!r}")

    def _finish(self, status: str, detail: str = "", summary: dict | None = None, size: int | None = None) -> None:
        self.state = "done"
        ok = status == "ok"
        self.ctl.reply({"cmd_id": self.cmd_id, "status": status, "detail": detail, "kind": self.kind,
                        "uri": ("file://" + os.path.abspath(self.path)) if ok else None, "bytes": size,
                        "summary": summary, "started_at": self.started_at, "finished_at": self.finished_at,
                        "steps": self.n if self.started_at else self.steps, "step_first": self.step_first,
                        "role": self.cmd.get("role"), "reason": self.cmd.get("reason")})
        self.ctl.done(self)


class ProbeControl:
    """The probe's end of the control channel. ``poll`` runs on the training thread from the probe's
    flush; ``reply`` may run on any thread (it uses only this object's own socket)."""

    def __init__(self, probe, header):
        self.probe = probe
        self.header = header               # callable(type, instance, rank) -> bytes of the datagram header
        self.sock: socket.socket | None = None
        self.path = ""
        self.run: ProfileRun | None = None
        self.received = self.replies = 0

    def ensure_bound(self, socket_dir: str) -> str:
        """Bind ``<socket_dir>/probe-<instance>.sock`` once; returns its path ('' when impossible)."""
        if self.sock is not None:
            return self.path
        path = os.path.join(socket_dir, f"{CTL_PREFIX}{self.probe.instance}.sock")
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.setblocking(False)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            old = os.umask(0o177)
            try:
                s.bind(path)
            finally:
                os.umask(old)
            mode = os.environ.get("STEPWATCH_CTL_SOCKET_MODE")
            os.chmod(path, int(mode, 8) if mode else 0o600)
        except OSError:
            return ""
        self.sock, self.path = s, path
        return path

    def close(self, unlink: bool = True) -> None:
        s, self.sock = self.sock, None
        if s is not None:
            try:
                s.close()
            except OSError:
                pass
            if unlink and self.path:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
        self.path = ""

    def poll(self) -> None:
        """Non-blocking: take the commands waiting on the socket (at most a few) and check the running
        profile's deadline."""
        s = self.sock
        if s is not None:
            for _ in range(4):
                try:
                    data = s.recv(65536)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                self.received += 1
                try:
                    cmd = json.loads(data.decode("utf-8"))
                    if not isinstance(cmd, dict):
                        raise ValueError("not an object")
                except (UnicodeDecodeError, ValueError):
                    continue
                self.handle(cmd)
        r = self.run
        if r is not None:
            r.check_deadline()

    def handle(self, cmd: dict) -> None:
        if self.run is not None:
            self.reply({"cmd_id": str(cmd.get("cmd_id")), "status": "busy", "kind": cmd.get("kind"),
                        "detail": f"profile {self.run.cmd_id} is still running in this process",
                        "role": cmd.get("role"), "reason": cmd.get("reason"), "steps": cmd.get("steps")})
            return
        if cmd.get("kind") not in PROFILER_KINDS:
            self.reply({"cmd_id": str(cmd.get("cmd_id")), "status": "failed", "kind": cmd.get("kind"),
                        "detail": f"unknown profile kind {cmd.get('kind')!r}", "role": cmd.get("role"),
                        "reason": cmd.get("reason"), "steps": cmd.get("steps")})
            return
        self.run = ProfileRun(self, cmd)
        self.probe._ctl_active = True

    def on_step(self, step: int) -> None:
        r = self.run
        if r is None or not r.on_step(step):
            self.probe._ctl_active = False

    def done(self, run: ProfileRun) -> None:
        if self.run is run:
            self.run = None
            self.probe._ctl_active = False

    def reply(self, body: dict) -> bool:
        """Send a ``T_PROFILE`` datagram to the agent (retries briefly when its queue is full)."""
        s = self.sock
        if s is None:
            return False
        p = self.probe
        data = self.header(p.instance, p.rank or 0) + json.dumps(body, separators=(",", ":"), default=str).encode()
        tries = 50 if threading.current_thread().name.startswith("stepwatch-profile") else 1   # never wait on training
        for _ in range(tries):
            try:
                s.sendto(data, p._path)
                self.replies += 1
                return True
            except BlockingIOError:
                if tries > 1:
                    time.sleep(0.02)
            except OSError:
                return False
        return False


def _main(argv: list[str]) -> int:
    """``python -m stepwatch.agents.profiling summarize TRACE.json[.gz] STEPS [GZ_OUT]``: the summary
    as JSON on stdout; with ``GZ_OUT`` the trace is also written there gzip-compressed (atomically)
    and the plain ``TRACE`` is removed."""
    import gzip
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
        tmp = out + ".tmp"
        with gzip.open(tmp, "wb", compresslevel=6) as f:
            f.write(raw)
        os.replace(tmp, out)
        if os.path.abspath(out) != os.path.abspath(path):
            os.unlink(path)
    json.dump(summary, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

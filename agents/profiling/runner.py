"""The probe's side of targeted profiling (:mod:`stepwatch.agents.profiling`): :class:`ProbeControl`, the
probe's end of the control socket, and :class:`ProfileRun`, one profile from a step boundary to its
answer. Standard library only at module level (the probe loads it into the training process); torch
only when a ``torch`` profile runs, py-spy as a separate binary."""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

from .protocol import (CTL_DIR, CTL_PREFIX, ENV_PUBLIC, ENV_PUBLIC_FILE, MAX_ENVELOPE, PYSPY_RATE, BadCommand, KeyError_,
                       load_public_keys, open_envelope, safe_job)
from .summary import pyspy_summary, summarize_in_subprocess, trace_name


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
        import torch._inductor.config  # noqa: F401 - the import is the warm-up: its cost paid here, not in start()


def pyspy_binary() -> str | None:
    p = os.environ.get("STEPWATCH_PYSPY")
    if p:
        return p if os.access(p, os.X_OK) else None
    cand = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(cand, os.X_OK):
        return cand
    return shutil.which("py-spy")


PRIVATE_PREFIX = ".stepwatch-u"    # <trace dir>/.stepwatch-u<uid>: where a training process's unfinished traces are


def private_dir(parent: str) -> tuple[str, bool]:
    """This uid's own directory in the (shared) trace directory ``parent``, for every file a profile
    writes before it is finished: ``<parent>/.stepwatch-u<uid>``, created 0700, used only when
    ``lstat`` shows a directory (not a link) owned by this uid. When another user holds that name, a
    fresh ``mkdtemp`` directory there instead; returns (path, True) then (the run removes it). Other
    users of the trace directory can then plant nothing the profiler, kineto or py-spy would follow
    (they write by name). ``parent`` must not be writable by others unless it is sticky (otherwise
    they could rename this directory away and put a link in its place): OSError."""
    st = os.stat(parent)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise OSError(f"trace directory {parent} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by others and not "
                      f"sticky: traces are written only where no other user can replace this process's files "
                      f"(chmod +t it, or make it 0755)")
    uid = os.geteuid()
    p = os.path.join(parent, f"{PRIVATE_PREFIX}{uid}")
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(p)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(p, 0o700)                          # ours, a directory, in a directory only we may rename in
        return p, False
    return tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{uid}-", dir=parent), True


def _unlink_quietly(*paths: str) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


class ProbeLimits:
    """What a probe accepts, from its own environment (never from a command): at most
    ``max_steps`` steps (``STEPWATCH_PROFILE_MAX_STEPS``, 200), a profile of at most ``max_seconds``
    (``STEPWATCH_PROFILE_MAX_S``, 600) from its acceptance whatever the command's deadline, py-spy at
    ``pyspy_rate`` samples/s (``STEPWATCH_PYSPY_RATE``, 200, clamped to 1..1000), traces written only
    under ``trace_dir`` (``STEPWATCH_PROFILE_DIR``, else ``<socket_dir>/profiles``)."""

    def __init__(self, socket_dir: str, env=None):
        env = os.environ if env is None else env
        self.max_steps = _env_int(env, "STEPWATCH_PROFILE_MAX_STEPS", 200, 1, 100_000)
        self.max_seconds = _env_int(env, "STEPWATCH_PROFILE_MAX_S", 600, 1, 86_400)
        self.pyspy_rate = _env_int(env, "STEPWATCH_PYSPY_RATE", PYSPY_RATE, 1, 1000)
        self.trace_dir = os.path.abspath(env.get("STEPWATCH_PROFILE_DIR") or os.path.join(socket_dir, "profiles"))


def _env_int(env, name: str, default: int, lo: int, hi: int) -> int:
    try:
        v = int(env.get(name, default))
    except (TypeError, ValueError):
        v = default
    return min(max(v, lo), hi)


class ProfileRun:
    """One profile in a probe. States: ``warming`` (helper thread prepares the profiler) -> ``ready``
    -> ``running`` (from a step boundary) -> ``finishing`` (trace written off the training thread) ->
    ``done``. ``on_step`` is called at every step boundary by the training thread. ``cmd`` is a
    verified command (:func:`open_envelope`); steps and deadline are clamped by the probe's limits."""

    def __init__(self, ctl: "ProbeControl", cmd: dict, rank: int):
        lim = ctl.limits
        self.ctl, self.cmd, self.rank = ctl, cmd, rank
        self.cmd_id = cmd["cmd_id"]
        self.kind = cmd["kind"]
        self.role = "reference" if rank in cmd["reference"] else "suspect"
        self.steps = max(1, min(int(cmd["steps"]), lim.max_steps))
        self.deadline_ns = min(int(cmd["expires_at"]), time.time_ns() + lim.max_seconds * 1_000_000_000)
        self.rate = lim.pyspy_rate
        self.trace_dir = lim.trace_dir
        self.state = "warming"
        self.n = 0
        self.prof = None
        self.proc = None
        self.path = ""                     # where the trace is published (<trace dir>/<trace_name>)
        self.work, self.own_work = "", False   # private_dir() of this run
        self.tmp = ""                      # the trace until it is finished, in self.work
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
        d = self.trace_dir                                     # the probe's own setting, never the sender's
        os.makedirs(d, exist_ok=True)
        self.path = os.path.join(d, trace_name(self.cmd["job"], self.rank, self.cmd_id, self.kind))
        # every file of the run is written in this uid's private directory under an unpredictable
        # name, and renamed to self.path when finished: nothing in the shared directory is opened by name
        self.work, self.own_work = private_dir(d)
        suffix = ".json.gz" if self.kind == "torch" else ".pyspy.txt"
        self.tmp = os.path.join(self.work, secrets.token_hex(12) + suffix)
        if self.kind == "torch":
            factory, acts = _torch_activities()
            self.prof = factory(activities=acts)
            self.prof.start()
            return
        exe = pyspy_binary()
        if exe is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy, or set STEPWATCH_PYSPY)")
        dur = max(1, int((self.deadline_ns - time.time_ns()) / 1e9))
        self.proc = subprocess.Popen(
            [exe, "record", "--pid", str(os.getpid()), "--format", "raw", "--rate", str(self.rate), "--duration",
             str(dur), "--nonblocking", "-o", self.tmp], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
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
        plain = self.tmp[:-3] if self.kind == "torch" else ""     # <token>.json
        try:
            t0 = time.perf_counter()
            if self.kind == "torch":
                self.prof.export_chrome_trace(plain)          # kineto writes plain JSON (C++, milliseconds)
                self.prof = None
                # a child process summarises it and compresses it into self.tmp
                summary = summarize_in_subprocess(plain, max(self.n, 1), gzip_to=self.tmp)
            else:
                try:
                    _, err = self.proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    _, err = self.proc.communicate()
                if not os.path.exists(self.tmp):
                    msg = (err or b"").decode("utf-8", "replace").strip().splitlines()
                    raise RuntimeError("py-spy failed: " + (msg[-1] if msg else f"exit code {self.proc.returncode}"))
                with open(self.tmp, encoding="utf-8", errors="replace") as f:
                    summary = pyspy_summary(f.read(), max(self.n, 1), self.rate)
            os.chmod(self.tmp, 0o640)                          # the owner and the agent's group, not every tenant
            size = os.path.getsize(self.tmp)
            try:
                os.rename(self.tmp, self.path)                 # replaces a link at self.path, never follows it
            except OSError as e:
                # another user's entry holds the name (a sticky directory keeps it): the trace stays private
                note = "; ".join(x for x in (note, f"{self.path} is taken ({e.strerror}): the trace is at {self.tmp}")
                                 if x)
                self.path = self.tmp
            else:
                if self.own_work:
                    os.rmdir(self.work)
            summary["export_s"] = round(time.perf_counter() - t0, 4)
            summary["step_first"] = self.step_first
            self._finish("ok", note, summary=summary, size=size)
        except Exception as e:  # noqa: BLE001
            _unlink_quietly(*(p for p in (self.tmp, plain) if p))
            if self.own_work:
                try:
                    os.rmdir(self.work)
                except OSError:
                    pass
            self._finish("failed", f"{e}" if isinstance(e, RuntimeError) else f"export failed: {e!r}")

    def _finish(self, status: str, detail: str = "", summary: dict | None = None, size: int | None = None) -> None:
        self.state = "done"
        ok = status == "ok"
        self.ctl.reply({"cmd_id": self.cmd_id, "status": status, "detail": detail, "kind": self.kind,
                        "uri": ("file://" + os.path.abspath(self.path)) if ok else None, "bytes": size,
                        "summary": summary, "started_at": self.started_at, "finished_at": self.finished_at,
                        "steps": self.n if self.started_at else self.steps, "step_first": self.step_first,
                        "role": self.role, "reason": self.cmd["reason"]})
        self.ctl.done(self)


class ProbeControl:
    """The probe's end of the control channel. ``poll`` runs on the training thread from the probe's
    flush; ``reply`` may run on any thread (it uses only this object's own socket). Given what it uses of
    the probe: ``transport`` (``instance``: the socket's name and the replies' header; ``path``: the agent's
    socket), ``identity`` (``rank`` and ``job``: whom a command must name), ``header`` and ``set_active``
    (``set_active(True)`` while a profile runs: it needs the probe to replay at every step end)."""

    SEEN_MAX = 1024                     # command ids remembered (until they expire)
    REFUSAL_REPLY_S = 10.0              # at most one answer per this many seconds to an unverifiable envelope

    def __init__(self, transport, identity, header, set_active):
        self.transport, self.identity = transport, identity
        self.header = header               # callable(instance, rank) -> bytes of the datagram header
        self.set_active = set_active
        self.sock: socket.socket | None = None
        self.path = ""
        self.run: ProfileRun | None = None
        self.received = self.replies = 0
        self.rejected: dict[str, int] = {}
        self.keys: dict | None = None
        self.key_error = ""
        self._keys_loaded = threading.Event()
        self.limits: ProbeLimits | None = None
        self.seen: dict[str, int] = {}
        # commands issued before this process's control channel existed were meant for an earlier process
        # of the rank: ``seen`` does not survive a restart, so such a command sent straight to the new
        # socket (skipping the agent's durable replay log) is refused; the skew allows for the clock
        # of the processor that issued it (STEPWATCH_PROFILE_SKEW_S, 5 s)
        self.t_start_ns = time.time_ns()
        self.skew_ns = _env_int(os.environ, "STEPWATCH_PROFILE_SKEW_S", 5, 0, 3600) * 1_000_000_000
        self._t_refusal = -1e18
        self._held: bytes | None = None     # an envelope that arrived before the keys were loaded

    def ensure_bound(self, socket_dir: str) -> str:
        """Bind ``<socket_dir>/ctl/probe-<instance>.sock`` (or ``<socket_dir>/probe-<instance>.sock``
        without a writable ``ctl`` directory) once; returns its path ('' when impossible). The public
        keys are loaded on a helper thread (``cryptography`` is not imported on the training thread)."""
        if self.sock is not None:
            return self.path
        if self.limits is None:
            self.limits = ProbeLimits(socket_dir)
            threading.Thread(target=self._load_keys, name="stepwatch-profile-keys", daemon=True).start()
        sub = os.path.join(socket_dir, CTL_DIR)
        d = sub if os.path.isdir(sub) and os.access(sub, os.W_OK | os.X_OK) else socket_dir
        path = os.path.join(d, f"{CTL_PREFIX}{self.transport.instance}.sock")
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.setblocking(False)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            old = os.umask(0o117)
            try:
                s.bind(path)
            finally:
                os.umask(old)
            mode = os.environ.get("STEPWATCH_CTL_SOCKET_MODE")
            os.chmod(path, int(mode, 8) if mode else 0o660)
        except (OSError, ValueError):
            return ""
        self.sock, self.path = s, path
        return path

    def _load_keys(self) -> None:
        try:
            self.keys = load_public_keys()
            if self.keys is None:
                self.key_error = (f"no public key in the training process: set {ENV_PUBLIC} or {ENV_PUBLIC_FILE} "
                                  f"(docs/profiling.md)")
        except Exception as e:  # noqa: BLE001 - KeyError_, or cryptography missing
            self.key_error = f"{e}" if isinstance(e, KeyError_) else f"cannot verify commands: {e!r}"
        self._keys_loaded.set()

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
        if self._held is not None and self._keys_loaded.is_set():
            held, self._held = self._held, None
            self.handle(held)
        if s is not None:
            for _ in range(4):
                try:
                    data = s.recv(MAX_ENVELOPE + 1)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                self.received += 1
                self.handle(data)
        r = self.run
        if r is not None:
            r.check_deadline()

    def _refuse(self, reason: str, detail: str, cmd: dict | None = None, data: bytes = b"") -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if cmd is None:                                 # unverifiable: answered at most every REFUSAL_REPLY_S
            now = time.monotonic()
            if now - self._t_refusal < self.REFUSAL_REPLY_S:
                return
            self._t_refusal = now
            self.reply({"cmd_id": None, "envelope": hashlib.sha256(bytes(data)).hexdigest()[:16],
                        "status": "rejected", "detail": f"the probe refused the command: {reason}: {detail}"})
            return
        self.reply({"cmd_id": cmd["cmd_id"], "status": "rejected", "kind": cmd["kind"], "steps": cmd["steps"],
                    "detail": f"the probe refused the command: {reason}: {detail}", "reason": cmd["reason"]})

    def handle(self, data: bytes) -> None:
        """One envelope from the control socket: verified with the probe's own keys, then checked
        against its identity, its seen ids and its limits."""
        if not self._keys_loaded.is_set():          # the helper thread is still loading the keys: next poll
            self._held = data
            return
        if not self.keys:
            self._refuse("no_key", self.key_error or "no public key", None, data)
            return
        try:
            cmd = open_envelope(data, self.keys)
        except BadCommand as e:
            self._refuse(e.reason, e.detail, None, data)
            return
        rank = self.identity.rank
        now = time.time_ns()
        if rank is None or rank not in cmd["ranks"]:
            self._refuse("not_this_rank", f"the command names ranks {cmd['ranks'][:8]}, this is rank {rank}", cmd)
            return
        job = self.identity.job
        if job and safe_job(job) != cmd["job"]:
            self._refuse("not_this_job", "the command is for another job", cmd)
            return
        if cmd["issued_at"] < self.t_start_ns - self.skew_ns:
            self._refuse("before_start", f"command {cmd['cmd_id']} was issued "
                                         f"{(self.t_start_ns - cmd['issued_at']) / 1e9:.0f} s before this process "
                                         f"started (an earlier process of the rank, or a replay)", cmd)
            return
        if cmd["expires_at"] <= now:
            self.reply({"cmd_id": cmd["cmd_id"], "status": "expired", "kind": cmd["kind"], "steps": cmd["steps"],
                        "detail": "expired before it reached the probe", "reason": cmd["reason"]})
            return
        for k in [k for k, e in self.seen.items() if e <= now]:
            del self.seen[k]
        if cmd["cmd_id"] in self.seen:
            self._refuse("replay", f"command {cmd['cmd_id']} was already received", cmd)
            return
        if len(self.seen) >= self.SEEN_MAX:
            self.seen.pop(min(self.seen, key=self.seen.get))
        self.seen[cmd["cmd_id"]] = cmd["expires_at"]
        if self.run is not None:
            self.reply({"cmd_id": cmd["cmd_id"], "status": "busy", "kind": cmd["kind"],
                        "detail": f"profile {self.run.cmd_id} is still running in this process",
                        "role": "reference" if rank in cmd["reference"] else "suspect", "reason": cmd["reason"],
                        "steps": cmd["steps"]})
            return
        self.run = ProfileRun(self, cmd, rank)
        self.set_active(True)

    def on_step(self, step: int) -> None:
        r = self.run
        if r is None or not r.on_step(step):
            self.set_active(False)

    def done(self, run: ProfileRun) -> None:
        if self.run is run:
            self.run = None
            self.set_active(False)

    def reply(self, body: dict) -> bool:
        """Send a ``T_PROFILE`` datagram to the agent (retries briefly when its queue is full)."""
        s = self.sock
        if s is None:
            return False
        tr = self.transport
        data = self.header(tr.instance, self.identity.rank or 0) + json.dumps(body, separators=(",", ":"), default=str).encode()
        tries = 50 if threading.current_thread().name.startswith("stepwatch-profile") else 1   # never wait on training
        for _ in range(tries):
            try:
                s.sendto(data, tr.path)
                self.replies += 1
                return True
            except BlockingIOError:
                if tries > 1:
                    time.sleep(0.02)
            except OSError:
                return False
        return False

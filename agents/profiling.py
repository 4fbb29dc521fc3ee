"""Targeted fine-grained profiling (docs/profiling.md): signing, summaries, diffs, and the probe-side runner.

Everything here imports only the standard library at module level (the probe loads it into the
training process); ``cryptography`` is imported when a key is loaded or a command verified (on a
helper thread in the probe), torch only when a ``torch`` profile runs, and ``py-spy`` is a separate
binary.

Commands. A command asks one node's agent to profile ``steps`` steps of some ranks of a job. It
travels as a *sealed envelope* (:func:`seal`), the same bytes on the ``control`` topic and on the
probe's control socket::

    b"SWC2" | key id (8 bytes: sha256 of the raw public key) | Ed25519 signature (64) | body

``body`` is the command as canonical JSON (:func:`canonical`, at most :data:`MAX_BODY` bytes). The
signature covers ``b"stepwatch-control/2\\0" + key id + body``. :func:`open_envelope` checks the
length, the magic, the key id and the signature **before** it decodes anything of the body, then
:func:`parse_command` checks every field's type and range. The processor (and ``stepwatch profile``)
hold the private key (:func:`load_private_key`: ``STEPWATCH_PROFILING_PRIVATE_KEY[_FILE]``); node
agents and probes hold only public keys (:func:`load_public_keys`: ``STEPWATCH_PROFILING_PUBLIC_KEY[_FILE]``,
several for a rotation), so a compromised node cannot forge commands for the others. Keys are never
logged or put into any row.

Probe side. :class:`ProbeControl` owns a non-blocking ``AF_UNIX``/``SOCK_DGRAM`` socket
``<socket_dir>/ctl/probe-<instance>.sock`` (``<socket_dir>/probe-<instance>.sock`` when there is no
writable ``ctl`` directory; mode 0660, or ``STEPWATCH_CTL_SOCKET_MODE``), announced in the probe's
hello as ``ctl``. The probe polls it with one non-blocking ``recv`` when it flushes (at most every
``flush_ms``), never per step. It verifies each envelope itself with its own public keys, accepts only
commands for its own job and rank that it has not seen, and clamps them (steps, deadline, py-spy rate:
:class:`ProbeLimits`); traces go only to its own trace directory (``STEPWATCH_PROFILE_DIR``). An
accepted command becomes a :class:`ProfileRun`: it starts at the first step boundary after the profiler
is ready, profiles exactly ``steps`` steps (or stops at the deadline, whichever comes first), then
writes the trace and its summary on a background thread and answers the agent with a ``T_PROFILE``
datagram (header + JSON).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

ENV_PRIVATE = "STEPWATCH_PROFILING_PRIVATE_KEY"
ENV_PRIVATE_FILE = "STEPWATCH_PROFILING_PRIVATE_KEY_FILE"
ENV_PUBLIC = "STEPWATCH_PROFILING_PUBLIC_KEY"
ENV_PUBLIC_FILE = "STEPWATCH_PROFILING_PUBLIC_KEY_FILE"
OLD_ENV = ("STEPWATCH_PROFILING_KEY", "STEPWATCH_PROFILING_KEY_FILE")      # the shared HMAC secret of old
PROFILER_KINDS = ("torch", "py-spy")
STATUSES = ("ok", "failed", "rejected", "expired", "busy")
SIGNED_FIELDS = ("cmd_id", "job", "node", "ranks", "reference", "steps", "kind", "reason", "issued_at", "expires_at")
CTL_PREFIX = "probe-"
CTL_DIR = "ctl"                  # sub-directory of the socket directory where probes bind (see docs/limits.md)
TOP_N = 25                       # entries kept in a summary
PYSPY_RATE = 200                 # py-spy samples per second (the default; STEPWATCH_PYSPY_RATE, at most 1000)

MAGIC = b"SWC2"
DOMAIN = b"stepwatch-control/2\0"
KEY_ID_LEN = 8
SIG_LEN = 64
ENVELOPE_HDR = len(MAGIC) + KEY_ID_LEN + SIG_LEN
MAX_BODY = 4096                  # canonical JSON of one command
MAX_ENVELOPE = ENVELOPE_HDR + MAX_BODY
MAX_RANKS = 256                  # ranks one command may address
MAX_KEYS = 8                     # public keys trusted at once (a rotation needs two)
CMD_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
INT64_MAX = (1 << 63) - 1
RANK_LIMIT = 1 << 31


class KeyError_(ValueError):
    """No usable profiling key."""


class BadCommand(ValueError):
    """A control envelope or command that is refused; ``reason`` is the metric label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


# ---------------------------------------------------------------------------- keys

def _ed():
    from cryptography.hazmat.primitives.asymmetric import ed25519
    return ed25519


def _raw_public(pub) -> bytes:
    from cryptography.hazmat.primitives import serialization as ser
    return pub.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)


def key_id(pub) -> bytes:
    """The 8 bytes that name a public key in an envelope."""
    return hashlib.sha256(_raw_public(pub)).digest()[:KEY_ID_LEN]


def _old_env_error(env) -> None:
    old = [k for k in OLD_ENV if env.get(k)]
    if old:
        raise KeyError_(f"{old[0]} (a shared HMAC secret) is no longer used: commands are signed with Ed25519. "
                        f"Create a key pair with 'stepwatch profile keygen DIR'; give the processor "
                        f"{ENV_PRIVATE_FILE}, agents and training processes {ENV_PUBLIC} (see docs/profiling.md)")


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16)
    except OSError as e:
        raise KeyError_(f"cannot read the profiling {what} key file {path}: {e.strerror}") from None


def _key_setting(env, name: str, file_name: str, path: str | None, what: str) -> bytes | None:
    """The key text: ``$name``, else the file ``path`` or ``$file_name``; None (after refusing the old
    shared-secret variables) when none is set."""
    raw = env.get(name)
    raw = raw.encode() if isinstance(raw, str) else raw
    p = path or env.get(file_name)
    if not raw and p:
        raw = _read(p, what)
    if not raw:
        _old_env_error(env)
        return None
    return raw


def load_private_key(path: str | None = None, env=None):
    """The Ed25519 private key that signs commands (processor, ``stepwatch profile``):
    ``$STEPWATCH_PROFILING_PRIVATE_KEY`` (base64 of the 32-byte seed, or PEM), else the file ``path``
    or ``$STEPWATCH_PROFILING_PRIVATE_KEY_FILE`` (PEM PKCS#8 or base64). None when none is set;
    KeyError_ (never quoting the key) when it cannot be read or parsed."""
    raw = _key_setting(os.environ if env is None else env, ENV_PRIVATE, ENV_PRIVATE_FILE, path, "private")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        if raw.startswith(b"-----BEGIN"):
            from cryptography.hazmat.primitives import serialization as ser
            k = ser.load_pem_private_key(raw, password=None)
            if not isinstance(k, _ed().Ed25519PrivateKey):
                raise ValueError("not an Ed25519 key")
            return k
        seed = base64.b64decode(raw, validate=True)
        if len(seed) != 32:
            raise ValueError("not 32 bytes")
        return _ed().Ed25519PrivateKey.from_private_bytes(seed)
    except (ValueError, TypeError) as e:
        raise KeyError_(f"the profiling private key is not an Ed25519 key in PEM or base64 ({type(e).__name__})") \
            from None


def _parse_public(text: bytes) -> list:
    text = text.strip()
    out = []
    if b"-----BEGIN" in text:
        from cryptography.hazmat.primitives import serialization as ser
        for block in re.findall(rb"-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----", text, re.S):
            k = ser.load_pem_public_key(block)
            if not isinstance(k, _ed().Ed25519PublicKey):
                raise ValueError("not an Ed25519 key")
            out.append(k)
        return out
    for part in re.split(rb"[\s,]+", text):
        if part:
            raw = base64.b64decode(part, validate=True)
            if len(raw) != 32:
                raise ValueError("not 32 bytes")
            out.append(_ed().Ed25519PublicKey.from_public_bytes(raw))
    return out


def load_public_keys(path: str | None = None, env=None) -> dict | None:
    """The public keys that verify commands (agent, probe), by key id: ``$STEPWATCH_PROFILING_PUBLIC_KEY``
    (base64 of the 32-byte key, several separated by commas or spaces; or PEM), else the file ``path``
    or ``$STEPWATCH_PROFILING_PUBLIC_KEY_FILE``. None when none is set; KeyError_ when unparsable."""
    raw = _key_setting(os.environ if env is None else env, ENV_PUBLIC, ENV_PUBLIC_FILE, path, "public")
    if raw is None:
        return None
    try:
        keys = _parse_public(raw)
    except (ValueError, TypeError) as e:
        raise KeyError_(f"the profiling public key is not an Ed25519 key in base64 or PEM ({type(e).__name__})") \
            from None
    if not keys or len(keys) > MAX_KEYS:
        raise KeyError_(f"the profiling public key setting holds {len(keys)} keys (1 to {MAX_KEYS})")
    return {key_id(k): k for k in keys}


def public_key_text(private_key) -> str:
    """The base64 public key of a private key (what agents and probes are given)."""
    return base64.b64encode(_raw_public(private_key.public_key())).decode()


def keygen() -> tuple[bytes, str]:
    """A new key pair: (private key as PEM PKCS#8, public key as base64)."""
    from cryptography.hazmat.primitives import serialization as ser
    k = _ed().Ed25519PrivateKey.generate()
    pem = k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
    return pem, public_key_text(k)


# ---------------------------------------------------------------------------- commands: seal, open, check

def canonical(cmd: dict) -> bytes:
    """The body of an envelope: the signed fields as sorted compact ASCII JSON (ranks sorted, times
    as int ns)."""
    d = {}
    for k in SIGNED_FIELDS:
        v = cmd.get(k)
        if k in ("ranks", "reference"):
            v = sorted(int(x) for x in (v or []))
        elif k in ("steps", "issued_at", "expires_at"):
            v = int(v) if v is not None else None
        else:
            v = "" if v is None else str(v)
        d[k] = v
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


CONTENT_TYPE = "application/vnd.stepwatch.control+ed25519"


def control_headers() -> list[tuple[str, bytes]]:
    """The Kafka headers of a ``control`` message (its value: :func:`seal`)."""
    return [("content-type", CONTENT_TYPE.encode()), ("schema", b"control/2")]


def seal(cmd: dict, private_key) -> bytes:
    """The envelope of ``cmd`` signed with ``private_key``."""
    body = canonical(cmd)
    if len(body) > MAX_BODY:
        raise ValueError(f"command body of {len(body)} bytes (at most {MAX_BODY})")
    kid = key_id(private_key.public_key())
    return MAGIC + kid + private_key.sign(DOMAIN + kid + body) + body


def open_envelope(data, public_keys: dict) -> dict:
    """Verify an envelope, then decode and check its command; raises :class:`BadCommand` with reason
    ``too_large``, ``bad_envelope``, ``unknown_key``, ``bad_signature`` (nothing of the body decoded
    yet) or ``bad_command`` (signed but malformed)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadCommand("bad_envelope", "not bytes")
    n = len(data)
    if n > MAX_ENVELOPE:
        raise BadCommand("too_large", f"{n} bytes (at most {MAX_ENVELOPE})")
    if n <= ENVELOPE_HDR or bytes(data[:4]) != MAGIC:
        raise BadCommand("bad_envelope", "not a sealed command (stepwatch control/2)")
    data = bytes(data)
    kid = data[4:4 + KEY_ID_LEN]
    pub = public_keys.get(kid) if public_keys else None
    if pub is None:
        raise BadCommand("unknown_key", "signed with a key this node does not trust")
    from cryptography.exceptions import InvalidSignature
    body = data[ENVELOPE_HDR:]
    try:
        pub.verify(data[4 + KEY_ID_LEN:ENVELOPE_HDR], DOMAIN + kid + body)
    except InvalidSignature:
        raise BadCommand("bad_signature", "signature does not match (wrong key or altered command)") from None
    return parse_command(body)


def _int(v, lo: int, hi: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadCommand("bad_command", f"{what} must be an integer in [{lo}, {hi}]")
    return v


def _str(v, rx, what: str) -> str:
    if not isinstance(v, str) or not rx.match(v):
        raise BadCommand("bad_command", f"bad {what}")
    return v


def parse_command(body: bytes) -> dict:
    """The command of a verified body, every field checked (types, lengths, ranges)."""
    try:
        d = json.loads(body.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadCommand("bad_command", "body is not ASCII JSON") from None
    if not isinstance(d, dict):
        raise BadCommand("bad_command", "body is not an object")
    ranks = d.get("ranks")
    ref = d.get("reference")
    for name, lst in (("ranks", ranks), ("reference", ref)):
        if not isinstance(lst, list) or len(lst) > MAX_RANKS:
            raise BadCommand("bad_command", f"{name} must be a list of at most {MAX_RANKS} ranks")
        for r in lst:
            _int(r, 0, RANK_LIMIT - 1, name[:-1] if name == "ranks" else "reference rank")
    reason = d.get("reason")
    if not isinstance(reason, str) or len(reason) > 256:
        raise BadCommand("bad_command", "reason must be a string of at most 256 characters")
    if d.get("kind") not in PROFILER_KINDS:
        raise BadCommand("bad_command", f"unknown kind {str(d.get('kind'))[:32]!r}")
    cmd = {"cmd_id": _str(d.get("cmd_id"), CMD_ID_RE, "cmd_id"), "job": _str(d.get("job"), JOB_RE, "job"),
           "node": _str(d.get("node"), NODE_RE, "node"), "ranks": sorted(set(ranks)), "reference": sorted(set(ref)),
           "steps": _int(d.get("steps"), 1, 1_000_000, "steps"), "kind": d["kind"], "reason": reason,
           "issued_at": _int(d.get("issued_at"), 0, INT64_MAX, "issued_at"),
           "expires_at": _int(d.get("expires_at"), 0, INT64_MAX, "expires_at")}
    return cmd


def new_command(job: str, node: str, ranks, steps: int, kind: str = "torch", reason: str = "",
                reference=(), ttl_s: float = 120.0, now_ns: int | None = None, cmd_id: str | None = None) -> dict:
    """A command (seal it with :func:`seal`). ``expires_at`` = now + ``ttl_s``: the command is refused
    after it, and a profile still running at that instant stops."""
    if kind not in PROFILER_KINDS:
        raise ValueError(f"unknown profile kind {kind!r} (one of {', '.join(PROFILER_KINDS)})")
    now = time.time_ns() if now_ns is None else int(now_ns)
    return {"cmd_id": cmd_id or uuid.uuid4().hex[:16], "job": job, "node": node,
            "ranks": sorted(int(r) for r in ranks), "steps": int(steps), "kind": kind, "reason": reason or "",
            "issued_at": now, "expires_at": now + int(ttl_s * 1e9), "reference": sorted(int(r) for r in reference)}


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
        d = self.trace_dir                                     # the probe's own setting, never the sender's
        os.makedirs(d, exist_ok=True)
        self.path = os.path.join(d, trace_name(self.cmd["job"], self.rank, self.cmd_id, self.kind))
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
                    summary = pyspy_summary(f.read(), max(self.n, 1), self.rate)
            try:
                os.chmod(self.path, 0o640)                     # the owner and the agent's group, not every tenant
            except OSError:
                pass
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
                        "role": self.role, "reason": self.cmd["reason"]})
        self.ctl.done(self)


class ProbeControl:
    """The probe's end of the control channel. ``poll`` runs on the training thread from the probe's
    flush; ``reply`` may run on any thread (it uses only this object's own socket)."""

    SEEN_MAX = 1024                     # command ids remembered (until they expire)
    REFUSAL_REPLY_S = 10.0              # at most one answer per this many seconds to an unverifiable envelope

    def __init__(self, probe, header):
        self.probe = probe
        self.header = header               # callable(type, instance, rank) -> bytes of the datagram header
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
        path = os.path.join(d, f"{CTL_PREFIX}{self.probe.instance}.sock")
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
        p = self.probe
        rank = p.rank
        now = time.time_ns()
        if rank is None or rank not in cmd["ranks"]:
            self._refuse("not_this_rank", f"the command names ranks {cmd['ranks'][:8]}, this is rank {rank}", cmd)
            return
        job = getattr(p, "job", None)
        if job and safe_job(job) != cmd["job"]:
            self._refuse("not_this_job", "the command is for another job", cmd)
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


_UNSAFE_JOB = re.compile(r"[^A-Za-z0-9._:@+-]")


def safe_job(job: str | None, default: str = "default") -> str:
    """A job id usable as a folder name (``JOB_RE``, = ``stepwatch.schema.JOB_RE``): unsafe characters
    become '_'. The job id the agent gives a probe's job; here (standard library only) so that the
    probe, the agent and its control channel share one copy."""
    j = (job or "").strip() or default
    if JOB_RE.match(j):
        return j
    j = _UNSAFE_JOB.sub("_", j)
    if not j[:1].isalnum():
        j = "j" + j
    return j[:128]


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

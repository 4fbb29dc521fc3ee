"""Profiling's protocol: the Ed25519 keys, the sealed command envelope and the command's checks
(:mod:`stepwatch.agents.profiling`, docs/profiling.md). Standard library only at module level;
``cryptography`` is imported when a key is loaded or a command sealed or verified."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
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
CMD_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")        # \Z, not $: "$" matches before a final newline
JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}\Z")
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")
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
        if what == "private":
            from stepwatch import secretfile
            secretfile.check(p, "the private key file" if path else file_name)
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
    if not isinstance(v, str) or not rx.fullmatch(v):
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


_UNSAFE_JOB = re.compile(r"[^A-Za-z0-9._:@+-]")


def safe_job(job: str | None, default: str = "default") -> str:
    """A job id usable as a folder name (``JOB_RE``, = ``stepwatch.wire.tables.JOB_RE``): unsafe characters
    become '_'. The job id the agent gives a probe's job; here (standard library only) so that the
    probe, the agent and its control channel share one copy."""
    j = (job or "").strip() or default
    if JOB_RE.fullmatch(j):
        return j
    j = _UNSAFE_JOB.sub("_", j)
    if not j[:1].isalnum():
        j = "j" + j
    return j[:128]

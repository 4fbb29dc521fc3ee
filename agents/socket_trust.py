"""The node agent's ingress contract (docs/limits.md, "Agent, control plane and spool"): who may send
on ``agent.sock`` and what a hello may claim.

- **Who.** The socket file has mode 0660 (``--socket-mode``) and the agent's group, or the group given
  with ``--socket-group``: only that group's members (the chart gives training pods the agent's gid as a
  supplemental group) and root can send. The socket has ``SO_PASSCRED`` set, so the kernel attaches the
  sender's pid, uid and gid (``SCM_CREDENTIALS``) to every datagram: a sender cannot choose them
  without ``CAP_SYS_ADMIN``/``CAP_SETUID``. ``--allow-uid``/``--allow-gid`` narrow the senders further.
- **What.** :func:`check_hello` range-checks a hello (rank < world size <= ``max_world_size``, job
  and node names, the name table, the topology integers) and returns a cleaned copy: a hello that
  would make an Arrow table fail later is refused here, counted, and never stored.
- **Speaking for others.** The agent binds each probe instance to the (pid, uid) that sent its hello
  (:class:`Peer`): frames of that instance from another process are dropped (``peer_mismatch``), and
  a hello for a (job, rank) that a live instance of another process holds is refused
  (``identity_conflict``) until that instance falls silent.
- **Speaking for another job.** A job is owned on this node by the first sender whose hello names it
  (:func:`owner_of`): its uid and its pod (Kubernetes), Slurm job or else whole cgroup, read from
  ``$HOST_PROC/<pid>/cgroup``, or the digest of the job token it presents (``STEPWATCH_JOB_TOKEN``).
  A hello for that job from another owner is refused (``job_not_owned``) while one of the owner's
  instances of the job is live (heard within 60 s, its process still there).
"""
from __future__ import annotations

import collections
import hashlib
import math
import os
import re
import socket
import struct
import time
from dataclasses import dataclass, field

UCRED = struct.Struct("iII")                          # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(UCRED.size)
SO_PASSCRED = getattr(socket, "SO_PASSCRED", 16)
SCM_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", 2)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")     # \Z: '$' would let a final newline in
MAX_NAMES = 4096                                      # entries of a hello's name table (the probe keeps 1,024)
MAX_NAME = 256                                        # characters of one op/group/phase name
MAX_STR = 256                                         # device, dtype, framework ...
MAX_JOB_IN = 512                                      # a job name longer than this is refused, not shortened
MAX_TOKEN = 256                                       # characters of a hello's job token
JOB_BINDINGS = ("cgroup", "uid", "none")
# a Kubernetes pod's cgroup (cgroupfs: pod<uid>; systemd: kubepods-<qos>-pod<uid with _>.slice) and a Slurm job's
_POD_CG = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_SLURM_CG = re.compile(r"(?:^|/)(job_\d+)(?:/|$)")


@dataclass(frozen=True)
class Peer:
    """Who sent a datagram, as the kernel says (``SCM_CREDENTIALS``)."""

    pid: int
    uid: int
    gid: int
    scope: str | None = field(default=None, compare=False)   # the sender's cgroup scope, when read (cgroup_scope)


@dataclass
class IngressLimits:
    """Bounds of the agent's socket. Defaults fit a node of a 100,000-rank job."""

    max_world_size: int = 1 << 20          # a hello's world_size (and so rank) above this is refused
    max_queue_bytes: int = 64 << 20        # datagrams received and not yet decoded
    max_pending_bytes: int = 16 << 20      # datagrams of instances whose hello has not come yet
    max_instances: int = 4096              # probe instances known at once (a node runs a few dozen)
    allow_uids: frozenset | None = None    # None: every uid the socket's permissions let in
    allow_gids: frozenset | None = None
    job_binding: str = "cgroup"            # who owns a job on this node: uid + pod/Slurm job/cgroup, uid, none

    def __post_init__(self):
        if self.job_binding not in JOB_BINDINGS:
            raise ValueError(f"job_binding {self.job_binding!r} is not one of {', '.join(JOB_BINDINGS)}")

    def allowed(self, peer: Peer | None) -> bool:
        if peer is None:
            return True
        if self.allow_uids is not None and peer.uid not in self.allow_uids and peer.uid != 0:
            return False
        if self.allow_gids is not None and peer.gid not in self.allow_gids and peer.uid != 0:
            return False
        return True


def enable_passcred(sock: socket.socket) -> bool:
    """Ask the kernel for the sender's credentials with every datagram (Linux)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
        return True
    except OSError:
        return False


def recv_with_peer(sock: socket.socket, bufsize: int = 65536) -> tuple[bytes, Peer | None]:
    """One datagram and its sender's credentials (None where the kernel attached none)."""
    data, anc, _flags, _addr = sock.recvmsg(bufsize, _CMSG_SPACE)
    for level, typ, cdata in anc:
        if level == socket.SOL_SOCKET and typ == SCM_CREDENTIALS and len(cdata) >= UCRED.size:
            pid, uid, gid = UCRED.unpack_from(cdata)
            return data, Peer(pid, uid, gid)
    return data, None


def host_proc() -> str:
    return os.environ.get("HOST_PROC") or "/proc"


def cgroup_scope(pid: int, proc: str | None = None) -> str:
    """The scope a sender's cgroup puts it in: ``pod<uid>`` (Kubernetes: every container of a pod),
    ``job_<id>`` (Slurm: every step and task of a job), else the whole of ``/proc/<pid>/cgroup`` (a
    container, a systemd session). ``?`` when it cannot be read (pid 0: the agent does not share the
    sender's PID namespace; or the process is gone): ``?`` never equals a scope that was read."""
    if pid <= 0:
        return "?"
    try:
        with open(os.path.join(proc or host_proc(), str(pid), "cgroup")) as f:
            text = f.read(65536)
    except OSError:
        return "?"
    paths = [ln.split(":", 2)[2] for ln in text.splitlines() if ln.count(":") >= 2]
    for path in paths:
        m = _POD_CG.search(path)
        if m:
            return "pod" + m.group(1).replace("_", "-")
    for path in paths:
        m = _SLURM_CG.search(path)
        if m:
            return m.group(1)
    return "cgroup:" + "|".join(sorted(set(paths))) if paths else "?"


class ScopeCache:
    """``cgroup_scope`` per pid, read at most once per ``ttl_s`` (bounded: a flood of hellos of made-up
    senders costs one read per pid). Read on the receiver thread as the datagram arrives, so a sender
    that exits right after sending is still placed."""

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 4096):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._d: collections.OrderedDict[int, tuple[float, str]] = collections.OrderedDict()

    def get(self, pid: int, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        hit = self._d.get(pid)
        if hit is not None and now - hit[0] <= self.ttl_s:
            return hit[1]
        scope = cgroup_scope(pid)
        self._d[pid] = (now, scope)
        self._d.move_to_end(pid)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)
        return scope


def owner_of(peer: Peer | None, token: str | None, binding: str) -> str | None:
    """Who a hello speaks as, for job ownership: the digest of its job token when it presents one
    (every pod of a job that shares the token shares the job), else by ``binding``: ``cgroup`` = uid
    and cgroup scope, ``uid`` = uid alone. None: no binding (``none``, or no credentials)."""
    if binding == "none":
        return None
    if token:
        return "token:" + hashlib.sha256(token.encode()).hexdigest()[:32]
    if peer is None:
        return None
    if binding == "uid":
        return f"uid:{peer.uid}"
    scope = peer.scope if peer.scope is not None else cgroup_scope(peer.pid)
    return f"uid:{peer.uid} {scope}"


def describe_owner(owner: str | None) -> str:
    """An owner key for a log line or error (a token's digest is shown as 'a job token')."""
    if owner is None:
        return "anyone"
    return "the holders of a job token" if owner.startswith("token:") else owner[:200]


def resolve_group(group) -> int | None:
    """A gid from a number or a group name (None: leave the socket's group as created)."""
    if group is None or group == "":
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    import grp
    return grp.getgrnam(str(group)).gr_gid


def _int_ok(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def check_hello(hello: dict, limits: IngressLimits) -> dict:
    """A cleaned copy of a hello whose every field the agent stores is within range; raises ValueError
    naming the first bad field (the hello is then refused and counted as a bad datagram)."""
    if not isinstance(hello, dict):
        raise ValueError("hello: not an object")
    rank, ws = hello.get("rank"), hello.get("world_size")
    if not _int_ok(ws, 1, min(limits.max_world_size, INT32_MAX)):
        raise ValueError(f"hello: world_size {str(ws)[:24]!r} not in 1..{limits.max_world_size}")
    if not _int_ok(rank, 0, ws - 1):
        raise ValueError(f"hello: rank {str(rank)[:24]!r} not in 0..world_size-1 ({ws - 1})")
    job = hello.get("job")
    if job is not None and (not isinstance(job, str) or len(job) > MAX_JOB_IN):
        raise ValueError("hello: job is not a string of at most 512 characters")
    node = hello.get("node")
    if node not in (None, "") and (not isinstance(node, str) or not NODE_RE.fullmatch(node)):
        raise ValueError("hello: node is not a host name (letters, digits, '.', '_', '-'; at most 253)")
    names = hello.get("names") or {}
    if not isinstance(names, dict) or len(names) > MAX_NAMES:
        raise ValueError(f"hello: names is not an object of at most {MAX_NAMES} entries")
    clean_names = {}
    for k, v in names.items():
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 5 and isinstance(v, str) and len(v) <= MAX_NAME):
            raise ValueError("hello: names maps small integers to names of at most 256 characters")
        clean_names[k] = v
    out = dict(hello, names=clean_names)
    tok = out.pop("job_token", None)                 # never stored with the hello (nor logged)
    if tok is not None and not (isinstance(tok, str) and 0 < len(tok) <= MAX_TOKEN):
        raise ValueError(f"hello: job_token is not a string of 1..{MAX_TOKEN} characters")
    if tok is not None:
        out["_token"] = tok
    for k in ("dp", "tp", "pp", "ep", "cp"):
        v = out.get(k)
        if v is not None and not _int_ok(v, 0, INT32_MAX):
            raise ValueError(f"hello: {k} is not an integer in 0..{INT32_MAX}")
    for k in ("slurm_job", "slurm_step"):            # the Slurm job and step (uint32): sacct's JobID
        v = out.get(k)
        if v is not None and not _int_ok(v, 0, 2**32 - 1):
            raise ValueError(f"hello: {k} {str(v)[:24]!r} is not an integer in 0..{2**32 - 1}")
    mp = out.get("model_params")
    if mp is not None and not _int_ok(mp, 0, INT64_MAX):
        raise ValueError("hello: model_params is not an integer in int64 range")
    for k in ("model_flops_per_token", "model_flops_per_sample"):
        v = out.get(k)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                  and 0 <= v < 1e30):
            out.pop(k)
    for k in ("device", "device_type", "dtype", "framework"):
        v = out.get(k)
        if v is not None and not (isinstance(v, str) and len(v) <= MAX_STR):
            out.pop(k)
    if out.get("flops_source") not in (None, "user", "counted", "analytic"):
        out.pop("flops_source")                       # (only these three: agents/probe/flops.py)
    gs = out.get("group_sizes")
    if gs is not None:
        if isinstance(gs, dict) and len(gs) <= MAX_NAMES:
            out["group_sizes"] = {k: v for k, v in gs.items() if isinstance(k, str) and len(k) <= MAX_NAME
                                  and _int_ok(v, 1, INT32_MAX)}
        else:
            out.pop("group_sizes")
    ctl = out.get("ctl")
    if ctl is not None and not (isinstance(ctl, str) and len(ctl) <= 512):
        out.pop("ctl")
    return out


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (as the agent sees pids; 0: unknown -> True)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["Peer", "IngressLimits", "enable_passcred", "recv_with_peer", "resolve_group", "check_hello", "pid_alive",
           "cgroup_scope", "ScopeCache", "owner_of", "describe_owner"]

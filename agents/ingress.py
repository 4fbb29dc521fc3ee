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
"""
from __future__ import annotations

import math
import os
import re
import socket
import struct
from dataclasses import dataclass

UCRED = struct.Struct("iII")                          # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(UCRED.size)
SO_PASSCRED = getattr(socket, "SO_PASSCRED", 16)
SCM_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", 2)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
MAX_NAMES = 4096                                      # entries of a hello's name table (the probe keeps 1,024)
MAX_NAME = 256                                        # characters of one op/group/phase name
MAX_STR = 256                                         # device, dtype, framework ...
MAX_JOB_IN = 512                                      # a job name longer than this is refused, not shortened


@dataclass(frozen=True)
class Peer:
    """Who sent a datagram, as the kernel says (``SCM_CREDENTIALS``)."""

    pid: int
    uid: int
    gid: int


@dataclass
class IngressLimits:
    """Bounds of the agent's socket. Defaults fit a node of a 100,000-rank job."""

    max_world_size: int = 1 << 20          # a hello's world_size (and so rank) above this is refused
    max_queue_bytes: int = 64 << 20        # datagrams received and not yet decoded
    max_pending_bytes: int = 16 << 20      # datagrams of instances whose hello has not come yet
    max_instances: int = 4096              # probe instances known at once (a node runs a few dozen)
    allow_uids: frozenset | None = None    # None: every uid the socket's permissions let in
    allow_gids: frozenset | None = None

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
    if node not in (None, "") and (not isinstance(node, str) or not NODE_RE.match(node)):
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
    for k in ("dp", "tp", "pp", "ep", "cp"):
        v = out.get(k)
        if v is not None and not _int_ok(v, 0, INT32_MAX):
            raise ValueError(f"hello: {k} is not an integer in 0..{INT32_MAX}")
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


__all__ = ["Peer", "IngressLimits", "enable_passcred", "recv_with_peer", "resolve_group", "check_hello", "pid_alive"]

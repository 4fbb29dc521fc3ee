"""The node agent's part of hang localization: ``inflight`` rows.

* :func:`row_from_probe` turns a probe's ``T_INFLIGHT`` datagram (its watchdog's view of an overlong
  step, see :mod:`stepwatch.agents.probe.watchdog`) into an ``inflight`` row (``source`` = ``probe``).
* :class:`Liveness` is the agent's own view of its ranks, for the rank that cannot speak: at every tick
  it looks at the process of every rank it served recently (the pid from its hello) in
  ``$HOST_PROC/<pid>/stat``: a process that is **stopped** (state ``T``/``t``: SIGSTOP, a debugger) or
  **silent** (running, but no datagram for ``silent_s``, 30 s: e.g. stuck in a C call that holds the GIL,
  so even its watchdog cannot run) gets a row (``source`` = ``agent``) every ``every_s`` (5 s) while the
  agent heard from it within the last ``horizon_s`` (120 s); one that is **gone** (no such process, or a
  zombie) gets one row, at the second tick that sees it gone (dated by the first), unless the probe said goodbye
  by then (state ``exited``, :mod:`stepwatch.agents.probe.exitwatch`, which also says how it ended: a goodbye sent
  just before the exit can reach the agent's queue after the tick that first sees the process gone). A healthy rank costs one small file read
  per tick.
"""
from __future__ import annotations

import os

from stepwatch.agents.hostmetrics import host_proc

STATES = ("collective", "data", "compute", "done", "exited")   # exited: the probe's goodbye (probe.exitwatch)
MAX_STACK = 4096


def _int(v):
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v, n: int = 256):
    return v[:n] if isinstance(v, str) and v else None


def row_from_probe(ident, body: dict, t_now: int | None = None) -> dict:
    """An ``inflight`` row from a probe's in-flight datagram; raises ValueError on a malformed one. A
    goodbye sent from a signal handler (state ``exited``, built in advance) has no time: ``t_now``, when
    the agent received it."""
    state = body.get("state")
    if state not in STATES:
        raise ValueError(f"in-flight state: bad state {state!r}")
    t = _int(body.get("t"))
    if t is None and state == "exited" and t_now:
        t = int(t_now)
    if t is None or t <= 0:
        raise ValueError(f"in-flight state: bad time {body.get('t')!r}")
    kinds = body.get("kinds")
    kinds = ",".join(str(k) for k in kinds if isinstance(k, str)) if isinstance(kinds, list) else None
    el = body.get("elapsed_ns")
    seq, gs = _int(body.get("seq")), _int(body.get("group_size"))
    return {"job": ident.job, "node": ident.node, "rank": ident.rank, "t": t, "source": "probe", "state": state,
            "step": _int(body.get("step")), "step_kind": kinds or None,
            "elapsed_ms": el / 1e6 if isinstance(el, (int, float)) and not isinstance(el, bool) and el >= 0 else None,
            "since": _int(body.get("since")), "op": _str(body.get("op"), 64), "group": _str(body.get("group"), 128),
            "seq": seq if seq is not None and seq >= 0 else None,
            "group_size": gs if gs is not None and 0 < gs < 2**31 else None,
            "stack": _str(body.get("stack"), MAX_STACK), "pid": _int(body.get("pid")) or _int(ident.hello.get("pid")),
            "exit_code": _code(body.get("exit_code")), "signal": _code(body.get("signal"), 1, 128),
            "error": _str(body.get("error"), 512)}


def _code(v, lo: int = -(1 << 31), hi: int = (1 << 31) - 1):
    v = _int(v)
    return v if v is not None and lo <= v <= hi else None


class RateBound:
    """At most ``per_s`` in-flight rows per second per probe instance (a burst of ``burst``): the watchdog
    sends one every few seconds; a probe that sends more is cut (``inflight_rate``), bounding the rows a
    process can make the agent publish."""

    def __init__(self, per_s: float = 1.0, burst: int = 4, max_keys: int = 65536):
        self.per_s, self.burst, self.max_keys = per_s, burst, max_keys
        self._tokens: dict[int, tuple[float, float]] = {}

    def allow(self, inst: int, now: float) -> bool:
        tok, t = self._tokens.get(inst, (float(self.burst), now))
        tok = min(float(self.burst), tok + (now - t) * self.per_s)
        if tok < 1.0:
            self._tokens[inst] = (tok, now)
            return False
        if len(self._tokens) >= self.max_keys and inst not in self._tokens:
            self._tokens.clear()
        self._tokens[inst] = (tok - 1.0, now)
        return True


def process_state(pid: int, proc: str | None = None) -> str:
    """``running`` | ``stopped`` | ``gone`` for a pid, from ``<procfs>/<pid>/stat``."""
    try:
        with open(os.path.join(proc or host_proc(), str(int(pid)), "stat"), "rb") as f:
            raw = f.read(512)
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return "gone"
    except OSError:
        return "running"                    # not readable here (permissions): say nothing
    try:
        st = raw[raw.rindex(b")") + 2:raw.rindex(b")") + 3]
    except ValueError:
        return "running"
    if st in (b"T", b"t"):
        return "stopped"
    if st in (b"Z", b"X", b"x"):
        return "gone"
    return "running"


class Liveness:
    def __init__(self, silent_s: float = 30.0, every_s: float = 5.0, horizon_s: float = 120.0):
        self.silent_s, self.every_s, self.horizon_s = silent_s, every_s, horizon_s
        self._last: dict[int, float] = {}          # probe instance -> monotonic time of its last agent row
        self._gone: set[int] = set()               # instances reported gone (once: a gone process stays gone)
        # instances seen gone once, not yet reported -> (monotonic, wall ns) of that sighting: a process that
        # said goodbye and exited can be gone from /proc while its goodbye still waits in the agent's queue
        # (sent just before the exit, received after the tick drained the queue); the next tick has it
        self._vanished: dict[int, tuple[float, int]] = {}

    def said_goodbye(self, inst: int) -> None:
        """The probe told how it ends (its ``exited`` row): no ``gone`` row follows for it."""
        self._gone.add(inst)
        self._vanished.pop(inst, None)

    def rows(self, idents: dict, node_default: str, now: float, t_ns: int, final: bool = False) -> list[dict]:
        """The rows of this look. ``final``: the agent's last look, after its receiver stopped and its queue
        was read: a goodbye that has not come will not, so a process gone now is said at once (an agent
        stopped within a tick of a rank's death lost that death: a GPU run's rank 1 ``os._exit`` was never
        reported, and the rank that raised for the lost peer was named the crash)."""
        out = []
        for inst, ident in idents.items():
            age = max(now - ident.t_seen, 0.0)
            peer = getattr(ident, "peer", None)            # the kernel's word (SO_PASSCRED) over the hello's
            pid = _int(getattr(peer, "pid", None)) or _int(ident.hello.get("pid"))
            if pid is None or age > self.horizon_s or inst in self._gone or \
                    now - self._last.get(inst, -1e18) < self.every_s:
                continue
            st = process_state(pid)
            if st == "gone":
                first = self._vanished.get(inst)
                if first is None and not final:            # gone without a word, for now: its goodbye may be
                    self._vanished[inst] = (now, t_ns)     # on its way; said at the next sighting, dated this one
                    continue
                first = first or (now, t_ns)
                self._gone.add(inst)
                self._vanished.pop(inst, None)
                age = max(first[0] - ident.t_seen, 0.0)
                out.append({"job": ident.job, "node": ident.node or node_default, "rank": ident.rank, "t": first[1],
                            "source": "agent", "state": st, "elapsed_ms": age * 1e3,
                            "since": first[1] - int(age * 1e9), "pid": pid})
                self._last[inst] = now
                continue
            self._vanished.pop(inst, None)
            if st == "running":
                if age < self.silent_s:
                    continue
                st = "silent"
            self._last[inst] = now
            out.append({"job": ident.job, "node": ident.node or node_default, "rank": ident.rank, "t": t_ns,
                        "source": "agent", "state": st, "elapsed_ms": age * 1e3,
                        "since": t_ns - int(age * 1e9), "pid": pid})
        for inst in [i for i in self._last if i not in idents]:
            del self._last[inst]
        self._gone &= set(idents)
        for inst in [i for i in self._vanished if i not in idents]:
            del self._vanished[inst]
        return out

"""The probe's watchdog: what a rank is doing while its step runs far longer than usual.

A daemon thread, started by the probe at ``init`` in a rank (``RANK`` known, not a multiprocessing
child) or else once the process has finished its first step, wakes every ``period_s`` (1 s). It runs while the training (main) thread is blocked in a C call (a collective, a
``time.sleep``, I/O), because those release the GIL. It never touches the hot path's state: it reads
the probe's replayed step state, peeks at the events the hot path logged since the last replay (a copy;
nothing is drained) and the main thread's Python stack (``sys._current_frames()``; no ptrace, no signal).

When the step in progress has lasted more than ``max(min_s, factor x usual step time)`` (the usual step
time is the mean over the last minute of the watchdog's own samples of the step counter: nothing is
measured per step), it sends the rank's *in-flight state* to the node agent as one ``T_INFLIGHT``
datagram (header + JSON, on a socket of its own), and again whenever that state changes or every
``resend_s`` (5 s) while the step lasts; when the step ends it sends a last one with state ``done``.

The state is one of:

* ``collective``: inside a wrapped ``torch.distributed`` collective: its op, process group, the group's
  *sequence number* (1 = the group's first collective of this process, counted the same way on every rank
  as NCCL and the Flight Recorder do: a collective made of collectives counts once, ``Work.wait()`` not at
  all), the group size and since when;
  Also a rank whose DDP gradient buckets were launched and are not complete: DDP's reducer waits for
  their all-reduce inside ``backward`` (C++), where no Python frame says so (op ``all_reduce`` on DDP's
  process group, since the oldest pending bucket's launch);
* ``data``: inside ``DataLoader.__next__``;
* ``compute``: anything else, since the last event the probe logged (the end of the last collective,
  DataLoader call or optimizer step).

With the step number, the step's kinds (``first``, ``eval``, ``checkpoint``: what the probe saw in this
step) and the main thread's stack, innermost frame last (at most 24 frames, 4 KiB).

Standard library only, like the rest of the probe's package (``stepwatch wrap`` may load it from its directory).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading

from stepwatch.wire.datagram import HDR, MAGIC, T_INFLIGHT, VERSION

from . import eventlog as _ev

# collective functions of torch.distributed whose frame names the op the main thread is blocked in
COLLECTIVES = frozenset((
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "reduce", "barrier", "all_to_all", "all_to_all_single", "gather", "scatter", "all_reduce_coalesced", "send",
    "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "monitored_barrier", "batch_isend_irecv"))
MAX_FRAMES = 24
MAX_STACK = 4096
_HERE = os.path.dirname(os.path.abspath(__file__))


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name, "")
    try:
        return float(v) if v not in ("", None) else default
    except ValueError:
        return default


def format_stack(frame, limit: int = MAX_FRAMES) -> tuple[str, list]:
    """The stack from ``frame`` outwards as text, outermost first and innermost last (``file:line in
    func`` per line, at most ``limit`` frames: the innermost ones), and the frames themselves (innermost
    first)."""
    frames = []
    f = frame
    while f is not None and len(frames) < 256:
        if os.path.dirname(f.f_code.co_filename) != _HERE:      # (the probe's own wrappers: its package)
            frames.append(f)
        f = f.f_back
    lines = []
    for f in reversed(frames[:limit]):
        co = f.f_code
        lines.append(f"{co.co_filename}:{f.f_lineno} in {co.co_name}")
    text = "\n".join(lines)
    if len(text) > MAX_STACK:
        text = "…" + text[-(MAX_STACK - 1):]
    return text, frames


class Watchdog:
    """One per probe (see the module docstring), given what it reads: ``log`` (the hot path's event log:
    ``peek``, ``n``, ``last_drain``, ``in_coll``, ``coll_t0``), ``fold`` (:meth:`.fold.StepFold.position`
    and ``n_steps``), ``names`` (kind slots, groups, collective keys), ``hooks`` (``wait_slot``, the DDP
    bucket timers), ``transport`` (``wall_off``, and ``path``/``instance`` to send), ``identity`` (the rank),
    ``held()`` (the events the probe holds for a step boundary's device event) and ``paused()`` (True while
    the probe is off or replaying: nothing is looked at then)."""

    def __init__(self, log, fold, names, hooks, transport, identity, held, paused, period_s: float | None = None,
                 min_s: float | None = None, factor: float | None = None, resend_s: float = 5.0):
        self.log, self.fold, self.names, self.hooks = log, fold, names, hooks
        self.transport, self.identity, self.held, self.paused = transport, identity, held, paused
        self.period_s = period_s if period_s is not None else _env_float("STEPWATCH_WATCHDOG_S", 1.0)
        self.min_s = min_s if min_s is not None else _env_float("STEPWATCH_INFLIGHT_S", 10.0)
        self.factor = factor if factor is not None else _env_float("STEPWATCH_INFLIGHT_FACTOR", 5.0)
        self.resend_s = resend_s
        self.main_ident = threading.main_thread().ident
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._samples: list[tuple[int, int]] = []      # (perf ns, steps ended) at the wakes where steps advanced
        self._first: tuple[int, int] | None = None
        self._hung_step = None                          # the step reported as overlong (None: none)
        self._last_key = None
        self._last_sent = 0
        self.sent = self.failed = 0

    # ------------------------------------------------------------------ thread
    def start(self) -> "Watchdog":
        if self.period_s <= 0:
            return self
        self.thread = threading.Thread(target=self._run, name="stepwatch-watchdog", daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self._drop_socket()

    def _drop_socket(self) -> None:
        s, self._sock = self._sock, None
        if s is not None:
            try:
                s.close()
            except OSError:
                pass

    def _run(self) -> None:
        while not self.stop.wait(self.period_s):
            try:
                self.check(_ev._perf())
            except Exception:  # noqa: BLE001 - the watchdog never disturbs training
                pass

    # ------------------------------------------------------------------ judgement
    def usual_ns(self, now: int) -> float:
        """Mean step time over the last minute of wakes (0: not known yet)."""
        n = self.fold.n_steps
        s = self._samples
        if not s or s[-1][1] != n:
            s.append((now, n))
            while len(s) > 2 and now - s[0][0] > 60_000_000_000:
                s.pop(0)
        if len(s) < 2 or s[-1][1] <= s[0][1]:
            return 0.0
        return (s[-1][0] - s[0][0]) / (s[-1][1] - s[0][1])

    def threshold_ns(self, usual: float) -> float:
        return max(self.min_s * 1e9, self.factor * usual)

    def check(self, now: int) -> dict | None:
        """One wake: the in-flight state when the step is overlong (sent when due), else None."""
        if self.paused():
            return None
        usual = self.usual_ns(now)
        if self._hung_step is None:               # the cheap look of every wake: nothing is overlong
            pos = self.fold.position()
            if pos.open:
                if now - pos.start < self.threshold_ns(usual):
                    return None
            elif not self.log.n:
                return None
        st = self.state(now)
        if self._hung_step is not None and (st is None or st["step"] != self._hung_step or not st["_open"]):
            off = self.transport.wall_off
            done = {"state": "done", "step": self._hung_step, "t": now + off, "pid": os.getpid(),
                    "since": now + off, "kinds": [], "stack": ""}
            self._hung_step = None
            self._last_key = None
            self._send(done)
            return done
        if st is None or not st["_open"]:
            return None
        elapsed = now - st["_start"]
        if elapsed < self.threshold_ns(usual):
            return None
        self._hung_step = st["step"]
        st["elapsed_ns"] = elapsed
        st["usual_ns"] = usual
        key = (st["state"], st.get("op"), st.get("group"), st.get("seq"), st["step"])
        if key != self._last_key or now - self._last_sent >= self.resend_s * 1e9:
            self._last_key, self._last_sent = key, now
            self._send(st)
        return st

    def state(self, now: int) -> dict | None:
        """What the main thread is doing now (see the module docstring), from the replayed state, a
        copy of the events logged since the last replay, and the main thread's stack."""
        log, off = self.log, self.transport.wall_off
        try:
            events = self.held() + log.peek()     # (the held: boundaries whose device event runs)
        except Exception:  # noqa: BLE001
            events = []
        step0, start, open_, primary, explicit, used, seq = self.fold.position()
        step = step0
        kind_slots = self.names.kind_slots()
        kinds = {name for s, name in kind_slots.items() if used[s]} if open_ else set()
        last_t = log.last_drain
        for kind, slot, t0, t1, a, b in events:
            if kind == _ev.K_COLL or kind == _ev.K_DCOLL or kind == _ev.K_BUCKET:
                seq[slot] += 1
                last_t = t1
            elif kind == _ev.K_DATA:
                last_t = t1
                if not open_ and not explicit:
                    open_, start = True, t0
            elif kind == _ev.K_OPT_POST:
                last_t = t1
                if not explicit and a == primary:
                    step, start, open_, kinds = step + 1, t1, True, set()
            elif kind == _ev.K_BEGIN:
                if open_:
                    step = step + 1 if a < 0 else a
                elif a >= 0:
                    step = a
                start, open_, kinds, last_t = t0, True, set(), t0
            elif kind == _ev.K_END:
                if open_:
                    step, open_, last_t = step + 1, False, t0
                    kinds = set()
            elif kind == _ev.K_PHASE or kind == _ev.K_MARK:
                name = kind_slots.get(slot)
                if name:
                    kinds.add(name)
        if not open_ and not events:
            return None
        frame = sys._current_frames().get(self.main_ident)
        stack, frames = format_stack(frame) if frame is not None else ("", [])
        st = {"step": step, "_start": start, "_open": open_, "t": now + off, "pid": os.getpid()}
        coll = data = None
        for f in frames:
            co = f.f_code
            fn = co.co_filename
            if coll is None and co.co_name in COLLECTIVES and "distributed" in fn:
                coll = f
                break
            if data is None and co.co_name == "__next__" and fn.endswith(os.path.join("data", "dataloader.py")):
                data = f
                break
            if co.co_name == "save" and ("serialization" in fn or "checkpoint" in fn):
                kinds.add("checkpoint")
        if coll is not None or log.in_coll:
            st["state"] = "collective"
            ct = getattr(log, "coll_t0", 0)
            st["since"] = (ct if ct else last_t) + off
            if coll is not None:
                st["op"] = coll.f_code.co_name
                try:
                    group = coll.f_locals.get("group")
                except Exception:  # noqa: BLE001
                    group = None
                gname, gsize, gid = self._group(group)
                st["group"], st["group_size"] = gname, gsize
                if gid:
                    st["seq"] = self._seq(seq, gid)
        elif self._ddp_pending(st, seq):
            pass                          # blocked in backward, where DDP's reducer waits for its all-reduces
        elif data is not None:
            st["state"] = "data"
            st["since"] = last_t + off
        else:
            st["state"] = "compute"
            st["since"] = last_t + off
        if self.fold.n_steps == 0 and step == step0:       # no step finished yet: the process's first
            kinds.add("first")
        st["kinds"] = sorted(kinds)
        st["stack"] = stack
        return st

    def _ddp_pending(self, st: dict, seq: list) -> bool:
        """DDP's gradient buckets launched and not complete (agents.probe.ddp_hooks): the rank waits in
        their all-reduce (from the oldest bucket's launch), not in compute. Sets the collective state."""
        for t in list(self.hooks.ddp_timers):
            if getattr(t, "pending", 0) <= 0:
                continue
            st["state"], st["op"] = "collective", "all_reduce"
            st["since"] = int(t.pending_t0) + self.transport.wall_off
            gname, gsize, gid = self._group(t.group)
            st["group"], st["group_size"] = gname, gsize or getattr(t, "size", None)
            if gid:
                st["seq"] = self._seq(seq, gid)
            return True
        return False

    def _seq(self, seq: list, gid: int) -> int:
        """The sequence number of a group's collective in progress: 1 + its collectives so far (all its
        comm slots but ``Work.wait``'s)."""
        keys, wait_slot = self.names.comm_key, self.hooks.wait_slot
        return 1 + sum(seq[s] for s in range(len(self.names.comm_slot)) if keys[s][1] == gid and s != wait_slot)

    def _group(self, group) -> tuple[str, int | None, int]:
        """(name, size, name id) of a process group as the probe names it in its comm rows."""
        names = self.names
        dist = sys.modules.get("torch.distributed")
        if group is not None and dist is not None:
            try:                                        # the default group, as the call's frame sees it
                if group is dist.distributed_c10d._get_default_group():
                    group = None
            except Exception:  # noqa: BLE001
                pass
        g = names.groups.get(id(group))
        if g is None:
            if dist is None:
                return ("world" if group is None else "?"), None, 0
            try:
                g = names.group(dist, group)
            except Exception:  # noqa: BLE001
                return "?", None, 0
        gid, size = g
        name = next((n for n, i in names.ids.items() if i == gid), "?")
        return name, size, gid

    # ------------------------------------------------------------------ sending
    def payload(self, st: dict) -> bytes:
        body = {k: v for k, v in st.items() if not k.startswith("_")}
        return HDR.pack(MAGIC, VERSION, T_INFLIGHT, self.transport.instance, self.identity.rank or 0, 0, 0, 0, 0) + \
            json.dumps(body, separators=(",", ":"), default=str).encode()

    def _send(self, st: dict) -> bool:
        data = self.payload(st)
        try:
            if self._sock is None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                s.setblocking(False)
                s.connect(self.transport.path)
                self._sock = s
            self._sock.send(data)
            self.sent += 1
            return True
        except (OSError, AttributeError):
            self.failed += 1
            self._drop_socket()
            return False


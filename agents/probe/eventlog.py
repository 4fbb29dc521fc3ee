"""The probe's hot path: every hook inside a training step appends one fixed-size event to a log.

An event is ``(kind, slot, t0, t1, a, b)``; :mod:`.fold` turns them into steps later, a few hundred at a
time. The log and the wrappers of DataLoader iterators and collectives exist twice, with the same
behaviour: in C (``_probefast.Log``, ``DataWrap``, ``CollWrap``, built from ``agents/probe/_probefast.c``
where a compiler exists) and in pure Python here (:class:`_PyLog`, :func:`_py_data_wrap`,
:func:`_py_coll_wrap`). Which one runs is ``_fast`` (the C module, or None), read at each use.
"""
from __future__ import annotations

import os
import time

from stepwatch.wire.datagram import DEFAULT_FLUSH_MS

LOG_CAP = 1024                        # hot-path events held before a replay is forced (see _PyLog)

# Events of the hot path (see _PyLog): (kind, slot, t0, t1, a, b), folded into steps by StepFold.replay.
# K_OPT_POST: t0 = the optimizer's pre-hook time (0: none), t1 = its post-hook time, a = id(optimizer)
# K_OPT_POST, K_BEGIN, K_END: b = 1 + the token of a device event recorded at that step boundary (0: none;
# see DeviceTiming.step_mark)
K_OPT_POST, K_DATA, K_COLL, K_GC, K_BEGIN, K_END, K_PHASE, K_COUNT = range(2, 10)
# K_DCOLL: a synchronous collective on a device tensor; b = the token of its device events
K_DCOLL = 10
# K_MARK: the step has a kind (evaluation, checkpoint, ...): slot = the kind's phase slot, t0 = when it was seen
K_MARK = 11
#: step kinds the probe marks, as entries of the step's ``phases`` map (ms): name in the map -> kind
KIND_PHASES = {"first_step": "first", "eval": "eval", "checkpoint": "checkpoint"}
# K_BUCKET: one gradient bucket of a DDP reducer, from its all-reduce's launch (t0) to its completion (t1),
# a = payload bytes (see .ddp_hooks)
K_BUCKET = 12


_perf = time.perf_counter_ns
_wall = time.time_ns


def _load_fast():
    """The C hot path (``_probefast``, built from ``agents/probe/_probefast.c`` when a compiler was there),
    or None: then the pure-Python one below runs (same events, same records, more cost per step).
    ``STEPWATCH_PROBE_PURE=1`` forces the pure-Python path. (Relative: the extension beside this file,
    also when ``stepwatch wrap`` loads the package from its directory.)"""
    if os.environ.get("STEPWATCH_PROBE_PURE", "") not in ("", "0"):
        return None
    try:
        from . import _probefast
        return _probefast
    except ImportError:
        return None


_fast = _load_fast()
FAST = _fast is not None             # which hot path runs (reported by stats() and the overhead bench)


class _PyLog:
    """The hot path's event log, in pure Python (``_probefast.Log`` is the same in C).

    Every hook that runs inside a training step only reads the clock and appends one event
    ``(kind, slot, t0, t1, a, b)``; :meth:`StepFold.replay` turns the events into steps later, a few
    hundred at a time. On a real loop the probe's code is out of the caches at every step, where each
    Python operation costs ~0.1-0.3 µs: doing the per-step logic in the replay, warm, and not in the
    hooks is what keeps the step path short. ``opt_post`` (the step end of automatic mode) asks for a
    replay (``on_drain``) once ``high`` events wait, ``drain_ns`` passed since ``last_drain``, or
    ``eager`` is set (a profile that needs every step boundary); a full log asks for one at once."""

    def __init__(self, cap: int, on_drain, on_first_opt):
        self.ev: list[tuple] = []          # the same list for the log's life (the wrappers hold it)
        self.cap, self.high = cap, cap // 2
        self.last_drain = 0
        self.drain_ns = int(DEFAULT_FLUSH_MS * 1e6)
        self.primary = 0                   # id of the primary optimizer (0: none stepped yet)
        self.lost = self.comm_keys_dropped = self.pre_t = 0
        self.eager = self.in_coll = self.dev_on = 0
        self.on_step = None                # with dev_on: the primary's step end records a device event
        self.coll_t0 = 0                   # perf ns when the running collective started (the watchdog reads it)
        self.dq_need = 1                   # the next DataLoader call reads the prefetch queue depth
        self._on_drain, self._on_first_opt = on_drain, on_first_opt
        self._draining = False

    @property
    def n(self) -> int:
        return len(self.ev)

    def call_drain(self) -> None:
        if self._draining:
            return
        self._draining = True
        try:
            self._on_drain()
        except Exception:  # noqa: BLE001 - telemetry never fails training
            pass
        finally:
            self._draining = False

    def add(self, kind: int, slot: int, t0: int, t1: int, a: int, b: float) -> None:
        ev = self.ev
        if len(ev) >= self.cap:
            self.call_drain()
            if len(ev) >= self.cap:            # a replay is running (re-entered): count, drop
                self.lost += 1
                return
        ev.append((kind, slot, t0, t1, a, b))

    def drain(self) -> list[tuple]:
        ev = self.ev
        out = ev[:]           # (a GC callback while this copy is allocated appends before it: kept)
        ev.clear()
        return out

    def clear(self) -> None:
        self.ev.clear()

    def peek(self) -> list[tuple]:
        """A copy of the events waiting (the watchdog's view; nothing is drained)."""
        return self.ev[:]

    def opt_pre(self, opt, args, kwargs) -> None:
        self.pre_t = _perf()              # sent with the post-hook's event: one event per optimizer step

    def opt_post(self, opt, args, kwargs) -> None:
        t = _perf()
        if not self.primary:
            try:
                self._on_first_opt(opt)
            except Exception:  # noqa: BLE001
                pass
        ev = self.ev
        mark = 0.0
        if self.dev_on and self.on_step is not None and id(opt) == self.primary:
            try:
                tok = self.on_step()
                if tok >= 0:
                    mark = tok + 1.0
            except Exception:  # noqa: BLE001
                pass
        if len(ev) < self.cap:
            ev.append((K_OPT_POST, 0, self.pre_t, t, id(opt), mark))
        else:
            self.add(K_OPT_POST, 0, self.pre_t, t, id(opt), mark)
        self.pre_t = 0
        self.dq_need = 1
        if self.eager or len(ev) >= self.high or t - self.last_drain >= self.drain_ns:
            self.call_drain()


def _py_data_wrap(log: _PyLog, fn, dq_fn):
    """A DataLoader iterator's ``__next__``, timed (``_probefast.DataWrap`` in C)."""
    ev, cap = log.ev, log.cap
    single = [None]                       # an iterator type whose queue depth is always 0

    def __next__(it):
        t0 = _perf()
        try:
            return fn(it)
        finally:
            t1 = _perf()
            dq = -1
            if log.dq_need:               # the first call of a step: how many batches were ready
                log.dq_need = 0
                if type(it) is single[0]:
                    dq = 0
                else:
                    try:
                        dq = int(dq_fn(it))
                    except Exception:  # noqa: BLE001
                        dq = -1
                    if dq == -2:
                        single[0] = type(it)
                        dq = 0
            if len(ev) < cap:
                ev.append((K_DATA, 0, t0, t1, dq, 0.0))
            else:
                log.add(K_DATA, 0, t0, t1, dq, 0.0)

    __next__.__wrapped__ = fn
    return __next__


def _py_coll_wrap(log: _PyLog, fn, p_idx: int, g_idx: int, a_idx: int, payload, resolve, nbytes_fn,
                  dev_begin=None, dev_end=None):
    """A torch.distributed collective, timed (``_probefast.CollWrap`` in C): the call, raw, as one
    event; its accumulator slot is cached per process group. A synchronous call on a device tensor
    is also bracketed by device events (``dev_begin``/``dev_end``, see :meth:`DeviceTiming.begin`)."""
    ev, cap = log.ev, log.cap
    slots: dict[int, int] = {}          # id(group) -> accumulator slot (resolve keeps the group alive)

    def wrapper(*args, **kwargs):
        if log.in_coll:                 # a collective made of collectives: the outer one counts
            return fn(*args, **kwargs)
        log.in_coll = 1
        n = len(args)
        x = None if payload is None else args[p_idx] if 0 <= p_idx < n else kwargs.get(payload)
        is_async = a_idx >= 0 and (args[a_idx] if a_idx < n else kwargs.get("async_op", False))
        tok = -1
        if log.dev_on and dev_begin is not None and x is not None and not is_async:
            try:
                if x.is_cpu is False:
                    tok = dev_begin(x)
            except Exception:  # noqa: BLE001 - a list payload, or no device events: host time
                tok = -1
        t0 = log.coll_t0 = _perf()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = _perf()
            log.in_coll = 0
            try:
                if tok >= 0:
                    dev_end(tok)
                group = args[g_idx] if 0 <= g_idx < n else kwargs.get("group")
                s = slots.get(id(group), -2)
                if s == -2:
                    s = slots[id(group)] = resolve(group)
                if s < 0:
                    log.comm_keys_dropped += 1
                else:
                    if x is None:
                        nbytes = 0
                    else:
                        try:
                            nbytes = x.nbytes
                        except AttributeError:
                            nbytes = nbytes_fn(x)
                    if tok >= 0:                # timed on the device: the replay reads the events
                        e = (K_DCOLL, s, t0, t1, nbytes, float(tok))
                    else:                       # async: the launch only (0 wait), the wait is timed in
                        e = (K_COLL, s, t0, t1, nbytes, 0.0 if is_async else -1.0)   # Work.wait(); -1: split later
                    if len(ev) < cap:
                        ev.append(e)
                    else:
                        log.add(*e)
            except Exception:  # noqa: BLE001 - telemetry never fails a collective
                pass

    wrapper.__wrapped__ = fn
    return wrapper


def _queue_depth(it) -> int:
    """Ready batches in a DataLoader iterator's prefetch queue (multi-process loaders); -2 for a
    single-process one (always 0: it prefetches nothing); -1 when unknown."""
    q = getattr(it, "_data_queue", None)
    if q is not None:
        try:
            return int(q.qsize())
        except (NotImplementedError, OSError, AttributeError, ValueError):
            return -1
    return -2 if getattr(it, "_num_workers", 1) == 0 else -1


def _nbytes(x) -> int:
    """Payload bytes of a tensor or a list/tuple of tensors (0 for anything else)."""
    try:
        if isinstance(x, (list, tuple)):
            return sum(t.numel() * t.element_size() for t in x)
        return x.numel() * x.element_size()
    except Exception:  # noqa: BLE001 - telemetry must not fail the call
        return 0

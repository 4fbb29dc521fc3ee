"""The in-process probe: per-step telemetry of one training rank, handed to the node agent.

Two lines instrument a PyTorch script::

    from stepwatch import probe
    probe.init()                 # job/rank/world size from STEPWATCH_JOB, RANK, WORLD_SIZE, LOCAL_RANK

``init`` installs the automatic hooks (``auto=True``):

- **step boundaries**: a global ``torch.optim`` step post-hook. A step ends when the first optimizer
  that ever stepped (the "primary" one) finishes ``step()``; the next step starts at that instant.
  Time inside any optimizer's ``step()`` is reported as the ``optimizer`` phase.
- **data wait**: ``DataLoader`` iterators' ``__next__`` is timed (``data_ms``); the number of ready
  batches in a multi-process loader's queue is read at the first ``__next__`` of a step
  (``data_queue``; 0 for single-process loaders, which prefetch nothing).
- **GC**: ``gc.callbacks`` time every collection (``gc_ms``, ``gc_count`` of the step); collections
  lasting at least ``gc_row_min_ms`` (default 0: all) are also sent as ``gc`` rows.
- **collectives**: the ``torch.distributed`` functions (all_reduce, all_gather[_into_tensor],
  reduce_scatter[_tensor], broadcast, reduce, barrier, all_to_all[_single], gather, scatter, send,
  recv, ...) are wrapped: wall time, calls and payload bytes per (op, process group) and step, and
  the time blocked in ``Work.wait()`` of asynchronous ones (op ``wait``). A synchronous collective
  on a CUDA/NPU tensor is timed by device events on the current stream (the host only launches it),
  read without synchronising when the steps are replayed. See :func:`transfer_ms` for how the time
  blocked waiting for peers (``comm_wait_ms``) is separated from transfer time.

Or explicitly (any framework)::

    probe.init(job="llama", auto=False)
    for batch in loader:
        with probe.step(samples=len(batch)):
            with probe.phase("data"): ...
            with probe.phase("forward"): ...

``begin_step()/end_step()`` do the same without a ``with``. Phase ``data`` feeds ``data_ms``,
``compute`` feeds ``compute_ms`` (otherwise compute is derived: step - data - comm - comm wait - gc,
floored at 0), any other name goes to the ``phases`` map (at most 8 names per step).

Cost and safety. Inside a step every hook only reads the clock and appends one fixed-size event to
a preallocated log (:class:`_PyLog`; in C, ``_probefast.Log``, built from ``agents/_probefast.c``
where a compiler exists). Every few hundred events (or ``flush_ms``, 500 ms) :meth:`Probe._replay`
turns them into steps, warm, and packs each finished step as a fixed-size *frame* with
:mod:`struct` into one preallocated buffer. Frames are sent together as one datagram on a
non-blocking ``AF_UNIX``/``SOCK_DGRAM`` socket connected to ``<socket_dir>/agent.sock``: a 100 ms
step pays a system call every fifth step, a 1 s step every step. When the agent is absent, or its
queue stays full past a small backlog, frames are dropped and counted (:func:`stats`); training
never blocks on telemetry. Events and steps still waiting are sent by ``shutdown`` (also at exit,
at ``destroy_process_group`` and in the finalizers of multiprocessing children). This module
imports only the standard library (torch is touched only when the program imports it), so
``stepwatch wrap`` can load it into any Python process.

Datagram layout (little-endian; the node agent decodes it with :func:`decode`). A datagram is a hello
alone, or one or more batch frames back to back; a frame is ``HDR`` followed by its records:

====================  =========================================================================
``HDR``  16 bytes     magic ``0x5357``, version 2, type (1 batch frame, 2 hello), instance id
                      (int32, random per probe), rank (int32), n_step (0/1), n_comm, n_gc, n_phase
``STEP`` 120 bytes    step, t_start ns, t_end ns, step/data/compute/comm/comm_wait/gc ns, gc_count,
                      data_queue (-1 = null), samples, tokens (-1 = null), frames the probe
                      dropped so far (uint32), the step-ending thread's CPU ns and
                      run-queue wait ns (float64, -1 = null; version 1 frames end before them)
``PHASE`` 16 bytes    name id, ns   (``n_phase`` of them)
``COMM`` 40 bytes     op id, group id, calls, bytes, time ns, wait ns   (``n_comm``)
``GCREC`` 40 bytes    t_end ns, duration ns, generation, collected, uncollectable   (``n_gc``)
hello                 ``HDR`` + UTF-8 JSON: identity (job, rank, world_size, node, device, ...) and
                      the table of interned names (op, group and phase ids)

Durations travel as float64 nanoseconds (the probe never divides; the agent converts to ms) and
wall times as int64 ns derived from ``perf_counter_ns`` plus an offset to ``time_ns`` that is
re-anchored with every hello (so a step costs no ``clock_gettime(CLOCK_REALTIME)``).
====================  =========================================================================
"""
from __future__ import annotations

import collections
import gc
import json
import os
import socket
import struct
import sys
import threading
import time

MAGIC = 0x5357
VERSION = 2                           # 2: STEP carries the main thread's CPU time and run-queue wait
VERSIONS = (1, 2)                     # what decode() reads (a version-1 STEP has neither: null)
T_BATCH = 1
T_HELLO = 2
T_PROFILE = 3                         # probe -> agent: the outcome of a profiling command (HDR + JSON)
T_INFLIGHT = 4                        # probe -> agent: the watchdog's in-flight state of an overlong step (HDR + JSON)

HDR = struct.Struct("<HBBiiBBBB")
STEP = struct.Struct("<qqqddddddiiqqI4xdd")
STEP_V1 = struct.Struct("<qqqddddddiiqqI4x")                      # (version-1 probes: no CPU fields)
HDR_STEP = struct.Struct("<HBBiiBBBB" + "qqqddddddiiqqI4xdd")   # both at once: one call per step
PHASE = struct.Struct("<H6xd")
COMM = struct.Struct("<HH4xqqdd")
GCREC = struct.Struct("<qdB7xqq")
MAX_PHASES = 8
MAX_COMM = 16
MAX_GC = 16
MAX_FRAME = HDR.size + STEP.size + MAX_PHASES * PHASE.size + MAX_COMM * COMM.size + MAX_GC * GCREC.size
MAX_DATAGRAM = 16384                  # frames of several steps are sent together up to this size
DEFAULT_FLUSH_MS = 500.0              # a datagram leaves at least this often while steps end
MAX_NAMES = 1024
MAX_BACKLOG = 16                      # datagrams kept for a retry while the agent's queue is full
MAX_PENDING = 64                      # finished steps packed and waiting to be sent (then a flush)
MAX_CALLS = 512                       # collective calls kept raw in one step; beyond, they are summed then

LOG_CAP = 1024                        # hot-path events held before a replay is forced (see _PyLog)

# Events of the hot path (see _PyLog): (kind, slot, t0, t1, a, b), replayed by Probe._replay.
# K_OPT_POST: t0 = the optimizer's pre-hook time (0: none), t1 = its post-hook time, a = id(optimizer)
K_OPT_POST, K_DATA, K_COLL, K_GC, K_BEGIN, K_END, K_PHASE, K_COUNT = range(2, 10)
# K_DCOLL: a synchronous collective on a device tensor; b = the token of its device events
K_DCOLL = 10
# K_MARK: the step has a kind (evaluation, checkpoint, ...): slot = the kind's phase slot, t0 = when it was seen
K_MARK = 11
#: step kinds the probe marks, as entries of the step's ``phases`` map (ms): name in the map -> kind
KIND_PHASES = {"first_step": "first", "eval": "eval", "checkpoint": "checkpoint"}
# K_BUCKET: one gradient bucket of a DDP reducer, from its all-reduce's launch (t0) to its completion (t1),
# a = payload bytes (see Probe._ddp_hook)
K_BUCKET = 12
MAX_DEV_CALLS = 4096                  # device event pairs awaiting their replay (beyond: timed by the host)

SOCKET_NAME = "agent.sock"
HELLO_EVERY_NS = 10_000_000_000       # identity re-sent every 10-20 s (an agent restart learns it again)
DEFAULT_COMM_GBPS = 25.0              # nominal link bandwidth for the transfer estimate (GB/s)

_perf = time.perf_counter_ns
_wall = time.time_ns


def _load_fast():
    """The C hot path (``_probefast``, built from ``agents/_probefast.c`` when a compiler was there),
    or None: then the pure-Python one below runs (same events, same records, more cost per step).
    ``STEPWATCH_PROBE_PURE=1`` forces the pure-Python path."""
    if os.environ.get("STEPWATCH_PROBE_PURE", "") not in ("", "0"):
        return None
    try:
        from stepwatch.agents import _probefast
        return _probefast
    except ImportError:
        pass
    try:                           # loaded on its own (STEPWATCH_PROBE_FILE): the extension beside this file
        import importlib.machinery
        import importlib.util
        here = os.path.dirname(os.path.abspath(__file__))
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            f = os.path.join(here, "_probefast" + suffix)
            if os.path.exists(f):
                spec = importlib.util.spec_from_file_location("_probefast", f)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                return mod
    except Exception:  # noqa: BLE001 - an unloadable extension: the pure-Python path
        pass
    return None


_fast = _load_fast()
FAST = _fast is not None             # which hot path runs (reported by stats() and the overhead bench)


class _ThreadCpu:
    """The calling thread's CPU time and run-queue wait, cumulative ns: ``read() -> (cpu, wait)``.

    Both come from one ``pread`` of ``/proc/thread-self/schedstat`` (the scheduler's own accounting:
    time on a CPU, and time *runnable but waiting for a CPU*, which is what a competing process on the
    rank's core costs it). Where that file is missing (no ``CONFIG_SCHED_INFO``), the CPU time comes
    from ``CLOCK_THREAD_CPUTIME_ID`` and the wait is -1 (unknown). The file is reopened when the
    reading thread changes or after a fork. Read by :meth:`Probe._drain` (every ~500 ms), not per step."""

    def __init__(self):
        self.fd, self.tid, self.pid, self.proc = -1, 0, 0, True

    def read(self) -> tuple[int, int]:
        if self.proc:
            tid = threading.get_native_id()
            if tid != self.tid or self.fd < 0 or self.pid != os.getpid():
                self._reopen(tid)
            if self.fd >= 0:
                try:
                    f = os.pread(self.fd, 96, 0).split()
                    return int(f[0]), int(f[1])
                except (OSError, ValueError, IndexError):
                    self.proc = False
        return time.thread_time_ns(), -1

    def _reopen(self, tid: int) -> None:
        if self.fd >= 0 and self.pid == os.getpid():
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd, self.tid, self.pid = -1, tid, os.getpid()
        try:
            self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.proc = False


class _PyLog:
    """The hot path's event log, in pure Python (``_probefast.Log`` is the same in C).

    Every hook that runs inside a training step only reads the clock and appends one event
    ``(kind, slot, t0, t1, a, b)``; :meth:`Probe._replay` turns the events into steps later, a few
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
        if len(ev) < self.cap:
            ev.append((K_OPT_POST, 0, self.pre_t, t, id(opt), 0.0))
        else:
            self.add(K_OPT_POST, 0, self.pre_t, t, id(opt), 0.0)
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
    is also bracketed by device events (``dev_begin``/``dev_end``, see :meth:`Probe._dev_begin`)."""
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


def default_socket_dir() -> str:
    """``$STEPWATCH_SOCKET_DIR``, else ``/run/stepwatch`` when it exists, else ``/tmp/stepwatch``."""
    d = os.environ.get("STEPWATCH_SOCKET_DIR")
    if d:
        return d
    return "/run/stepwatch" if os.path.isdir("/run/stepwatch") else "/tmp/stepwatch"


def _new_instance() -> int:
    """A random 31-bit id for a probe instance (pid namespaces make pids ambiguous on a node)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    try:
        return int(v) if v not in (None, "") else None
    except ValueError:
        return None


# Bytes moved per byte of this rank's payload, as a function of the group size n (ring algorithms).
_TRAFFIC = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_reduce_coalesced": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: float(n - 1),
    "all_gather_into_tensor": lambda n: float(n - 1),
    "all_gather_single": lambda n: float(n - 1),
    "reduce_scatter": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_single": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "gather": lambda n: 1.0,
    "scatter": lambda n: 1.0, "send": lambda n: 1.0, "recv": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}
# *_object collectives: payload size unknown (pickled inside), so no transfer part is estimated


def transfer_ms(op: str, nbytes: int, group_size: int, gbps: float) -> float:
    """Estimated pure transfer time of one collective (ms): bytes on the wire / link bandwidth.

    The probe splits a synchronous collective's wall time ``t`` into ``comm_ms = min(t, transfer)``
    and ``comm_wait_ms = t - comm_ms`` (time blocked waiting for peers). On CPU/gloo a rank cannot see
    when its peers arrived, so the transfer part comes from a bandwidth model; an error in it shifts
    every rank of a data-parallel group by the same amount (same bytes, same model), so it never
    hides a straggler: the slow rank arrives last, waits least and keeps the highest busy time
    (step - comm wait). A per-rank minimum of observed times would not do: a rank that always waits
    for the same straggler never sees a wait-free call.
    """
    if gbps <= 0 or nbytes <= 0:
        return 0.0
    f = _TRAFFIC.get(op)
    moved = nbytes * (f(max(group_size, 1)) if f else 1.0)
    return moved / (gbps * 1e9) * 1e3


def _nbytes(x) -> int:
    """Payload bytes of a tensor or a list/tuple of tensors (0 for anything else)."""
    try:
        if isinstance(x, (list, tuple)):
            return sum(t.numel() * t.element_size() for t in x)
        return x.numel() * x.element_size()
    except Exception:  # noqa: BLE001 - telemetry must not fail the call
        return 0


class _Phase:
    """Context manager timing one named phase; one cached instance per name (no per-use allocation)."""

    __slots__ = ("probe", "slot", "t0", "depth")

    def __init__(self, probe: "Probe", slot: int):
        self.probe, self.slot, self.t0, self.depth = probe, slot, 0, 0

    def __enter__(self):
        self.depth += 1
        if self.depth == 1:
            self.t0 = _perf()
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            self.probe._log.add(K_PHASE, self.slot, 0, 0, _perf() - self.t0, 0.0)
        return False


class _TorchImportHook:
    """A ``sys.meta_path`` finder that finds nothing itself: on ``import torch`` it wraps torch's
    loader so that the probe's hooks are installed once torch has finished importing."""

    def __init__(self, probe: "Probe"):
        self.probe = probe

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        import importlib.util
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        orig, probe = loader.exec_module, self.probe

        def exec_module(module):
            orig(module)
            if probe._on:
                try:
                    probe.install_torch()
                except Exception as e:  # noqa: BLE001 - never break the user's import
                    sys.stderr.write(f"stepwatch probe: PyTorch hooks not installed: {e!r}\n")

        loader.exec_module = exec_module
        return spec


class _StepCtx:
    __slots__ = ("probe",)

    def __init__(self, probe: "Probe"):
        self.probe = probe

    def __enter__(self):
        self.probe.begin_step()
        return self.probe

    def __exit__(self, *exc):
        self.probe.end_step()
        return False


# phase slots with a fixed meaning; named phases get slots from 2 on
_SLOT_DATA, _SLOT_COMPUTE = 0, 1


class Probe:
    """One per process (the module-level functions use a singleton). Lifecycle: ``init`` ->
    steps -> ``shutdown`` (also at interpreter exit)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._on = False
        self._installed = False
        self._hooks: list = []
        self._patches: list[tuple[object, str, object]] = []
        self._sock: socket.socket | None = None
        self._path = ""
        self._connected = False
        self._t_connect = -(1 << 62)
        self.reconnect_ns = 1_000_000_000
        self._hello_bytes = b""
        self._hello_dirty = True
        self._backlog: collections.deque = collections.deque()
        self._buf = bytearray(MAX_DATAGRAM)
        self._mv = memoryview(self._buf)
        self._off = self._frames = 0                   # bytes and frames (finished steps) packed in _buf
        self._last_flush = 0
        self.flush_ns = int(DEFAULT_FLUSH_MS * 1e6)
        self._gcbuf = bytearray(HDR.size + MAX_GC * GCREC.size)   # header room: sent alone when full
        self._gcmv = memoryview(self._gcbuf)
        self.instance = _new_instance()
        # periodic hello every 10-20 s, spread per instance so ranks started together do not burst
        self._hello_every = HELLO_EVERY_NS + (self.instance % 10_000) * 1_000_000
        # identity (None = resolved lazily at the first step)
        self.job: str | None = None
        self.rank: int | None = None
        self.world_size: int | None = None
        self.local_rank: int | None = None
        self.node: str | None = None
        self.extra: dict = {}
        self._identity_ready = False
        self._rank_given = self._world_given = False
        # names (ops, groups, phases) -> small ids shared with the agent through the hello
        self._names: dict[str, int] = {}
        self._phase_ids = [0] * MAX_PHASES       # slot -> name id
        self._phase_slot: dict[str, int] = {}
        self._phase_ctx: dict[str, _Phase] = {}
        self._comm_slot: dict[tuple[int, int], int] = {}
        self._comm_key = [(0, 0)] * MAX_COMM
        self._groups: dict[int, tuple[int, int]] = {}     # id(group) -> (name id, size)
        self._group_sizes: dict[str, int] = {}             # group name -> ranks (sent in the hello)
        self._group_refs: list = []
        self._c_traffic = [1.0] * MAX_COMM                 # bytes on the wire per payload byte, per slot
        self._ns_per_byte = 1.0 / DEFAULT_COMM_GBPS
        # the hot path: hooks append events here, _replay makes steps of them (C when built, else Python)
        self._log = (_fast.Log if _fast is not None else _PyLog)(LOG_CAP, self._drain, self._first_opt)
        self._replaying = False
        # device timing of collectives (CUDA/NPU events), see _dev_begin
        self._dev_mods: dict = {}                          # device type -> torch.cuda / torch.npu (False: none)
        self._dev_pool: dict = {}                          # device type -> free events
        self._dev_calls: dict = {}                         # token -> (device type, start event, end event)
        self._dev_next = 0
        self.dev_timed = self.dev_unready = 0
        self._step_ctx = _StepCtx(self)
        self._reset_counters()
        self._reset_step_state()
        self._need_hello = True
        self._last_hello = 0
        self._wall_off = _wall() - _perf()           # wall ns = perf ns + offset (re-anchored per hello)
        self.comm_gbps = DEFAULT_COMM_GBPS
        self.gc_row_min_ns = 0
        self._explicit = False
        self._pending_counts: tuple | None = None
        self._primary_opt: int | None = None
        self._opt_slot: int | None = None
        self._gc_t0 = 0
        self._pid = os.getpid()
        self._step_tid: int | None = None     # the thread that ends steps (its CPU clocks: _cpu_sample)
        self._cpu_clock = _ThreadCpu()
        self._ctl = None                      # targeted profiling (stepwatch.agents.profiling.ProbeControl)
        self._ctl_active = False              # a profile needs step boundaries (every step end replays)
        self._seq = [0] * MAX_COMM            # collectives replayed per comm slot (per-group sequence numbers)
        self._wait_slot = -1                  # the slot of Work.wait() (no collective of its own)
        self._marks: dict[int, int] = {}      # kind phase slot -> perf ns it was marked in the open step
        self._wd = None                       # the watchdog (stepwatch.agents.watchdog), after the first step

    @property
    def _ctl_active(self) -> bool:
        return self._ctl_on

    @_ctl_active.setter
    def _ctl_active(self, on: bool) -> None:
        self._ctl_on = bool(on)
        self._log.eager = 1 if on else 0

    # ------------------------------------------------------------------ state
    def _reset_counters(self) -> None:
        self.n_steps = 0
        self.sent = 0                    # frames (step records, GC bursts) delivered to the agent
        self.datagrams = 0
        self.dropped_full = 0
        self.dropped_no_agent = 0
        self.dropped_error = 0
        self.dropped = 0                 # frames lost: sum of the three above (carried in every step record)
        self.deferred = 0                # datagrams that waited in the backlog (sent later or dropped)
        self.gc_rows_dropped = 0
        self.comm_keys_dropped = 0
        self.phases_dropped = 0
        self.hellos = 0

    def _reset_step_state(self) -> None:
        """All per-step state; the phase lists are allocated here once and only zeroed afterwards."""
        self._open = False
        self._step = 0
        self._t0_perf = 0
        self._t0_wall = 0
        if not hasattr(self, "_ph_ns"):
            self._ph_ns = [0] * MAX_PHASES
            self._ph_used = [False] * MAX_PHASES
            self._ph_touched: list[int] = []      # named phase slots (>= 2) used in this step
        self._calls: list[tuple] = []             # this step's collectives: (slot, count, bytes, ns, wait ns | None)
        self._buckets: dict[int, list] = {}        # this step's DDP buckets per slot (see _bucket_calls)
        self._cpu_rates = (-1.0, -1.0)             # CPU and run-queue wait per wall ns, this replay (see _cpu_sample)
        self._cpu_prev = None                      # (perf ns, cpu ns, wait ns) at the last sample
        self._clear_step()
        self._n_gc = 0

    def _zero_phases(self) -> None:
        ph, used = self._ph_ns, self._ph_used
        ph[0] = ph[1] = 0
        used[0] = used[1] = False
        if self._ph_touched:
            for i in self._ph_touched:
                ph[i] = 0
                used[i] = False
            self._ph_touched.clear()

    def _clear_step(self) -> None:
        """Zero what the last step used (O(phases and collective kinds used), no allocation)."""
        self._zero_phases()
        if self._calls:
            self._calls = []
        self._gc_ns = self._gc_count = 0
        self._data_queue = self._samples = self._tokens = -1

    # ------------------------------------------------------------------ set-up
    def init(self, job: str | None = None, rank: int | None = None, world_size: int | None = None,
             node: str | None = None, socket_dir: str | None = None, local_rank: int | None = None,
             auto: bool = True, start_step: int = 0, comm_gbps: float | None = None,
             gc_row_min_ms: float | None = None, flush_ms: float | None = None, **topology) -> "Probe":
        """Configure the probe and (``auto``) install the PyTorch hooks. Safe to call again.

        Identity defaults: ``job`` from ``STEPWATCH_JOB`` (else ``TORCHELASTIC_RUN_ID``; else the
        agent's ``--job``), ``rank``/``world_size``/``local_rank`` from ``RANK``/``WORLD_SIZE``/
        ``LOCAL_RANK`` (else from ``torch.distributed`` at the first step, else 0/1), ``node`` from
        ``STEPWATCH_NODE`` (else the agent's node name). ``topology`` may hold ``dp, tp, pp, ep, cp,
        device, device_type, dtype, model_flops_per_token, model_params`` (also read from ``STEPWATCH_DP``
        ...; ``model_params`` is otherwise counted from the primary optimizer at its first step).
        ``comm_gbps`` (``STEPWATCH_COMM_GBPS``, default 25) is the link bandwidth of the transfer
        estimate; ``gc_row_min_ms`` (``STEPWATCH_GC_ROW_MIN_MS``, default 0) the shortest collection
        sent as a ``gc`` row (every collection is counted in the step either way); ``flush_ms``
        (``STEPWATCH_FLUSH_MS``, default 500) how long finished steps may wait to share a datagram
        (0: one datagram per step).
        """
        with self._lock:
            self.job = job or os.environ.get("STEPWATCH_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or None
            self.rank = rank if rank is not None else _env_int("RANK")
            self.world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
            self._rank_given, self._world_given = self.rank is not None, self.world_size is not None
            self.local_rank = local_rank if local_rank is not None else _env_int("LOCAL_RANK")
            self.node = node or os.environ.get("STEPWATCH_NODE") or None
            extra = {}
            for k in ("dp", "tp", "pp", "ep", "cp"):
                v = topology.pop(k, None)
                v = v if v is not None else _env_int(f"STEPWATCH_{k.upper()}")
                if v is not None:
                    extra[k] = int(v)
            for k in ("device", "device_type", "dtype", "model_flops_per_token", "model_params"):
                v = topology.pop(k, None) or os.environ.get(f"STEPWATCH_{k.upper()}")
                if v is not None:
                    extra[k] = (float(v) if k == "model_flops_per_token" else int(float(v)) if k == "model_params"
                                else str(v))
            if topology:
                raise TypeError(f"probe.init: unknown argument(s) {', '.join(sorted(topology))}")
            self.extra = extra
            g = comm_gbps if comm_gbps is not None else os.environ.get("STEPWATCH_COMM_GBPS")
            self.comm_gbps = float(g) if g not in (None, "") else DEFAULT_COMM_GBPS
            self._ns_per_byte = 1.0 / self.comm_gbps if self.comm_gbps > 0 else 0.0   # GB/s = bytes/ns
            m = gc_row_min_ms if gc_row_min_ms is not None else os.environ.get("STEPWATCH_GC_ROW_MIN_MS")
            self.gc_row_min_ns = int(float(m) * 1e6) if m not in (None, "") else 0
            f = flush_ms if flush_ms is not None else os.environ.get("STEPWATCH_FLUSH_MS")
            self.flush_ns = int(float(f) * 1e6) if f not in (None, "") else int(DEFAULT_FLUSH_MS * 1e6)
            self._log.drain_ns = self.flush_ns
            self._log.last_drain = self._last_flush = 0     # the first step end is sent at once, with the hello
            self._identity_ready = self.rank is not None and self.world_size is not None
            path = os.path.join(socket_dir or default_socket_dir(), SOCKET_NAME)
            if path != self._path:
                self._connected = False
                self._t_connect = -(1 << 62)
                if self._sock is not None:           # a connected datagram socket cannot be re-pointed
                    self._sock.close()
                    self._sock = None
            self._path = path
            if self._sock is None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                s.setblocking(False)
                self._sock = s
            self._step = int(start_step)
            self._need_hello = self._hello_dirty = True
            self._pid = os.getpid()
            if not self._on:
                gc.callbacks.append(self._gc_cb)
                if not self._installed:
                    os.register_at_fork(after_in_child=self._after_fork)
                    import atexit
                    atexit.register(self.shutdown)
                    try:        # children of multiprocessing end with os._exit(): flush in its finalizers
                        import multiprocessing.util as mpu
                        mpu.register_after_fork(self, Probe._mp_child)
                    except ImportError:
                        pass
                self._installed = True
                self._on = True
        if auto:
            self.install_torch()
        if self._wd is None and self.rank is not None and _is_rank_process():
            self._start_watchdog()                # (its first step may hang too: in-flight kind "first")
        return self

    def install_torch(self) -> bool:
        """Install the optimizer, DataLoader and torch.distributed hooks (once). When torch is not
        imported yet, nothing is imported here: a finder on ``sys.meta_path`` installs the hooks right
        after the program imports torch itself (so ``init()`` may come first, and a program that never
        uses torch never loads it). torch_npu needs nothing more: it runs through the same hooks.
        Returns True when the hooks are in place."""
        if self._hooks:
            return True
        if "torch" not in sys.modules:
            if not any(isinstance(f, _TorchImportHook) for f in sys.meta_path):
                sys.meta_path.insert(0, _TorchImportHook(self))
            return False
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        except ImportError:
            return False
        self._hooks.append(register_optimizer_step_pre_hook(self._log.opt_pre))
        self._hooks.append(register_optimizer_step_post_hook(self._log.opt_post))
        try:
            from torch.utils.data import dataloader as dl
            self._patch_dataloader(dl._BaseDataLoaderIter)
        except (ImportError, AttributeError):
            pass
        try:
            import torch.distributed as dist
            if dist.is_available():
                self._patch_distributed(dist)
                try:            # DDP's reducer all-reduces from C++: time them through a comm hook
                    _sibling("ddp_hooks").patch(self, dist)
                except Exception:  # noqa: BLE001 - no DDP timing, the rest goes on
                    pass
        except ImportError:
            pass
        try:
            self._patch_eval_save(sys.modules["torch"])
        except Exception:  # noqa: BLE001 - step kinds are optional
            pass
        return True

    def shutdown(self) -> None:
        """Send what waits, remove every hook and patch and close the socket (the probe can be
        ``init``-ed again)."""
        if self._on:
            self.flush()
        with self._lock:
            self._on = False
            try:
                gc.callbacks.remove(self._gc_cb)
            except ValueError:
                pass
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            for obj, name, orig in reversed(self._patches):
                setattr(obj, name, orig)
            self._patches.clear()
            for f in [f for f in sys.meta_path if isinstance(f, _TorchImportHook) and f.probe is self]:
                sys.meta_path.remove(f)
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._connected = False
            self._t_connect = -(1 << 62)
            self._backlog.clear()
            self._log.clear()
            self._open = False
            self._ctl_close(unlink=True)
            if self._wd is not None:
                self._wd.close()
                self._wd = None

    def _after_fork(self) -> None:
        """In a forked child: a new probe instance with its own socket and counters. Identity fields
        that were resolved lazily are resolved again (a launcher that forks its ranks); a child that
        never completes a step (a DataLoader worker) never sends anything."""
        self.instance = _new_instance()
        self._hello_every = HELLO_EVERY_NS + (self.instance % 10_000) * 1_000_000
        self._backlog.clear()
        old, self._sock = self._sock, None
        self._connected = False
        self._t_connect = -(1 << 62)
        if old is not None:
            try:
                old.close()
            except OSError:
                pass
        if self._on:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.setblocking(False)
            self._sock = s
        self._reset_counters()
        self._reset_step_state()
        self._n_gc = 0
        self._off = self._frames = 0                  # the parent's pending steps are the parent's
        self._last_flush = 0
        log = self._log                               # ... and so are its events
        log.clear()
        log.primary = log.last_drain = log.in_coll = log.pre_t = 0
        log.dq_need = 1
        self._replaying = False
        self._dev_calls.clear()                       # (the parent's device events)
        self._primary_opt = None
        self._step_tid = None
        self._gc_t0 = 0
        self._last_hello = 0
        self._need_hello = self._hello_dirty = True
        if not self._rank_given:
            self.rank = None
        if not self._world_given:
            self.world_size = None
        self._identity_ready = self.rank is not None and self.world_size is not None
        self._pid = os.getpid()
        self._ctl_close(unlink=False)                 # the parent's control socket stays the parent's
        self._wd = None                               # (its thread did not survive the fork)
        self._seq = [0] * MAX_COMM
        self._marks = {}

    def _mp_child(self) -> None:
        import multiprocessing.util as mpu
        mpu.Finalize(self, self.flush, exitpriority=100)

    # ------------------------------------------------------------------ names
    def _intern(self, name: str) -> int:
        i = self._names.get(name)
        if i is None:
            if len(self._names) >= MAX_NAMES:
                return self._intern("other") if name != "other" else 0
            i = self._names[name] = len(self._names) + 1
            self._need_hello = self._hello_dirty = True
        return i

    def _slot_for_phase(self, name: str) -> int:
        if name == "data":
            return _SLOT_DATA
        if name == "compute":
            return _SLOT_COMPUTE
        s = self._phase_slot.get(name)
        if s is None:
            if len(self._phase_slot) >= MAX_PHASES - 2:
                return -1
            s = self._phase_slot[name] = len(self._phase_slot) + 2
            self._phase_ids[s] = self._intern(name)
        return s

    # ------------------------------------------------------------------ explicit API
    def phase(self, name: str) -> _Phase:
        ctx = self._phase_ctx.get(name)
        if ctx is None:
            ctx = self._phase_ctx[name] = _Phase(self, self._slot_for_phase(name))
        return ctx

    def add_phase(self, name: str, ms: float) -> None:
        """Add ``ms`` to a phase of the current step (for times measured elsewhere)."""
        self._log.add(K_PHASE, self._slot_for_phase(name), 0, 0, int(ms * 1e6), 0.0)

    def _add_phase(self, slot: int, ns: int) -> None:
        if slot < 0:
            self.phases_dropped += 1
            return
        if not self._ph_used[slot]:
            self._ph_used[slot] = True
            if slot >= 2:
                self._ph_touched.append(slot)
        self._ph_ns[slot] += ns

    def count(self, samples: int | None = None, tokens: int | None = None) -> None:
        """Add samples/tokens to the current step."""
        if samples is not None or tokens is not None:
            self._log.add(K_COUNT, 0, int(tokens) if tokens is not None else -1, 0,
                          int(samples) if samples is not None else -1, 0.0)

    def step(self, samples: int | None = None, tokens: int | None = None) -> _StepCtx:
        """``with probe.step():`` one training step (explicit mode)."""
        self._pending_counts = (samples, tokens)
        return self._step_ctx

    def begin_step(self, step: int | None = None) -> None:
        """Start a step (explicit mode); an open step is ended first. ``step`` sets the number."""
        t = _perf()
        log = self._log
        if self._step_tid is None:
            self._step_tid = threading.get_ident()
        log.add(K_BEGIN, 0, t, 0, int(step) if step is not None else -1, 0.0)
        log.dq_need = 1
        pc = self._pending_counts
        if pc is not None:
            self._pending_counts = None
            self.count(*pc)
        if log.eager or log.n >= log.high or t - log.last_drain >= log.drain_ns:
            self._drain()

    def end_step(self) -> None:
        t = _perf()
        log = self._log
        log.add(K_END, 0, t, 0, 0, 0.0)
        log.dq_need = 1
        if log.eager or log.n >= log.high or t - log.last_drain >= log.drain_ns:
            self._drain()

    # ------------------------------------------------------------------ replay: events -> steps
    def _drain(self) -> None:
        """Replay the hot path's events into steps (and send them when due). Called by the hooks at a
        step end (see :class:`_PyLog` for when), by ``flush``/``stats``/``shutdown``, and when the log
        is full."""
        if self._replaying:
            return
        self._replaying = True
        try:
            log = self._log
            log.last_drain = _perf()
            self._cpu_sample(log.last_drain)
            if not log.dev_on:
                log.dev_on = self._accelerator_in_use()
            events = log.drain()
            if not events or not self._on:
                return
            n0 = self.n_steps
            self._replay(events)
            if self._wd is None and self.n_steps:
                self._start_watchdog()
            if self._ctl_on and self.n_steps != n0:
                last = events[-1]             # a profile starts and stops at live step boundaries only
                if last[0] == K_END or last[0] == K_BEGIN or (
                        last[0] == K_OPT_POST and last[4] == self._primary_opt and not self._explicit):
                    self._ctl.on_step(self._step)
        finally:
            self._replaying = False

    def _cpu_sample(self, now: int) -> None:
        """The step thread's CPU time and run-queue wait since the last replay, as rates per wall ns, which
        the replay applies to each step it packs: one ``pread`` per replay (every ~500 ms, or every step
        end where steps are longer or a profile runs), nothing on the step path. A replay run by another
        thread (a collective's callback filling the log) samples nothing; its steps get null."""
        self._cpu_rates = (-1.0, -1.0)
        tid = self._step_tid
        if tid is None or threading.get_ident() != tid:
            return
        c, w = self._cpu_clock.read()
        prev = self._cpu_prev
        self._cpu_prev = (now, c, w)
        if prev is None or now <= prev[0] or c < prev[1]:
            return
        dt = now - prev[0]
        self._cpu_rates = ((c - prev[1]) / dt, (w - prev[2]) / dt if w >= prev[2] >= 0 else -1.0)

    def _replay(self, events: list) -> None:
        """Apply the events, in order, to the step state: what the hooks would have done live. The
        state lives in locals while the batch is replayed (the loop runs once per event, a few
        hundred at a time; attribute traffic per event would be most of its cost)."""
        open_, explicit, t0p, t0w = self._open, self._explicit, self._t0_perf, self._t0_wall
        ph, used, touched = self._ph_ns, self._ph_used, self._ph_touched
        calls, gc_ns, gc_count, dq = self._calls, self._gc_ns, self._gc_count, self._data_queue
        samples, tokens, step = self._samples, self._tokens, self._step
        primary, off = self._primary_opt, self._wall_off
        buf, boff, inst = self._buf, self._off, self.instance
        ids, keys = self._phase_ids, self._comm_key
        traffic, nspb = self._c_traffic, self._ns_per_byte
        opt_slot = self._opt_slot
        seqs, marks = self._seq, self._marks
        rate_c, rate_w = self._cpu_rates
        buckets = self._buckets
        pack = _fast.pack_step if _fast is not None else None      # the frame in one C call
        for kind, slot, t0, t1, a, b in events:
            if kind == K_DATA:
                if not open_ and not explicit:          # automatic mode: the first event opens a step
                    open_, t0p, t0w = True, t0, t0 + off
                    self._zero_phases()
                    calls, gc_ns, gc_count, dq, samples, tokens = [], 0, 0, -1, -1, -1
                if a >= 0 and dq < 0:
                    dq = a
                ph[0] += t1 - t0                        # (the data slot is always sent: no "used" flag)
                continue
            if kind == K_COLL or kind == K_DCOLL:       # raw: summed and split into comm/wait when packed
                if not open_ and not explicit:
                    open_, t0p, t0w = True, t0, t0 + off
                    self._zero_phases()
                    calls, gc_ns, gc_count, dq, samples, tokens = [], 0, 0, -1, -1, -1
                seqs[slot] += 1
                if kind == K_COLL:
                    calls.append((slot, 1, a, t1 - t0, None if b < 0 else b))
                else:                                   # timed on the device (see _dev_begin)
                    calls.append((slot, 1, a, self._dev_time(int(b), t1 - t0), None))
                if len(calls) >= MAX_CALLS:
                    self._calls = calls
                    self._squash_calls()
                    calls = self._calls
                continue
            if kind == K_BUCKET:                        # a DDP bucket: summed per slot, see _bucket_calls
                seqs[slot] += 1                         # (a collective of the group: its sequence number)
                if not open_ and not explicit:
                    open_, t0p, t0w = True, t0, t0 + off
                    self._zero_phases()
                    calls, gc_ns, gc_count, dq, samples, tokens = [], 0, 0, -1, -1, -1
                if b >= 0:                              # timed on the device (see _dev_begin)
                    t1 = t0 + self._dev_time(int(b), t1 - t0)
                bk = buckets.get(slot)
                if bk is None:
                    buckets[slot] = [1, a, t0, t1, a]
                else:
                    bk[0] += 1
                    bk[1] += a
                    if t0 >= bk[2]:
                        bk[2], bk[4] = t0, a
                    if t1 > bk[3]:
                        bk[3] = t1
                continue
            if kind == K_OPT_POST:
                if t0:                                  # the optimizer phase (any optimizer)
                    if not open_ and not explicit:      # (automatic mode: the first one opens a step)
                        open_, t0p, t0w = True, t0, t0 + off
                        self._zero_phases()
                        calls, gc_ns, gc_count, dq, samples, tokens = [], 0, 0, -1, -1, -1
                    if opt_slot is None:
                        opt_slot = self._opt_slot = self._slot_for_phase("optimizer")
                    if opt_slot >= 0:
                        if not used[opt_slot]:
                            used[opt_slot] = True
                            touched.append(opt_slot)
                        ph[opt_slot] += t1 - t0
                if explicit or a != primary:
                    continue
                t0, reopen, number = t1, True, -1       # the primary optimizer: a step ends, the next starts
            elif kind == K_END:
                if not open_:
                    continue
                reopen, number = False, -1
            elif kind == K_BEGIN:
                explicit = self._explicit = True
                if not open_:                           # (what came since the last step end is nobody's)
                    if a >= 0:
                        step = a
                    open_, t0p, t0w = True, t0, t0 + off
                    self._zero_phases()
                    calls, gc_ns, gc_count, dq, samples, tokens = [], 0, 0, -1, -1, -1
                    buckets.clear()
                    continue
                reopen, number = True, a
            elif kind == K_GC:
                gc_ns += t1
                gc_count += 1
                if t1 >= self.gc_row_min_ns:
                    self._gc_row(t0, t1, slot, a, int(b))
                continue
            elif kind == K_PHASE:
                self._add_phase(slot, a)
                continue
            elif kind == K_MARK:
                if slot >= 0 and slot not in marks:
                    marks[slot] = t0
                continue
            elif kind == K_COUNT:
                if a >= 0:
                    samples = (samples if samples > 0 else 0) + a
                if t0 >= 0:
                    tokens = (tokens if tokens > 0 else 0) + t0
                continue
            else:
                continue
            # ---- the open step ends at t0: its frame is packed into the datagram buffer
            wall = t0 + off
            if marks or not self.n_steps:               # step kinds: phases eval/checkpoint/first_step (ms)
                self._kind_phases(t0, t0p)
            self.n_steps += 1
            step_ns = t0 - t0p                          # its CPU time and run-queue wait: at this
            cpu_ns = step_ns * rate_c if rate_c >= 0 else -1.0     # replay's rates (see _cpu_sample)
            cw_ns = step_ns * rate_w if rate_w >= 0 else -1.0
            if buckets:
                self._bucket_calls(calls, buckets)
            if self._connected or t0 - self._t_connect >= self.reconnect_ns:
                if not self._identity_ready:
                    self._resolve_identity()
                if boff > MAX_DATAGRAM - MAX_FRAME:       # the buffer is full: it leaves now
                    self._off = boff
                    self._send_buf(t0)
                    boff = self._off
                n_gc = self._n_gc
                if pack is not None:                     # C: the frame in one call
                    boff = pack(buf, boff, inst, self.rank, step, t0w, wall, t0 - t0p, ph[0],
                                ph[1] if used[1] else -1, gc_ns, gc_count, dq, samples, tokens, self.dropped,
                                touched, ph, ids, calls, traffic, nspb, keys,
                                self._gcmv[16:16 + n_gc * GCREC.size] if n_gc else None, cpu_ns, cw_ns)
                else:
                    boff = self._pack_py(boff, step, t0w, wall, t0 - t0p, gc_ns, gc_count, dq, samples, tokens,
                                         calls, n_gc, cpu_ns, cw_ns)
                self._n_gc = 0
                self._frames += 1
            else:                                        # nobody listens (a reconnect was tried < 1 s ago)
                self._n_gc = 0
                self._lost(1, "no_agent")
            step = step + 1 if number < 0 else number
            # zero what this step used (no allocation but the next step's call list)
            ph[0] = ph[1] = 0
            used[0] = used[1] = False
            if touched:
                for i in touched:
                    ph[i] = 0
                    used[i] = False
                touched.clear()
            if calls:
                calls.clear()
            gc_ns = gc_count = 0
            dq = samples = tokens = -1
            open_, t0p, t0w = reopen, t0, wall
            if (t0 - self._last_flush >= self.flush_ns or self._frames >= MAX_PENDING
                    or (self._need_hello and self._connected)):
                self._off = boff
                self._flush(t0)
                boff = self._off
        self._off = boff
        self._open, self._t0_perf, self._t0_wall, self._calls = open_, t0p, t0w, calls
        self._gc_ns, self._gc_count, self._data_queue = gc_ns, gc_count, dq
        self._samples, self._tokens, self._step = samples, tokens, step

    def _bucket_calls(self, calls: list, buckets: dict) -> None:
        """The step's DDP buckets as one call per slot (and clear them). The reducer launches each
        bucket's all-reduce while backward goes on, so most of their time overlaps computation; what held
        the step is the tail from the last launch (the end of backward) to the last completion. That tail
        is the call's time, split into transfer (the last bucket's payload at ``comm_gbps``) and waiting
        for peers; count and bytes are all the buckets'."""
        nspb, traffic = self._ns_per_byte, self._c_traffic
        for s, (count, nbytes, last_launch, last_done, last_bytes) in buckets.items():
            tail = last_done - last_launch if last_done > last_launch else 0
            tr = last_bytes * traffic[s] * nspb
            calls.append((s, count, nbytes, tail, float(tail - tr) if tail > tr else 0.0))
        buckets.clear()

    def _pack_py(self, boff: int, step: int, t0w: int, wall: int, step_ns: int, gc_ns: int, gc_count: int,
                 dq: int, samples: int, tokens: int, calls: list, n_gc: int, cpu_ns: float = -1.0,
                 cw_ns: float = -1.0) -> int:
        """One step's frame at ``boff`` in the datagram buffer, in Python (``_probefast.pack_step`` does
        the same in C, byte for byte); returns the new offset."""
        buf, mv, inst = self._buf, self._mv, self.instance
        ph, used, touched = self._ph_ns, self._ph_used, self._ph_touched
        ids, keys = self._phase_ids, self._comm_key
        traffic, nspb = self._c_traffic, self._ns_per_byte
        data_ns = ph[0]
        one = None
        if not calls:
            comms, comm_ns, wait_ns = None, 0.0, 0.0
        elif len(calls) == 1:                    # (the common case, without a dict)
            one = calls[0]
            k, count, nbytes, tt, wait = one
            if wait is None:
                tr = nbytes * traffic[k] * nspb
                wait = tt - tr if tt > tr else 0.0
                one = (k, count, nbytes, tt, wait)
            comms, comm_ns, wait_ns = None, tt - wait, wait
        else:
            comms, comm_ns, wait_ns = self._sum_calls(calls)
        if used[1]:
            compute_ns = ph[1]
        else:                                    # not given: the rest of the step, less the run-queue wait
            compute_ns = step_ns - data_ns - comm_ns - wait_ns - gc_ns - (cw_ns if cw_ns > 0 else 0.0)
            if compute_ns < 0:
                compute_ns = 0
        HDR_STEP.pack_into(buf, boff, MAGIC, VERSION, T_BATCH, inst, self.rank, 1,
                           len(comms) if comms else 1 if one else 0, n_gc, len(touched),
                           step, t0w, wall, step_ns, data_ns, compute_ns, comm_ns, wait_ns, gc_ns,
                           gc_count, dq, samples, tokens, self.dropped & 0xFFFFFFFF, cpu_ns, cw_ns)
        boff += HDR_STEP.size
        for i in touched:
            PHASE.pack_into(buf, boff, ids[i], ph[i])
            boff += 16
        if one:
            k, count, nbytes, tt, wait = one
            op, grp = keys[k]
            COMM.pack_into(buf, boff, op, grp, count, nbytes, tt, wait)
            boff += 40
        elif comms:
            for k, (count, nbytes, tt, wait) in comms.items():
                op, grp = keys[k]
                COMM.pack_into(buf, boff, op, grp, count, nbytes, tt, wait)
                boff += 40
        if n_gc:
            k = n_gc * GCREC.size
            mv[boff:boff + k] = self._gcmv[16:16 + k]
            boff += k
        return boff

    # ------------------------------------------------------------------ step kinds and the watchdog
    def _kind_phases(self, t_end: int, t_start: int) -> None:
        """Replay, at a step end: the kinds marked in the step become phases (ms from the mark to the
        step end; ``checkpoint`` also gets the time inside the save calls), and the first step of the
        process gets ``first_step`` (its length)."""
        marks = self._marks
        if marks:
            for s, tm in marks.items():
                self._add_phase(s, max(t_end - tm, 0) if not self._ph_used[s] else 0)
            marks.clear()
        if not self.n_steps:
            self._add_phase(self._slot_for_phase("first_step"), t_end - t_start)

    def _kind_slots(self) -> dict[int, str]:
        """Phase slot -> step kind, for the kinds that have a slot."""
        return {s: KIND_PHASES[n] for n, s in self._phase_slot.items() if n in KIND_PHASES}

    def mark_step_kind(self, kind: str) -> None:
        """Mark the step in progress as ``kind`` (``eval``, ``checkpoint`` or a name of your own): it is
        sent as the phase of that name (ms from the mark to the step end), and the processor's hang and
        stall thresholds for that kind apply to it (see docs/configuration.md)."""
        name = {"first": "first_step"}.get(kind, str(kind))
        self._log.add(K_MARK, self._slot_for_phase(name), _perf(), 0, 0, 0.0)

    def _start_watchdog(self) -> None:
        """Once: at ``init`` in a rank process, else after the process's first step (launchers and
        DataLoader workers never start one)."""
        self._wd = False                              # (not again, whatever happens)
        if os.environ.get("STEPWATCH_WATCHDOG", "1") == "0":
            return
        try:
            self._patch_dcp()
            self._wd = _watchdog_module().Watchdog(self, sys.modules[__name__]).start()
        except Exception:  # noqa: BLE001 - no watchdog, telemetry goes on
            self._wd = False

    def _patch_eval_save(self, torch) -> None:
        """``Module.eval()`` marks the step ``eval``; ``torch.save`` counts as ``checkpoint`` time. Both are
        called a few times per evaluation or checkpoint, never per step."""
        probe_ = self
        mod = getattr(getattr(torch, "nn", None), "Module", None)
        if mod is not None and not getattr(mod.eval, "_stepwatch", False):
            orig_eval = mod.eval

            def eval(module):
                probe_._log.add(K_MARK, probe_._slot_for_phase("eval"), _perf(), 0, 0, 0.0)
                return orig_eval(module)
            eval._stepwatch = True
            eval.__wrapped__ = orig_eval
            self._patch(mod, "eval", eval)
        save = getattr(torch, "save", None)
        if save is not None and not getattr(save, "_stepwatch", False):
            self._patch(torch, "save", self._timed_save(save))

    def _timed_save(self, fn):
        probe_ = self

        def save(*args, **kwargs):
            t0 = _perf()
            try:
                return fn(*args, **kwargs)
            finally:
                probe_._log.add(K_PHASE, probe_._slot_for_phase("checkpoint"), 0, 0, _perf() - t0, 0.0)
        save._stepwatch = True
        save.__wrapped__ = fn
        return save

    def _patch_dcp(self) -> None:
        """``torch.distributed.checkpoint.save`` (and ``async_save``, ``save_state_dict``) count as
        checkpoint time, when the program imported it by its first step."""
        dcp = sys.modules.get("torch.distributed.checkpoint")
        if dcp is None:
            return
        for name in ("save", "async_save", "save_state_dict"):
            fn = getattr(dcp, name, None)
            if fn is not None and not getattr(fn, "_stepwatch", False):
                self._patch(dcp, name, self._timed_save(fn))

    # ------------------------------------------------------------------ step end: pack and send
    def _resolve_identity(self) -> None:
        if self.rank is None or self.world_size is None:
            try:
                dist = sys.modules.get("torch.distributed")
                if dist is not None and dist.is_available() and dist.is_initialized():
                    if self.rank is None:
                        self.rank = dist.get_rank()
                    if self.world_size is None:
                        self.world_size = dist.get_world_size()
            except Exception:  # noqa: BLE001
                pass
            if self.rank is None:
                self.rank = 0
            if self.world_size is None:
                self.world_size = max(1, self.rank + 1)
        self._identity_ready = True
        self._need_hello = self._hello_dirty = True

    def _device(self) -> dict:
        out = {}
        if "device" in self.extra:
            return out
        lr = self.local_rank if self.local_rank is not None else 0
        npu = sys.modules.get("torch_npu")
        torch = sys.modules.get("torch")
        try:
            if npu is not None:
                out["device"] = f"npu:{lr}"
                try:
                    out["device_type"] = str(npu.npu.get_device_name(lr))
                except Exception:  # noqa: BLE001
                    pass
            elif torch is not None and torch.cuda.is_initialized():
                idx = torch.cuda.current_device()
                out["device"] = f"cuda:{idx}"
                out["device_type"] = torch.cuda.get_device_name(idx)
            else:
                out["device"] = "cpu"
        except Exception:  # noqa: BLE001
            pass
        return out

    def hello_payload(self) -> dict:
        torch = sys.modules.get("torch")
        fw = f"pytorch-{torch.__version__}" if torch is not None else "python"
        if sys.modules.get("torch_npu") is not None:
            fw += "+torch_npu"
        d = {"v": VERSION, "job": self.job, "rank": self.rank, "world_size": self.world_size,
             "local_rank": self.local_rank, "pid": os.getpid(), "framework": fw,
             "names": {str(i): n for n, i in self._names.items()}}
        if self._group_sizes:
            d["group_sizes"] = dict(self._group_sizes)
        if self.node:
            d["node"] = self.node
        ctl = self._ctl_path()
        if ctl:
            d["ctl"] = ctl
        d.update(self._device())
        d.update(self.extra)
        return d

    def _send_hello(self, perf: int) -> None:
        self._last_hello = perf
        self._wall_off = _wall() - _perf()
        if not self._connected and perf - self._t_connect < self.reconnect_ns:
            return                              # nobody to tell: do not even build it
        if self._hello_dirty or not self._hello_bytes:
            body = json.dumps(self.hello_payload(), separators=(",", ":")).encode()
            self._hello_bytes = HDR.pack(MAGIC, VERSION, T_HELLO, self.instance, self.rank or 0, 0, 0, 0, 0) + body
            self._hello_dirty = False
        if self._sendto(self._hello_bytes, hello=True):
            self._need_hello = False

    def _sendto(self, data, hello: bool = False, frames: int = 0) -> bool:
        """Hand one datagram (a hello, or ``frames`` frames) to the agent; never blocks, never
        raises. True when it was sent or queued in the backlog, False when it was dropped; lost
        frames are counted (a lost hello is not: it is sent again with the next datagram).

        The socket is connected to the agent's path once (a connected send costs ~3 µs, a send by
        path ~5 µs). While no agent listens, a reconnect is tried at most every ``reconnect_ns``
        (1 s) and datagrams in between are dropped without a system call; a new agent receives the
        hello first. When the agent's queue is full (``EAGAIN``: the kernel queues only
        ``net.unix.max_dgram_qlen`` datagrams, 10 by default) the datagram is copied into a backlog
        of ``MAX_BACKLOG`` that is sent, in order, before the next one; only what falls out of it is
        dropped."""
        if not self._connected:
            now = _perf()
            if now - self._t_connect < self.reconnect_ns:
                self._lost(frames, "no_agent")
                return False
            self._t_connect = now
            try:
                self._sock.connect(self._path)
            except (FileNotFoundError, ConnectionRefusedError, PermissionError):
                self._lost(frames, "no_agent")
                return False
            except (OSError, AttributeError):
                self._lost(frames, "error")
                return False
            self._connected = True
            self._need_hello = True
            if not hello:                           # a new agent learns who we are first
                self._send_hello(now)
        if self._backlog and not self._flush_backlog():
            return self._defer(data, hello, frames)     # keep the order
        try:
            self._sock.send(data)
        except BlockingIOError:
            return self._defer(data, hello, frames)
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
            self._agent_gone()
            self._lost(frames, "no_agent")
            return False
        except OSError:
            self._agent_gone()
            self._lost(frames, "error")
            return False
        except AttributeError:                      # socket closed by shutdown()
            self._lost(frames, "error")
            return False
        if hello:
            self.hellos += 1
        else:
            self.datagrams += 1
            self.sent += frames
        return True

    def _lost(self, frames: int, why: str) -> None:
        if frames:
            if why == "no_agent":
                self.dropped_no_agent += frames
            elif why == "full":
                self.dropped_full += frames
            else:
                self.dropped_error += frames
            self.dropped += frames

    def _agent_gone(self) -> None:
        """The agent went away: forget the connection (reconnect on the next send) and the backlog."""
        self._connected = False
        self._t_connect = 0
        self._need_hello = True
        if self._backlog:
            self._lost(sum(f for _, _, f in self._backlog), "no_agent")
            self._backlog.clear()

    def _defer(self, data, hello: bool, frames: int) -> bool:
        bl = self._backlog
        if len(bl) >= MAX_BACKLOG:
            self._lost(bl.popleft()[2], "full")
        bl.append((bytes(data), hello, frames))
        self.deferred += 1
        return True

    def _flush_backlog(self) -> bool:
        """Send the backlog oldest first; False while the agent's queue is still full."""
        bl = self._backlog
        while bl:
            data, hello, frames = bl[0]
            try:
                self._sock.send(data)
            except BlockingIOError:
                return False
            except (OSError, AttributeError):
                self._agent_gone()
                return False
            bl.popleft()
            if hello:
                self.hellos += 1
            else:
                self.datagrams += 1
                self.sent += frames
        return True

    def flush(self) -> None:
        """Send the finished steps that wait for company now (shutdown and exit do it too)."""
        self._drain()
        self._flush(_perf())

    def _flush(self, perf: int) -> None:
        """Send the frames packed so far (and poll the profiling control socket)."""
        self._last_flush = perf
        if self._ctl is not None:
            self._ctl_poll()
        if self._frames:
            self._send_buf(perf)

    def _send_buf(self, perf: int) -> None:
        """The buffer's frames as one datagram, after the hello when one is due."""
        frames, off = self._frames, self._off
        self._frames = self._off = 0
        if not self._connected and perf - self._t_connect < self.reconnect_ns:
            self._lost(frames, "no_agent")
            return
        if self._need_hello or perf - self._last_hello > self._hello_every:
            self._send_hello(perf)
        self._sendto(self._mv[:off], frames=frames)

    # ------------------------------------------------------------------ automatic hooks
    def _first_opt(self, opt) -> None:
        """Live, once: the first optimizer that finishes a step is the primary one (its step ends
        training steps)."""
        if self._primary_opt is None:
            self._primary_opt = id(opt)
            self._log.primary = id(opt)
            if self._step_tid is None:
                self._step_tid = threading.get_ident()          # whose CPU the steps report
            self._count_params(opt)

    def _gc_cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = _perf()
            return
        if not self._gc_t0:
            return
        t = _perf()
        dt = t - self._gc_t0
        self._gc_t0 = 0
        if self._on:
            self._log.add(K_GC, info.get("generation", 0), t, dt, info.get("collected", 0),
                          float(info.get("uncollectable", 0)))

    def _gc_row(self, t: int, dt: int, generation: int, collected: int, uncollectable: int) -> None:
        """One collection as a ``gc`` row of the step (replay)."""
        n = self._n_gc
        GCREC.pack_into(self._gcbuf, HDR.size + n * GCREC.size, t + self._wall_off, dt, generation,
                        collected, uncollectable)
        n += 1
        if n == MAX_GC and self.n_steps:
            # a burst of collections: send them now on their own (no step record)
            HDR.pack_into(self._gcbuf, 0, MAGIC, VERSION, T_BATCH, self.instance, self.rank, 0, 0, MAX_GC, 0)
            self._sendto(self._gcmv, frames=1)
            n = 0
        elif n == MAX_GC:
            self.gc_rows_dropped += 1       # nothing is sent before the first step: reuse the last slot
            n -= 1
        self._n_gc = n

    def _count_params(self, opt) -> None:
        """Once, at the primary optimizer's first step: the parameters it updates (this rank's share
        under tensor/pipeline parallelism or FSDP) go into the hello as ``model_params`` for the MFU
        estimate, unless the user gave ``model_params``."""
        if "model_params" in self.extra:
            return
        try:
            n = sum(int(p.numel()) for g in opt.param_groups for p in g["params"])
        except Exception:  # noqa: BLE001 - not a torch optimizer
            return
        if n > 0:
            self.extra["model_params"] = n
            self._hello_dirty = self._need_hello = True

    def _patch(self, obj, name: str, new) -> None:
        self._patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    def _patch_dataloader(self, cls) -> None:
        orig = cls.__next__
        w = (_fast.DataWrap(self._log, orig, _queue_depth) if _fast is not None
             else _py_data_wrap(self._log, orig, _queue_depth))
        self._patch(cls, "__next__", w)

    # ------------------------------------------------------------------ collectives
    def _group(self, dist, group) -> tuple[int, int]:
        key = id(group)
        g = self._groups.get(key)
        if g is None:
            try:
                size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            except Exception:  # noqa: BLE001
                size = 1
            if group is None:
                name = "world"
            else:
                name = getattr(group, "group_desc", None) or getattr(group, "group_name", None) or f"pg{len(self._groups)}"
                if name in ("default_pg", "undefined"):
                    name = getattr(group, "group_name", None) or name
            g = self._groups[key] = (self._intern(str(name)), int(size))
            self._group_refs.append(group)          # keep it alive: its id() is our cache key
            self._group_sizes[str(name)] = int(size)
            self._need_hello = self._hello_dirty = True
        return g

    def _comm_slot_for(self, op: str, op_id: int, grp_id: int, size: int) -> int:
        """The accumulator slot of (op, group), created on first use (-1 when all are taken)."""
        key = (op_id, grp_id)
        s = self._comm_slot.get(key)
        if s is None:
            if len(self._comm_slot) >= MAX_COMM:
                return -1
            s = self._comm_slot[key] = len(self._comm_slot)
            self._comm_key[s] = key
            f = _TRAFFIC.get(op)
            self._c_traffic[s] = f(max(size, 1)) if f else (0.0 if op.endswith(("_object", "_object_list"))
                                                              else 1.0)
        return s

    def _record_comm(self, op_id: int, grp_id: int, nbytes: int, dt: int, wait_ns: float) -> None:
        """Add one call with a known wait, ending now (Work.wait(), tests and benchmarks)."""
        key = (op_id, grp_id)
        s = self._comm_slot.get(key)
        if s is None:
            if len(self._comm_slot) >= MAX_COMM:
                self.comm_keys_dropped += 1
                return
            s = self._comm_slot[key] = len(self._comm_slot)
            self._comm_key[s] = key
        t1 = _perf()
        self._log.add(K_COLL, s, t1 - int(dt), t1, int(nbytes), float(wait_ns))

    def _squash_calls(self) -> None:
        """A step with very many collectives: sum its calls so far per slot (bounded memory)."""
        agg, _, _ = self._sum_calls(self._calls)
        self._calls = [(k, c, b, t, w) for k, (c, b, t, w) in agg.items()]

    def _sum_calls(self, calls) -> tuple[dict, float, float]:
        """Per accumulator slot [count, bytes, ns, wait ns], and the step's comm and wait ns. A call
        timed on the CPU without a known wait (a blocking collective) splits into the transfer its
        payload needs at ``comm_gbps`` (comm) and the rest (waiting for peers)."""
        agg: dict[int, list] = {}
        traffic, nspb = self._c_traffic, self._ns_per_byte
        comm_ns = wait_ns = 0.0
        for s, count, nbytes, dt, wait in calls:
            if wait is None:
                tr = nbytes * traffic[s] * nspb
                wait = dt - tr if dt > tr else 0.0
            a = agg.get(s)
            if a is None:
                agg[s] = [count, nbytes, dt, wait]
            else:
                a[0] += count
                a[1] += nbytes
                a[2] += dt
                a[3] += wait
            comm_ns += dt - wait
            wait_ns += wait
        return agg, comm_ns, wait_ns

    def _wrap_collective(self, dist, name: str, fn):
        """A wrapper timing ``fn`` (``_probefast.CollWrap``, or :func:`_py_coll_wrap`): per call, the
        clock twice and one event; the process group's accumulator slot is cached per group object,
        the payload read with ``Tensor.nbytes``."""
        import inspect
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return None
        payload = {"all_gather_into_tensor": "input_tensor", "reduce_scatter": "input_list",
                   "reduce_scatter_tensor": "input", "all_gather_single": "input_tensor",
                   "reduce_scatter_single": "input", "all_to_all": "input_tensor_list",
                   "all_to_all_single": "input", "all_reduce_coalesced": "tensors",
                   "barrier": None}.get(name, None if name.endswith(("_object", "_object_list")) else "tensor")
        p_idx = params.index(payload) if payload in params else -1
        if payload not in params:
            payload = None
        g_idx = params.index("group") if "group" in params else -1
        a_idx = params.index("async_op") if "async_op" in params and name not in ("send", "recv") else -1
        op_id = self._intern(name)

        def resolve(group) -> int:
            grp_id, size = self._group(dist, group)          # (keeps the group alive: the caches use its id)
            return self._comm_slot_for(name, op_id, grp_id, size)

        if _fast is not None:
            w = _fast.CollWrap(self._log, fn, p_idx, g_idx, a_idx, payload, resolve, _nbytes,
                               self._dev_begin, self._dev_end)
        else:
            w = _py_coll_wrap(self._log, fn, p_idx, g_idx, a_idx, payload, resolve, _nbytes,
                              self._dev_begin, self._dev_end)
        w.__name__ = getattr(fn, "__name__", name)
        w.__doc__ = getattr(fn, "__doc__", None)
        return w

    @staticmethod
    def _accelerator_in_use() -> int:
        """1 once this process uses CUDA (its context exists) or has torch_npu loaded: only then do the
        collective wrappers look at their payload's device (checked at every replay until true; never
        initialises CUDA)."""
        if sys.modules.get("torch_npu") is not None:
            return 1
        torch = sys.modules.get("torch")
        try:
            return 1 if torch is not None and torch.cuda.is_initialized() else 0
        except Exception:  # noqa: BLE001
            return 0

    def _dev_begin(self, x) -> int:
        """Live, before a synchronous collective on a device tensor: record a start event on the
        current stream (``torch.cuda.Event``/``torch.npu.Event``, pooled) and return its token (-1:
        no device events; the host time is kept). On CUDA/NPU the host only launches the collective,
        so the host's wall time would be the launch; the events, read at the replay (``query()``
        first: never a synchronisation), give the kernel's time on the device, waiting for peers
        included, which is then split into transfer and wait as on the CPU."""
        kind = x.device.type
        mod = self._dev_mods.get(kind)
        if mod is None:
            torch = sys.modules.get("torch")
            mod = getattr(torch, kind, None) if torch is not None else None
            if mod is None or not hasattr(mod, "Event"):
                mod = False
            self._dev_mods[kind] = mod
        if mod is False or len(self._dev_calls) >= MAX_DEV_CALLS:
            return -1
        pool = self._dev_pool.get(kind)
        if pool:
            e0, e1 = pool.pop()
        else:
            e0, e1 = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
        e0.record()
        tok = self._dev_next
        self._dev_next = (tok + 1) & 0x3FFFFFFF
        self._dev_calls[tok] = (kind, e0, e1)
        return tok

    def _dev_end(self, tok: int) -> None:
        d = self._dev_calls.get(tok)
        if d is not None:
            d[2].record()

    def _dev_time(self, tok: int, host_ns: int) -> int:
        """Replay: the device time of a collective (ns) when its end event completed, else the
        host's (counted in ``dev_unready``); the events go back to the pool."""
        d = self._dev_calls.pop(tok, None)
        if d is None:
            return host_ns
        kind, e0, e1 = d
        try:
            if e1.query():
                self.dev_timed += 1
                host_ns = int(e0.elapsed_time(e1) * 1e6)
            else:
                self.dev_unready += 1
        except Exception:  # noqa: BLE001 - a device error is the training's to report, not ours
            self.dev_unready += 1
        self._dev_pool.setdefault(kind, []).append((e0, e1))
        return host_ns

    def _patch_distributed(self, dist) -> None:
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                     "reduce_scatter_tensor", "broadcast", "reduce", "barrier", "all_to_all",
                     "all_to_all_single", "gather", "scatter", "all_reduce_coalesced", "send", "recv",
                     "isend", "irecv", "all_gather_object", "broadcast_object_list", "gather_object",
                     "scatter_object_list", "all_gather_single", "reduce_scatter_single"):
            fn = getattr(dist, name, None)
            if fn is None or getattr(fn, "_stepwatch", False):
                continue
            w = self._wrap_collective(dist, name, fn)
            if w is not None:
                w._stepwatch = True
                self._patch(dist, name, w)
        dpg = getattr(dist, "destroy_process_group", None)
        if dpg is not None and not getattr(dpg, "_stepwatch", False):
            probe_ = self

            def destroy_process_group(*args, **kwargs):
                probe_.flush()                     # the end of a distributed run: send what waits
                return dpg(*args, **kwargs)

            destroy_process_group._stepwatch = True
            destroy_process_group.__wrapped__ = dpg
            self._patch(dist, "destroy_process_group", destroy_process_group)
        work = getattr(dist, "Work", None)
        if work is not None and hasattr(work, "wait"):
            orig_wait = work.wait
            log = self._log
            slot = self._comm_slot_for("wait", self._intern("wait"), self._intern("async"), 1)
            self._wait_slot = slot

            def wait(w, *args, **kwargs):
                if log.in_coll or slot < 0:
                    return orig_wait(w, *args, **kwargs)
                log.in_coll = 1
                t0 = _perf()
                try:
                    return orig_wait(w, *args, **kwargs)
                finally:
                    t1 = _perf()
                    log.in_coll = 0
                    log.add(K_COLL, slot, t0, t1, 0, float(t1 - t0))     # all of it is waiting

            try:
                self._patch(work, "wait", wait)
            except (TypeError, AttributeError):
                pass

    # ------------------------------------------------------------------ targeted profiling
    def _ctl_path(self) -> str:
        """The control socket announced in the hello (bound on first use; '' when profiling is off:
        ``STEPWATCH_PROFILING=0``). Commands and their handling: :mod:`stepwatch.agents.profiling`."""
        if self._ctl is None:
            if os.environ.get("STEPWATCH_PROFILING", "1") == "0" or not self._path:
                return ""
            try:
                mod = _profiling_module()
            except Exception:  # noqa: BLE001 - no profiling, telemetry goes on
                return ""
            self._ctl = mod.ProbeControl(self, lambda inst, rank: HDR.pack(MAGIC, VERSION, T_PROFILE, inst, rank,
                                                                          0, 0, 0, 0))
        return self._ctl.ensure_bound(os.path.dirname(self._path))

    def _ctl_poll(self) -> None:
        try:
            self._ctl.poll()
        except Exception:  # noqa: BLE001 - profiling never fails training
            self._ctl_active = False

    def _ctl_close(self, unlink: bool) -> None:
        c, self._ctl = self._ctl, None
        self._ctl_active = False
        if c is not None:
            c.close(unlink=unlink)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        """Counters since ``init`` (or the fork that made this process). ``steps`` ended; of their
        frames, ``sent`` reached the agent's socket, ``pending`` wait in the buffer, ``backlog_frames``
        wait in the retry backlog and ``dropped`` (= ``dropped_full + dropped_no_agent +
        dropped_error``) were lost; ``datagrams`` and ``hellos`` sent; ``gc_rows_dropped`` (before
        the first step), ``comm_keys_dropped`` and ``phases_dropped`` (over the fixed capacity);
        ``events_lost`` hot-path events dropped (none unless a replay re-entered with a full log);
        ``fast``: whether the C hot path runs; ``dev_timed``/``dev_unready`` collectives timed by
        device events / by the host because their end event had not completed at the replay.
        Replays the waiting events first."""
        self._drain()
        log = self._log
        return {"fast": FAST, "events_lost": log.lost, "dev_timed": self.dev_timed, "dev_unready": self.dev_unready,"steps": self.n_steps, "sent": self.sent, "dropped": self.dropped, "deferred": self.deferred,
                "backlog": len(self._backlog), "backlog_frames": sum(f for _, _, f in self._backlog),
                "datagrams": self.datagrams, "pending": self._frames,
                "dropped_full": self.dropped_full, "dropped_no_agent": self.dropped_no_agent,
                "dropped_error": self.dropped_error, "gc_rows_dropped": self.gc_rows_dropped,
                "comm_keys_dropped": self.comm_keys_dropped + log.comm_keys_dropped, "phases_dropped": self.phases_dropped,
                "hellos": self.hellos, "socket": self._path, "instance": self.instance,
                "rank": self.rank, "job": self.job}


def _is_rank_process() -> bool:
    """A process started as a rank (torchrun, a scheduler), not a multiprocessing child (DataLoader
    workers, ranks forked by ``mp.spawn``: their watchdog starts after their first step)."""
    try:
        import multiprocessing
        return multiprocessing.parent_process() is None
    except Exception:  # noqa: BLE001
        return False


def _watchdog_module():
    """``stepwatch.agents.watchdog``, or the file next to this one (see :func:`_profiling_module`)."""
    try:
        from stepwatch.agents import watchdog
        return watchdog
    except ImportError:
        mod = sys.modules.get("stepwatch_watchdog")
        if mod is None:
            import importlib.util
            spec = importlib.util.spec_from_file_location(
                "stepwatch_watchdog", os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules["stepwatch_watchdog"] = mod
            spec.loader.exec_module(mod)
        return mod


def _profiling_module():
    return _sibling("profiling")


def _sibling(name: str):
    """``stepwatch.agents.<name>``, or the file next to this one when the probe was loaded on its
    own (``STEPWATCH_PROBE_FILE``, where the package is not importable)."""
    try:
        import importlib
        return importlib.import_module(f"stepwatch.agents.{name}")
    except ImportError:
        mod = sys.modules.get(f"stepwatch_{name}")
        if mod is None:
            import importlib.util
            spec = importlib.util.spec_from_file_location(
                f"stepwatch_{name}", os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"stepwatch_{name}"] = mod
            spec.loader.exec_module(mod)
        return mod


# ---------------------------------------------------------------------------- decoding (agent side)

class BadDatagram(ValueError):
    """A datagram that does not follow the layout above (counted and skipped by the agent)."""


STEP_FIELDS = ("step", "t_start", "t_end", "step_ns", "data_ns", "compute_ns", "comm_ns", "comm_wait_ns",
               "gc_ns", "gc_count", "data_queue", "samples", "tokens", "probe_dropped", "cpu_ns", "cpu_wait_ns")
_NO_CPU = (-1.0, -1.0)


def decode(data: bytes) -> list[tuple[int, int, int, object]]:
    """The frames of one datagram, each ``(type, instance, rank, body)``: for a hello (always alone in
    its datagram) the identity dict, for a batch frame ``(step_tuple | None, [(name_id, ns)],
    [comm tuples], [gc tuples])``. Raises BadDatagram when any part does not follow the layout."""
    n = len(data)
    if n < HDR.size:
        raise BadDatagram(f"short datagram ({n} bytes)")
    out = []
    off = 0
    while off < n:
        if n - off < HDR.size:
            raise BadDatagram(f"{n - off} stray bytes after frame {len(out)}")
        magic, ver, typ, inst, rank, n_step, n_comm, n_gc, n_phase = HDR.unpack_from(data, off)
        if magic != MAGIC:
            raise BadDatagram(f"bad magic 0x{magic:04x}")
        if ver not in VERSIONS:
            raise BadDatagram(f"unsupported version {ver}")
        if typ in (T_HELLO, T_PROFILE, T_INFLIGHT):      # header + one JSON object, alone in its datagram
            what = {T_HELLO: "hello", T_PROFILE: "profile result"}.get(typ, "in-flight state")
            if off:
                raise BadDatagram(f"{what} after a batch frame")
            try:
                body = json.loads(bytes(data[HDR.size:]).decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise BadDatagram(f"undecodable {what}: {e}") from None
            if not isinstance(body, dict):
                raise BadDatagram(f"{what} is not a JSON object")
            return [(typ, inst, rank, body)]
        if typ != T_BATCH:
            raise BadDatagram(f"unknown frame type {typ}")
        if n_step > 1 or n_phase > MAX_PHASES or n_comm > MAX_COMM or n_gc > MAX_GC:
            raise BadDatagram(f"record counts out of range (step {n_step}, phase {n_phase}, comm {n_comm}, "
                              f"gc {n_gc})")
        st = STEP if ver == VERSION else STEP_V1
        size = HDR.size + n_step * st.size + n_phase * PHASE.size + n_comm * COMM.size + n_gc * GCREC.size
        if off + size > n:
            raise BadDatagram(f"frame {len(out)} needs {size} bytes, {n - off} left")
        p = off + HDR.size
        step = None
        if n_step:
            step = st.unpack_from(data, p)
            if st is STEP_V1:
                step += _NO_CPU
            p += st.size
        phases = []
        for _ in range(n_phase):
            phases.append(PHASE.unpack_from(data, p))
            p += PHASE.size
        comm = []
        for _ in range(n_comm):
            comm.append(COMM.unpack_from(data, p))
            p += COMM.size
        gcs = []
        for _ in range(n_gc):
            gcs.append(GCREC.unpack_from(data, p))
            p += GCREC.size
        out.append((typ, inst, rank, (step, phases, comm, gcs)))
        off += size
    return out


# ---------------------------------------------------------------------------- module-level API

_probe = Probe()


def init(**kw) -> Probe:
    return _probe.init(**kw)


def step(samples: int | None = None, tokens: int | None = None) -> _StepCtx:
    return _probe.step(samples, tokens)


def begin_step(step: int | None = None) -> None:
    _probe.begin_step(step)


def end_step() -> None:
    _probe.end_step()


def phase(name: str) -> _Phase:
    return _probe.phase(name)


def add_phase(name: str, ms: float) -> None:
    _probe.add_phase(name, ms)


def count(samples: int | None = None, tokens: int | None = None) -> None:
    _probe.count(samples, tokens)


def stats() -> dict:
    return _probe.stats()


def mark_step_kind(kind: str) -> None:
    """Mark the step in progress as ``kind`` (``eval``, ``checkpoint``, ...); see :meth:`Probe.mark_step_kind`."""
    _probe.mark_step_kind(kind)


def flush() -> None:
    _probe.flush()


def shutdown() -> None:
    _probe.shutdown()


def get() -> Probe:
    """The process-wide probe."""
    return _probe


def auto_install() -> None:
    """Zero-code mode (``stepwatch wrap``): init from the environment with the automatic hooks."""
    if not _probe._on:
        _probe.init(auto=True)

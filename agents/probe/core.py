"""The probe itself: :class:`Probe`, its set-up (``init``, fork, ``shutdown``), the explicit step API, the
watchdog and profiling control, and its counters. It composes parts, each given its collaborators:
:class:`.transport.Transport` (socket, hello, buffer, backlog), :class:`.names.Names` (ids and slots),
:class:`.timing.DeviceTiming` (device events), :class:`.flops.Flops` (FLOPs, dtype),
:class:`.identity.Identity` (who it is), :class:`.fold.StepFold` (events -> frames), :class:`.hooks.Hooks`
(torch patching), :class:`.exitwatch.ExitWatch` (the goodbye), the watchdog and the profiling control;
docs/architecture.md lists what each is given. The hot path
(``begin_step``/``end_step`` and the hooks' events) is :mod:`.eventlog`'s log, held by the probe."""
from __future__ import annotations

import gc
import os
import sys
import threading

from . import eventlog as _ev
from .collectives import DEFAULT_COMM_GBPS
from .exitwatch import ExitWatch
from .flops import Flops
from .names import Names
from .eventlog import K_BEGIN, K_COUNT, K_END, K_GC, K_MARK, K_OPT_POST, K_PHASE, LOG_CAP, _PyLog, _perf
from .hooks import Hooks
from .fold import StepFold
from .identity import Identity
from .timing import DeviceTiming
from .transport import Transport, device_fields
from stepwatch.wire.datagram import DEFAULT_FLUSH_MS, HDR, MAGIC, SOCKET_NAME, T_PROFILE, VERSION, default_socket_dir


HOLD_NS = 1_000_000_000        # a step boundary waits at most this long for its device event (see Probe._hold)
HOLD_EVENTS = LOG_CAP          # ... and with at most this many events behind it
SLURM_ID_MAX = 2**32 - 1       # Slurm's job and step ids are uint32 (the batch step is 4294967294)


def _env_int(name: str, slurm: str | None = None) -> int | None:
    """``$name`` as an int; else (a task ``srun`` started, not a launcher such as torchrun, whose workers get
    ``RANK`` from it) Slurm's ``$slurm``."""
    v = os.environ.get(name)
    if v in (None, "") and slurm and os.environ.get("SLURM_JOB_ID") and not _is_launcher():
        v = os.environ.get(slurm)
    try:
        return int(v) if v not in (None, "") else None
    except ValueError:
        return None


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


def _of(part: str, name: str) -> property:
    """An attribute of the probe that is its part's (read and written through)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, v: setattr(getattr(self, part), name, v), doc=f"``{part}.{name}``")


class Probe:
    """One per process (the module-level functions use a singleton). Lifecycle: ``init`` ->
    steps -> ``shutdown`` (also at interpreter exit)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._on = False
        self._installed = False
        self._phase_ctx: dict[str, _Phase] = {}
        # the hot path: hooks append events here, the fold makes steps of them (C when built, else Python)
        fast = _ev._fast
        self._log = (fast.Log if fast is not None else _PyLog)(LOG_CAP, self._drain, self._first_opt)
        self._replaying = False
        self._step_ctx = _StepCtx(self)
        # its parts, each given what it uses: the socket to the agent (the hello: this probe's identity;
        # the frames the fold packs; a hello heard arms the goodbye), who this probe is, the names' ids and
        # slots, device timing, FLOPs, the fold (events -> steps -> frames) and the goodbye
        self.transport = Transport(self._log, self.hello_payload, lambda: self._exitw.on_hello(), self._ctl_tick)
        self.identity = Identity(self.transport.hello_changed)
        self.names = Names(self.transport.hello_changed)
        self.timing = DeviceTiming()
        self._log.on_step = self.timing.step_mark      # (called at step ends only while dev_on)
        self._held: list = []                 # events from the first step boundary whose device event runs
        self.flops = Flops(self.identity.extra, self.transport.hello_changed)
        self.fold = StepFold(self.transport, self.timing, self.names, self.identity)
        self._exitw = ExitWatch(self.transport, self.identity, self.fold, self.flush, lambda: self._on)   # (exitwatch)
        self.hooks = Hooks(self._log, self.names, self.timing, self.flush, lambda: self._on)   # torch patching
        self.comm_gbps = DEFAULT_COMM_GBPS
        self._pending_counts: tuple | None = None
        self._gc_t0 = 0
        self._pid = os.getpid()
        self._step_tid: int | None = None     # the thread that ends steps (its CPU clocks: StepFold.cpu_sample)
        self._ctl = None                      # targeted profiling (stepwatch.agents.profiling.ProbeControl)
        self._ctl_active = False              # a profile needs step boundaries (every step end replays)
        self._wd = None                       # the watchdog (stepwatch.agents.probe.watchdog), after the first step

    @property
    def _ctl_active(self) -> bool:
        return self._ctl_on

    @_ctl_active.setter
    def _ctl_active(self, on: bool) -> None:
        self._ctl_on = bool(on)
        self._log.eager = 1 if on else 0

    def set_flops_per_token(self, flops: float, *, per: str = "token") -> None:     # the FLOPs API: flops.Flops
        self.flops.set_flops_per_token(flops, per=per)

    def count_flops(self, step_fn, *args, tokens: int | None = None, samples: int | None = None, **kwargs):
        return self.flops.count_flops(step_fn, *args, tokens=tokens, samples=samples, **kwargs)

    def set_model_shape(self, *, layers: int, heads: int, hidden: int, seq_len: int, model=None,
                        params: float | None = None) -> float:
        return self.flops.set_model_shape(layers=layers, heads=heads, hidden=hidden, seq_len=seq_len, model=model,
                                          params=params)

    def flush(self) -> None:
        """Send the finished steps that wait for company now (shutdown and exit do it too)."""
        self._drain(force=True)
        self.transport.flush(_perf())

    def hello_payload(self) -> dict:
        torch = sys.modules.get("torch")
        fw = f"pytorch-{torch.__version__}" if torch is not None else "python"
        if sys.modules.get("torch_npu") is not None:
            fw += "+torch_npu"
        d = {"v": VERSION, "job": self.job, "rank": self.rank, "world_size": self.world_size,
             "local_rank": self.local_rank, "pid": os.getpid(), "framework": fw,
             "names": {str(i): n for n, i in self.names.ids.items()}}
        if self.names.group_sizes:
            d["group_sizes"] = dict(self.names.group_sizes)
        if self.node:
            d["node"] = self.node
        ctl = self._ctl_path()
        if ctl:
            d["ctl"] = ctl
        d.update(device_fields(self.extra, self.local_rank))
        d.update(self.extra)
        tok = os.environ.get("STEPWATCH_JOB_TOKEN")       # the job's own secret: its pods share the job (agent)
        if tok:
            d["job_token"] = tok
        return d

    counted_flops = property(lambda self: self.flops.counted_flops)
    dev_timed = property(lambda self: self.timing.timed)
    dev_unready = property(lambda self: self.timing.unready)
    # the parts', read (and written) on the probe as before
    instance, sent, datagrams, deferred, hellos, dropped, dropped_full, dropped_no_agent, dropped_error, flush_ns, \
        reconnect_ns = (_of("transport", n) for n in (
            "instance", "sent", "datagrams", "deferred", "hellos", "dropped", "dropped_full", "dropped_no_agent",
            "dropped_error", "flush_ns", "reconnect_ns"))
    job, rank, world_size, local_rank, node, extra = (_of("identity", n) for n in (
        "job", "rank", "world_size", "local_rank", "node", "extra"))
    n_steps, gc_rows_dropped, phases_dropped, gc_row_min_ns = (_of("fold", n) for n in (
        "n_steps", "gc_rows_dropped", "phases_dropped", "gc_row_min_ns"))
    comm_keys_dropped = _of("hooks", "comm_keys_dropped")

    def _drain(self, force: bool = False) -> None:
        """Fold the hot path's events into steps (and send them when due). Called by the hooks at a
        step end (see :class:`_PyLog` for when), by ``flush``/``stats``/``shutdown``, and when the log
        is full. On an accelerator the events from the first step boundary whose device event has not
        completed wait for the next drain (see :meth:`_hold`); ``force`` (flush, shutdown) folds all."""
        if self._replaying:
            return
        self._replaying = True
        try:
            log = self._log
            log.last_drain = _perf()
            fold = self.fold
            fold.cpu_sample(log.last_drain, self._step_tid)
            if not log.dev_on:
                log.dev_on = self.timing.accelerator_in_use()
            tr = self.transport
            if tr.backlog:                        # the agent's queue was full: its room first
                tr.flush_backlog()
            events = log.drain()
            if self._held:
                events = self._held + events
                self._held = []
            if self.timing.marks and not force:
                events = self._hold(events, log.last_drain)
            if not events or not self._on:
                return
            n0 = fold.n_steps
            fold.replay(events)
            tr.flush_due(log.last_drain)            # (by the drain's clock: when the steps it folded leave)
            if self._wd is None and fold.n_steps:
                self._start_watchdog()
            if self._ctl_on and fold.n_steps != n0:
                last, pos = events[-1], fold.position()   # a profile starts and stops at live step boundaries only
                if last[0] == K_END or last[0] == K_BEGIN or (
                        last[0] == K_OPT_POST and last[4] == pos.primary and not pos.explicit):
                    self._ctl.on_step(pos.step)
        finally:
            self._replaying = False

    def _hold(self, events: list, now: int) -> list:
        """The events to fold now: those before the first step boundary whose device event (see
        :meth:`DeviceTiming.step_mark`) has not completed; the rest wait in ``_held`` for the next
        drain, for at most ``HOLD_NS`` and ``HOLD_EVENTS`` (a device that stopped, a flood of events:
        then they fold with the host's times)."""
        ready = self.timing.step_ready
        for i, ev in enumerate(events):
            b = ev[5]
            if b and (ev[0] == K_OPT_POST or ev[0] == K_END or ev[0] == K_BEGIN) and not ready(int(b) - 1):
                t = ev[3] if ev[0] == K_OPT_POST else ev[2]
                if now - t < HOLD_NS and len(events) - i <= HOLD_EVENTS:
                    self._held = events[i:]
                    return events[:i]
                break
        return events

    def init(self, job: str | None = None, rank: int | None = None, world_size: int | None = None,
             node: str | None = None, socket_dir: str | None = None, local_rank: int | None = None,
             auto: bool = True, start_step: int = 0, comm_gbps: float | None = None,
             gc_row_min_ms: float | None = None, flush_ms: float | None = None, **topology) -> "Probe":
        """Configure the probe and (``auto``) install the PyTorch hooks. Safe to call again.

        Identity defaults: ``job`` from ``STEPWATCH_JOB`` (else ``SLURM_JOB_ID``, else
        ``TORCHELASTIC_RUN_ID``; else the agent's ``--job``), ``rank``/``world_size``/``local_rank`` from
        ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (else, in a task ``srun`` started, ``SLURM_PROCID``/
        ``SLURM_NTASKS``/``SLURM_LOCALID``; else from ``torch.distributed`` at the first step, else 0/1),
        ``node`` from ``STEPWATCH_NODE`` (else ``SLURMD_NODENAME``, else the agent's node name); the topology's
        ``slurm_job``/``slurm_step`` from ``SLURM_JOB_ID``/``SLURM_STEP_ID`` (to join ``sacct``). ``topology`` may hold ``dp, tp, pp, ep, cp,
        device, device_type, dtype, model_flops_per_token, model_params`` (also read from ``STEPWATCH_DP``
        ...; ``model_params`` is otherwise counted from the primary optimizer at its first step; FLOPs by
        count or shape, and the dtype seen: ``flops.py``).
        ``comm_gbps`` (``STEPWATCH_COMM_GBPS``, default 25) is the link bandwidth of the transfer
        estimate; ``gc_row_min_ms`` (``STEPWATCH_GC_ROW_MIN_MS``, default 0) the shortest collection
        sent as a ``gc`` row (every collection is counted in the step either way); ``flush_ms``
        (``STEPWATCH_FLUSH_MS``, default 500) how long finished steps may wait to share a datagram
        (0: one datagram per step)."""
        with self._lock:
            env = os.environ
            self.job = (job or env.get("STEPWATCH_JOB") or env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID")
                        or None)
            self.rank = rank if rank is not None else _env_int("RANK", "SLURM_PROCID")
            self.world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", "SLURM_NTASKS")
            self.identity.rank_given, self.identity.world_given = self.rank is not None, self.world_size is not None
            self.local_rank = local_rank if local_rank is not None else _env_int("LOCAL_RANK", "SLURM_LOCALID")
            self.node = node or env.get("STEPWATCH_NODE") or env.get("SLURMD_NODENAME") or None
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
            for k, var in (("slurm_job", "SLURM_JOB_ID"), ("slurm_step", "SLURM_STEP_ID")):
                v = env.get(var) or ""
                if v.isdigit() and int(v) <= SLURM_ID_MAX:     # the Slurm job and step, for sacct (topology)
                    extra[k] = int(v)
            if "model_flops_per_token" in extra:
                extra["flops_source"] = "user"          # (see flops.py: the user's figure wins)
            if topology:
                raise TypeError(f"probe.init: unknown argument(s) {', '.join(sorted(topology))}")
            self.extra.clear()                  # (in place: the flops part holds it)
            self.extra.update(extra)
            g = comm_gbps if comm_gbps is not None else os.environ.get("STEPWATCH_COMM_GBPS")
            self.comm_gbps = float(g) if g not in (None, "") else DEFAULT_COMM_GBPS
            m = gc_row_min_ms if gc_row_min_ms is not None else os.environ.get("STEPWATCH_GC_ROW_MIN_MS")
            self.fold.configure(start_step, self.comm_gbps, int(float(m) * 1e6) if m not in (None, "") else 0)
            f = flush_ms if flush_ms is not None else os.environ.get("STEPWATCH_FLUSH_MS")
            tr = self.transport
            tr.flush_ns = int(float(f) * 1e6) if f not in (None, "") else int(DEFAULT_FLUSH_MS * 1e6)
            self._log.drain_ns = tr.flush_ns
            self._log.last_drain = tr.last_flush = 0     # the first step end is sent at once, with the hello
            self.identity.ready = self.rank is not None and self.world_size is not None
            tr.open(os.path.join(socket_dir or default_socket_dir(), SOCKET_NAME))
            self._pid = os.getpid()
            if not self._on:
                gc.callbacks.append(self._gc_cb)
                if not self._installed:
                    os.register_at_fork(after_in_child=self._after_fork)
                    import atexit
                    atexit.register(self.shutdown)
                    atexit.register(self._exitw.at_exit)     # (LIFO: the goodbye before the shutdown)
                    self._exitw.install()
                    mp = sys.modules.get("multiprocessing")
                    if mp is not None and mp.parent_process() is not None:   # it ends with os._exit
                        import multiprocessing.util as mpu
                        mpu.Finalize(self, self._exitw.at_exit, exitpriority=101)
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
            self.hooks.remove()
            self.transport.close()
            self._log.clear()
            self._held = []
            self.fold.drop_open()
            self._ctl_close(unlink=True)
            if not self._exitw.sent:       # at exit the signal goodbyes stay armed (an abort in teardown)
                self._exitw.close()
            if self._wd:                              # (False: none was started, or it is off)
                self._wd.close()
                self._wd = None

    def _after_fork(self) -> None:
        """In a forked child: a new probe instance with its own socket and counters. Identity fields
        that were resolved lazily are resolved again (a launcher that forks its ranks); a child that
        never completes a step (a DataLoader worker) never sends anything."""
        self.transport.after_fork(reopen=self._on)   # new instance, socket, counters; the parent's frames stay its
        self.hooks.comm_keys_dropped = 0
        self.fold.after_fork()                        # the parent's steps are the parent's
        log = self._log                               # ... and so are its events
        log.clear()
        log.primary = log.last_drain = log.in_coll = log.pre_t = 0
        log.dq_need = 1
        self._replaying = False
        self.timing.after_fork()                      # (the parent's device events)
        self._held = []
        self._step_tid = None
        self._gc_t0 = 0
        self.identity.after_fork()
        self._pid = os.getpid()
        self._exitw.after_fork()                      # the parent's goodbye is the parent's
        self._ctl_close(unlink=False)                 # the parent's control socket stays the parent's
        self._wd = None                               # (its thread did not survive the fork)

    def _first_opt(self, opt) -> None:
        """Live, once: the first optimizer that finishes a step is the primary one (its step ends
        training steps)."""
        if self.fold.claim_primary(id(opt)):
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
            self.transport.hello_changed()
        self.flops.watch_dtype_once()             # the compute dtype, at the next forward (flops.py)

    def install_torch(self) -> bool:
        """The optimizer, DataLoader and torch.distributed hooks, installed once (:meth:`.hooks.Hooks.install_torch`)."""
        return self.hooks.install_torch()

    def _mp_child(self) -> None:
        import multiprocessing.util as mpu
        mpu.Finalize(self, self.flush, exitpriority=100)
        mpu.Finalize(self, self._exitw.at_exit, exitpriority=101)     # (first: it flushes too)

    def phase(self, name: str) -> _Phase:
        ctx = self._phase_ctx.get(name)
        if ctx is None:
            ctx = self._phase_ctx[name] = _Phase(self, self.names.slot_for_phase(name))
        return ctx

    def add_phase(self, name: str, ms: float) -> None:
        """Add ``ms`` to a phase of the current step (for times measured elsewhere)."""
        self._log.add(K_PHASE, self.names.slot_for_phase(name), 0, 0, int(ms * 1e6), 0.0)

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
        log.add(K_BEGIN, 0, t, 0, int(step) if step is not None else -1,
                self._mark() if log.dev_on else 0.0)
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
        log.add(K_END, 0, t, 0, 0, self._mark() if log.dev_on else 0.0)
        log.dq_need = 1
        if log.eager or log.n >= log.high or t - log.last_drain >= log.drain_ns:
            self._drain()

    def _mark(self) -> float:
        """A step boundary's device event, as the event's ``b`` (token + 1; 0.0: none)."""
        try:
            tok = self.timing.step_mark()
        except Exception:  # noqa: BLE001 - telemetry never fails training
            return 0.0
        return tok + 1.0 if tok >= 0 else 0.0

    def mark_step_kind(self, kind: str) -> None:
        """Mark the step in progress as ``kind`` (``eval``, ``checkpoint`` or a name of your own): it is
        sent as the phase of that name (ms from the mark to the step end), and the processor's hang and
        stall thresholds for that kind apply to it (see docs/configuration.md)."""
        name = {"first": "first_step"}.get(kind, str(kind))
        self._log.add(K_MARK, self.names.slot_for_phase(name), _perf(), 0, 0, 0.0)

    def mark_change(self, what: str) -> None:
        """Announce a change of the job's own from the step in progress on (a new batch size, sequence
        length, learning-rate phase, model stage): sent as the phase ``change:<what>``; the processor's
        detectors that judge the job against its own past (change points, jitter, MFU) start new
        baselines at this step instead of reporting the change as a regression."""
        self.mark_step_kind("change:" + str(what)[:64])

    def _start_watchdog(self) -> None:
        """Once: at ``init`` in a rank process, else after the process's first step (launchers and
        DataLoader workers never start one)."""
        self._wd = False                              # (not again, whatever happens)
        if os.environ.get("STEPWATCH_WATCHDOG", "1") == "0":
            return
        try:
            self.hooks.patch_dcp()
            self._wd = self.make_watchdog().start()
        except Exception:  # noqa: BLE001 - no watchdog, telemetry goes on
            self._wd = False

    def make_watchdog(self, **settings):
        """A :class:`.watchdog.Watchdog` (not started) given this probe's parts; ``settings``: its
        ``period_s``, ``min_s``, ``factor``, ``resend_s``."""
        from . import watchdog
        return watchdog.Watchdog(self._log, self.fold, self.names, self.hooks, self.transport, self.identity,
                                 lambda: self._held, lambda: not self._on or self._replaying, **settings)

    def _ctl_path(self) -> str:
        """The control socket announced in the hello (bound on first use; '' when profiling is off:
        ``STEPWATCH_PROFILING=0``). Commands and their handling: :mod:`stepwatch.agents.profiling`."""
        if self._ctl is None:
            if os.environ.get("STEPWATCH_PROFILING", "1") == "0" or not self.transport.path:
                return ""
            try:
                mod = _profiling_module()
            except Exception:  # noqa: BLE001 - no profiling, telemetry goes on
                return ""
            self._ctl = mod.ProbeControl(self.transport, self.identity,
                                         lambda inst, rank: HDR.pack(MAGIC, VERSION, T_PROFILE, inst, rank, 0, 0, 0, 0),
                                         lambda on: setattr(self, "_ctl_active", on))
        return self._ctl.ensure_bound(os.path.dirname(self.transport.path))

    def _ctl_tick(self) -> None:
        """At every flush of the transport: poll the profiling control socket, when one is bound."""
        if self._ctl is None:
            return
        try:
            self._ctl.poll()
        except Exception:  # noqa: BLE001 - profiling never fails training
            self._ctl_active = False

    def _ctl_close(self, unlink: bool) -> None:
        c, self._ctl = self._ctl, None
        self._ctl_active = False
        if c is not None:
            c.close(unlink=unlink)

    def stats(self) -> dict:
        """Counters since ``init`` (or the fork that made this process). ``steps`` ended; of their
        frames, ``sent`` reached the agent's socket, ``pending`` wait in the buffer, ``backlog_frames``
        wait in the retry backlog and ``dropped`` (= ``dropped_full + dropped_no_agent +
        dropped_error``) were lost; ``datagrams`` and ``hellos`` sent; ``gc_rows_dropped`` (before
        the first step), ``comm_keys_dropped`` and ``phases_dropped`` (over the fixed capacity);
        ``events_lost`` hot-path events dropped (none unless a replay re-entered with a full log);
        ``fast``: whether the C hot path runs; ``dev_timed``/``dev_unready`` collectives timed by
        device events / by the host because their end event had not completed at the replay;
        ``dev_steps_timed``/``dev_steps_unready`` the same for step times (see
        :meth:`DeviceTiming.step_mark`), ``held`` the events waiting for a step boundary's device event.
        Replays the waiting events first (but those held)."""
        self._drain()
        log, tr = self._log, self.transport
        return {"fast": _ev.FAST, "events_lost": log.lost, "dev_timed": self.timing.timed, "dev_unready": self.timing.unready, "dev_steps_timed": self.timing.steps_timed, "dev_steps_unready": self.timing.steps_unready, "held": len(self._held), "steps": self.fold.n_steps, "sent": tr.sent, "dropped": tr.dropped, "deferred": tr.deferred,
                "backlog": len(tr.backlog), "backlog_frames": sum(f for _, _, f in tr.backlog),
                "datagrams": tr.datagrams, "pending": tr.frames,
                "dropped_full": tr.dropped_full, "dropped_no_agent": tr.dropped_no_agent,
                "dropped_error": tr.dropped_error, "gc_rows_dropped": self.fold.gc_rows_dropped,
                "comm_keys_dropped": self.hooks.comm_keys_dropped + log.comm_keys_dropped, "phases_dropped": self.fold.phases_dropped,
                "hellos": tr.hellos, "socket": tr.path, "instance": tr.instance,
                "rank": self.rank, "job": self.job}


def _is_launcher() -> bool:
    """This process is torchrun (``torchrun`` or ``python -m torch.distributed.run``), not a rank."""
    if os.path.basename(sys.argv[0] if sys.argv else "") == "torchrun":
        return True
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", "") in ("torch.distributed.run", "torch.distributed.launch")


def _is_rank_process() -> bool:
    """A process started as a rank (torchrun, a scheduler), not a multiprocessing child (DataLoader
    workers, ranks forked by ``mp.spawn``: their watchdog starts after their first step)."""
    try:
        import multiprocessing
        return multiprocessing.parent_process() is None
    except Exception:  # noqa: BLE001
        return False


def _profiling_module():
    return _sibling("profiling")


def _sibling(name: str):
    """``stepwatch.agents.<name>``, or the file in the directory above this package when the probe was
    loaded on its own (``stepwatch wrap``'s ``STEPWATCH_PROBE_FILE``, where ``stepwatch`` is not importable)."""
    try:
        import importlib
        return importlib.import_module(f"stepwatch.agents.{name}")
    except ImportError:
        mod = sys.modules.get(f"stepwatch_{name}")
        if mod is None:
            import importlib.util
            here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name)
            if os.path.isdir(here):               # a package (profiling/): by its directory, like the probe itself
                spec = importlib.util.spec_from_file_location(f"stepwatch_{name}", os.path.join(here, "__init__.py"),
                                                              submodule_search_locations=[here])
            else:
                spec = importlib.util.spec_from_file_location(f"stepwatch_{name}", here + ".py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"stepwatch_{name}"] = mod
            spec.loader.exec_module(mod)
        return mod

"""The probe's view of DistributedDataParallel's gradient all-reduces (loaded by ``probe.install_torch``).

DDP's reducer launches one all-reduce per gradient bucket from C++, while backward runs: those calls never
pass the ``torch.distributed`` wrappers, so without this module a DDP job reports no communication at all.
The probe therefore patches ``DistributedDataParallel`` so that every model's buckets go through a
*communication hook* of its own (``register_comm_hook``, the API DDP provides for this) that keeps what the
reducer would have done and times it:

- **No hook of the user's** (the common case): at the model's first forward the probe registers
  :func:`stepwatch_allreduce_hook`, which does what DDP's built-in reduction does (divide the bucket by
  the group size, all-reduce it asynchronously, hand back the result) and logs each bucket from the launch
  to the completion of its all-reduce (one ``K_BUCKET`` event, appended from the completion callback).
- **The user registers a hook** (``register_comm_hook``, before or after the first forward; DDP's own
  mixed-precision hook included): it runs inside the probe's hook, unchanged, and its future is timed the
  same way. A built-in C++ hook (``_register_builtin_comm_hook``) registered before the first forward is
  left alone and is not timed; one registered after the probe's hook is run as its Python equivalent
  (``ALLREDUCE``: the probe's own; ``FP16_COMPRESS``: ``default_hooks.fp16_compress_hook``).
- DDP under compiled autograd's Python reducer (``_use_python_reducer``) calls hooks differently and is
  left alone.

The replay (``StepFold._bucket_calls``) turns a step's buckets into one ``all_reduce`` call on the model's
process group: the buckets overlap backward, so the time that held the step is the tail from the last
launch (the end of backward) to the last completion, split into transfer and waiting for peers.

On CUDA/NPU a bucket on a device tensor is bracketed by the probe's device events (``DeviceTiming.begin``;
the end event is recorded in the completion callback, which runs on the all-reduce's stream), so its time
is the device's; this path has not been run on a GPU by the sessions that wrote it.

Only the standard library and torch (already imported by the program, reached through
:func:`.torchref.loaded`) are used, like the rest of the probe's package.
"""
from __future__ import annotations

import time

from .eventlog import K_BUCKET
from .torchref import loaded


class BucketTimer:
    """The comm hook state of one DDP model: its process group and slot, and the user's hook if any."""

    def __init__(self, hooks, dist, ddp):
        self.hooks = hooks
        self.perf = time.perf_counter_ns        # the probe's clock
        pg = getattr(ddp, "process_group", None)
        try:
            if pg is None or pg is dist.distributed_c10d._get_default_group():
                pg = None                      # the default group: "world", as for the wrapped collectives
        except Exception:  # noqa: BLE001
            pass
        self.group = pg
        ar = dist.all_reduce
        self.all_reduce = getattr(ar, "__wrapped__", ar)       # the original: no second timing
        try:
            self.size = dist.get_world_size(pg) if pg is not None else dist.get_world_size()
        except Exception:  # noqa: BLE001
            self.size = 1
        grp_id, gsize = hooks.names.group(dist, pg)
        self.slot = hooks.names.comm_slot_for("all_reduce", hooks.names.intern("all_reduce"), grp_id, gsize)
        self.user = self.user_state = None
        self.registered = False                # the probe's hook is in the reducer
        self.builtin = False                   # a C++ built-in hook is (untimed)
        # buckets launched and not yet complete: DDP's reducer waits for them inside backward (C++), where no
        # Python frame says so; the watchdog reads these to name the all-reduce a hung rank waits in
        self.pending = 0
        self.pending_t0 = 0
        timers = hooks.ddp_timers
        timers.append(self)
        del timers[:-8]                        # a few DDP models per process at most

    def run(self, bucket):
        perf = self.perf
        t0 = perf()
        tensor = bucket.buffer()
        hooks = self.hooks
        tok = -1
        if hooks.log.dev_on and not tensor.is_cpu:
            try:
                tok = hooks.timing.begin(tensor)
            except Exception:  # noqa: BLE001 - no device events: the host's times
                tok = -1
        nbytes = tensor.nbytes
        self.pending += 1
        if self.pending == 1:
            self.pending_t0 = t0
        if self.user is not None:
            log = hooks.log
            outer, log.in_coll = log.in_coll, 1      # its collectives are the bucket's: timed once, as the bucket
            try:
                fut = self.user(self.user_state, bucket)
            finally:
                log.in_coll = outer
            unwrap = False
        else:                                   # what DDP's built-in reduction does
            tensor.div_(self.size)
            fut = self.all_reduce(tensor, group=self.group, async_op=True).get_future()
            unwrap = True
        slot = self.slot

        def done(f):
            self.pending = max(self.pending - 1, 0)
            try:
                if tok >= 0:
                    hooks.timing.end(tok)
                if slot >= 0:
                    hooks.log.add(K_BUCKET, slot, t0, perf(), nbytes, float(tok))
            except Exception:  # noqa: BLE001 - telemetry never fails a reduction
                pass
            v = f.value()
            return v[0] if unwrap else v

        return fut.then(done)


def stepwatch_allreduce_hook(state: BucketTimer, bucket):
    """DDP comm hook: the bucket's reduction (the user's hook, or DDP's default all-reduce), timed."""
    return state.run(bucket)


def _timer(hooks, dist, ddp) -> BucketTimer:
    t = getattr(ddp, "_stepwatch_timer", None)
    if t is None:
        t = BucketTimer(hooks, dist, ddp)
        ddp._stepwatch_timer = t
    return t


def patch(hooks, dist) -> None:
    """Patch ``DistributedDataParallel`` (through ``hooks.patch``: undone by ``shutdown``)."""
    try:
        DDP = loaded("torch.nn.parallel").DistributedDataParallel
    except (ImportError, AttributeError):
        return
    if getattr(DDP.__init__, "_stepwatch", False):
        return
    orig_init, orig_reg = DDP.__init__, DDP.register_comm_hook
    orig_builtin = getattr(DDP, "_register_builtin_comm_hook", None)

    def _ours(ddp) -> bool:
        return not getattr(ddp, "_use_python_reducer", False) and getattr(ddp, "reducer", None) is not None

    def _register(ddp, t) -> None:
        orig_reg(ddp, t, stepwatch_allreduce_hook)
        t.registered = True

    def __init__(ddp, *args, **kwargs):
        orig_init(ddp, *args, **kwargs)
        try:
            if not _ours(ddp):
                return
            t = _timer(hooks, dist, ddp)
            if t.registered or t.builtin:
                return
            box = []

            def first_forward(module, inputs):       # the user had their chance to register a hook
                box.pop().remove()
                try:
                    if not t.registered and not t.builtin:
                        _register(ddp, t)
                except Exception:  # noqa: BLE001 - DDP goes on with its own reduction, untimed
                    pass

            box.append(ddp.register_forward_pre_hook(first_forward))
        except Exception:  # noqa: BLE001
            pass

    def register_comm_hook(ddp, state, hook):
        if not _ours(ddp):
            return orig_reg(ddp, state, hook)
        t = _timer(hooks, dist, ddp)
        if t.builtin:
            return orig_reg(ddp, state, hook)      # (DDP raises: one hook per model, as without the probe)
        ddp._check_comm_hook(hook)
        t.user, t.user_state = hook, state
        if not t.registered:
            _register(ddp, t)
        ddp.logger._set_comm_hook_name(getattr(hook, "__qualname__", str(hook)))

    def _register_builtin_comm_hook(ddp, comm_hook_type):
        t = getattr(ddp, "_stepwatch_timer", None)
        if t is None or not t.registered or not _ours(ddp):
            if t is not None:
                t.builtin = True
            return orig_builtin(ddp, comm_hook_type)
        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        if name == "ALLREDUCE":
            t.user = t.user_state = None
        elif name == "FP16_COMPRESS":
            default_hooks = loaded("torch.distributed.algorithms.ddp_comm_hooks.default_hooks")
            t.user, t.user_state = default_hooks.fp16_compress_hook, ddp.process_group
        else:
            return orig_builtin(ddp, comm_hook_type)
        ddp.logger._set_comm_hook_name(str(comm_hook_type))

    for name, fn, orig in (("__init__", __init__, orig_init), ("register_comm_hook", register_comm_hook, orig_reg),
                           ("_register_builtin_comm_hook", _register_builtin_comm_hook, orig_builtin)):
        if orig is None:
            continue
        fn._stepwatch = True
        fn.__wrapped__ = orig
        fn.__doc__ = orig.__doc__
        fn.__name__ = orig.__name__
        hooks.patch(DDP, name, fn)

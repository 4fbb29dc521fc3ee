"""Torch patching: the probe's automatic hooks (optimizer step hooks, DataLoader iterators,
``torch.distributed`` collectives and ``Work.wait``, DDP buckets through :mod:`.ddp_hooks`, ``Module.eval``
and checkpoint saves) and the GC callback. Nothing here imports torch: the hooks are installed once the
program has imported it (:class:`_TorchImportHook`), and reach torch through :func:`.torchref.loaded`. :class:`Hooks` is a part the :class:`~.core.Probe` composes.
"""
from __future__ import annotations

import functools
import sys

from . import eventlog as _ev
from .collectives import COLLECTIVES
from .eventlog import K_COLL, K_MARK, K_PHASE, _nbytes, _perf, _py_coll_wrap, _py_data_wrap, _queue_depth
from .torchref import loaded
from stepwatch.wire.datagram import MAX_COMM


# The functional collectives (torch.distributed._functional_collectives) timed, and the op each is
# recorded as: the same ops as the torch.distributed calls they stand for.
FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce_coalesced",
              "all_gather_tensor": "all_gather_into_tensor", "all_gather_single": "all_gather_single",
              "reduce_scatter_tensor": "reduce_scatter_tensor", "reduce_scatter_single": "reduce_scatter_single",
              "all_to_all_single": "all_to_all_single", "broadcast": "broadcast"}


def _is_compiling():
    """``torch.compiler.is_compiling`` (True while dynamo traces: it folds it to a constant), or a
    function returning False on a torch without it."""
    try:
        return loaded("torch.compiler").is_compiling
    except (ImportError, AttributeError):
        return lambda: False


def _traceable(fn, timed, is_compiling):
    """The function installed in place of the collective ``fn``: ``timed`` (the C or Python timing
    wrapper) in eager code; ``fn`` itself while ``torch.compile`` traces, so that dynamo, which inlines
    this function, sees the original collective and rewrites it to a functional collective in the graph
    as it does without the probe (no graph break). The compiled graph's collectives are not timed."""
    def collective(*args, **kwargs):
        if is_compiling():
            return fn(*args, **kwargs)
        return timed(*args, **kwargs)

    functools.update_wrapper(collective, fn)          # (name, doc, signature; __wrapped__: the original)
    collective._stepwatch = True
    return collective


class _TorchImportHook:
    """A ``sys.meta_path`` finder that finds nothing itself: on ``import torch`` it wraps torch's
    loader so that the probe's hooks are installed once torch has finished importing."""

    def __init__(self, hooks: "Hooks"):
        self.hooks = hooks

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
        orig, hooks = loader.exec_module, self.hooks

        def exec_module(module):
            orig(module)
            if hooks.is_on():
                try:
                    hooks.install_torch()
                except Exception as e:  # noqa: BLE001 - never break the user's import
                    sys.stderr.write(f"stepwatch probe: PyTorch hooks not installed: {e!r}\n")

        loader.exec_module = exec_module
        return spec


class Hooks:
    """The automatic hooks: what they patched (``patches``, undone by :meth:`remove`) and the optimizer hook
    handles. A part the :class:`~.core.Probe` composes; its collaborators: ``log`` (every hook appends its
    events there), ``names`` (slots of phases and collectives), ``timing`` (device events around
    collectives on device tensors), ``flush`` (called before ``destroy_process_group``) and ``is_on`` (whether
    the probe is on: the torch import hook installs only then). The optimizer step hooks are the log's own
    (``opt_pre``/``opt_post``; the log calls the probe back at the primary optimizer's first step)."""

    def __init__(self, log, names, timing, flush, is_on):
        self.log, self.names, self.timing, self.flush, self.is_on = log, names, timing, flush, is_on
        self.handles: list = []                                    # the optimizer hooks' handles
        self.patches: list[tuple[object, str, object]] = []       # (object, name, original)
        self.wait_slot = -1                   # the slot of Work.wait() (no collective of its own)
        self.comm_keys_dropped = 0
        self.ddp_timers: list = []            # DDP models' bucket timers (ddp_hooks; the watchdog reads them)

    def remove(self) -> None:
        """Undo every hook and patch (``shutdown``)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for obj, name, orig in reversed(self.patches):
            setattr(obj, name, orig)
        self.patches.clear()
        for f in [f for f in sys.meta_path if isinstance(f, _TorchImportHook) and f.hooks is self]:
            sys.meta_path.remove(f)

    def install_torch(self) -> bool:
        """Install the optimizer, DataLoader and torch.distributed hooks (once). When torch is not
        imported yet, nothing is imported here: a finder on ``sys.meta_path`` installs the hooks right
        after the program imports torch itself (so ``init()`` may come first, and a program that never
        uses torch never loads it). torch_npu needs nothing more: it runs through the same hooks.
        Returns True when the hooks are in place."""
        if self.handles:
            return True
        if "torch" not in sys.modules:
            if not any(isinstance(f, _TorchImportHook) for f in sys.meta_path):
                sys.meta_path.insert(0, _TorchImportHook(self))
            return False
        try:
            opt = loaded("torch.optim.optimizer")
            register_optimizer_step_pre_hook = opt.register_optimizer_step_pre_hook
            register_optimizer_step_post_hook = opt.register_optimizer_step_post_hook
        except (ImportError, AttributeError):
            return False
        self.handles.append(register_optimizer_step_pre_hook(self.log.opt_pre))
        self.handles.append(register_optimizer_step_post_hook(self.log.opt_post))
        try:
            dl = loaded("torch.utils.data.dataloader")
            self._patch_dataloader(dl._BaseDataLoaderIter)
        except (ImportError, AttributeError):
            pass
        try:
            dist = loaded("torch.distributed")
            if dist.is_available():
                self._patch_distributed(dist)
                try:            # DDP's reducer all-reduces from C++: time them through a comm hook
                    from . import ddp_hooks
                    ddp_hooks.patch(self, dist)
                except Exception:  # noqa: BLE001 - no DDP timing, the rest goes on
                    pass
        except ImportError:
            pass
        try:
            self._patch_eval_save(loaded())
        except Exception:  # noqa: BLE001 - step kinds are optional
            pass
        return True

    def patch(self, obj, name: str, new) -> None:
        self.patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    def _patch_dataloader(self, cls) -> None:
        orig = cls.__next__
        fast = _ev._fast
        w = (fast.DataWrap(self.log, orig, _queue_depth) if fast is not None
             else _py_data_wrap(self.log, orig, _queue_depth))
        self.patch(cls, "__next__", w)

    def _patch_eval_save(self, torch) -> None:
        """``Module.eval()`` marks the step ``eval``; ``torch.save`` counts as ``checkpoint`` time. Both are
        called a few times per evaluation or checkpoint, never per step."""
        hooks_ = self
        mod = getattr(getattr(torch, "nn", None), "Module", None)
        if mod is not None and not getattr(mod.eval, "_stepwatch", False):
            orig_eval = mod.eval

            def eval(module):
                hooks_.log.add(K_MARK, hooks_.names.slot_for_phase("eval"), _perf(), 0, 0, 0.0)
                return orig_eval(module)
            eval._stepwatch = True
            eval.__wrapped__ = orig_eval
            self.patch(mod, "eval", eval)
        save = getattr(torch, "save", None)
        if save is not None and not getattr(save, "_stepwatch", False):
            self.patch(torch, "save", self._timed_save(save))

    def _timed_save(self, fn):
        hooks_ = self

        def save(*args, **kwargs):
            t0 = _perf()
            try:
                return fn(*args, **kwargs)
            finally:
                hooks_.log.add(K_PHASE, hooks_.names.slot_for_phase("checkpoint"), 0, 0, _perf() - t0, 0.0)
        save._stepwatch = True
        save.__wrapped__ = fn
        return save

    def patch_dcp(self) -> None:
        """``torch.distributed.checkpoint.save`` (and ``async_save``, ``save_state_dict``) count as
        checkpoint time, when the program imported it by its first step."""
        dcp = sys.modules.get("torch.distributed.checkpoint")
        if dcp is None:
            return
        for name in ("save", "async_save", "save_state_dict"):
            fn = getattr(dcp, name, None)
            if fn is not None and not getattr(fn, "_stepwatch", False):
                self.patch(dcp, name, self._timed_save(fn))

    def _record_comm(self, op_id: int, grp_id: int, nbytes: int, dt: int, wait_ns: float) -> None:
        """Add one call with a known wait, ending now (Work.wait(), tests and benchmarks)."""
        key, names = (op_id, grp_id), self.names
        s = names.comm_slot.get(key)
        if s is None:
            if len(names.comm_slot) >= MAX_COMM:
                self.comm_keys_dropped += 1
                return
            s = names.comm_slot[key] = len(names.comm_slot)
            names.comm_key[s] = key
        t1 = _perf()
        self.log.add(K_COLL, s, t1 - int(dt), t1, int(nbytes), float(wait_ns))

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
        op_id = self.names.intern(name)

        def resolve(group) -> int:
            grp_id, size = self.names.group(dist, group)          # (keeps the group alive: the caches use its id)
            return self.names.comm_slot_for(name, op_id, grp_id, size)

        fast = _ev._fast
        if fast is not None:
            w = fast.CollWrap(self.log, fn, p_idx, g_idx, a_idx, payload, resolve, _nbytes,
                               self.timing.begin, self.timing.end)
        else:
            w = _py_coll_wrap(self.log, fn, p_idx, g_idx, a_idx, payload, resolve, _nbytes,
                              self.timing.begin, self.timing.end)
        w.__name__ = getattr(fn, "__name__", name)
        w.__doc__ = getattr(fn, "__doc__", None)
        return w

    def _wrap_functional(self, dist, funcol, name: str, op: str, fn):
        """A wrapper timing the functional collective ``funcol.<name>`` (DTensor's redistributions,
        ``clip_grad_norm_`` on FSDP2's sharded parameters, tensor-parallel code): the launch, as op ``op``
        on its process group, with 0 wait (its result is an ``AsyncCollectiveTensor``: the wait is timed in
        ``funcol.wait_tensor``, as ``Work.wait()``). The group (a process group, its name, a
        ``(DeviceMesh, dim)``, ranks) is resolved to its name, as the collective resolves it."""
        import inspect
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return None
        g_idx = params.index("group") if "group" in params else -1
        t_idx = params.index("tag") if "tag" in params else -1
        log, hooks_, op_id = self.log, self, self.names.intern(op)
        resolve_name = getattr(funcol, "_resolve_group_name", None)
        resolve_pg = getattr(dist.distributed_c10d, "_resolve_process_group", None)
        if g_idx < 0 or resolve_name is None or resolve_pg is None:
            return None
        slots: dict[str, int] = {}          # group name -> accumulator slot

        def timed(*args, **kwargs):
            if log.in_coll:                 # inside a timed collective: the outer one counts
                return fn(*args, **kwargs)
            log.in_coll = 1
            t0 = log.coll_t0 = _perf()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = _perf()
                log.in_coll = 0
                try:
                    n = len(args)
                    group = args[g_idx] if g_idx < n else kwargs.get("group")
                    tag = args[t_idx] if 0 <= t_idx < n else kwargs.get("tag", "")
                    gname = str(resolve_name(group, tag))
                    s = slots.get(gname)
                    if s is None:
                        grp_id, size = hooks_.names.group(dist, resolve_pg(gname))
                        s = slots[gname] = hooks_.names.comm_slot_for(op, op_id, grp_id, size)
                    if s < 0:
                        log.comm_keys_dropped += 1
                    else:
                        x = args[0] if n else kwargs.get("self")
                        log.add(K_COLL, s, t0, t1, _nbytes(x), 0.0)
                except Exception:  # noqa: BLE001 - telemetry never fails a collective
                    pass

        return timed

    def _patch_distributed(self, dist) -> None:
        is_compiling = _is_compiling()
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or getattr(fn, "_stepwatch", False):
                continue
            w = self._wrap_collective(dist, name, fn)
            if w is not None:
                w = _traceable(fn, w, is_compiling)
                self.patch(dist, name, w)
        try:
            funcol = loaded("torch.distributed._functional_collectives")
        except Exception:  # noqa: BLE001 - no functional collectives in this build
            funcol = None
        if funcol is not None:
            for name, op in FUNCTIONAL.items():
                fn = getattr(funcol, name, None)
                if fn is None or getattr(fn, "_stepwatch", False):
                    continue
                w = self._wrap_functional(dist, funcol, name, op, fn)
                if w is not None:
                    self.patch(funcol, name, _traceable(fn, w, is_compiling))
            wt = getattr(funcol, "wait_tensor", None)
            if wt is not None and not getattr(wt, "_stepwatch", False):
                self.patch(funcol, "wait_tensor", _traceable(wt, self._timed_wait(wt), is_compiling))
        dpg = getattr(dist, "destroy_process_group", None)
        if dpg is not None and not getattr(dpg, "_stepwatch", False):
            hooks_ = self

            def destroy_process_group(*args, **kwargs):
                hooks_.flush()                     # the end of a distributed run: send what waits
                return dpg(*args, **kwargs)

            destroy_process_group._stepwatch = True
            destroy_process_group.__wrapped__ = dpg
            self.patch(dist, "destroy_process_group", destroy_process_group)
        work = getattr(dist, "Work", None)
        if work is not None and hasattr(work, "wait"):
            try:
                self.patch(work, "wait", self._timed_wait(work.wait))
            except (TypeError, AttributeError):
                pass

    def _timed_wait(self, orig_wait):
        """``Work.wait()`` or ``funcol.wait_tensor``, timed as op ``wait``, group ``async``: all of it is
        waiting."""
        log = self.log
        slot = self.names.comm_slot_for("wait", self.names.intern("wait"), self.names.intern("async"), 1)
        self.wait_slot = slot

        def wait(*args, **kwargs):
            if log.in_coll or slot < 0:
                return orig_wait(*args, **kwargs)
            log.in_coll = 1
            t0 = _perf()
            try:
                return orig_wait(*args, **kwargs)
            finally:
                t1 = _perf()
                log.in_coll = 0
                log.add(K_COLL, slot, t0, t1, 0, float(t1 - t0))     # all of it is waiting

        wait.__wrapped__ = orig_wait
        return wait

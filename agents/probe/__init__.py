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
a preallocated log (:mod:`.eventlog`; in C, ``_probefast.Log``, built from ``agents/probe/_probefast.c``
where a compiler exists). Every few hundred events (or ``flush_ms``, 500 ms) the replay
(:mod:`.fold`) turns them into steps, warm, and packs each finished step as a fixed-size *frame*
(:mod:`stepwatch.wire.datagram`) into one preallocated buffer. Frames are sent together as one datagram on a
non-blocking ``AF_UNIX``/``SOCK_DGRAM`` socket connected to ``<socket_dir>/agent.sock``
(:mod:`.transport`): a 100 ms step pays a system call every fifth step, a 1 s step every step. When the
agent is absent, or its queue stays full past a small backlog, frames are dropped and counted
(:func:`stats`); training never blocks on telemetry. Events and steps still waiting are sent by
``shutdown`` (also at exit, at ``destroy_process_group`` and in the finalizers of multiprocessing
children).

This package imports only the standard library (torch is touched only when the program imports it, through
:mod:`.torchref`: the probe never imports torch itself; ``lint-imports`` checks it), so ``pip install stepwatch`` (no extras) installs the probe alone and
``stepwatch wrap`` can load it into any Python process, even by its directory
(``STEPWATCH_PROBE_FILE``). Modules: :mod:`.core` (``Probe``), :mod:`.hooks`, :mod:`.eventlog`,
:mod:`.fold`, :mod:`.transport`, :mod:`.names`, :mod:`.identity`, :mod:`.timing`, :mod:`.flops`,
:mod:`.collectives`, :mod:`.torchref` (the program's torch), :mod:`.watchdog` (in-flight state
of an overlong step), :mod:`.ddp_hooks` (DDP buckets). The datagram's layout, encoder and decoder are
:mod:`stepwatch.wire.datagram` (the standard library only too); of its names only the API's ``decode``,
``BadDatagram`` and ``default_socket_dir`` are also names of this package (``__all__``): import the rest
(``HDR``, ``MAGIC``, ...) from the module that defines them.
"""
from __future__ import annotations


def _datagram_by_file() -> None:
    """Loaded by its directory where ``stepwatch`` is not importable (``stepwatch wrap``'s
    ``STEPWATCH_PROBE_FILE``): ``stepwatch.wire.datagram`` is then read from its file, two folders above
    this package (``stepwatch/agents/probe`` -> ``stepwatch/wire/datagram.py``), so that the modules here
    import it by its one name."""
    import importlib.util
    import os
    import sys
    try:
        importlib.import_module("stepwatch.wire.datagram")   # importable by its name: nothing to do
        return
    except ImportError:
        pass
    f = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "wire",
                     "datagram.py")
    spec = importlib.util.spec_from_file_location("stepwatch.wire.datagram", f)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["stepwatch.wire.datagram"] = mod
    spec.loader.exec_module(mod)


_datagram_by_file()

from .collectives import transfer_ms  # noqa: E402
from .core import Probe, _Phase, _StepCtx  # noqa: E402
from .flops import analytic_flops_per_token  # noqa: E402
from stepwatch.wire.datagram import BadDatagram, decode, default_socket_dir  # noqa: E402

__all__ = ["Probe", "init", "step", "begin_step", "end_step", "phase", "add_phase", "count", "stats", "flush",
           "shutdown", "get", "auto_install", "mark_step_kind", "mark_change", "decode", "BadDatagram",
           "default_socket_dir", "transfer_ms", "count_flops", "set_flops_per_token", "set_model_shape",
           "analytic_flops_per_token"]

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


def mark_change(what: str) -> None:
    """Announce a change of the job's own from the step in progress on (new baselines); see
    :meth:`Probe.mark_change`."""
    _probe.mark_change(what)


def count_flops(step_fn, *args, tokens: int | None = None, samples: int | None = None, **kwargs):
    """Count one training step's FLOPs (``FlopCounterMode``) for MFU; see :meth:`Probe.count_flops`."""
    return _probe.count_flops(step_fn, *args, tokens=tokens, samples=samples, **kwargs)


def set_flops_per_token(flops: float, *, per: str = "token") -> None:
    """The user's FLOPs per token (sample) for MFU: wins over a count and a shape."""
    _probe.set_flops_per_token(flops, per=per)


def set_model_shape(**kw) -> float:
    """The analytic FLOPs per token ``6N + 12 L H Q T``; see :meth:`Probe.set_model_shape`."""
    return _probe.set_model_shape(**kw)


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


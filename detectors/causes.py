"""Cause taxonomy (DESIGN §6) and phase-based attribution shared by the detectors.

The taxonomy is the field's: ``io`` (data wait), ``cpu`` (host-side gap: dispatch, contention,
environment), ``gc`` (Python GC pauses), ``communication`` (collective time), ``computation``
(accelerator time), ``parallelism`` (imbalance / poor overlap). :data:`SUGGESTIONS` holds the remedies
of the DESIGN case table for each cause.

Attribution works on *phase medians* in milliseconds. The phases are the step record's columns plus
the derived host gap::

    host_gap_ms = step_ms - data_ms - compute_ms - comm_ms - comm_wait_ms - gc_ms   (clipped at 0)

:func:`attribute` compares two sets of phase medians (before/after a change, or stage peers/suspect
rank) and names the cause of the phase that grew most in absolute milliseconds.
"""
from __future__ import annotations

import warnings

import numpy as np

CAUSES: tuple[str, ...] = ("io", "cpu", "gc", "communication", "computation", "parallelism")

#: Remedies per cause, from the DESIGN §6 case table (GC is the table's CPU row "GC" entry).
SUGGESTIONS: dict[str, str] = {
    "io": ("I/O bound: add I/O bandwidth or use local storage; more DataLoader workers; avoid "
           "compressed formats; no taskset binding; enable pin_memory and prefetch."),
    "cpu": ("CPU-side gap: disable JIT/operator compilation; remove host-device sync points; stop the "
            "competing process (check the node's top processes); align library versions, lower the log "
            "level."),
    "gc": ("Python GC pauses: raise the GC threshold (gc.set_threshold) or gc.freeze() after setup; "
           "disable automatic GC and collect at checkpoints."),
    "communication": ("Communication: separate compute and communication traffic; tune the collective "
                      "library (HCCL/NCCL); fuse small tensors; check NIC retransmits and switch config."),
    "computation": ("Computation: isolate the slow node (check accelerator clock and temperature); "
                    "memory settings / smaller micro-batch / ZeRO; fused or faster operators, no dynamic "
                    "shapes."),
    "parallelism": ("Parallelism: ranks wait on each other (poor overlap or load imbalance): overlap "
                    "communication with computation across shards; revisit the hybrid-parallel plan."),
    "unknown": "No single phase explains the change: profile the named ranks for a few steps.",
}

#: Phase column -> cause. ``comm_wait_ms`` is optional: when given, time spent waiting for peers growing
#: most means imbalance / poor overlap (``parallelism``).
PHASE_CAUSE: dict[str, str] = {
    "data_ms": "io",
    "compute_ms": "computation",
    "comm_ms": "communication",
    "gc_ms": "gc",
    "host_gap_ms": "cpu",
    "comm_wait_ms": "parallelism",
}

#: The phases every detector reports (``comm_wait_ms`` is added where it is meaningful).
PHASES: tuple[str, ...] = ("data_ms", "compute_ms", "comm_ms", "gc_ms", "host_gap_ms")


def host_gap(step_ms, data_ms, compute_ms, comm_ms, comm_wait_ms, gc_ms) -> np.ndarray:
    """Host-side gap per element (ms): step time not explained by the reported phases, clipped at 0.

    Missing (NaN) phases count as 0; the result is NaN where ``step_ms`` is NaN.
    """
    gap = np.array(step_ms, dtype=np.float64)  # a copy
    for p in (data_ms, compute_ms, comm_ms, comm_wait_ms, gc_ms):
        p = np.asarray(p, dtype=np.float64)
        gap -= np.where(np.isnan(p), 0.0, p)
    return np.maximum(gap, 0.0, where=~np.isnan(gap), out=gap)


def phase_arrays(block, cols=None) -> dict[str, np.ndarray]:
    """The phase arrays of a :class:`~stepwatch.detectors.base.StepBlock` (optionally only the columns
    ``cols``), including the derived ``host_gap_ms`` and ``comm_wait_ms``. Shapes follow the block."""
    sel = (lambda a: a) if cols is None else (lambda a: a[:, cols])
    out = {
        "data_ms": sel(block.data_ms), "compute_ms": sel(block.compute_ms),
        "comm_ms": sel(block.comm_ms), "gc_ms": sel(block.gc_ms),
        "comm_wait_ms": sel(block.comm_wait_ms),
    }
    out["host_gap_ms"] = host_gap(sel(block.step_ms), out["data_ms"], out["compute_ms"],
                                  out["comm_ms"], out["comm_wait_ms"], out["gc_ms"])
    return out


def nanmedian(a, axis=None):
    """``np.nanmedian`` without the all-NaN warning (all-NaN slices give NaN); takes the faster
    ``np.median`` path when there is no NaN."""
    a = np.asarray(a)
    if a.size and not np.isnan(a).any():
        return np.median(a, axis=axis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(a, axis=axis)


def attribute(before: dict[str, float], after: dict[str, float]) -> tuple[str, dict]:
    """Name the cause of the phase that grew most from ``before`` to ``after``.

    ``before``/``after`` map phase names (:data:`PHASE_CAUSE` keys; unknown keys are ignored) to median
    milliseconds — before/after a change, or stage peers/suspect rank. The phase with the largest
    positive absolute growth names the cause; ``"unknown"`` when no phase grew (or all are NaN).
    Returns ``(cause, evidence)`` where evidence is ``{"phase": <grown phase or None>,
    "phases": {phase: {"before", "after", "delta"}}}`` (ms, rounded to 3 decimals, JSON-safe).
    """
    keys = [k for k in PHASE_CAUSE if k in before and k in after]
    b = np.array([before[k] for k in keys], dtype=np.float64)
    a = np.array([after[k] for k in keys], dtype=np.float64)
    delta = a - b
    grown = np.where(np.isnan(delta), -np.inf, delta)
    phases = {k: {"before": _num(b[i]), "after": _num(a[i]), "delta": _num(delta[i])}
              for i, k in enumerate(keys)}
    if not keys or not np.any(grown > 0):
        return "unknown", {"phase": None, "phases": phases}
    i = int(np.argmax(grown))
    return PHASE_CAUSE[keys[i]], {"phase": keys[i], "phases": phases}


def _num(x: float):
    x = float(x)
    return None if np.isnan(x) else round(x, 3)

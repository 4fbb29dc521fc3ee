"""The simulator's model (:mod:`stepwatch.devtools.simulate`): the fault kinds, their spec strings
(:class:`Fault`, :func:`parse_fault`) and ground-truth causes, and the nominal constants of a step."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Fault kinds understood by :class:`Simulation`.
FAULT_KINDS = ("slow-rank", "regression", "gc-storm", "cpu-contention", "gc-jitter", "data-stall",
               "comm-slow", "rank-hang", "job-hang", "small-messages", "slow-link", "dataloader-starved",
               "clean")
#: Phases a regression can hit (the cause in the taxonomy of docs/incidents.md, 'Cause taxonomy and remedies').
REGRESSION_CAUSES = ("io", "communication", "computation", "cpu")
_CAUSE_ALIASES = {"data": "io", "comm": "communication", "network": "communication",
                  "compute": "computation", "host": "cpu"}
#: Ground-truth cause of each fault kind (regression: its own ``cause``).
#: ``rank-hang`` has none in the taxonomy (a rank's telemetry stops while its peers go on: ``None``); a
#: job hang is the collective that every rank blocks in (``communication``).
_KIND_CAUSE = {"slow-rank": "computation", "gc-storm": "gc", "cpu-contention": "cpu", "gc-jitter": "gc",
               "data-stall": "io", "comm-slow": "communication", "rank-hang": None,
               "job-hang": "communication", "small-messages": "communication", "slow-link": "communication",
               "dataloader-starved": "io"}
#: faults that need a ``rank``
_NEEDS_RANK = ("slow-rank", "cpu-contention", "comm-slow", "rank-hang", "slow-link")

# Nominal shares of the step time (before calibration).
_DATA, _COMPUTE, _GAP, _COMM = 0.04, 0.68, 0.06, 0.12
_BLIP_P = 1e-4           # data-wait blip probability per rank-step
_T_CLIP = (-3.0, 8.0)    # clip of the Student-t compute noise
_CALIB_STEPS = 16
_GC_GEN_P = (0.70, 0.25, 0.05)
_GC_GEN_MS = (1.0, 3.0, 8.0)
_STORM_PER_STEP = 4.0    # mean collections per step of a gc-storm rank
_JITTER_PAUSES = 0.35    # gc-jitter: mean pausing ranks per step (whole job)
_STALL_P = 0.25          # data-stall: share of the steps that stall
_HANG_LAG = 2            # job-hang with a rank: the others stop this many steps later
_FOREIGN = "monitor-plugin"
_FOREIGN_CORES = 40.0
_FOREIGN_PID = 4242
_PY_PID0 = 21000         # pid of the training process of local rank i: _PY_PID0 + i
_TOP_N = 5

# rng stream ids (third element of the per-step seed)
_S_BASE, _S_GC, _S_HOST, _S_CKPT, _S_ACCEL, _S_QUEUE, _S_FAULT = 0, 1, 2, 3, 4, 5, 100

# model and links, for the efficiency analyses: a dense model of _PARAMS parameters (about 40% MFU on an
# H100 in bf16 at 1 s steps with the default 8 x 4,096 tokens per rank); the gradient all-reduce carries a
# payload sized so that the nominal comm time reaches _LINK_UTIL of the link's peak bus bandwidth
_PARAMS = 2.0e9
_LINK_UTIL = 0.75
_SMALL_CALLS = 2048      # small-messages: calls per step the gradient all-reduce is split into


# --------------------------------------------------------------------------- faults

@dataclass
class Fault:
    """One injected fault.

    ``start``/``end`` are step numbers (``end`` inclusive, None = until the end of the job).
    ``rank``: the slow rank (``slow-rank``), the GC-storming rank (``gc-storm``; None = all ranks),
    or a rank on the contended node (``cpu-contention``). ``pct``: effect size in percent (of the
    rank's nominal busy time, or of ``step_ms`` for ``regression``). ``cause``: for ``regression``
    only, the phase that slows down: io | communication | computation | cpu.
    """

    kind: str
    start: int
    end: int | None = None
    rank: int | None = None
    pct: float = 20.0
    cause: str = "io"
    every: int = 1

    def active(self, steps: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``steps`` this fault affects."""
        m = steps >= self.start
        if self.end is not None:
            m &= steps <= self.end
        if self.every > 1:
            m &= (steps - self.start) % self.every == 0
        return m

    def spec(self) -> str:
        """The fault as a spec string that :func:`parse_fault` reads back."""
        if self.kind == "clean":
            return "clean"
        parts = [f"start={self.start}"]
        if self.end is not None:
            parts.append(f"end={self.end}")
        if self.rank is not None:
            parts.append(f"rank={self.rank}")
        parts.append(f"pct={self.pct:g}")
        if self.kind == "regression":
            parts.append(f"cause={self.cause}")
        if self.every > 1:
            parts.append(f"every={self.every}")
        return f"{self.kind}:" + ",".join(parts)


_FAULT_KEYS = {"start": int, "end": int, "rank": int, "pct": float, "cause": str, "every": int}


def _check_fault(f: Fault) -> Fault:
    """Normalise and validate a fault (ValueError naming the bad field)."""
    if f.kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {f.kind!r} (expected one of {', '.join(FAULT_KINDS)})")
    cause = _CAUSE_ALIASES.get(str(f.cause), str(f.cause))
    if f.kind == "regression" and cause not in REGRESSION_CAUSES:
        raise ValueError(f"bad value {f.cause!r} for key 'cause' "
                         f"(expected one of {', '.join(REGRESSION_CAUSES)})")
    f.cause = cause
    if int(f.start) < 0:
        raise ValueError(f"bad value {f.start!r} for key 'start' (must be >= 0)")
    if f.end is not None and int(f.end) < int(f.start):
        raise ValueError(f"bad value {f.end!r} for key 'end' (must be >= start {f.start})")
    if not np.isfinite(f.pct) or f.pct < 0:
        raise ValueError(f"bad value {f.pct!r} for key 'pct' (must be finite and >= 0)")
    if int(f.every) < 1:
        raise ValueError(f"bad value {f.every!r} for key 'every' (must be >= 1)")
    f.every = int(f.every)
    if f.kind in _NEEDS_RANK and f.rank is None:
        raise ValueError(f"fault {f.kind!r} needs key 'rank' (e.g. '{f.kind}:rank=3,start=100')")
    if f.rank is not None and int(f.rank) < 0:
        raise ValueError(f"bad value {f.rank!r} for key 'rank' (must be >= 0)")
    return f


def parse_fault(spec: str) -> Fault:
    """Read a fault spec: ``KIND[:key=value,...]``.

    Keys: ``start`` (default 0), ``end``, ``rank``, ``pct`` (default 20), ``cause`` (regression;
    default io), ``every`` (default 1: every step). Examples: ``"slow-rank:rank=17,pct=30,start=100"``,
    ``"regression:start=200,pct=20,cause=io"``, ``"gc-storm:start=50,end=80"``, ``"clean"``.
    Raises ValueError naming the bad kind, key or value.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty fault spec {spec!r} (expected e.g. 'slow-rank:rank=3,start=100')")
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip()
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r} in {spec!r} (expected one of {', '.join(FAULT_KINDS)})")
    kw: dict = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key not in _FAULT_KEYS:
            raise ValueError(f"unknown key {key!r} in fault spec {spec!r} "
                             f"(expected {', '.join(_FAULT_KEYS)})")
        if not eq or not value:
            raise ValueError(f"key {key!r} has no value in fault spec {spec!r} (write {key}=VALUE)")
        if key in kw:
            raise ValueError(f"key {key!r} given twice in fault spec {spec!r}")
        conv = _FAULT_KEYS[key]
        try:
            kw[key] = conv(value)
        except ValueError:
            raise ValueError(f"bad value {value!r} for key {key!r} in fault spec {spec!r} "
                             f"(expected {'an integer' if conv is int else 'a number' if conv is float else 'text'})"
                             ) from None
    if kind == "clean" and kw:
        raise ValueError(f"fault 'clean' takes no keys (got {', '.join(kw)}) in {spec!r}")
    kw.setdefault("start", 0)
    return _check_fault(Fault(kind=kind, **kw))


"""Detector interface: aligned step blocks of one job in, alerts out.

Lifecycle: the processor creates one instance of every registered detector per job, calls
:meth:`Detector.update` with each block of *closed* steps (all ranks reported, or the lateness bound
passed) in step order, and collects the alerts it returns. After a restart or a partition move the
processor replays the job's last window of stored steps through fresh detectors with the same
settings; because detectors are deterministic and alert ids are stable, replayed alerts that are
already stored are recognised and not sent twice.

Arrays are numpy: ``(S, R)`` float64 per field for S steps and R ranks (rank r is column r), NaN
where a rank did not report. Durations are milliseconds, times UTC nanoseconds.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np


@dataclass
class JobContext:
    """What is known about a job from its topology records."""

    job: str
    world_size: int
    nodes: np.ndarray            # (R,) object: node name per rank ("" if unknown)
    stage: np.ndarray            # (R,) int32: pipeline stage (pp coordinate), 0 when unknown

    def node_of(self, rank: int) -> str:
        return str(self.nodes[rank]) if 0 <= rank < len(self.nodes) else ""


@dataclass
class StepBlock:
    """Closed, aligned steps of one job: S steps x R ranks."""

    steps: np.ndarray            # (S,) int64 step numbers, increasing
    t_end: np.ndarray            # (S,) int64 ns: latest t_end over the ranks of each step
    step_ms: np.ndarray          # (S, R)
    data_ms: np.ndarray          # (S, R)
    compute_ms: np.ndarray       # (S, R)
    comm_ms: np.ndarray          # (S, R)
    comm_wait_ms: np.ndarray     # (S, R)
    gc_ms: np.ndarray            # (S, R)

    @property
    def busy_ms(self) -> np.ndarray:
        """Step time minus the time blocked waiting for peers; falls back to data+compute when the
        comm wait is not reported."""
        busy = self.step_ms - self.comm_wait_ms
        fallback = np.nan_to_num(self.data_ms) + np.nan_to_num(self.compute_ms)
        return np.where(np.isnan(self.comm_wait_ms), np.where(fallback > 0, fallback, self.step_ms), busy)

    def __len__(self) -> int:
        return len(self.steps)


@dataclass
class Alert:
    """One alert (DESIGN §4 ``alerts`` columns). ``alert_id`` is stable for the same finding."""

    job: str
    kind: str
    status: str                  # firing | resolved
    step_first: int
    step_detected: int
    t_detected: int              # ns (event time of the step that confirmed it)
    ranks: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    cause: str = "unknown"
    severity: str = "warning"
    evidence: dict = field(default_factory=dict)
    cost_pct: float = 0.0
    suggestion: str = ""
    alert_id: str = ""

    def __post_init__(self):
        if not self.alert_id:
            self.alert_id = stable_id(self.job, self.kind, self.ranks, self.step_first)

    def row(self) -> dict:
        return {
            "alert_id": self.alert_id, "job": self.job, "kind": self.kind, "severity": self.severity,
            "status": self.status, "t_detected": int(self.t_detected), "step_first": int(self.step_first),
            "step_detected": int(self.step_detected), "ranks": [int(r) for r in self.ranks],
            "nodes": [str(n) for n in self.nodes], "cause": self.cause,
            "evidence": json.dumps(self.evidence, default=float, sort_keys=True),
            "cost_pct": float(self.cost_pct), "suggestion": self.suggestion,
        }

    def line(self) -> str:
        """The readable console line."""
        who = ""
        if self.ranks:
            rs = ",".join(str(r) for r in self.ranks[:8]) + ("…" if len(self.ranks) > 8 else "")
            ns = ",".join(dict.fromkeys(self.nodes[:8]))
            who = f" rank {rs} on {ns}"
        return (f"[{self.status.upper()}] {self.kind} job={self.job}{who} from step {self.step_first} "
                f"(detected at {self.step_detected}) cause={self.cause} cost≈{self.cost_pct:.1f}% "
                f"— {self.suggestion}")


def stable_id(job: str, kind: str, ranks, step_first: int) -> str:
    key = f"{job}|{kind}|{','.join(str(int(r)) for r in sorted(ranks))}|{int(step_first)}"
    return hashlib.sha1(key.encode()).hexdigest()[:16]


class Detector:
    """Base class. Subclasses set ``name`` and implement :meth:`update`.

    Detectors keep bounded state (fixed-size windows), are deterministic for the same input, and
    tolerate NaN (missing ranks) anywhere in the block.
    """

    name = "detector"

    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:  # pragma: no cover
        raise NotImplementedError

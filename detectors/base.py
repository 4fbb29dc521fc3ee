"""Detector interface: aligned step blocks of one job in, alerts out.

Lifecycle: the processor creates one instance of every registered detector per job, calls
:meth:`Detector.update` with each block of *closed* steps (all ranks reported, or the lateness bound
passed) in step order, and collects the alerts it returns and the rows :meth:`Detector.drain_rows`
hands out (the outputs each class declares in :attr:`Detector.outputs`). The loop that does so is
:func:`stepwatch.detectors.replay.replay`, shared by the live processor, its rebuild, the offline
analysis and the detector benchmark. After a restart or a partition move the
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

from .settings import Configurable


@dataclass
class JobContext:
    """What is known about a job: its topology, where each rank's reporting stands, and bounded
    windows of its host / GC / comm rows (the context detectors use as evidence).

    Only the first four fields are required; everything else has a neutral default, so a detector must
    work (with less evidence) when a window is None or empty, or the per-rank arrays are None.
    """

    job: str
    world_size: int
    nodes: np.ndarray            # (R,) object: node name per rank ("" if unknown)
    stage: np.ndarray            # (R,) int32: pipeline stage (pp coordinate), 0 when unknown
    #: other parallel coordinates from the topology: "dp", "tp", "cp", "ep" -> (R,) int32, -1 unknown
    coords: dict = field(default_factory=dict)
    #: bounded windows of the job's rows (:class:`~stepwatch.detectors.context.Window`), or None
    host: object = None          # host samples, keyed by event time t (ns)
    gc: object = None            # GC records, keyed by t (ns)
    comm: object = None          # comm records, keyed by step
    inflight: object = None      # in-flight states of ranks in an overlong step (probe watchdog, agent), keyed by t
    life: object = None          # how its ranks ended (detectors.lifecycle.JobLife), or None
    #: (R,) newest step each rank reported so far (-1: none yet) and its t_end (ns); None if unknown
    last_step: np.ndarray | None = None
    last_t_end: np.ndarray | None = None
    max_step: int = -1           # newest step any rank reported
    steps_event_ns: int = 0      # newest t_end of any step row of the job (event time of the steps)
    host_event_ns: int = 0       # newest host sample time of the job (event time that goes on in a hang)
    backlog: bool = False        # the job's step rows are known to be behind (consumer lag > 0)
    #: newest host sample time per node (ns): one event-time watermark per source (job-hang judgement)
    host_node_ns: dict | None = None
    #: ``caught_up()`` -> whether the job's steps source has been read to its end (the consumer's
    #: position on its partition has reached the broker's end offset); None: unknown, taken as yes (the
    #: rows were handed over in order, e.g. a test or a replay)
    caught_up: object = None
    #: job-level facts from the topology rows for the efficiency analyses: ``device_type``, ``dtype``,
    #: ``model_flops_per_token``, ``model_flops_per_sample``, ``model_params`` (mean over the ranks that
    #: sent it: each rank's share), ``tp_size``, ``pp_size`` (1 when unknown); empty when unknown;
    #: ``cpu_wait_reported`` (True once step rows carry ``cpu_wait_ms``: see causes.decide)
    info: dict = field(default_factory=dict)

    def node_of(self, rank: int) -> str:
        return str(self.nodes[rank]) if 0 <= rank < len(self.nodes) else ""

    def dp_groups(self) -> np.ndarray | None:
        """(R,) id of each rank's data-parallel group: ranks sharing the pipeline stage and the tp, cp
        and ep coordinates (they all-reduce gradients together). None when no tp/cp/ep coordinate is
        known or every stage is a single group (then a group is a stage, compared with nothing)."""
        R = len(self.stage)
        if R == 0:
            return None
        key = np.asarray(self.stage, dtype=np.int64)
        varied = False
        for c in ("tp", "cp", "ep"):
            a = self.coords.get(c)
            if a is None or len(a) != R:
                continue
            a = np.asarray(a, dtype=np.int64)
            lo, hi = int(a.min()), int(a.max())
            if hi < 0 or lo == hi:
                continue                                   # unknown, or the same everywhere
            varied = True
            base = min(lo, -1)
            key = key * (hi - base + 1) + (a - base)
        if not varied:
            return None
        _, gid = np.unique(key, return_inverse=True)
        gid = gid.ravel()
        return gid


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
    #: optional (None when the producer does not send them): per step, the sum over the reporting ranks
    #: of ``tokens`` / ``samples`` and how many ranks reported each; DataLoader ready batches (S, R)
    tokens: np.ndarray | None = None         # (S,) float64
    tokens_ranks: np.ndarray | None = None   # (S,) int64
    samples: np.ndarray | None = None        # (S,) float64
    samples_ranks: np.ndarray | None = None  # (S,) int64
    data_queue: np.ndarray | None = None     # (S, R) float32, NaN = not reported
    #: CPU starvation (probe): the step-ending thread's CPU time and its time runnable but waiting for a
    #: CPU (run queue), (S, R) float32 ms, NaN = not reported; None when no rank sends them
    cpu_ms: np.ndarray | None = None
    cpu_wait_ms: np.ndarray | None = None

    @property
    def busy_ms(self) -> np.ndarray:
        """Step time minus the time blocked waiting for peers; falls back to data + compute + GC pause
        (the rank's own work that is reported) when the comm wait is not reported. Computed once per
        block (every detector gets the same block) and handed out read-only."""
        return self._memo("busy_ms", self._busy, (self.step_ms, self.comm_wait_ms, self.data_ms,
                                                  self.compute_ms, self.gc_ms))

    def step_median(self) -> np.ndarray:
        """(S,) median step time over the reporting ranks of each step (NaN where none reported): the
        job's step time, which most detectors need; computed once per block (an O(R) partition per
        step) and handed out read-only."""
        from .causes import nanmedian
        return self._memo("step_median", lambda: nanmedian(self.step_ms, axis=1), (self.step_ms,))

    def step_median_scaled(self, scale: np.ndarray) -> np.ndarray:
        """``nanmedian(step_ms * scale, axis=1)`` for a finite, positive ``scale`` per step ((S,) or (S, 1)),
        the same values without an (S, R) product or a second partition: a rounded product by a positive
        number keeps the order, so the two middle values of a scaled step are the middle values of the
        step (:meth:`_step_middle`, once per block) times its scale, and their mean is the median."""
        lo, hi = self._memo("step_middle", self._step_middle, (self.step_ms,))
        sc = np.asarray(scale, dtype=np.float64).reshape(-1)
        return (lo * sc + hi * sc) / 2.0

    def _step_middle(self) -> np.ndarray:
        """(2, S): the lower and upper middle value of each step's reported step times (equal for an odd
        count; NaN where no rank reported)."""
        x = np.asarray(self.step_ms, dtype=np.float64)
        out = np.full((2, x.shape[0]), np.nan)
        for s in range(x.shape[0]):
            row = x[s]
            v = row[~np.isnan(row)] if np.isnan(row).any() else row.copy()
            n = len(v)
            if n:
                v.partition(((n - 1) // 2, n // 2))
                out[0, s], out[1, s] = v[(n - 1) // 2], v[n // 2]
        return out

    def _busy(self) -> np.ndarray:
        busy = self.step_ms - self.comm_wait_ms
        if not np.isnan(self.comm_wait_ms).any():
            return busy
        fallback = np.nan_to_num(self.data_ms) + np.nan_to_num(self.compute_ms) + np.nan_to_num(self.gc_ms)
        return np.where(np.isnan(self.comm_wait_ms), np.where(fallback > 0, fallback, self.step_ms), busy)

    def _memo(self, name: str, make, inputs: tuple) -> np.ndarray:
        # kept beside the fields (not a dataclass field): valid while the very same input arrays are set
        memo = self.__dict__.setdefault("_derived", {})
        got = memo.get(name)
        if got is not None and len(got[0]) == len(inputs) and all(a is b for a, b in zip(got[0], inputs)):
            return got[1]
        v = np.asarray(make())
        v.flags.writeable = False
        memo[name] = (inputs, v)
        return v

    def __len__(self) -> int:
        return len(self.steps)

    def head(self, k: int) -> "StepBlock":
        """The block's first ``k`` steps (views)."""
        import dataclasses
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[:k] for f in dataclasses.fields(self)
                                            if getattr(self, f.name) is not None})

    def tail(self, k: int) -> "StepBlock":
        """The block without its first ``k`` steps (views)."""
        import dataclasses
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[k:] for f in dataclasses.fields(self)
                                            if getattr(self, f.name) is not None})


@dataclass
class Alert:
    """One alert (the ``alerts`` table's columns, docs/tables.md). ``alert_id`` is stable for the same finding."""

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
    incident_id: str = ""        # the incident it belongs to (detectors/incidents.py); set by the processor
    #: what its host evidence was read from (nodes, time span, the other evidence its cause was decided on):
    #: the processor reads it again when the host samples covering the alert's steps arrive later
    #: (stream/hostwait.py); not stored
    host_query: dict | None = field(default=None, repr=False, compare=False)

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
            "incident_id": self.incident_id or None,
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


class Detector(Configurable):
    """Base class. Subclasses set ``name``, declare their settings in ``SETTINGS`` (a tuple of
    :class:`~stepwatch.detectors.settings.Setting`; ``__init__(self, **kw)`` calls ``self._bind(kw)``,
    which sets them as attributes and calls ``_derive()``) and implement :meth:`update`.

    Detectors keep bounded state (fixed-size windows), are deterministic for the same input, and
    tolerate NaN (missing ranks) anywhere in the block.
    """

    name = "detector"
    #: Every output of the detector, output name -> the table of the store it goes to
    #: (:mod:`stepwatch.wire.catalog`): ``alerts`` (what :meth:`update` and :meth:`tick` return) for all of
    #: them; a detector that also writes rows declares each output :meth:`drain_rows` returns. The
    #: processor and :func:`stepwatch.detectors.replay.replay` read this, never guess.
    outputs: dict[str, str] = {"alerts": "alerts"}

    @classmethod
    def row_outputs(cls) -> dict[str, str]:
        """The declared outputs that are rows (all but ``alerts``), name -> table."""
        return {k: v for k, v in cls.outputs.items() if k != "alerts"}

    def drain_rows(self) -> dict:
        """Rows written since the last call, output name -> ``pyarrow.Table``, for the outputs declared in
        :attr:`outputs` (only those with rows). Called after every :meth:`update` / :meth:`tick`.
        Default: none."""
        return {}

    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:  # pragma: no cover
        raise NotImplementedError

    def prepare(self, ctx: JobContext) -> None:
        """The job's width (``ctx.world_size``) and layout became known (its topology arrived) before any
        of its steps reached this detector: allocate the per-rank state now. That is an allocation
        event, paid once per job where the processor learns the width, not on the first step (at 100k
        ranks: tens of MB of rings whose pages were faulted in by the first step's update). It must
        leave every output as it would have been: a detector that has seen a block ignores it, and an
        update whose block has another width resets the state as before. Default: nothing."""

    def restore_open(self, alerts: list[Alert]) -> None:
        """A processor rebuilding the job from the store (after a restart or a partition move) hands over
        the job's alerts still open there (all kinds, oldest first), before it replays the newest stored
        steps: what began before that replay window is known only from them. Nothing is emitted for
        them. Default: nothing."""

    def on_context(self, ctx: JobContext, kind: str) -> list[Alert]:
        """Rows of a context table (``comm``) reached the job's window (``ctx.comm``) after its steps:
        Kafka orders nothing across topics, so a step's comm rows may come after the step closed. The
        processor calls this for the detectors that override it; a replay feeds the rows before the
        block instead. Default: nothing."""
        return []

    def tick(self, ctx: JobContext, now_ns: int) -> list[Alert]:
        """Event time of the job moved to ``now_ns`` (host samples or step rows arrived) without
        necessarily closing a step. Detectors that judge silence (a hang) override this; it must be
        cheap (O(1) or O(R) numpy) because it runs on every host batch. Default: nothing."""
        return []

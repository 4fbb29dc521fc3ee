"""The one loop that feeds closed step blocks to a job's detectors: :func:`replay`.

The live processor (:meth:`stepwatch.stream.processor.Processor._detect`), its rebuild of a job from the
store (:mod:`stepwatch.stream.rebuild`), the offline analysis (:func:`stepwatch.stream.offline.efficiency_tables`)
and the detector benchmark (``stepwatch bench detectors``, :mod:`stepwatch.devtools.eval`) all call it, so a
detector sees the same calls in the same order everywhere:

for each block (re-cut to ``block_steps`` steps if asked): the context rows of its steps reach the job's
windows (``feeds``), then every detector in order gets ``update(ctx, block)`` (and ``tick(ctx, t_end of
the block's last step)`` with ``tick=True``), then its rows are drained — only from detectors that declare
row outputs (:attr:`~stepwatch.detectors.base.Detector.outputs`) — and handed to ``out`` with the alerts,
keyed by the *table* each output is declared to go to.

Nothing here knows about Kafka or the store (detectors never import the stream layer); what happens to the
alerts and rows is the caller's ``out``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa

from .base import Alert, Detector, JobContext, StepBlock


@dataclasses.dataclass
class Feed:
    """Context rows of one kind (``comm``, ``host``, ``gc``...) handed to the job's telemetry windows as the
    replay reaches them: before a block, the rows whose ``by`` column is at most the block's last step
    (``by="step"``) or its last ``t_end`` (``by="t"``, ns). The rows are put in that order once."""

    kind: str
    table: pa.Table
    by: str = "step"
    _keys: np.ndarray = dataclasses.field(init=False, repr=False)
    _fed: int = dataclasses.field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        k = self.table.column(self.by)
        if pa.types.is_timestamp(k.type):
            k = k.cast(pa.int64())
        keys = k.to_numpy(zero_copy_only=False).astype(np.int64)
        order = np.argsort(keys, kind="stable")
        if len(order) and np.any(order != np.arange(len(order))):
            self.table = self.table.take(pa.array(order))
        self._keys = keys[order]

    def upto(self, telemetry, block: StepBlock) -> bool:
        """Hand ``telemetry`` the rows up to ``block``'s end not handed yet; True if there were any."""
        if not len(block):
            return False
        edge = int(block.steps[-1]) if self.by == "step" else int(block.t_end[-1])
        upto = int(np.searchsorted(self._keys, edge, side="right"))
        if upto <= self._fed:
            return False
        telemetry.add(self.kind, self.table.slice(self._fed, upto - self._fed))
        self._fed = upto
        return True


def _call(det: Detector, fn, *args):
    return fn(*args)


def cut(blocks: Iterable[StepBlock], steps: int | None) -> Iterator[StepBlock]:
    """``blocks`` as they are (``steps`` None) or re-cut to ``steps`` steps each (views)."""
    for b in blocks:
        if steps is None or len(b) <= steps:
            yield b
            continue
        for i in range(0, len(b), steps):
            yield block_slice(b, i, i + steps)


def block_slice(b: StepBlock, i: int, j: int) -> StepBlock:
    """Steps ``i:j`` of a block (every per-step field sliced, None kept)."""
    return StepBlock(**{f.name: (None if getattr(b, f.name) is None else getattr(b, f.name)[i:j])
                        for f in dataclasses.fields(b)})


def drain(det: Detector, declared: dict[str, str] | None = None) -> dict[str, pa.Table]:
    """The rows ``det`` wrote since the last call, by the *table* its outputs are declared to go to (no
    call at all for a detector that declares no rows output). Raises :class:`ValueError` for rows of an
    output it does not declare."""
    declared = det.row_outputs() if declared is None else declared
    if not declared:
        return {}
    rows = {}
    for name, t in det.drain_rows().items():
        if name not in declared:
            raise ValueError(f"detector {det.name!r} wrote rows of {name!r}, which it does not declare "
                             f"in its outputs {sorted(det.outputs)}")
        rows[declared[name]] = t
    return rows


def replay(detectors: list[Detector], ctx: JobContext, blocks: Iterable[StepBlock], *,
           block_steps: int | None = None, feeds: Iterable[Feed] = (), telemetry=None, tick: bool = False,
           call: Callable | None = None, on_block: Callable[[StepBlock], None] | None = None,
           out: Callable[[Detector, list[Alert], dict[str, pa.Table]], None] | None = None) -> list[Alert]:
    """Feed ``blocks`` (closed steps, in step order) to ``detectors`` (see the module docs).

    ``telemetry``: the job's :class:`~stepwatch.detectors.context.JobTelemetry`, attached to ``ctx`` before
    every block when given (``feeds`` add to it). ``call(det, fn, *args)``: how an entry point is called
    (the processor times it and survives a failure: it returns None then, and the detector's rows wait for
    its next call); default: ``fn(*args)``. ``on_block(block)``: before the block goes to the detectors.
    ``out(det, alerts, rows)``: after each detector's turn, ``rows`` table -> ``pyarrow.Table`` (empty when
    it wrote none). Returns every alert (in order) when ``out`` is None, else [].
    Raises :class:`ValueError` if a detector hands out rows of an output it does not declare."""
    call = call or _call
    feeds = list(feeds)
    rows_of = {id(d): d.row_outputs() for d in detectors}
    got: list[Alert] = []
    for blk in cut(blocks, block_steps):
        for f in feeds:
            f.upto(telemetry, blk)
        if telemetry is not None:
            telemetry.attach(ctx)
        if on_block is not None:
            on_block(blk)
        for det in detectors:
            alerts = call(det, det.update, ctx, blk)
            if alerts is None:
                continue
            if tick:
                more = call(det, det.tick, ctx, int(blk.t_end[-1]))
                if more is None:
                    continue
                alerts = list(alerts) + list(more)
            rows = drain(det, rows_of[id(det)])
            if out is not None:
                out(det, alerts, rows)
            else:
                got += alerts
    return got

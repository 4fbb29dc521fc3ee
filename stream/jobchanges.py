"""A job's own changes, as its step rows show them to the processor:

- an **announced change** (``probe.mark_change("batch_size")``: a phase named ``change:<what>`` in a
  step's ``phases``): the step is kept (the newest 64) until the detectors reach it; the closed blocks
  are cut there, and the detectors that judge the job against its own past (:data:`BASELINE_DETECTORS`)
  start new baselines at it (a fresh warm-up gate; comm_bw's sync-bound baseline too), and what they
  still say firing is resolved (``evidence.resolved_by``): its baseline is gone;
- a **restart** (steps newer than the judged end of the job: the same job id started again, from a
  checkpoint): its steps are the new attempt's, not duplicates of the old ones, so its alignment starts
  afresh with the job's topology, its detectors are fresh and its life starts over.
"""
from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.detectors.base import StepBlock
from stepwatch.detectors.lifecycle import JobLife
from stepwatch.stream.align import JobState
from stepwatch.stream.emitter import resolution
from stepwatch.stream.stepaxis import JobAxis

log = logging.getLogger("stepwatch.processor")

#: detectors that judge a job against its own past: an announced change gives them a new baseline
#: (detector name -> the alert kinds of theirs it resolves)
BASELINE_DETECTORS = {"changepoint": ("regression", "recovery"), "jitter": ("jitter",),
                      "mfu": ("mfu_regression",)}
KEEP_CHANGES = 64                 # announced steps kept per job until the detectors reach them


class JobChanges:
    """The processor's job-change stage, built by it with what it uses: ``new_detectors(job)`` (a fresh
    set of the job's detectors) and ``emit(rt, alert)`` (an alert handed out as the detectors' are:
    :meth:`stepwatch.stream.emitter.AlertEmitter.emit`). ``rt`` is the processor's runtime of one job
    (``Processor.JobRuntime``): its ``state``, ``changes``, ``detectors``, ``firing``, ``topology``,
    ``axis``, ``pending`` and ``telemetry.life``."""

    def __init__(self, *, new_detectors, emit):
        self.new_detectors, self.emit = new_detectors, emit

    def announced(self, rt, part: pa.Table) -> None:
        """Steps the job marked as a change of its own (``probe.mark_change``: a phase named
        ``change:<what>`` in the step's ``phases``): kept until the detectors reach them."""
        if "phases" not in part.column_names:
            return
        ph = part.column("phases")
        if ph.null_count == len(ph):
            return
        arr = ph.combine_chunks()
        offs = arr.offsets.to_numpy(zero_copy_only=False)          # (a slice's offsets; its keys are all)
        n = np.diff(offs)
        if not n.sum():
            return
        keys = arr.keys.slice(int(offs[0]), int(offs[-1] - offs[0]))
        hit = pc.fill_null(pc.starts_with(keys, "change:"), False).to_numpy(zero_copy_only=False)
        if not hit.any():
            return
        row = np.repeat(np.arange(len(n)), n)[hit]
        steps = np.unique(part.column("step").to_numpy(zero_copy_only=False)[row]).tolist()
        done = rt.state.next_close if rt.state.next_close is not None else -1
        rt.changes = sorted(set(rt.changes) | {int(s) for s in steps if s >= done})[-KEEP_CHANGES:]

    @staticmethod
    def segments(rt, blocks: list[StepBlock]):
        """``blocks`` cut at the job's announced changes: (blocks before a change, its step) ..., (rest,
        None)."""
        if not rt.changes:
            yield blocks, None
            return
        seg: list[StepBlock] = []
        for b in blocks:
            while rt.changes and len(b) and rt.changes[0] <= int(b.steps[-1]):
                c = rt.changes.pop(0)
                k = int(np.searchsorted(b.steps, c))
                if k:
                    seg.append(b.head(k))
                yield seg, c
                seg, b = [], b.tail(k)
            if len(b):
                seg.append(b)
        yield seg, None

    def rebaseline(self, rt, step: int) -> None:
        """The job announced a change at ``step`` (a new batch size, learning-rate phase, model stage): the
        detectors that judge it against its own past start new baselines there (a fresh warm-up gate),
        and what they still say firing is resolved: its baseline is gone."""
        fresh = {d.name: d for d in self.new_detectors(rt.state.job)}
        kinds = {k for n in BASELINE_DETECTORS for k in BASELINE_DETECTORS[n]}
        rt.detectors = [fresh[d.name] if d.name in BASELINE_DETECTORS and d.name in fresh else d
                        for d in rt.detectors]
        for d in rt.detectors:
            if d.name == "comm_bw":
                d.new_baseline()
        log.info("job %s: a change announced at step %d: new baselines for %s", rt.state.job, step,
                 ", ".join(sorted(BASELINE_DETECTORS)))
        for f in list(rt.firing.values()):
            if f.kind in kinds:
                self.emit(rt, resolution(f, step=step, t_detected=f.t_detected,
                                         by=f"change announced at step {step}"))

    def restarted(self, rt, part: pa.Table) -> None:
        """Steps newer than the judged end of the job: the same job id started again (a restart from a
        checkpoint). Its detectors start new baselines and its life starts over."""
        life = rt.telemetry.life
        t = part.column("t_end")
        newest = pc.max(t.cast(pa.int64()) if pa.types.is_timestamp(t.type) else t).as_py()
        if newest is None or not life.restarted(int(newest)):
            return
        log.info("job %s: steps after its end (%s at step %d): a restart, new baselines", rt.state.job,
                 life.outcome, life.step_outcome)
        # a new attempt: its steps (from its checkpoint, so often numbers the last attempt ran too) are its
        # own, not duplicates of the old ones; its alignment starts afresh with the job's topology
        old = rt.state
        rt.state = JobState(old.job, capacity=old.capacity, lateness_ns=old.lateness_ns)
        for t in rt.topology:
            rt.state.set_topology(t)
        rt.axis = JobAxis()
        rt.pending = []
        rt.detectors = self.new_detectors(rt.state.job)
        rt.telemetry.life = JobLife()
        rt.firing.clear()

"""Offline replay of the efficiency detectors over one job's stored telemetry (post-mortems, backfills,
test stores): the steps aligned as the stream aligns them (:mod:`stepwatch.stream.align`), then fed to the
``mfu`` and ``comm_bw`` detectors. It lives in the stream layer because it uses the stream's alignment
(detectors never import the stream layer)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch import schema as wire
from stepwatch.detectors.base import StepBlock
from stepwatch.detectors.commbw import CommBandwidth
from stepwatch.detectors.context import JobTelemetry
from stepwatch.detectors.mfu import Mfu
from stepwatch.stream.align import JobState

def efficiency_tables(topology: pa.Table | None, steps: pa.Table, comm: pa.Table | None = None,
                      settings: dict | None = None) -> dict[str, pa.Table]:
    """The ``efficiency`` and ``comm_bw`` rows the processor would store for one job's stored telemetry
    (post-mortems, backfills, test stores): aligns the steps (stream order), feeds the ``mfu`` and
    ``comm_bw`` detectors with the comm rows as they would have arrived. ``settings`` as for the registry."""
    settings = settings or {}
    job = steps.column("job")[0].as_py()
    st = JobState(job, capacity=int(pc.max(steps.column("step")).as_py()) - int(pc.min(steps.column("step")).as_py()) + 8)
    if topology is not None and topology.num_rows:
        st.set_topology(topology)
    tel = JobTelemetry()
    cstep = None
    if comm is not None and comm.num_rows:             # step order, to hand each block its steps' rows
        cstep = pc.cast(comm.column("step"), pa.int64()).to_numpy(zero_copy_only=False)
        order = np.argsort(cstep, kind="stable")
        comm, cstep = comm.take(pa.array(order)), cstep[order]
    _, blocks = st.ingest(wire.conform(steps, wire.STEPS))
    blocks += st.close_ready(force=True)
    dets = [Mfu(**settings.get("mfu", {})), CommBandwidth(**settings.get("comm_bw", {}))]
    out: dict[str, list] = {}
    ctx = st.context()
    tel.attach(ctx)
    fed = 0

    def keep(d):
        for k, v in d.drain_rows().items():
            out.setdefault(k, []).append(wire.conform(v, wire.SCHEMAS[k]))
    for b in blocks:
        dets[0].update(ctx, b)
        keep(dets[0])
        for j in range(len(b)):                         # comm_bw step by step, each step's comm rows first
            if cstep is not None:
                upto = int(np.searchsorted(cstep, int(b.steps[j]), side="right"))
                if upto > fed:
                    tel.add("comm", comm.slice(fed, upto - fed))
                    fed = upto
            dets[1].update(ctx, _block_slice(b, j, j + 1))
            keep(dets[1])
    return {k: pa.concat_tables(v) for k, v in out.items()}


def _block_slice(b: StepBlock, i: int, j: int) -> StepBlock:
    """Steps ``i:j`` of a block (every per-step field sliced, None kept)."""
    return StepBlock(**{f.name: (None if getattr(b, f.name) is None else getattr(b, f.name)[i:j])
                        for f in dataclasses.fields(b)})

"""Offline replay of the efficiency detectors over one job's stored telemetry (post-mortems, backfills,
test stores): the steps aligned as the stream aligns them (:mod:`stepwatch.stream.align`), then fed to the
``mfu`` and ``comm_bw`` detectors. It lives in the stream layer because it uses the stream's alignment
(detectors never import the stream layer). The detectors are fed by the same loop as the processor's
(:func:`stepwatch.detectors.replay.replay`)."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.detectors.commbw import CommBandwidth
from stepwatch.detectors.context import JobTelemetry
from stepwatch.detectors.mfu import Mfu
from stepwatch.detectors.replay import Feed, replay
from stepwatch.stream.align import JobState


def efficiency_tables(topology: pa.Table | None, steps: pa.Table, comm: pa.Table | None = None,
                      settings: dict | None = None) -> dict[str, pa.Table]:
    """The ``efficiency`` and ``comm_bw`` rows the processor would store for one job's stored telemetry
    (post-mortems, backfills, test stores): aligns the steps (stream order), feeds the ``mfu`` and
    ``comm_bw`` detectors through :func:`stepwatch.detectors.replay.replay` (``comm_bw`` step by step, each
    step's comm rows reaching the job's window first, as they would have arrived). ``settings`` as for the
    registry."""
    settings = settings or {}
    job = steps.column("job")[0].as_py()
    st = JobState(job, capacity=int(pc.max(steps.column("step")).as_py()) - int(pc.min(steps.column("step")).as_py()) + 8)
    if topology is not None and topology.num_rows:
        st.set_topology(topology)
    tel = JobTelemetry()
    _, blocks = st.ingest(conform(steps, wire.STEPS))
    blocks += st.close_ready(force=True)
    ctx = st.context()
    tel.attach(ctx)
    out: dict[str, list] = {}

    def keep(det, alerts, rows):
        for k, v in rows.items():
            out.setdefault(k, []).append(conform(v, wire.SCHEMAS[k]))
    feeds = [Feed("comm", comm)] if comm is not None and comm.num_rows else []
    # mfu reads no comm rows, comm_bw nothing of mfu's: one pass each gives what the interleaved stream gives
    replay([Mfu(**settings.get("mfu", {}))], ctx, blocks, out=keep)
    replay([CommBandwidth(**settings.get("comm_bw", {}))], ctx, blocks, block_steps=1, feeds=feeds,
           telemetry=tel, out=keep)
    return {k: pa.concat_tables(v) for k, v in out.items()}

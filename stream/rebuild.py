"""A job's detector state rebuilt from the store, the first time a processor sees the job (after a restart
or a partition move): its topology, the alerts already stored (so none is sent twice, and incidents keep
their ids), the alerts still open (handed to the sinks that keep alerts up, to the job metrics, and to the job's
detectors: :meth:`~stepwatch.detectors.base.Detector.restore_open`), the
host/gc context of the replayed span, and the last ``replay_steps`` steps replayed through the job's fresh
detectors by the processor's own detection path (:meth:`~stepwatch.stream.processor.Processor._detect`,
i.e. :func:`stepwatch.detectors.replay.replay`) with ``replaying`` set: a straggler in progress is not
forgotten, and the replayed rows are not stored again.
"""
from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.storage.views import connect as views_connect
from stepwatch.stream.alertfanout import open_alerts
from stepwatch.stream.sinks import AlertOut, NotifierSink

log = logging.getLogger("stepwatch.processor")


def rebuild(store, rt, *, replay_steps: int, window_steps: int, sinks, on_restored, call, detect) -> None:
    """Warm ``rt`` (the processor's JobRuntime of a job) from ``store`` (a
    :class:`~stepwatch.storage.store.LakeStore`): topology, last window of steps, stored alerts. Never
    raises: a job that cannot be rebuilt starts cold.

    What it uses is passed in: ``replay_steps`` (steps replayed) and ``window_steps`` (the alignment
    window: rows up to half of it past the ranks' position are read), ``sinks`` (the processor's
    :class:`~stepwatch.stream.sinks.Sinks`: the alerts still open go to them as restored),
    ``on_restored(alert)`` (or None: the job metrics count them), ``call(rt, det, fn, *args)`` (one
    detector entry point, timed and guarded) and ``detect(rt, blocks)`` (the processor's detection
    path, run with ``rt.replaying`` set)."""
    job = rt.state.job
    try:
        con = views_connect(store.root)
        topo = con.sql("SELECT * FROM topology WHERE job = ? QUALIFY row_number() OVER "
                       "(PARTITION BY rank ORDER BY date DESC) = 1", params=[job]).to_arrow_table()
        if topo.num_rows:
            rt.state.set_topology(topo)
        for aid, status in con.execute("SELECT alert_id, status FROM alerts WHERE job = ?", [job]).fetchall():
            rt.alerts_seen.add((aid, status))
        try:                                           # incidents keep their ids across restarts
            rt.incidents.seed(con.sql("SELECT * FROM alerts WHERE job = ? AND incident_id IS NOT NULL "
                                      "ORDER BY t_detected", params=[job]).to_arrow_table().to_pylist())
        except Exception:  # noqa: BLE001 - a store written before incidents existed
            log.info("no incidents to warm for job %s", job, exc_info=True)
        restore = on_restored
        try:
            still_open = open_alerts(con, job)
        except Exception:  # noqa: BLE001 - the rest of the rebuild does not need them
            log.warning("could not read the open alerts of job %s from the store", job, exc_info=True)
            still_open = []
        if restore is not None or any(isinstance(s, NotifierSink) for s in sinks.sinks):
            for a in still_open:                           # sinks re-send them, job metrics count them
                if restore is not None:
                    restore(a)
                sinks.write(AlertOut(a, restored=True))
        for det in rt.detectors:                           # what began before the replay window
            call(rt, det, det.restore_open, still_open)
        # the job's position: where its ranks' newest steps are (stream.stepaxis; one bad row cannot place it)
        top = con.execute("SELECT quantile_disc(m, 0.75) FROM (SELECT max(step) AS m FROM steps WHERE job = ? "
                          "GROUP BY rank)", [job]).fetchall()[0][0]
        if top is not None:
            lo = int(top) - replay_steps + 1
            hist = con.sql("SELECT * FROM steps WHERE job = ? AND step BETWEEN ? AND ? ORDER BY step, rank",
                           params=[job, lo, int(top) + window_steps // 2]).to_arrow_table()
            if hist.num_rows:
                warm_context(con, rt, hist)
                hist = conform(hist.drop_columns([c for c in ("date",) if c in hist.column_names]),
                                    wire.STEPS)
                rt.replaying = True
                try:
                    _, blocks = rt.state.ingest(hist)
                    detect(rt, blocks)
                finally:
                    rt.replaying = False
                log.info("rebuilt job %s from store: %d rows up to step %s, %d alerts known",
                         job, hist.num_rows, top, len(rt.alerts_seen))
        con.close()
    except Exception:  # noqa: BLE001 - a cold start must not stop the processor
        log.exception("could not rebuild state of job %s from the store; starting cold", job)


def warm_context(con, rt, hist: pa.Table) -> None:
    """Warm the job's host/gc windows from the store over the replayed steps' time span."""
    try:
        mm = pc.min_max(hist.column("t_end").cast(pa.int64())).as_py()
        if mm["min"] is None:
            return
        lo = max(int(mm["min"]) - 60_000_000_000, int(mm["max"]) - 300_000_000_000)
        for kind, schema in (("host", wire.HOST), ("gc", wire.GC)):
            # in time order: the window's row cap keeps the newest
            t = con.sql(f"SELECT * FROM {kind} WHERE job = ? AND epoch_ns(t) >= ? ORDER BY t",
                        params=[rt.state.job, lo]).to_arrow_table()
            if t.num_rows:
                rt.telemetry.add(kind, conform(t.drop_columns([c for c in ("date",) if c in t.column_names]),
                                                    schema))
    except Exception:  # noqa: BLE001 - evidence is optional; the steps replay is what matters
        log.info("could not warm the host/gc context of job %s from the store", rt.state.job, exc_info=True)

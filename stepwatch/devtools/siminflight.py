"""In-flight states of a simulated job: what probes' watchdogs and agents send while a step
runs long or the job hangs (:func:`setup_inflight`, :func:`with_inflight`)."""
from __future__ import annotations

import numpy as np

# ----------------------------------------------------------------------------- in-flight states ----------

#: what the stuck rank of a ``job-hang`` with a rank does, for :func:`with_inflight`
HANG_MODES = ("python", "mismatch", "sigstop")
_MAIN = "train.py:231 in main\ntrain.py:197 in train_step"
_C10D = "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py"


def setup_inflight(sim: "Simulation", hang: str | None = None, long_steps: dict | None = None) -> "Simulation":
    """Prepare ``sim`` for :func:`with_inflight`: a ``job-hang`` with a rank stops every rank at the same
    step (the others block in that step's all_reduce, as in a real hang), and ``long_steps`` (step ->
    (kind, extra ms): ``eval``, ``checkpoint``) last that much longer on every rank."""
    if hang is not None and hang not in HANG_MODES:
        raise ValueError(f"hang mode {hang!r}: one of {', '.join(HANG_MODES)}")
    sim.hang_lag = 0
    sim.inflight_hang = hang
    sim.long_steps = dict(long_steps or {})
    return sim


def _table(d: dict):
    import pyarrow as pa
    from stepwatch.wire.tables import INFLIGHT
    n = len(d["rank"])
    return pa.Table.from_pydict({f.name: d.get(f.name, [None] * n) for f in INFLIGHT}, schema=INFLIGHT)


def _rows(sim, ranks, t, **cols) -> dict:
    n = len(ranks)
    d = {"job": [sim.job] * n, "node": [str(sim.nodes[r]) for r in ranks], "rank": list(map(int, ranks)),
         "t": [int(t)] * n}
    for k, v in cols.items():
        d[k] = v if isinstance(v, list) else [v] * n
    return d


def with_inflight(sim: "Simulation", s: int, tables: dict, after_s: float = 10.0, every_s: float = 5.0) -> dict:
    """Step ``s``'s tables (from ``sim.generate(s, s + 1)``) plus what the probes' watchdogs and the agents
    send while a step runs long (see :func:`setup_inflight`), under ``tables["before"]``: a list of
    ``(kind, table)`` to send before the step's own rows, as they arrive live:

    * during a long step (evaluation, checkpoint): host samples every ``every_s`` inside it, and from
      ``after_s`` on every ``every_s`` each rank's in-flight state (compute, with the step's kind and a
      stack in ``evaluate`` / ``torch.save``); its step rows carry the kind in ``phases``;
    * during a ``job-hang`` with a rank, from ``after_s`` after the hang began, every ``every_s``: the
      other ranks in the step's ``all_reduce`` (group world, sequence number = step + 1) and the stuck
      rank in Python (``load_next_shard``), in a ``broadcast`` (mismatch), or, stopped, only the agent's
      row saying so.
    """
    import pyarrow as pa
    before = []
    R = sim.world_size
    step_ms = sim.step_ms
    ls = sim.long_steps.get(s)
    if ls is not None and tables["steps"].num_rows:
        kind, extra = ls
        st = tables["steps"]
        t0 = int(st.column("t_start")[0].value)
        t1 = int(st.column("t_end")[0].value)
        host = tables["host"]
        ts = np.arange(t0 + int(every_s * 1e9), t1 - int(0.5e9), int(every_s * 1e9))
        if len(ts) and host.num_rows:
            parts = [host.set_column(host.schema.get_field_index("t"), "t",
                                     pa.array(np.full(host.num_rows, t), pa.timestamp("ns", tz="UTC")))
                     for t in ts]
            before.append(("host", pa.concat_tables(parts)))
        stack = _MAIN + ("\ntrain.py:150 in evaluate" if kind == "eval" else
                         "\ntrain.py:172 in save_checkpoint\n/usr/lib/python3/site-packages/torch/serialization.py:"
                         "620 in save")
        tw = ts[ts >= t0 + int(after_s * 1e9)]
        rows = [_rows(sim, range(R), t, source="probe", state="compute", step=s, step_kind=kind,
                      elapsed_ms=(t - t0) / 1e6, since=t0, stack=stack) for t in tw]
        if rows:
            before.insert(0, ("inflight", _table({k: sum((r[k] for r in rows), []) for k in rows[0]})))
        ph = pa.array([[(kind, float(extra))]] * st.num_rows, st.schema.field("phases").type)
        tables["steps"] = st.set_column(st.schema.get_field_index("phases"), "phases", ph)
    f = next((f for f in sim.faults if f.kind == "job-hang" and f.rank is not None), None)
    mode = getattr(sim, "inflight_hang", None)
    if f is not None and mode is not None and s >= f.start and tables["host"].num_rows:
        hang_t0 = int(sim._ends[f.start - 1]) if f.start > 0 else sim.t0_ns
        t = int(tables["host"].column("t")[0].value)
        per = max(int(round(every_s * 1e3 / step_ms)), 1)
        k = s - f.start
        if (t - hang_t0) >= after_s * 1e9 and (k % per == 0 or (t - hang_t0) < (after_s * 1e9 + step_ms * 1e6)):
            others = [r for r in range(R) if r != f.rank]
            seq = f.start + 1
            d = _rows(sim, others, t, source="probe", state="collective", step=f.start, op="all_reduce",
                      group="world", seq=seq, group_size=R, elapsed_ms=(t - hang_t0) / 1e6, since=hang_t0,
                      stack=_MAIN + f"\n{_C10D}:2501 in all_reduce")
            if mode == "python":
                c = _rows(sim, [f.rank], t, source="probe", state="compute", step=f.start,
                          elapsed_ms=(t - hang_t0) / 1e6, since=hang_t0,
                          stack=_MAIN + "\ndata/shards.py:88 in load_next_shard")
            elif mode == "mismatch":
                c = _rows(sim, [f.rank], t, source="probe", state="collective", step=f.start, op="broadcast",
                          group="world", seq=seq, group_size=R, elapsed_ms=(t - hang_t0) / 1e6, since=hang_t0,
                          stack=_MAIN + f"\ntrain.py:201 in train_step\n{_C10D}:2213 in broadcast")
            else:
                c = None
            parts = [_table(d)]
            if c is not None:
                parts.append(_table(c))
            before.append(("inflight", pa.concat_tables(parts)))
        if mode == "sigstop" and k % per == 0:         # the agent sees the stopped process from the start
            before.append(("inflight", _table(
                _rows(sim, [f.rank], t, source="agent", state="stopped", elapsed_ms=(t - hang_t0) / 1e6,
                      since=hang_t0, pid=4242 + f.rank))))
    tables["before"] = before
    return tables

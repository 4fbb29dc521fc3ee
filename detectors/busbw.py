"""Bus-bandwidth maths over arrays (nccl-tests conventions) and the reference transmission analysis
:func:`comm_analysis` over raw comm rows. The scalar bus and size factors, the link peaks and the link
types live in ``agents/probe/collectives.py`` (shared with the probe and the simulator)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.agents.probe import collectives
from stepwatch.agents.probe.collectives import LINK_GBPS, SATURATE_BYTES, link_type

def bus_factor(op: str, n) -> np.ndarray:
    """:func:`collectives.bus_factor` over an array of group sizes (at least 1)."""
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    return collectives.bus_factor(op, n) * np.ones_like(n)


def size_factor(op: str, n) -> np.ndarray:
    """:func:`collectives.size_factor` over an array of group sizes (at least 1)."""
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    return collectives.size_factor(op, n) * np.ones_like(n)


def bus_bandwidth(op: str, n, bytes_per_call, ms_per_call) -> tuple[np.ndarray, np.ndarray]:
    """(algbw, busbw) in GB/s for a collective of ``n`` ranks moving ``bytes_per_call`` (the probe's
    payload) in ``ms_per_call``."""
    b = np.asarray(bytes_per_call, dtype=np.float64)
    t = np.asarray(ms_per_call, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        alg = np.where(t > 0, b * size_factor(op, n) / (t * 1e6), np.nan)
    return alg, alg * bus_factor(op, n)



def comm_analysis(t: pa.Table, nodes: np.ndarray | None, family: str | None, step_ms: float,
                  link_gbps: dict | None = None, link: str | None = None) -> dict:
    """Achieved bandwidth per (op, group) over comm rows of a window of steps.

    Per (op, group, step) the transfer time is the smallest wall time of a rank in the collective (the
    last rank to arrive waits least: its time is the transfer, independent of how the producer split
    time and wait); per (op, group): payload per call = sum(bytes) / sum(count), transfer per call =
    sum over steps of that time / calls per rank, ``algbw``/``busbw`` by :func:`bus_bandwidth`, peak by
    the group's link (:func:`link_type`, ``link`` forces one). ``barrier`` and ``wait`` rows carry no
    payload and count only in the wait share. Returns ``{"groups": dict of numpy columns, "hist":
    {bucket: calls}, "wait_share", "comm_share", "rank_wait"}``; empty dict without usable rows."""
    if t is None or t.num_rows == 0:
        return {}
    peaks = dict(LINK_GBPS, **(link_gbps or {}))
    cols = {c: t.column(c) for c in t.column_names}
    n = t.num_rows

    def f64(c, fill=0.0):
        if c not in cols:
            return np.full(n, fill)
        return pc.fill_null(cols[c].cast(pa.float64()), fill).to_numpy(zero_copy_only=False)

    time_ms, wait_ms, nbytes, count = f64("time_ms"), f64("wait_ms"), f64("bytes"), f64("count", 1.0)
    rank = cols["rank"].to_numpy(zero_copy_only=False).astype(np.int64)
    steps = cols["step"].to_numpy(zero_copy_only=False).astype(np.int64)
    gs = f64("group_size", np.nan)
    n_steps = max(len(np.unique(steps)), 1)
    n_ranks = max(len(np.unique(rank)), 1)
    tot_time, tot_wait = float(time_ms.sum()), float(wait_ms.sum())
    out = {"wait_share": tot_wait / tot_time if tot_time > 0 else None,
           "comm_share": tot_time / (n_steps * n_ranks) / step_ms if step_ms and step_ms > 0 else None,
           "steps": n_steps, "ranks": n_ranks}
    # per-rank wait over the window (who waits least = who everyone waits for)
    rw = np.bincount(rank, weights=wait_ms)
    seen = np.bincount(rank) > 0
    out["rank_wait"] = (np.flatnonzero(seen), rw[seen] / n_steps)
    # each step's least per-rank wait: what every rank waited (the collective's own latency), no peer
    su, si = np.unique(steps, return_inverse=True)
    ru, ri = np.unique(rank, return_inverse=True)
    cell = np.bincount(si * len(ru) + ri, weights=wait_ms, minlength=len(su) * len(ru)).reshape(len(su), len(ru))
    hit = np.bincount(si * len(ru) + ri, minlength=len(su) * len(ru)).reshape(len(su), len(ru)) > 0
    out["floor_wait"] = float(np.where(hit, cell, np.inf).min(axis=1).sum()) / n_steps
    op = pc.fill_null(cols["op"], "?")
    grp = pc.fill_null(cols["group"], "") if "group" in cols else pa.array([""] * n)
    payload = pc.invert(pc.is_in(op, value_set=pa.array(["barrier", "wait"]))).to_numpy(zero_copy_only=False)
    payload &= (count > 0) & (nbytes > 0)
    if not payload.any():
        out["groups"] = None
        out["hist"] = {}
        return out
    idx = np.flatnonzero(payload)
    node_code = None
    if nodes is not None and len(nodes):
        _, codes = np.unique(np.asarray(nodes, dtype=object).astype(str), return_inverse=True)
        node_code = np.where(rank[idx] < len(codes), codes[np.minimum(rank[idx], len(codes) - 1)], -1)
    sub = pa.table({"op": op.take(pa.array(idx)), "group": grp.take(pa.array(idx)), "step": steps[idx],
                    "rank": rank[idx], "time": time_ms[idx], "wait": wait_ms[idx], "bytes": nbytes[idx],
                    "count": count[idx], "gs": gs[idx],
                    "node": node_code if node_code is not None else np.zeros(len(idx), np.int64)})
    per_step = sub.group_by(["op", "group", "step"]).aggregate(
        [("time", "min"), ("time", "sum"), ("wait", "sum"), ("bytes", "sum"), ("count", "sum"),
         ("rank", "count")])
    g = per_step.group_by(["op", "group"]).aggregate(
        [("time_min", "sum"), ("time_sum", "sum"), ("wait_sum", "sum"), ("bytes_sum", "sum"),
         ("count_sum", "sum"), ("rank_count", "sum"), ("step", "count")])
    meta = sub.group_by(["op", "group"]).aggregate([("gs", "max"), ("rank", "count_distinct"),
                                                   ("node", "count_distinct")])
    # align meta with g (both keyed by op, group)
    key_g = [f"{a}\x00{b}" for a, b in zip(g.column("op").to_pylist(), g.column("group").to_pylist())]
    key_m = {f"{a}\x00{b}": i for i, (a, b) in enumerate(zip(meta.column("op").to_pylist(),
                                                             meta.column("group").to_pylist()))}
    mi = np.array([key_m[k] for k in key_g], dtype=np.int64)
    gsz = meta.column("gs_max").to_numpy(zero_copy_only=False).astype(float)[mi]
    nrk = meta.column("rank_count_distinct").to_numpy(zero_copy_only=False).astype(float)[mi]
    nnd = meta.column("node_count_distinct").to_numpy(zero_copy_only=False).astype(float)[mi]
    gsz = np.where(np.isfinite(gsz) & (gsz > 0), gsz, nrk)
    rows = g.column("rank_count_sum").to_numpy().astype(float)          # rank-step rows
    nst = g.column("step_count").to_numpy().astype(float)
    calls = g.column("count_sum_sum").to_numpy().astype(float)
    byts = g.column("bytes_sum_sum").to_numpy().astype(float)
    xfer = g.column("time_min_sum").to_numpy().astype(float)           # sum over steps of min time
    tsum = g.column("time_sum_sum").to_numpy().astype(float)
    wsum = g.column("wait_sum_sum").to_numpy().astype(float)
    calls_rank_step = calls / np.maximum(rows, 1)
    bpc = byts / np.maximum(calls, 1)
    xfer_per_call = xfer / np.maximum(nst * calls_rank_step, 1e-12)
    ops = g.column("op").to_pylist()
    alg = np.full(len(ops), np.nan)
    bus = np.full(len(ops), np.nan)
    for o in set(ops):
        m = np.array([x == o for x in ops])
        alg[m], bus[m] = bus_bandwidth(o, gsz[m], bpc[m], xfer_per_call[m])
    links = [link or link_type(family, int(k)) for k in nnd]
    peak = np.array([peaks.get(lk, np.nan) for lk in links])
    sat = np.array([SATURATE_BYTES.get(lk, 4 * 2**20) for lk in links])
    out["groups"] = {
        "op": ops, "group": g.column("group").to_pylist(), "group_size": gsz.astype(np.int64),
        "ranks": nrk.astype(np.int64), "link": links, "calls_per_step": calls_rank_step,
        "bytes_per_call": bpc, "xfer_ms_per_step": xfer / np.maximum(nst, 1),
        "time_ms_per_step": tsum / np.maximum(rows, 1),
        "wait_share": np.where(tsum > 0, wsum / np.maximum(tsum, 1e-12), np.nan),
        "algbw_gbps": alg, "busbw_gbps": bus, "peak_gbps": peak,
        "util": bus / peak, "saturate_bytes": sat, "calls": calls, "time_sum": tsum, "rows": rows,
    }
    # message-size distribution: calls by payload-per-call bucket (per rank-step row averages)
    row_bpc = nbytes[idx] / np.maximum(count[idx], 1)
    edges = np.array([4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20], dtype=np.float64)
    names = ["<4KiB", "4KiB-64KiB", "64KiB-1MiB", "1MiB-16MiB", "16MiB-256MiB", ">=256MiB"]
    b = np.searchsorted(edges, row_bpc, side="right")
    h = np.bincount(b, weights=count[idx], minlength=len(names))
    out["hist"] = {names[i]: int(h[i]) for i in range(len(names))}
    return out

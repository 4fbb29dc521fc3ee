"""Efficiency analytics beyond jitter: how far from the hardware a job runs, and what wastes it.

Three detectors (registered as ``mfu``, ``comm_bw`` and ``dataloader``) computed live from the telemetry
the agents send, each writing rows the processor stores (:meth:`drain_rows`) and alerting like the rest:

* :class:`Mfu` — per closed step the model FLOPs, **MFU** (model FLOPs / (step time x devices x peak
  FLOPS per device)) and the productive share of the wall time (**goodput**), stored in the
  ``efficiency`` table; a change point on the work-normalised step time alerts ``mfu_regression``.
* :class:`CommBandwidth` — per window of steps and (collective kind, group): payload per call, achieved
  algorithm and bus bandwidth (nccl-tests conventions) against the link's peak, stored in ``comm_bw``;
  diagnoses ``comm_small_messages``, ``comm_slow_link``, ``comm_sync_bound``.
* :class:`DataLoader` — the distribution of the DataLoader's ready-batch queue per rank; mostly empty
  with a material data wait alerts ``dataloader_starved`` (cause ``io``) with the concrete remedy.

The tables of device peaks (:data:`PEAK_TFLOPS`) and link peaks (:data:`LINK_GBPS`), and the collectives'
bus and size factors, live in ``agents/probe/collectives.py`` (shared with the probe and the simulator) and
are documented in
``docs/detectors.md`` with their sources; both can be overridden (settings, ``STEPWATCH_PEAK_TFLOPS``).
Everything is columnar (numpy / pyarrow group-by); nothing loops per rank or per record.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.agents.probe import collectives
from stepwatch.agents.probe.collectives import (LINK_GBPS, PEAK_TFLOPS, SATURATE_BYTES, device_family,  # noqa: F401
                                                intra_link, link_type, norm_dtype, peak_tflops)

from .base import Alert, Detector, JobContext, StepBlock
from .causes import DATALOADER_SUGGESTION, SUGGESTIONS, nanmedian, queue_evidence

# --------------------------------------------------------------------------- device peaks

def load_peak_table(src) -> dict[str, float]:
    """A user peak table: a dict, a JSON/YAML file, or a number (all devices). Keys ``family/dtype``,
    ``family`` (any dtype) or ``*``; values TFLOPS."""
    if src is None or src == "":
        return {}
    if isinstance(src, (int, float)):
        return {"*": float(src)}
    if isinstance(src, dict):
        return {str(k).lower(): float(v) for k, v in src.items()}
    s = str(src)
    try:
        return {"*": float(s)}
    except ValueError:
        pass
    text = Path(s).read_text()
    if s.endswith((".yaml", ".yml")):
        import yaml
        d = yaml.safe_load(text) or {}
    else:
        d = json.loads(text)
    return {str(k).lower(): float(v) for k, v in d.items()}


def model_flops_per_token(info: dict) -> tuple[float | None, str]:
    """Whole-model training FLOPs per token: ``model_flops_per_token`` from the topology, else
    6 x parameters (dense transformer, forward + backward) with parameters = the ranks' mean
    ``model_params`` (each rank's share) x tp x pp."""
    f = info.get("model_flops_per_token")
    if f and f > 0:
        return float(f), "model_flops_per_token"
    p = info.get("model_params")
    if p and p > 0:
        n = float(p) * int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)
        return 6.0 * n, f"6 x {n:.3g} params"
    return None, "unknown"


# --------------------------------------------------------------------------- bus bandwidth

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


# --------------------------------------------------------------------------- shared helpers

def _pending_add(pending: list, t: pa.Table, cap: int) -> None:
    """Queue rows for the store (NaN stored as null, so SQL aggregates skip it); bounded by ``cap``."""
    t = pa.table({n: (pa.array(c.to_numpy(), from_pandas=True) if pa.types.is_floating(c.type) else c)
                  for n, c in zip(t.column_names, t.columns)})
    pending.append(t)
    while sum(x.num_rows for x in pending) > cap and len(pending) > 1:
        pending.pop(0)


class _Episodes:
    """Firing/resolved bookkeeping of one detector's alerts by key: fire once, resolve after ``clear``
    consecutive evaluations without the finding. Bounded by the number of live findings."""

    def __init__(self, clear: int):
        self.clear = clear
        self.open: dict[str, list] = {}          # key -> [alert, clean evaluations]

    def seen(self, key: str, make) -> list[Alert]:
        st = self.open.get(key)
        if st is not None:
            st[1] = 0
            return []
        a = make()
        if a is None:
            return []
        self.open[key] = [a, 0]
        return [a]

    def sweep(self, present: set, step_now: int, t_now: int) -> list[Alert]:
        out = []
        for key in list(self.open):
            if key in present:
                continue
            st = self.open[key]
            st[1] += 1
            if st[1] >= self.clear:
                a = st[0]
                out.append(Alert(job=a.job, kind=a.kind, status="resolved", step_first=a.step_first,
                                 step_detected=step_now, t_detected=t_now, ranks=a.ranks, nodes=a.nodes,
                                 cause=a.cause, severity=a.severity, evidence=a.evidence, cost_pct=a.cost_pct,
                                 suggestion=a.suggestion, alert_id=a.alert_id))
                del self.open[key]
        return out


# --------------------------------------------------------------------------- MFU and goodput

class Mfu(Detector):
    """MFU and goodput per closed step (``efficiency`` rows) and MFU regressions (``mfu_regression``).

    Per step: ``step_ms`` = median over the ranks; ``devices`` = ranks that reported tokens (samples);
    global ``tokens`` = sum of the ranks' tokens / (tp x pp) (every rank of a tensor- or pipeline-parallel
    group reports the tokens of the micro-batches it works on; context-parallel ranks are taken to report
    their own shard of the sequence); ``model_flops`` = FLOPs per token x global tokens, FLOPs per token
    from the topology's ``model_flops_per_token`` or 6 x parameters (dense transformers; parameters =
    mean of the ranks' ``model_params`` x tp x pp; FSDP/ZeRO-3 jobs count only a shard per rank and must
    give ``model_flops_per_token``); without tokens, ``model_flops_per_sample`` x global samples.
    ``mfu = model_flops / (step_ms/1000 x devices x peak)`` with the device peak from
    :func:`peak_tflops` (``device_type``, ``dtype`` of the topology; override with ``peak_tflops``, a
    number or a JSON/YAML table, or the ``STEPWATCH_PEAK_TFLOPS`` environment variable).

    Goodput: ``wall_ms`` = this step's ``t_end`` minus the previous closed step's (the first step: its
    step time); ``productive_ms`` = the step time, or, for an anomalous step (slower than ``slow`` x the
    median of the previous ``baseline`` steps: a stall, a checkpoint pause, the first step after a
    restart), that median; capped at ``wall_ms``. Gaps between steps (restarts, pauses outside steps)
    and the excess of anomalous steps are not productive. Goodput over a window = sum(productive_ms) /
    sum(wall_ms).

    ``mfu_regression``: the step times scaled by the model FLOPs of each step relative to the first
    (``step_ms x flops_ref / flops``, i.e. the inverse of MFU in ms) go through the change-point detector
    (:class:`~stepwatch.detectors.changepoint.ChangePoint` with its settings ``window``, ``min_effect``,
    ``min_t``, straggler deferral, floor check and cause attribution); a rise is an MFU drop. With a
    constant number of tokens per step it fires with ``regression``; when the tokens per step change it
    is the one that tells a slower model from more work. Steps without MFU are skipped.

    Settings (keyword arguments, defaults):
        peak_tflops=None   peak override: a number (all devices), a dict or a JSON/YAML file path
        baseline=21        steps in the goodput baseline median
        slow=1.1           a step slower than this x the baseline is anomalous (excess not productive)
        min_effect=0.05    minimum relative MFU change to alert
        min_t=5.0          minimum shift in standard errors
        window=200         steps kept for the change-point search
        critical_pct=10    MFU drops costing more are ``critical``
        max_pending=8192   efficiency rows kept until the processor drains them
    """

    name = "mfu"

    def __init__(self, *, peak_tflops=None, baseline: int = 21, slow: float = 1.1, min_effect: float = 0.05,
                 min_t: float = 5.0, window: int = 200, critical_pct: float = 10.0, max_pending: int = 8192):
        from .changepoint import ChangePoint
        if baseline < 1 or slow <= 1.0 or max_pending < 1:
            raise ValueError("mfu: need baseline >= 1, slow > 1, max_pending >= 1")
        src = peak_tflops if peak_tflops is not None else os.environ.get("STEPWATCH_PEAK_TFLOPS")
        self.table = load_peak_table(src)
        self.baseline, self.slow, self.max_pending = int(baseline), float(slow), int(max_pending)
        self._cp = ChangePoint(window=window, min_effect=min_effect, min_t=min_t, critical_pct=critical_pct,
                               phases=False)
        self._hist = np.full(self.baseline, np.nan)      # previous step medians (goodput baseline)
        self._nh = 0
        self._last_t = None
        self._flops_ref = None                           # model FLOPs per device of the first MFU step
        self._mfu = np.full(int(window) + 8, np.nan)     # recent MFU by step (evidence)
        self._mfu_step = np.full(int(window) + 8, -1, dtype=np.int64)
        self._pending: list[pa.Table] = []
        self.peak_source = ""

    def drain_rows(self) -> dict[str, pa.Table]:
        if not self._pending:
            return {}
        t = pa.concat_tables(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        return {"efficiency": t}

    def _per_step(self, ctx: JobContext, block: StepBlock):
        S = len(block)
        info = ctx.info or {}
        rep = max(int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1), 1)
        fpt, _ = model_flops_per_token(info)
        flops = np.full(S, np.nan)
        tokens = samples = np.full(S, np.nan)
        devices = np.sum(np.isfinite(block.step_ms), axis=1).astype(np.int64)
        if block.tokens is not None:
            tokens = np.where(block.tokens_ranks > 0, block.tokens / rep, np.nan)
            if fpt:
                flops = fpt * tokens
            devices = np.where(block.tokens_ranks > 0, block.tokens_ranks, devices)
        if block.samples is not None:
            samples = np.where(block.samples_ranks > 0, block.samples / rep, np.nan)
            fps = info.get("model_flops_per_sample")
            if fps and fps > 0:
                use = ~np.isfinite(flops)
                flops = np.where(use, fps * samples, flops)
                if block.tokens is None:
                    devices = np.where(block.samples_ranks > 0, block.samples_ranks, devices)
        peak, self.peak_source = peak_tflops(info.get("device_type"), info.get("dtype"), self.table)
        return tokens, samples, flops, devices, peak

    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2 or block.step_ms.shape[1] == 0:
            return []
        med = nanmedian(block.step_ms, axis=1)
        tokens, samples, flops, devices, peak = self._per_step(ctx, block)
        with np.errstate(invalid="ignore", divide="ignore"):
            mfu = flops / (med / 1e3 * np.maximum(devices, 1) * (peak or np.nan) * 1e12)
        wall = np.empty(S)
        prod = np.empty(S)
        for s in range(S):                       # O(S) scalars; the O(S x R) work is above
            base = float(np.nanmedian(self._hist)) if self._nh else np.nan
            m = med[s]
            t = int(block.t_end[s])
            w = (t - self._last_t) / 1e6 if self._last_t is not None and t > self._last_t else m
            if np.isfinite(m):
                p = base if np.isfinite(base) and m > self.slow * base else m
                self._hist[self._nh % self.baseline] = m
                self._nh += 1
            else:
                p = 0.0
            wall[s] = w if np.isfinite(w) else np.nan
            prod[s] = min(p, w) if np.isfinite(w) else np.nan
            if t > 0:
                self._last_t = t if self._last_t is None else max(self._last_t, t)
        q50 = qempty = np.full(S, np.nan)
        if block.data_queue is not None:
            q = block.data_queue.astype(np.float64)
            rep_q = np.isfinite(q).sum(axis=1)
            q50 = nanmedian(q, axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                qempty = np.where(rep_q > 0, (q == 0).sum(axis=1) / rep_q, np.nan)
        ok = np.isfinite(med)
        if ok.any():
            _pending_add(self._pending, pa.table({
                "job": pa.array([ctx.job] * int(ok.sum()), pa.string()),
                "step": pa.array(block.steps[ok]),
                "t_end": pa.array(block.t_end[ok].astype(np.int64)).cast(pa.timestamp("ns", tz="UTC")),
                "step_ms": med[ok], "wall_ms": wall[ok], "productive_ms": prod[ok],
                "devices": pa.array(devices[ok].astype(np.int32)),
                "tokens": tokens[ok], "samples": samples[ok], "model_flops": flops[ok],
                "peak_tflops": np.full(int(ok.sum()), np.nan if peak is None else float(peak)),
                "mfu": mfu[ok], "data_queue_p50": q50[ok], "data_queue_empty": qempty[ok],
            }), self.max_pending)
        for s in np.flatnonzero(np.isfinite(mfu)):
            i = int(block.steps[s]) % len(self._mfu)
            self._mfu[i], self._mfu_step[i] = mfu[s], block.steps[s]
        # MFU change points: step times normalised by the work of the step (inverse MFU, in ms)
        good = np.isfinite(mfu) & (mfu > 0)
        if not good.any():
            return []
        per_dev = flops / np.maximum(devices, 1)
        if self._flops_ref is None:
            self._flops_ref = float(per_dev[good][0])
        k = np.where(good, self._flops_ref / np.where(good, per_dev, 1.0), np.nan)[:, None]
        fields = ("step_ms", "data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms")
        if good.all():                            # the usual case: no (S, R) boolean-index copies
            scaled = StepBlock(block.steps, block.t_end, *(getattr(block, f) * k for f in fields))
        else:
            scaled = StepBlock(block.steps[good], block.t_end[good],
                               *(getattr(block, f)[good] * k[good] for f in fields))
        out = []
        for a in self._cp.update(ctx, scaled):
            if a.kind != "regression":
                continue                          # an MFU rise is not alerted
            ev = dict(a.evidence)
            sb, sa = ev.get("segment_before"), ev.get("segment_after")
            mb, ma = self._mfu_between(*sb) if sb else None, self._mfu_between(*sa) if sa else None
            ev.update({"mfu_before": mb, "mfu_after": ma, "peak": self.peak_source,
                       "step_time_scaled_by_work": True})
            what = (f"MFU fell from {100 * mb:.1f}% to {100 * ma:.1f}%" if mb is not None and ma is not None
                    else "MFU fell")
            out.append(Alert(job=a.job, kind="mfu_regression", status="firing", step_first=a.step_first,
                             step_detected=a.step_detected, t_detected=a.t_detected, ranks=[], nodes=[],
                             cause=a.cause, severity=a.severity, evidence=ev, cost_pct=a.cost_pct,
                             suggestion=f"{what} (job {ctx.job}, from step {a.step_first}). {a.suggestion}"))
        return out

    def _mfu_between(self, lo: int, hi: int) -> float | None:
        m = (self._mfu_step >= lo) & (self._mfu_step <= hi) & np.isfinite(self._mfu)
        return round(float(np.median(self._mfu[m])), 5) if m.any() else None


# --------------------------------------------------------------------------- transmission

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


# --------------------------------------------------------------------------- incremental comm aggregates

_HIST_EDGES = np.array([4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20], dtype=np.float64)
_HIST_NAMES = ["<4KiB", "4KiB-64KiB", "64KiB-1MiB", "1MiB-16MiB", "16MiB-256MiB", ">=256MiB"]
_RANK_BITS = 31                      # member codes: key << 31 | rank (ranks < 2**31)
_LOC_SHIFT = 52                      # per-batch sort key: step offset << 52 | key << 31 | rank
_MAX_KEYS = 1 << (_LOC_SHIFT - _RANK_BITS)
_MAX_SLOTS = 2048                    # step offsets of one batch fit in the 11 bits above _LOC_SHIFT


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique`` of an int64 array by sorting (numpy 2's hash-based ``np.unique`` is ~10x slower at
    the sizes here)."""
    s = np.sort(a)
    return s[np.r_[True, s[1:] != s[:-1]]] if len(s) > 1 else s


def _col_f64(t: pa.Table, name: str, fill: float) -> np.ndarray:
    """A numeric column as float64, nulls (and a missing column) as ``fill``."""
    if name not in t.column_names:
        return np.full(t.num_rows, fill)
    c = t.column(name)
    if c.null_count:
        return pc.fill_null(c.cast(pa.float64()), fill).to_numpy()
    return c.to_numpy().astype(np.float64, copy=False)


def _col_i64(t: pa.Table, name: str, fill: int) -> np.ndarray:
    c = t.column(name)
    if pa.types.is_timestamp(c.type):
        c = c.cast(pa.int64())
    if c.null_count:
        return pc.fill_null(c.cast(pa.int64()), fill).to_numpy()
    return c.to_numpy().astype(np.int64, copy=False)


class _Names:
    """Strings -> dense integer codes in order of first sight, by pyarrow hash lookups (no Python work
    per row; only a name never seen before costs a Python step)."""

    def __init__(self):
        self.names: list[str] = []
        self._vs = pa.array([], pa.string())
        self._prev = (None, None)                            # (last column, its codes)

    def codes(self, col) -> np.ndarray:
        if not pa.types.is_string(col.type):
            col = col.cast(pa.string())
        prev, codes = self._prev
        if prev is not None and len(prev) == len(col) and prev.equals(col):
            return codes                                    # the same layout as the last batch (a memcmp)
        idx = pc.index_in(col, value_set=self._vs)
        if idx.null_count:
            new = pc.unique(pc.filter(col, pc.is_null(idx))).to_pylist()
            self.names.extend(new)
            self._vs = pa.array(self.names, pa.string())
            idx = pc.index_in(col, value_set=self._vs)
        codes = idx.to_numpy().astype(np.int64)
        self._prev = (col, codes)
        return codes


class _CommAggregate:
    """The comm rows of a job folded, as they arrive, into per-step accumulators: per (step, rank) the wait
    and whether the rank reported, per (step, (op, group) key) the sums :func:`comm_analysis` needs (min and
    sum of the time, wait, bytes, calls, rows, max group size), the message-size histogram and
    the sorted (key, rank) members. ``(op, group)`` are dictionary-encoded to integer keys; steps live in a
    ring of ``slots`` (a step's slot is reclaimed by the step ``slots`` later; rows older than the newest
    step seen minus ``slots`` are dropped). :meth:`analyse` then reads only these small arrays: the same
    result as :func:`comm_analysis` over the rows of the window, at a cost independent of the rows.
    Memory: ``slots`` x (ranks x 9 + keys x 64) bytes."""

    def __init__(self, slots: int):
        self.W = int(min(max(slots, 2), _MAX_SLOTS))
        self.ops, self.groups = _Names(), _Names()
        self._lut = np.full((0, 0), -1, dtype=np.int64)       # (op code, group code) -> key
        self.key_op: list[int] = []                          # op code per key
        self.key_group: list[int] = []
        self._pay = np.zeros(0, dtype=bool)                   # key carries payload (not barrier / wait)
        self.K = 0
        self.slot_step = np.full(self.W, np.iinfo(np.int64).min, dtype=np.int64)
        self.newest = None
        W = self.W
        self.any = np.zeros(W, dtype=bool)
        self.tt, self.tw = np.zeros(W), np.zeros(W)
        self.rw = np.zeros((W, 0))                            # wait per slot and rank
        self.rs = np.zeros((W, 0), dtype=bool)                # rank reported in the slot
        self._kalloc(0)
        self.hist = np.zeros((W, len(_HIST_NAMES)))
        self.members: list[np.ndarray | None] = [None] * W    # sorted key << 31 | rank, payload rows
        self._prev_members = None
        self._prev_raw = (None, None)                         # (last batch's member codes, sorted unique)
        self._prev_keys = (None, None, None)                  # (op codes, group codes, keys) of the last batch
        self._nodes = (None, None, None)                      # (array seen, its copy, codes)
        self._mem_cache = (None, None, None, np.zeros(0), None)  # (members, node codes, (keys, ranks), ranks, nodes)

    # -- storage
    def _kalloc(self, kc: int) -> None:
        W = self.W
        new = {"kmin": np.inf, "ktime": 0.0, "kwait": 0.0, "kbytes": 0.0, "kcount": 0.0, "krows": 0.0,
               "kgs": np.nan}
        old = getattr(self, "_kc", 0)
        for name, fill in new.items():
            a = np.full((W, kc), fill)
            if old:
                a[:, :old] = getattr(self, name)
            setattr(self, name, a)
        self._kc = kc

    def _ralloc(self, rc: int) -> None:
        old = self.rw.shape[1]
        rw, rs = np.zeros((self.W, rc)), np.zeros((self.W, rc), dtype=bool)
        rw[:, :old], rs[:, :old] = self.rw, self.rs
        self.rw, self.rs = rw, rs

    def _reset_slot(self, i: int, step: int) -> None:
        self.slot_step[i] = step
        self.any[i] = False
        self.tt[i] = self.tw[i] = 0.0
        self.rw[i] = 0.0
        self.rs[i] = False
        for name in ("ktime", "kwait", "kbytes", "kcount", "krows"):
            getattr(self, name)[i] = 0.0
        self.kmin[i] = np.inf
        self.kgs[i] = np.nan
        self.hist[i] = 0.0
        self.members[i] = None

    def _keys(self, opc: np.ndarray, grc: np.ndarray) -> np.ndarray:
        po, pg, pk = self._prev_keys
        if po is opc and pg is grc:                         # the codes of the last batch again
            return pk
        key = self._lookup(opc, grc)
        self._prev_keys = (opc, grc, key)
        return key

    def _lookup(self, opc: np.ndarray, grc: np.ndarray) -> np.ndarray:
        no, ng = len(self.ops.names), len(self.groups.names)
        if self._lut.shape != (no, ng):
            lut = np.full((no, ng), -1, dtype=np.int64)
            lut[:self._lut.shape[0], :self._lut.shape[1]] = self._lut
            self._lut = lut
        key = self._lut[opc, grc]
        miss = key < 0
        if miss.any():
            pairs = _sorted_unique(opc[miss] * ng + grc[miss])
            o, g = pairs // ng, pairs % ng
            if self.K + len(pairs) > _MAX_KEYS:
                raise OverflowError("too many (op, group) keys")
            self._lut[o, g] = np.arange(self.K, self.K + len(pairs))
            self.key_op.extend(o.tolist())
            self.key_group.extend(g.tolist())
            self._pay = np.r_[self._pay, [self.ops.names[i] not in ("barrier", "wait") for i in o]]
            self.K += len(pairs)
            if self.K > self._kc:
                self._kalloc(max(self.K, 2 * self._kc, 16))
            key = self._lut[opc, grc]
        return key

    # -- ingest
    def ingest(self, t: pa.Table, rank_limit: int) -> None:
        """Fold a batch of comm rows (any steps, any order) into the accumulators."""
        n = t.num_rows
        if n == 0 or "step" not in t.column_names or "rank" not in t.column_names:
            return
        lo_int = np.iinfo(np.int64).min
        step, rank = _col_i64(t, "step", lo_int), _col_i64(t, "rank", -1)
        time_ms, wait_ms = _col_f64(t, "time_ms", 0.0), _col_f64(t, "wait_ms", 0.0)
        nbytes, count, gs = _col_f64(t, "bytes", 0.0), _col_f64(t, "count", 1.0), _col_f64(t, "group_size", np.nan)
        op = t.column("op") if "op" in t.column_names else pa.nulls(n, pa.string())
        opc = self.ops.codes(pc.fill_null(op, "?") if op.null_count else op)
        if "group" in t.column_names:
            grp = t.column("group")
            grc = self.groups.codes(pc.fill_null(grp, "") if grp.null_count else grp)
        else:
            grc = np.full(n, self.groups.codes(pa.array([""]))[0], dtype=np.int64)
        ok = (step != lo_int) & (rank >= 0) & (rank < rank_limit)
        if not ok.any():
            return
        top = int(step[ok].max())
        self.newest = top if self.newest is None else max(self.newest, top)
        ok &= step > self.newest - self.W
        if not ok.all():
            if not ok.any():
                return
            step, rank, time_ms, wait_ms, nbytes, count, gs, opc, grc = (
                a[ok] for a in (step, rank, time_ms, wait_ms, nbytes, count, gs, opc, grc))
        key = self._keys(opc, grc)
        smin = int(step.min())
        li = step - smin
        nloc = int(li.max()) + 1
        present = np.flatnonzero(np.bincount(li, minlength=nloc))
        slots = (smin + present) % self.W
        for p, i in zip(present.tolist(), slots.tolist()):
            if self.slot_step[i] != smin + p:
                self._reset_slot(i, smin + p)
        # every row: time and wait totals, per-rank wait and presence
        self.any[slots] = True
        if nloc == 1:                                       # the usual batch: one step
            self.tt[slots] += time_ms.sum()
            self.tw[slots] += wait_ms.sum()
        else:
            self.tt[slots] += np.bincount(li, weights=time_ms, minlength=nloc)[present]
            self.tw[slots] += np.bincount(li, weights=wait_ms, minlength=nloc)[present]
        rc = int(rank.max()) + 1
        if rc > self.rw.shape[1]:
            self._ralloc(max(rc, self.rw.shape[1] + self.rw.shape[1] // 4))
        R = self.rw.shape[1]
        if nloc == 1:
            self.rw[slots[0]] += np.bincount(rank, weights=wait_ms, minlength=R)
            self.rs[slots[0], rank] = True
        else:
            cell = li * R + rank
            self.rw[slots] += np.bincount(cell, weights=wait_ms, minlength=nloc * R).reshape(nloc, R)[present]
            self.rs.reshape(-1)[slots[np.searchsorted(present, li)] * R + rank] = True
        # payload rows: per (step, key)
        pi = np.flatnonzero(self._pay[key] & (count > 0) & (nbytes > 0))
        if not len(pi):
            return
        pk, pli, prank = key[pi], li[pi], rank[pi]
        ptime, pcount, pbytes = time_ms[pi], count[pi], nbytes[pi]
        kc = self._kc
        code = pk if nloc == 1 else pli * kc + pk
        M = nloc * kc

        def fold(name, w):
            acc = getattr(self, name)
            acc[slots] += np.bincount(code, weights=w, minlength=M).reshape(nloc, kc)[present]
        fold("ktime", ptime)
        fold("kwait", wait_ms[pi])
        fold("kbytes", pbytes)
        fold("kcount", pcount)
        self.krows[slots] += np.bincount(code, minlength=M).reshape(nloc, kc)[present]
        tmp = np.full(M, np.inf)
        np.minimum.at(tmp, code, ptime)
        self.kmin[slots] = np.minimum(self.kmin[slots], tmp.reshape(nloc, kc)[present])
        tmp = np.full(M, np.nan)
        np.fmax.at(tmp, code, gs[pi])
        self.kgs[slots] = np.fmax(self.kgs[slots], tmp.reshape(nloc, kc)[present])
        b = np.searchsorted(_HIST_EDGES, pbytes / np.maximum(pcount, 1), side="right")
        nh = len(_HIST_NAMES)
        self.hist[slots] += np.bincount(b if nloc == 1 else pli * nh + b, weights=pcount,
                                        minlength=nloc * nh).reshape(nloc, nh)[present]
        # members: sorted unique key << 31 | rank per step (one sort of the batch's payload rows)
        raw = (pk << _RANK_BITS) | prank
        if nloc > 1:
            raw |= pli << _LOC_SHIFT
        prev_raw, prev_u = self._prev_raw
        if prev_raw is not None and len(prev_raw) == len(raw) and np.array_equal(prev_raw, raw):
            u = prev_u                                      # the same rows as the last batch: no sort
        else:
            u = _sorted_unique(raw)
            self._prev_raw = (raw, u)
        loc = u >> _LOC_SHIFT
        cut = np.searchsorted(loc, np.arange(nloc + 1))
        mask = (np.int64(1) << _LOC_SHIFT) - 1
        for p, i in zip(present.tolist(), slots.tolist()):
            m = u[cut[p]:cut[p + 1]] & mask
            if not len(m):
                continue
            old = self.members[i]
            if old is not None:
                m = _sorted_unique(np.concatenate([old, m]))
            prev = self._prev_members
            if prev is not None and len(prev) == len(m) and np.array_equal(prev, m):
                m = prev                                    # the same members as before: share the array
            self.members[i] = self._prev_members = m

    # -- analysis
    def _node_codes(self, nodes) -> np.ndarray | None:
        if nodes is None or not len(nodes):
            return None
        seen, copy, codes = self._nodes
        if not (seen is nodes and len(copy) == len(nodes) and np.array_equal(copy, nodes)):
            arr = np.asarray(nodes, dtype=object)
            try:                                            # hash encoding (only equality matters here)
                d = pa.array(arr, pa.string(), from_pandas=True).dictionary_encode()
                codes = pc.fill_null(d.indices, len(d.dictionary)).to_numpy()
            except (pa.ArrowException, TypeError):
                _, codes = np.unique(arr.astype(str), return_inverse=True)
            self._nodes = (nodes, arr.copy(), codes.astype(np.int64))
            codes = self._nodes[2]
        return codes

    def analyse(self, lo: int, hi: int, nodes, family: str | None, step_ms: float,
                link_gbps: dict | None = None, link: str | None = None) -> dict:
        """:func:`comm_analysis` of the rows of steps ``lo..hi``, from the accumulators; the groups in
        the order their (op, group) was first seen, with their ``key``; ``members`` (key and rank of the
        window's payload members) for naming a group's ranks."""
        sl = np.flatnonzero((self.slot_step >= lo) & (self.slot_step <= hi) & self.any)
        if not len(sl):
            return {}
        peaks = dict(LINK_GBPS, **(link_gbps or {}))
        n_steps = len(sl)
        rows_sl = sl.tolist()
        seen, rwait = self.rs[rows_sl[0]].copy(), self.rw[rows_sl[0]].copy()
        for i in rows_sl[1:]:                               # a few (steps) vector ops, no (steps x ranks) copy
            seen |= self.rs[i]
            rwait += self.rw[i]
        n_ranks = max(int(seen.sum()), 1)
        tot_time, tot_wait = float(self.tt[sl].sum()), float(self.tw[sl].sum())
        out = {"wait_share": tot_wait / tot_time if tot_time > 0 else None,
               "comm_share": tot_time / (n_steps * n_ranks) / step_ms if step_ms and step_ms > 0 else None,
               "steps": n_steps, "ranks": n_ranks}
        rk = np.flatnonzero(seen)
        out["rank_wait"] = (rk, rwait[rk] / n_steps)
        # each step's least per-rank wait (what every rank waited: the collective's own latency)
        out["floor_wait"] = sum(float(self.rw[i][self.rs[i]].min()) if self.rs[i].any() else 0.0
                                for i in rows_sl) / n_steps
        K = self.K
        krows = self.krows[sl, :K]
        P = krows > 0
        nst = P.sum(axis=0)
        keys = np.flatnonzero(nst)
        if not len(keys):
            out["groups"] = None
            out["hist"] = {}
            return out
        rows = krows.sum(axis=0)[keys]
        nst = nst[keys].astype(float)
        calls = self.kcount[sl, :K].sum(axis=0)[keys]
        byts = self.kbytes[sl, :K].sum(axis=0)[keys]
        xfer = np.where(P, self.kmin[sl, :K], 0.0).sum(axis=0)[keys]
        tsum = self.ktime[sl, :K].sum(axis=0)[keys]
        wsum = self.kwait[sl, :K].sum(axis=0)[keys]
        gsz = np.fmax.reduce(self.kgs[sl, :K], axis=0)[keys]
        # distinct ranks and nodes per key over the window: union of the steps' members
        distinct: list[np.ndarray] = []
        for i in sl.tolist():
            m = self.members[i]
            if m is None or any(m is d for d in distinct):
                continue
            if distinct and len(distinct[-1]) == len(m) and np.array_equal(distinct[-1], m):
                continue
            distinct.append(m)
        mem = distinct[0] if len(distinct) == 1 else _sorted_unique(np.concatenate(distinct))
        codes = self._node_codes(nodes)
        cm = self._mem_cache
        if cm[0] is mem and cm[1] is codes and len(cm[3]) >= K:
            mk, mr, nrk_all, nnd_all = cm[2][0], cm[2][1], cm[3], cm[4]     # the same members as last time
        else:
            mk, mr = mem >> _RANK_BITS, mem & ((1 << _RANK_BITS) - 1)
            nrk_all = np.bincount(mk, minlength=K).astype(float)
            if codes is None:
                nnd_all = np.ones(K)
            else:
                nc = np.where(mr < len(codes), codes[np.minimum(mr, len(codes) - 1)], -1) + 1
                span = int(codes.max()) + 2 if len(codes) else 1
                nnd_all = np.bincount(_sorted_unique(mk * span + nc) // span, minlength=K).astype(float)
            self._mem_cache = (mem, codes, (mk, mr), nrk_all, nnd_all)
        nrk, nnd = nrk_all[keys], nnd_all[keys]
        gsz = np.where(np.isfinite(gsz) & (gsz > 0), gsz, nrk)
        calls_rank_step = calls / np.maximum(rows, 1)
        bpc = byts / np.maximum(calls, 1)
        xfer_per_call = xfer / np.maximum(nst * calls_rank_step, 1e-12)
        opk = np.asarray(self.key_op, dtype=np.int64)[keys]
        alg = np.full(len(keys), np.nan)
        bus = np.full(len(keys), np.nan)
        for o in np.unique(opk).tolist():
            m = opk == o
            alg[m], bus[m] = bus_bandwidth(self.ops.names[o], gsz[m], bpc[m], xfer_per_call[m])
        if link:
            kinds = [link]
            li = np.zeros(len(keys), dtype=np.int64)
        else:
            kinds = [link_type(family, 1), link_type(family, 2)]
            li = (nnd > 1).astype(np.int64)
        peak = np.array([peaks.get(k, np.nan) for k in kinds], dtype=float)[li]
        sat = np.array([SATURATE_BYTES.get(k, 4 * 2**20) for k in kinds], dtype=float)[li]
        names_k = np.array(kinds, dtype=object)[li]
        out["groups"] = {
            "op": [self.ops.names[o] for o in opk.tolist()],
            "group": [self.groups.names[self.key_group[k]] for k in keys.tolist()],
            "group_size": gsz.astype(np.int64), "ranks": nrk.astype(np.int64), "link": names_k.tolist(),
            "calls_per_step": calls_rank_step, "bytes_per_call": bpc, "xfer_ms_per_step": xfer / np.maximum(nst, 1),
            "time_ms_per_step": tsum / np.maximum(rows, 1),
            "wait_share": np.where(tsum > 0, wsum / np.maximum(tsum, 1e-12), np.nan),
            "algbw_gbps": alg, "busbw_gbps": bus, "peak_gbps": peak,
            "util": bus / peak, "saturate_bytes": sat, "calls": calls, "time_sum": tsum, "rows": rows,
            "key": keys,
        }
        out["members"] = (mk, mr)
        h = self.hist[sl].sum(axis=0)
        out["hist"] = {_HIST_NAMES[i]: int(h[i]) for i in range(len(_HIST_NAMES))}
        return out


class CommBandwidth(Detector):
    """Transmission analysis from the comm records: achieved bus bandwidth per (collective kind, group)
    against the link's peak (``comm_bw`` rows) and three diagnoses.

    Every ``every`` steps (by step number) the comm rows of the last ``window`` steps up to
    ``lag`` steps before the newest closed step (comm rows may arrive after the step rows) are analysed
    as :func:`comm_analysis` does, from a :class:`_CommAggregate` that folds the comm window's new rows on
    every ``update`` (the analysis never touches the raw rows; a context whose ``comm`` is not a
    :class:`~stepwatch.detectors.context.Window` gets :func:`comm_analysis` over ``comm.select``); the
    median step time of those steps is the reference. Diagnoses (each an
    alert, cause ``communication`` unless said; resolved after ``clear`` evaluations without it):

    * ``comm_small_messages`` (job): at least ``small_share`` of the calls carry less than 1/``small_div``
      of the link's saturation size (:data:`SATURATE_BYTES`), with at least ``min_calls`` calls per rank
      and step, and collectives take at least ``min_comm_share`` of the step → tensor fusion.
    * ``comm_slow_link`` (group): a group's bus bandwidth below ``slow_ratio`` x the median of its peers
      (same op, group size and link, payload per call within 2x; at least ``min_peers`` peers) → names the
      group, its ranks and nodes, "check the link/NIC".
    * ``comm_sync_bound`` (job, cause ``parallelism``): the wait for peers (each rank's wait above the
      least wait of any rank on that step: what all ranks wait is the collective's latency) is at least
      ``sync_share`` of the time in
      collectives and collectives take at least ``min_comm_share`` of the step, and the wait is not
      explained by a few stragglers (ranks waiting less than a quarter of the median wait are at most
      ``straggler_share`` of the ranks: those the slow-rank detector names; in a job where that share is
      less than one rank, the least-waiting rank waiting less than half the median of the others) → look
      for the straggler;
      the evidence lists the ranks that wait least.

    Settings (keyword arguments, defaults):
        window=20            steps per analysis window
        every=10             analyse when the step number enters a new multiple of this
        lag=2                newest steps left out (their comm rows may still be on the way)
        min_steps=8          steps of comm rows a window needs
        small_div=16         "small" = below the link's saturation size / this
        small_share=0.5      share of calls that must be small
        min_calls=4          calls per rank and step for small messages to matter
        min_comm_share=0.1   collectives' share of the step time for small-messages / sync-bound
        slow_ratio=0.5       slow link: bus bandwidth below this x the peers' median
        min_peers=3          peer groups needed to judge a slow link
        sync_share=0.6       sync-bound: wait / time in collectives at least this
        straggler_share=0.1  sync-bound is left to slow_rank when this few ranks explain the wait
        clear=3              evaluations without the finding to resolve
        link_gbps=None       peak bus bandwidth per link type, GB/s (overrides LINK_GBPS)
        link=None            force one link type for every group
        max_pending=8192     comm_bw rows kept until the processor drains them
    """

    name = "comm_bw"

    def __init__(self, *, window: int = 20, every: int = 10, lag: int = 2, min_steps: int = 8,
                 small_div: float = 16.0, small_share: float = 0.5, min_calls: int = 4,
                 min_comm_share: float = 0.1, slow_ratio: float = 0.5, min_peers: int = 3,
                 sync_share: float = 0.6, straggler_share: float = 0.1, clear: int = 3, link_gbps=None,
                 link=None, max_pending: int = 8192):
        if window < 2 or every < 1 or lag < 0 or min_steps < 1 or clear < 1 or min_peers < 1:
            raise ValueError("comm_bw: need window >= 2, every >= 1, lag >= 0, min_steps >= 1, clear >= 1, "
                             "min_peers >= 1")
        self.window, self.every, self.lag, self.min_steps = int(window), int(every), int(lag), int(min_steps)
        self.small_div, self.small_share, self.min_calls = float(small_div), float(small_share), int(min_calls)
        self.min_comm_share, self.slow_ratio, self.min_peers = float(min_comm_share), float(slow_ratio), int(min_peers)
        self.sync_share, self.straggler_share = float(sync_share), float(straggler_share)
        self.link_gbps, self.link, self.max_pending = dict(link_gbps or {}), link, int(max_pending)
        self._eps = _Episodes(int(clear))
        W = self.window + self.lag + 4
        self._st = np.full(W, -1, dtype=np.int64)       # recent closed steps, their median step time, t_end
        self._ms = np.full(W, np.nan)
        self._te = np.zeros(W, dtype=np.int64)
        self._n = 0
        self._bucket = None
        self._pending: list[pa.Table] = []
        self._agg: _CommAggregate | None = None     # rows folded as they arrive (see _pull)
        self._win = None                            # the comm window they come from
        self._last = None                           # its newest part already folded

    def drain_rows(self) -> dict[str, pa.Table]:
        if not self._pending:
            return {}
        t = pa.concat_tables(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        return {"comm_bw": t}

    def _pull(self, ctx: JobContext) -> None:
        """Fold the comm rows that reached the job's window since the last call into the aggregate (one
        vectorised pass over the new rows; the window's parts are appended in arrival order and leave from
        the front, so the new ones are those after the newest part already folded). Without a window of
        that kind (``_parts``), :meth:`_evaluate` falls back to :func:`comm_analysis` over its rows."""
        w = getattr(ctx, "comm", None)
        parts = getattr(w, "_parts", None)
        if parts is None:
            self._agg = self._win = self._last = None
            return
        if w is not self._win or self._agg is None:
            span = int(getattr(w, "span", 64) or 64)
            self._agg = _CommAggregate(max(self.window + self.lag + self.every + 2, span + 2))
            self._win, self._last = w, None
        new = []
        for e in reversed(parts):
            if e is self._last:
                break
            new.append(e[2])
        if not new:
            return
        self._last = parts[-1]
        new.reverse()
        t = new[0] if len(new) == 1 else pa.concat_tables(new, promote_options="permissive")
        nodes = getattr(ctx, "nodes", None)
        limit = max(int(getattr(ctx, "world_size", 0) or 0), 0 if nodes is None else len(nodes), 1 << 16)
        try:
            self._agg.ingest(t, limit)
        except OverflowError:                       # > 2M distinct (op, group) names: start over
            self._agg = None

    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2 or block.step_ms.shape[1] == 0:
            return []
        self._pull(ctx)
        med = nanmedian(block.step_ms, axis=1)
        out = []
        for s in range(S):
            i = self._n % len(self._st)
            self._st[i], self._ms[i], self._te[i] = block.steps[s], med[s], block.t_end[s]
            self._n += 1
            b = int(block.steps[s]) // self.every
            if b != self._bucket:
                self._bucket = b
                if getattr(ctx, "comm", None) is not None and len(ctx.comm):
                    out += self._evaluate(ctx, int(block.steps[s]))
        return out

    def _evaluate(self, ctx: JobContext, step_now: int) -> list[Alert]:
        hi = step_now - self.lag
        lo = hi - self.window + 1
        m = (self._st >= lo) & (self._st <= hi)
        if m.sum() < self.min_steps:
            return []
        t = None
        if self._agg is None:
            t = ctx.comm.select(lo, hi)
            if t is None:
                return []
        step_ms = float(np.nanmedian(self._ms[m])) if np.isfinite(self._ms[m]).any() else float("nan")
        t_hi = int(self._te[m][np.argmax(self._st[m])])
        fam = device_family((ctx.info or {}).get("device_type"))
        if self._agg is not None:
            res = self._agg.analyse(lo, hi, ctx.nodes, fam, step_ms, self.link_gbps, self.link)
        else:
            res = comm_analysis(t, ctx.nodes, fam, step_ms, self.link_gbps, self.link)
        if not res or res.get("steps", 0) < self.min_steps:
            return []
        g = res.get("groups")
        present: set = set()
        alerts: list[Alert] = []
        diag = np.full(len(g["op"]) if g else 0, None, dtype=object)
        step_first = int(self._st[m].min())
        t_now = int(self._te[(self._n - 1) % len(self._st)])
        comm_share = res.get("comm_share") or 0.0
        if g:
            # small messages (job-wide)
            small = g["bytes_per_call"] < g["saturate_bytes"] / self.small_div
            calls = g["calls"]
            share = float(calls[small].sum() / calls.sum()) if calls.sum() > 0 else 0.0
            cps = float(calls.sum() / max(res["ranks"] * res["steps"], 1))
            if share >= self.small_share and cps >= self.min_calls and comm_share >= self.min_comm_share:
                diag[small] = "small-messages"
                present.add("small")
                alerts += self._eps.seen("small", lambda: self._small_alert(ctx, g, res, small, share, cps,
                                                                           step_first, step_now, t_now))
            # slow link (per group, against peers of the same op, size, link and payload class)
            bus = g["busbw_gbps"]
            for idx, ref in _peer_medians(g, bus, self.min_peers):
                for j, r in zip(idx.tolist(), ref.tolist()):
                    if r > 0 and bus[j] < self.slow_ratio * r:
                        diag[j] = "slow-link"
                        key = f"slow|{g['op'][j]}|{g['group'][j]}"
                        present.add(key)
                        alerts += self._eps.seen(key, lambda j=j, ref=r: self._slow_alert(
                            ctx, t, res, g, j, ref, step_ms, step_first, step_now, t_now))
        # sync-bound (job-wide), unless a few stragglers explain it (slow_rank names them)
        ws = res.get("wait_share")
        if ws is not None and len(res["rank_wait"][1]):
            # only the wait above each step's least one is waiting for a peer: what every rank waits on
            # a step is the collective's own latency (a clean 2-rank gloo job on a busy host: ~7 ms on
            # both ranks, every step), which a sync-bound diagnosis must not count
            mw = float(np.mean(res["rank_wait"][1]))
            ws = ws * max(0.0, 1.0 - res.get("floor_wait", 0.0) / mw) if mw > 0 else ws
        if ws is not None and ws >= self.sync_share and comm_share >= self.min_comm_share:
            ranks, wait = res["rank_wait"]
            medw = float(np.median(wait)) if len(wait) else 0.0
            few = (wait < 0.25 * medw).sum() if medw > 0 else 0
            explained = 0 < few <= self.straggler_share * len(wait)
            if not explained and 2 <= len(wait) and self.straggler_share * len(wait) < 1:
                # a small job (10% of it is less than one rank): one straggler, the rank that waits least,
                # compared with the median of the *other* ranks (the median of all would hold the straggler
                # itself: of 2 ranks it is their mean). Where nobody straggles, who arrives last changes
                # from step to step and the ranks' waits are alike; under half the others' is one rank last
                # on most steps, and the others' wait is its doing (slow_rank's small-stage test names it)
                lo = int(np.argmin(wait))
                rest = float(np.median(np.delete(wait, lo)))
                explained = rest > 0 and float(wait[lo]) < 0.5 * rest
            if not explained:
                if g:
                    diag[np.asarray(g["wait_share"]) >= self.sync_share] = "sync-bound"
                present.add("sync")
                alerts += self._eps.seen("sync", lambda: self._sync_alert(ctx, res, ranks, wait, ws, comm_share,
                                                                         step_first, step_now, t_now))
        if g:
            k = len(g["op"])
            _pending_add(self._pending, pa.table({
                "job": pa.array([ctx.job] * k, pa.string()), "step_lo": pa.array(np.full(k, lo, np.int64)),
                "step_hi": pa.array(np.full(k, hi, np.int64)),
                "t_end": pa.array(np.full(k, t_hi, np.int64)).cast(pa.timestamp("ns", tz="UTC")),
                "op": pa.array(g["op"], pa.string()), "group": pa.array(g["group"], pa.string()),
                "group_size": pa.array(g["group_size"].astype(np.int32)),
                "ranks": pa.array(g["ranks"].astype(np.int32)), "link": pa.array(g["link"], pa.string()),
                **{c: pa.array(np.asarray(g[c], dtype=np.float64)) for c in
                   ("calls_per_step", "bytes_per_call", "xfer_ms_per_step", "time_ms_per_step", "wait_share",
                    "algbw_gbps", "busbw_gbps", "peak_gbps", "util")},
                "diagnosis": pa.array(diag.tolist(), pa.string()),
            }), self.max_pending)
        return alerts + self._eps.sweep(present, step_now, t_now)

    def _small_alert(self, ctx, g, res, small, share, cps, step_first, step_now, t_now) -> Alert:
        j = int(np.argmax(np.where(small, g["calls"], -1)))
        sat = g["saturate_bytes"][j]
        ev = {"small_call_share": round(share, 3), "calls_per_rank_step": round(cps, 1),
              "comm_share_of_step": round(res["comm_share"], 3), "size_histogram": res["hist"],
              "top": {"op": g["op"][j], "group": g["group"][j], "bytes_per_call": float(g["bytes_per_call"][j]),
                      "link": g["link"][j], "saturate_bytes": float(sat), "busbw_gbps": _r(g["busbw_gbps"][j]),
                      "peak_gbps": _r(g["peak_gbps"][j])}}
        cost = max(0.0, 1.0 - float(np.nan_to_num(g["util"][j], nan=1.0))) * res["comm_share"] * 100.0
        return Alert(job=ctx.job, kind="comm_small_messages", status="firing", step_first=step_first,
                     step_detected=step_now, t_detected=t_now, cause="communication", evidence=ev,
                     cost_pct=round(min(cost, 100.0), 3),
                     suggestion=(f"Small messages in job {ctx.job}: {100 * share:.0f}% of collective calls carry "
                                 f"< {sat / self.small_div / 2**20:.2g} MiB ({cps:.0f} calls per rank and step; "
                                 f"{g['op'][j]} on {g['group'][j]}: {g['bytes_per_call'][j] / 2**10:.0f} KiB per call "
                                 f"at {_r(g['busbw_gbps'][j])} GB/s bus bandwidth vs {_r(g['peak_gbps'][j])} peak). "
                                 "Use tensor fusion: raise DDP bucket_cap_mb, FSDP/ZeRO reduce_bucket_size / "
                                 "allgather_bucket_size, Megatron overlap_grad_reduce with larger buckets "
                                 "(HCCL: HCCL_BUFFSIZE); coalesce small all_reduces."))

    def _slow_alert(self, ctx, t, res, g, j, ref, step_ms, step_first, step_now, t_now) -> Alert:
        op, grp = g["op"][j], g["group"][j]
        if "members" in res:                        # the aggregate's (key, rank) members of the window
            mk, mr = res["members"]
            ranks = mr[mk == g["key"][j]].tolist()
        else:
            m = pc.and_(pc.equal(t.column("op"), op), pc.equal(t.column("group"), grp))
            ranks = sorted(int(r) for r in np.unique(t.filter(m).column("rank").to_numpy(zero_copy_only=False)))
        ranks = [r for r in ranks if 0 <= r < len(ctx.nodes)] if len(ctx.nodes) else []
        nodes = [ctx.node_of(r) for r in ranks]
        uniq_nodes = sorted(set(nodes))
        bus = float(g["busbw_gbps"][j])
        extra = float(g["xfer_ms_per_step"][j]) * (1.0 - bus / ref) if ref > 0 else 0.0
        cost = 100.0 * extra / step_ms if step_ms and step_ms > 0 else 0.0
        ev = {"op": op, "group": grp, "group_size": int(g["group_size"][j]), "link": g["link"][j],
              "busbw_gbps": _r(bus), "peers_median_busbw_gbps": _r(ref), "peak_gbps": _r(g["peak_gbps"][j]),
              "bytes_per_call": float(g["bytes_per_call"][j]), "xfer_ms_per_step": _r(g["xfer_ms_per_step"][j]),
              "nodes": uniq_nodes[:32]}
        nd = ", ".join(uniq_nodes[:8]) + (" …" if len(uniq_nodes) > 8 else "")
        return Alert(job=ctx.job, kind="comm_slow_link", status="firing", step_first=step_first,
                     step_detected=step_now, t_detected=t_now, ranks=ranks, nodes=nodes, cause="communication",
                     severity="critical" if cost > 10 else "warning", evidence=ev, cost_pct=round(min(cost, 100.0), 3),
                     suggestion=(f"Slow link: {op} on group {grp} ({len(ranks)} ranks on {nd}) reaches "
                                 f"{_r(bus)} GB/s bus bandwidth vs {_r(ref)} GB/s on its peer groups "
                                 f"({g['link'][j]} peak {_r(g['peak_gbps'][j])}). Check the link/NIC of {nd}: "
                                 "RDMA retransmits and port errors, link width/speed (nvidia-smi nvlink -s, "
                                 "hccn_tool -link), cables and switch ports; move the group off the node if it "
                                 "persists."))

    def _sync_alert(self, ctx, res, ranks, wait, ws, comm_share, step_first, step_now, t_now) -> Alert:
        order = np.argsort(wait, kind="stable")[:8]
        least = [{"rank": int(ranks[i]), "node": ctx.node_of(int(ranks[i])), "wait_ms": _r(wait[i])} for i in order]
        who = ", ".join(f"{d['rank']} ({d['node']})" for d in least[:4])
        ev = {"wait_share": round(float(ws), 3), "comm_share_of_step": round(float(comm_share), 3),
              "median_wait_ms_per_step": _r(float(np.median(wait))), "least_waiting": least}
        return Alert(job=ctx.job, kind="comm_sync_bound", status="firing", step_first=step_first,
                     step_detected=step_now, t_detected=t_now, cause="parallelism", evidence=ev,
                     cost_pct=round(100.0 * float(ws) * float(comm_share), 3),
                     suggestion=(f"Sync-bound: {100 * ws:.0f}% of the time in collectives of job {ctx.job} is "
                                 "waiting for peers, not transfer: a faster network will not help. Look for the "
                                 f"straggler: the ranks that wait least are {who}; compare their phases "
                                 "(data, compute, host gap) and balance the work (pipeline stages, uneven "
                                 "batches). " + SUGGESTIONS["parallelism"]))


def _peer_medians(g: dict, bus: np.ndarray, min_peers: int):
    """The slow-link peer classes of the groups of an analysis: groups of the same op, group size, link and
    payload class (log2 of the bytes per call, rounded), in the order of their ``op|size|link|class``
    labels; yields per class with at least ``min_peers`` + 1 finite bus bandwidths (group indices
    ascending, the median bus bandwidth of each group's peers), the median leaving the group out (from one
    sort of the class, no per-group median)."""
    n = len(bus)
    if n < min_peers + 1:
        return
    ops = g["op"]
    opd = {o: i for i, o in enumerate(dict.fromkeys(ops))}
    lkd = {lk: i for i, lk in enumerate(dict.fromkeys(g["link"]))}
    lb = np.round(np.log2(np.maximum(np.asarray(g["bytes_per_call"], dtype=np.float64), 1.0))).astype(np.int64)
    combo = np.stack([np.array([opd[o] for o in ops], dtype=np.int64), np.asarray(g["group_size"], dtype=np.int64),
                      np.array([lkd[lk] for lk in g["link"]], dtype=np.int64), lb], axis=1)
    uniq, inv = np.unique(combo, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    opn, lkn = list(opd), list(lkd)
    labels = [f"{opn[u[0]]}|{u[1]}|{lkn[u[2]]}|{u[3]}" for u in uniq.tolist()]
    fin = np.isfinite(bus)
    for c in sorted(range(len(uniq)), key=labels.__getitem__):
        idx = np.flatnonzero((inv == c) & fin)
        k = len(idx)
        if k < min_peers + 1:
            continue
        v = bus[idx]
        o = np.argsort(v, kind="stable")
        srt = v[o]
        p = np.empty(k, dtype=np.int64)
        p[o] = np.arange(k)                 # each group's place in the sorted class

        def peer(i):                        # i-th smallest of the class without the group itself
            return np.where(i < p, srt[i], srt[min(i + 1, k - 1)])
        m = k - 1                           # peers per group
        ref = peer(m // 2) if m % 2 else (peer(m // 2 - 1) + peer(m // 2)) / 2.0
        yield idx, ref


def _nanmedian_axis0(a: np.ndarray) -> np.ndarray:
    """``np.nanmedian(a.astype(float64), axis=0)``, the same values, for a short axis 0 (steps) and many
    columns (ranks): one sort of the transposed rows (NaN sorts last) and the mean of the two middle
    values, instead of numpy's masked-array path (~10x slower at 20 x 16,384)."""
    if a.shape[1] == 0:
        return np.zeros(0)
    s = np.sort(np.ascontiguousarray(a.T, dtype=np.float64), axis=1)
    n = s.shape[1] - np.isnan(s).sum(axis=1)
    lo = np.maximum((n - 1) // 2, 0)[:, None]
    hi = np.maximum(n // 2, 0)[:, None]
    return ((np.take_along_axis(s, lo, axis=1) + np.take_along_axis(s, hi, axis=1)) / 2.0)[:, 0]


def _median_at_least(a: np.ndarray, thr: float) -> np.ndarray:
    """Per column, ``np.nan_to_num(np.nanmedian(a, axis=0)) >= thr`` (the same answer) by counting: the
    median (mean of the two middle values) is >= thr when the lower middle is, < thr when the upper middle
    is below; only columns with thr between the two middles need their median."""
    x = a.astype(np.float64)
    n = x.shape[0] - np.isnan(x).sum(axis=0)
    c = (x >= thr).sum(axis=0)                               # NaN compares False
    lo, hi = np.maximum((n - 1) // 2, 0), n // 2
    out = (n > 0) & (c >= n - lo)                            # the lower middle >= thr
    amb = (n > 0) & ~out & (c >= n - hi)                     # upper middle >= thr > lower middle
    if amb.any():
        out[amb] = _nanmedian_axis0(x[:, amb]) >= thr
    if thr <= 0:
        out |= n == 0                                        # an all-NaN median counts as 0
    return out


def _r(x, nd: int = 3):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return round(x, nd) if math.isfinite(x) else None


# --------------------------------------------------------------------------- data loader

class DataLoader(Detector):
    """DataLoader queue analysis (``dataloader_starved``, cause ``io``).

    The probe samples the DataLoader's ready batches (``data_queue``) at the start of every step. Over the
    last ``window`` steps (evaluated when the step number enters a new multiple of ``every``), per rank:
    the share of reported steps with an empty queue and the median data wait as a share of the step. A
    rank is *starved* when its queue was empty on at least ``empty_share`` of at least ``min_steps``
    reported steps and its data wait is at least ``min_data_share`` of the step: the workers cannot keep
    up (preprocessing or reading too slow, or a single-process loader, which never prefetches). A queue
    mostly at its fullest (``full_share`` in the evidence) says I/O is not the bottleneck. When at least
    ``job_share`` of the reporting ranks are starved the alert is job-wide (no ranks), otherwise it names
    the ranks and nodes. Resolves after ``clear`` evaluations without. The remedy names the DataLoader
    settings: num_workers, prefetch_factor, pin_memory, persistent_workers.

    Settings (keyword arguments, defaults):
        window=20            steps per evaluation
        every=10             evaluate when the step number enters a new multiple of this
        min_steps=8          reported steps a rank needs in the window
        empty_share=0.8      share of steps with an empty queue
        min_data_share=0.1   data wait as a share of the step time
        job_share=0.5        share of starved ranks for a job-wide alert
        clear=2              evaluations without to resolve
    """

    name = "dataloader"

    def __init__(self, *, window: int = 20, every: int = 10, min_steps: int = 8, empty_share: float = 0.8,
                 min_data_share: float = 0.1, job_share: float = 0.5, clear: int = 2):
        if window < 2 or every < 1 or min_steps < 1 or not 0 < empty_share <= 1 or clear < 1:
            raise ValueError("dataloader: need window >= 2, every >= 1, min_steps >= 1, 0 < empty_share <= 1, "
                             "clear >= 1")
        self.window, self.every, self.min_steps = int(window), int(every), int(min_steps)
        self.empty_share, self.min_data_share, self.job_share = float(empty_share), float(min_data_share), float(job_share)
        self._eps = _Episodes(int(clear))
        self._R = -1
        self._q = self._d = None
        self._st = np.full(self.window, -1, dtype=np.int64)
        self._te = np.zeros(self.window, dtype=np.int64)
        self._n = 0
        self._bucket = None

    def _reset(self, R: int) -> None:
        self._R = R
        self._q = np.full((self.window, R), np.nan, dtype=np.float32)    # ready batches
        self._d = np.full((self.window, R), np.nan, dtype=np.float32)    # data wait / step time
        self._st.fill(-1)
        self._n = 0

    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2 or block.step_ms.shape[1] == 0 or block.data_queue is None:
            return []
        R = block.step_ms.shape[1]
        if R != self._R:
            self._reset(R)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = (block.data_ms / block.step_ms).astype(np.float32)
        out = []
        for s in range(S):
            i = self._n % self.window
            self._q[i], self._d[i] = block.data_queue[s], share[s]
            self._st[i], self._te[i] = block.steps[s], block.t_end[s]
            self._n += 1
            b = int(block.steps[s]) // self.every
            if b != self._bucket:
                self._bucket = b
                out += self._evaluate(ctx, int(block.steps[s]))
        return out

    def _evaluate(self, ctx: JobContext, step_now: int) -> list[Alert]:
        q = self._q
        nrep = np.isfinite(q).sum(axis=0)
        t_now = int(self._te[(self._n - 1) % self.window])
        present: set = set()
        alerts: list[Alert] = []
        ok = nrep >= self.min_steps
        if ok.any():
            with np.errstate(invalid="ignore", divide="ignore"):
                empty = (q == 0).sum(axis=0) / np.maximum(nrep, 1)
            # median data share >= min_data_share, only where the queue test holds (usually no rank),
            # by counting; the medians themselves only for an alert being assembled
            cand = np.flatnonzero(ok & (empty >= self.empty_share))
            starved = np.zeros(q.shape[1], dtype=bool)
            starved[cand] = _median_at_least(self._d[:, cand], self.min_data_share)
            if starved.any():
                dshare = np.full(q.shape[1], np.nan)
                job_wide = starved.sum() >= self.job_share * ok.sum()
                ranks = [] if job_wide else np.flatnonzero(starved).tolist()
                key = "job" if job_wide else "ranks:" + ",".join(map(str, ranks[:64]))
                present.add(key)
                step_first = int(self._st[self._st >= 0].min())

                def make():
                    dshare[starved] = _nanmedian_axis0(self._d[:, starved])
                    return self._alert(ctx, q.astype(np.float64), empty, dshare, starved, ok, ranks, step_first,
                                       step_now, t_now)
                alerts += self._eps.seen(key, make)
        return alerts + self._eps.sweep(present, step_now, t_now)

    def _alert(self, ctx, q, empty, dshare, starved, ok, ranks, step_first, step_now, t_now) -> Alert:
        ev = queue_evidence(q[:, starved])
        ev.update({"starved_ranks": int(starved.sum()), "reporting_ranks": int(ok.sum()),
                   "data_share_of_step": _r(float(np.nanmedian(dshare[starved]))),
                   "others": queue_evidence(q[:, ok & ~starved]) if (ok & ~starved).any() else None})
        ds = float(np.nanmedian(dshare[starved]))
        who = (f"job {ctx.job}" if not ranks else
               f"rank(s) {', '.join(map(str, ranks[:8]))}{' …' if len(ranks) > 8 else ''} on "
               f"{', '.join(sorted({ctx.node_of(r) for r in ranks})[:4])}")
        return Alert(job=ctx.job, kind="dataloader_starved", status="firing", step_first=step_first,
                     step_detected=step_now, t_detected=t_now, ranks=ranks, nodes=[ctx.node_of(r) for r in ranks],
                     cause="io", evidence=ev, cost_pct=round(100.0 * ds, 3),
                     severity="critical" if ds > 0.2 else "warning",
                     suggestion=(f"Data loader starved ({who}): the prefetch queue was empty on "
                                 f"{100 * ev['empty_share']:.0f}% of steps while waiting for data took "
                                 f"{100 * ds:.0f}% of the step. " + DATALOADER_SUGGESTION))


# --------------------------------------------------------------------------- offline

def efficiency_tables(topology: pa.Table | None, steps: pa.Table, comm: pa.Table | None = None,
                      settings: dict | None = None) -> dict[str, pa.Table]:
    """The ``efficiency`` and ``comm_bw`` rows the processor would store for one job's stored telemetry
    (post-mortems, backfills, test stores): aligns the steps (stream order), feeds the ``mfu`` and
    ``comm_bw`` detectors with the comm rows as they would have arrived. ``settings`` as for the registry."""
    from stepwatch import schema as wire
    from stepwatch.detectors.context import JobTelemetry
    from stepwatch.stream.align import JobState
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
    import dataclasses
    return StepBlock(**{f.name: (None if getattr(b, f.name) is None else getattr(b, f.name)[i:j])
                        for f in dataclasses.fields(b)})

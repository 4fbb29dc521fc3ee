"""Cause taxonomy (docs/incidents.md, 'Cause taxonomy and remedies') and phase-based attribution shared by the detectors.

The taxonomy is the field's: ``io`` (data wait), ``cpu`` (host-side gap: dispatch, contention,
environment), ``gc`` (Python GC pauses), ``communication`` (collective time), ``computation``
(accelerator time), ``parallelism`` (imbalance / poor overlap). :data:`SUGGESTIONS` holds the remedies
of each cause (the case table of that docs section).

Attribution works on *phase medians* in milliseconds. The phases are the step record's columns plus
the derived host gap::

    host_gap_ms = step_ms - data_ms - compute_ms - comm_ms - comm_wait_ms - gc_ms   (clipped at 0)

The stepwatch probe leaves the time its rank's thread was runnable but waiting for a CPU (``cpu_wait_ms``,
the scheduler's run-queue wait) out of the compute time it derives, so CPU contention shows here as host
gap (cause ``cpu``), and a rank that is slow on its own (its compute, or time off the CPU such as waiting
for a device) shows as compute time (cause ``computation``).

:func:`attribute` compares two sets of phase medians (before/after a change, or stage peers/suspect
rank) and names the cause of the phase that grew most in absolute milliseconds.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np

CAUSES: tuple[str, ...] = ("io", "cpu", "gc", "communication", "computation", "parallelism")

#: Remedies per cause, from the case table of docs/incidents.md (GC is the table's CPU row "GC" entry).
SUGGESTIONS: dict[str, str] = {
    "io": ("I/O bound: add I/O bandwidth or use local storage; more DataLoader workers; avoid "
           "compressed formats; no taskset binding; enable pin_memory and prefetch."),
    "cpu": ("CPU-side gap: disable JIT/operator compilation; remove host-device sync points; stop the "
            "competing process (check the node's top processes); align library versions, lower the log "
            "level."),
    "gc": ("Python GC pauses: raise the GC threshold (gc.set_threshold) or gc.freeze() after setup; "
           "disable automatic GC and collect at checkpoints."),
    "communication": ("Communication: separate compute and communication traffic; tune the collective "
                      "library (HCCL/NCCL); fuse small tensors; check NIC retransmits and switch config."),
    "computation": ("Computation: isolate the slow node (check accelerator clock and temperature); "
                    "memory settings / smaller micro-batch / ZeRO; fused or faster operators, no dynamic "
                    "shapes."),
    "parallelism": ("Parallelism: ranks wait on each other (poor overlap or load imbalance): overlap "
                    "communication with computation across shards; revisit the hybrid-parallel plan."),
    "unknown": "No single phase explains the change: profile the named ranks for a few steps.",
}

#: The concrete DataLoader remedy when its prefetch queue runs empty (the I/O row of the case table,
#: with the settings named); used by the ``dataloader`` detector.
DATALOADER_SUGGESTION = ("The workers cannot keep up: raise DataLoader num_workers (a single-process loader, "
                         "num_workers=0, never prefetches), raise prefetch_factor, set pin_memory=True and "
                         "persistent_workers=True; make preprocessing cheaper (move it offline or to the "
                         "accelerator) and check the storage read speed (local copies, no compressed formats).")


def queue_evidence(q) -> dict:
    """Distribution of DataLoader ready batches (``data_queue``; any shape, NaN = not reported): share of
    samples with an empty queue, share at the deepest level seen (a full queue: I/O is not the
    bottleneck), median and max depth. ``{}`` when nothing was reported."""
    v = np.asarray(q)
    if v.dtype.kind != "f":
        v = v.astype(np.float64)
    v = v.ravel()
    fin = np.isfinite(v)
    if not fin.all():
        v = v[fin]                                           # (float32 depths stay float32: the counts, the
    if not len(v):                                           # max and _median's values are the same)
        return {}
    top = float(v.max())
    return {"samples": int(len(v)), "empty_share": round(float(np.mean(v == 0)), 4),
            "full_share": round(float(np.mean(v == top)), 4) if top > 0 else 0.0,
            "depth_p50": _median(v), "depth_max": top}


#: Phase column -> cause. ``comm_wait_ms`` is optional: when given, time spent waiting for peers growing
#: most means imbalance / poor overlap (``parallelism``).
PHASE_CAUSE: dict[str, str] = {
    "data_ms": "io",
    "compute_ms": "computation",
    "comm_ms": "communication",
    "gc_ms": "gc",
    "host_gap_ms": "cpu",
    "comm_wait_ms": "parallelism",
}

#: The phases every detector reports (``comm_wait_ms`` is added where it is meaningful).
PHASES: tuple[str, ...] = ("data_ms", "compute_ms", "comm_ms", "gc_ms", "host_gap_ms")


def host_gap(step_ms, data_ms, compute_ms, comm_ms, comm_wait_ms, gc_ms) -> np.ndarray:
    """Host-side gap per element (ms): step time not explained by the reported phases, clipped at 0.

    Missing (NaN) phases count as 0; the result is NaN where ``step_ms`` is NaN.
    """
    gap = np.array(step_ms, dtype=np.float64)  # a copy
    for p in (data_ms, compute_ms, comm_ms, comm_wait_ms, gc_ms):
        p = np.asarray(p, dtype=np.float64)
        nan = np.isnan(p)
        # a NaN phase subtracts nothing (x - 0.0 is x, signed zeros and NaN included): skipped in place
        np.subtract(gap, p, out=gap, where=~nan if nan.any() else True)
    return np.maximum(gap, 0.0, where=~np.isnan(gap), out=gap)


def phase_arrays(block, cols=None) -> dict[str, np.ndarray]:
    """The phase arrays of a :class:`~stepwatch.detectors.base.StepBlock` (optionally only the columns
    ``cols``), including the derived ``host_gap_ms`` and ``comm_wait_ms``. Shapes follow the block."""
    sel = (lambda a: a) if cols is None else (lambda a: a[:, cols])
    out = {
        "data_ms": sel(block.data_ms), "compute_ms": sel(block.compute_ms),
        "comm_ms": sel(block.comm_ms), "gc_ms": sel(block.gc_ms),
        "comm_wait_ms": sel(block.comm_wait_ms),
    }
    out["host_gap_ms"] = host_gap(sel(block.step_ms), out["data_ms"], out["compute_ms"],
                                  out["comm_ms"], out["comm_wait_ms"], out["gc_ms"])
    return out


#: below this many values a median is one ``np.median`` (the sampled band of :func:`median1d` costs more)
_BAND_MIN = 16384


def median1d(a: np.ndarray) -> float:
    """``np.median(a)`` of a 1-D float array without NaN, the same value, without partitioning all of it:
    the median lies, but for a rare unlucky sample, between two order statistics of an even sample of
    ~1,000 values (the sample's 45% and 55% points). One pass counts the values below that band and
    gathers the ~10% inside it; only those are partitioned, and the two middle values (or the one) are
    averaged by ``np.mean`` exactly as ``np.median`` does. When the band misses the middle, the whole
    array is partitioned after all. ~3x faster than ``np.median`` at 100k values (which partitions a
    copy of the whole array)."""
    n = len(a)
    if n < _BAND_MIN:
        return np.median(a)
    samp = np.sort(a[::n // 1024])
    m = len(samp)
    lo, hi = samp[(m * 45) // 100], samp[-(-m * 55 // 100)]
    below = int(np.count_nonzero(a < lo))
    band = a[(a >= lo) & (a <= hi)]
    k0, k1 = (n - 1) // 2 - below, n // 2 - below           # the middle order statistics, in the band
    if k0 < 0 or k1 >= len(band):
        return np.median(a)
    band.partition((k0, k1) if k1 != k0 else k0)
    return np.mean(band[k0:k1 + 1])


def nanmedian(a, axis=None, overwrite: bool = False):
    """``np.nanmedian`` without the all-NaN warning (all-NaN slices give NaN); takes the faster
    ``np.median`` path when there is no NaN (long rows: :func:`median1d`, the same values).
    ``overwrite``: ``a`` is a scratch array the caller no longer needs (partitioned in place, not copied
    first)."""
    a = np.asarray(a)
    if a.size and not np.isnan(a).any():
        if a.dtype == np.float64 and a.shape[-1] >= _BAND_MIN and (
                (a.ndim == 1 and axis in (None, 0, -1)) or (a.ndim == 2 and axis in (1, -1) and len(a) <= 8)):
            if a.ndim == 1:
                return median1d(a)
            return np.array([median1d(row) for row in a])
        return np.median(a, axis=axis, overwrite_input=overwrite)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(a, axis=axis)


def attribute(before: dict[str, float], after: dict[str, float]) -> tuple[str, dict]:
    """Name the cause of the phase that grew most from ``before`` to ``after``.

    ``before``/``after`` map phase names (:data:`PHASE_CAUSE` keys; unknown keys are ignored) to median
    milliseconds — before/after a change, or stage peers/suspect rank. The phase with the largest
    positive absolute growth names the cause; ``"unknown"`` when no phase grew (or all are NaN).
    Returns ``(cause, evidence)`` where evidence is ``{"phase": <grown phase or None>,
    "phases": {phase: {"before", "after", "delta"}}}`` (ms, rounded to 3 decimals, JSON-safe).
    """
    keys = [k for k in PHASE_CAUSE if k in before and k in after]
    b = np.array([before[k] for k in keys], dtype=np.float64)
    a = np.array([after[k] for k in keys], dtype=np.float64)
    delta = a - b
    grown = np.where(np.isnan(delta), -np.inf, delta)
    phases = {k: {"before": _num(b[i]), "after": _num(a[i]), "delta": _num(delta[i])}
              for i, k in enumerate(keys)}
    if not keys or not np.any(grown > 0):
        return "unknown", {"phase": None, "phases": phases}
    i = int(np.argmax(grown))
    return PHASE_CAUSE[keys[i]], {"phase": keys[i], "phases": phases}


def _num(x: float):
    x = float(x)
    return None if np.isnan(x) else round(x, 3)


# --------------------------------------------------------------------------- host / GC / comm evidence
#
# Used when an alert is assembled (rarely), on the bounded windows of
# :class:`~stepwatch.detectors.context.JobTelemetry` (``ctx.host``, ``ctx.gc``, ``ctx.comm``). Every
# function returns a JSON-safe dict (empty when the window is missing or holds nothing in range), so an
# alert carries the evidence its cause was decided on.

#: remedies of the stall / hang kinds (no row of the case table covers a silent rank)
HANG_SUGGESTION = ("Hang: dump the stacks of the rank that stopped first (py-spy dump --pid, or the "
                   "framework's flight recorder / NCCL_DEBUG=INFO, TORCH_NCCL_ASYNC_ERROR_HANDLING=1); the "
                   "other ranks are blocked in a collective waiting for it. Check its node (dmesg, "
                   "accelerator health, NIC) and set a collective timeout so a hang fails fast.")
STALL_SUGGESTION = ("Stopped reporting while its peers go on: check that the training process on the node "
                    "is alive (py-spy dump), its agent/probe and the node's network; if the host samples "
                    "stopped too, the node is down or unreachable.")

FOREIGN_MIN_PCT = 50.0      # a process must use at least half a core to count as contention
NEW_MIN_PCT = 20.0          # ... or a fifth of one when it was not among the node's top processes before
BEFORE_NS = 120_000_000_000 # "before": host samples up to 2 min ahead of the evidence window
FOREIGN_MAX_SHARE = 0.2     # ... and appear in the top processes of at most 20% of the other nodes
CLOCK_DROP = 0.95           # accelerator clock at or below 95% of the fleet median: down-clocked
TEMP_RISE_C = 10.0          # or this much hotter than the fleet median


def _med(a) -> float | None:
    a = np.asarray(a, dtype=np.float64)
    a = a[np.isfinite(a)]
    return round(_median(a), 3) if len(a) else None


def _median(a: np.ndarray) -> float:
    """``float(np.median(a))`` of finite float64 (or float32, widened) values, the same value; whole numbers
    in a modest range (non-negative: clocks in MHz, temperatures, queue depths: ~800k of them in a job's host
    window) by one count per value instead of a partition (the mean of the two middle whole numbers is exact
    in float64); all one value (an empty queue on every rank and step), that value."""
    n = len(a)
    if n > 4096:
        lo, hi = float(a.min()), float(a.max())
        if 0.0 <= lo and hi - lo < (1 << 16) and not np.signbit(a).any():
            if lo == hi:
                return lo
            smp = a[::64]                                # a fraction among every 64th value: not whole numbers
            if np.array_equal(smp.astype(np.int64), smp) and np.array_equal(iv := a.astype(np.int64), a):
                cum = np.cumsum(np.bincount(iv - int(lo)))
                m1 = int(np.searchsorted(cum, (n - 1) // 2, side="right")) + int(lo)
                m2 = int(np.searchsorted(cum, n // 2, side="right")) + int(lo)
                return (float(m1) + float(m2)) / 2.0
    return float(median1d(a.astype(np.float64, copy=False)))


def _med_without(a: np.ndarray, out: np.ndarray) -> float | None:
    """``_med(a[~out])`` of a float64 array, the same value (None when nothing finite is left): a fleet's
    median without the few suspect entries ``out``. Whole numbers in a modest range (clocks, temperatures:
    ~800k entries of a job's host window) are counted over all of ``a`` less the counts of the entries
    left out, without copying the others first; any other array takes ``_med``'s own path."""
    n_out = int(np.count_nonzero(out))
    n = len(a) - n_out
    if n > 4096 and n_out * 8 < len(a):
        lo, hi = a.min(), a.max()                            # NaN in a: NaN here, and _med below
        if np.isfinite(lo) and np.isfinite(hi) and 0.0 <= lo and hi - lo < (1 << 16) and not np.signbit(a).any():
            iv = a.astype(np.int64)
            if np.array_equal(iv, a):                        # (all of a whole: the others are)
                iv -= int(lo)
                cnt = np.bincount(iv)
                if n_out:
                    cnt -= np.bincount(iv[out], minlength=len(cnt))
                cum = np.cumsum(cnt)
                m1 = int(np.searchsorted(cum, (n - 1) // 2, side="right")) + int(lo)
                m2 = int(np.searchsorted(cum, n // 2, side="right")) + int(lo)
                return round((float(m1) + float(m2)) / 2.0, 3)
    return _med(a[~out])


def _col(t, name) -> np.ndarray:
    return t.column(name).to_numpy(zero_copy_only=False).astype(np.float64) if name in t.column_names \
        else np.full(t.num_rows, np.nan)


def host_evidence(ctx, nodes, t_lo: int, t_hi: int) -> dict:
    """The suspect ``nodes``' host samples in ``[t_lo, t_hi]`` (ns) against the other nodes' samples.

    Returns ``{"samples", "cpu_util", "cpu_iowait", "load1", "rdma_retrans": {"suspect", "others"}
    medians, "foreign": [{"node", "name", "pid", "cpu_pct", "seen_elsewhere", "new"}] (processes that use
    >= 50% of a core on a suspect node, or >= 20% when they are ``new`` there and the ranks report their
    run-queue wait (then a process only names the cause when the rank waited for its CPU), and appear among the top
    processes of <= 20% of the other nodes; ``new``: not among that node's top processes at >= 20% in the
    samples of the 2 minutes before the window (None without such samples); new ones first, then by CPU),
    "accel": {"node", "index", "clock_mhz", "temp_c", "fleet_clock_mhz", "fleet_temp_c", "down_clocked"}
    (the suspect nodes' slowest accelerator against the fleet), "cpu_wait_reported": True (when the
    job's ranks report their run-queue wait, see :func:`decide`)}``; ``{}`` when there are no samples.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    w = getattr(ctx, "host", None)
    t = w.select(int(t_lo), int(t_hi)) if w is not None and len(w) else None
    if t is None or "node" not in t.column_names:
        return {}
    nodes = sorted({str(n) for n in nodes if n})
    if not nodes:
        return {}
    sus = pc.is_in(t.column("node"), value_set=pa.array(nodes, type=t.column("node").type))
    sus = sus.to_numpy(zero_copy_only=False).astype(bool)
    if not sus.any():
        return {}
    ev: dict = {"samples": int(sus.sum())}
    for c in ("cpu_util", "cpu_iowait", "load1", "rdma_retrans"):
        v = _col(t, c)
        ev[c] = {"suspect": _med(v[sus]), "others": _med(v[~sus])}
    measured = bool((getattr(ctx, "info", None) or {}).get("cpu_wait_reported"))
    before = w.select(int(t_lo) - BEFORE_NS, int(t_lo) - 1_500_000_000)
    node_codes = _codes(t.column("node"))                # (codes, names), shared by both
    ev["foreign"] = _foreign(t, sus, _seen(before, nodes), NEW_MIN_PCT if measured else FOREIGN_MIN_PCT,
                             node_codes=node_codes)
    acc = _accel(t, sus, node_codes=node_codes)
    if acc:
        ev["accel"] = acc
    if measured:
        ev["cpu_wait_reported"] = True
    return ev


def recheck_host(window, q: dict) -> tuple[dict, str, str]:
    """A localised alert's host evidence and cause read again from the job's host ``window`` with the query
    it was built with (:attr:`~stepwatch.detectors.base.Alert.host_query`: nodes, time span, phase cause,
    GC / comm evidence, excess ms): the host samples that cover its steps may be read after it was built
    (see :mod:`stepwatch.stream.hostwait`). Returns ``(host evidence, cause, reason)``."""
    from types import SimpleNamespace
    ctx = SimpleNamespace(host=window, info={"cpu_wait_reported": bool(q.get("measured"))})
    host = host_evidence(ctx, q["nodes"], q["t_lo"], q["t_hi"])
    cause, reason = decide(q["phase_cause"], host, q.get("gc"), q.get("comm"), q.get("excess_ms"),
                           q.get("wait_rise_ms"))
    return host, cause, reason


def _seen(t, nodes) -> set | None:
    """(node, process name) pairs at >= NEW_MIN_PCT among the top processes of ``t`` on ``nodes``; None
    when ``t`` has no sample of those nodes."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if t is None or "node" not in t.column_names or "top_procs" not in t.column_names:
        return None
    t = t.filter(pc.is_in(t.column("node"), value_set=pa.array(nodes, type=t.column("node").type)))
    if not t.num_rows:
        return None
    tp = t.column("top_procs").combine_chunks()
    lens = pc.list_value_length(tp).fill_null(0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(tp)
    if not len(flat):
        return set()
    node = np.repeat(np.asarray(t.column("node").to_pylist(), dtype=object), lens)
    name = np.asarray(flat.field("name").fill_null("").to_pylist(), dtype=object)
    cpu = flat.field("cpu_pct").to_numpy(zero_copy_only=False).astype(np.float64)
    m = cpu >= NEW_MIN_PCT
    return set(zip(node[m].tolist(), name[m].tolist()))


def _codes(arr) -> tuple[np.ndarray, list]:
    """(int codes, distinct values) of a string array, without a Python object per row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    d = pc.dictionary_encode(arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr)
    return d.indices.to_numpy(zero_copy_only=False).astype(np.int64), d.dictionary.to_pylist()


def _foreign(t, sus: np.ndarray, seen: set | None = None, new_min: float = NEW_MIN_PCT,
             node_codes: tuple | None = None) -> list[dict]:
    import pyarrow.compute as pc

    if "top_procs" not in t.column_names:
        return []
    # the list column flattened chunk by chunk (a combine_chunks of the nested column copies every field)
    tp = t.column("top_procs")
    lens = pc.list_value_length(tp).fill_null(0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(tp)
    if len(flat) == 0:
        return []
    row = np.repeat(np.arange(t.num_rows), lens)
    name_c, names = _codes(pc.struct_field(flat, "name").fill_null(""))
    cpu = pc.struct_field(flat, "cpu_pct").to_numpy(zero_copy_only=False).astype(np.float64)
    pid = pc.struct_field(flat, "pid").to_numpy(zero_copy_only=False)
    node_row, node_names = node_codes if node_codes is not None else _codes(t.column("node"))
    node = node_row[row]
    on_s = sus[row]
    n_others = _n_distinct(node[~on_s])
    out = []
    for c in np.unique(name_c[on_s & (cpu >= (FOREIGN_MIN_PCT if seen is None else new_min))]).tolist():
        m = on_s & (name_c == c)
        k = int(np.argmax(np.where(m, cpu, -1)))
        nd = str(node_names[node[k]])
        new = None if seen is None else (nd, str(names[c])) not in seen
        big = m & (cpu >= FOREIGN_MIN_PCT)
        if not big.any() and not new:
            continue
        n_else = _n_distinct(node[~on_s & (name_c == c)])
        share = n_else / n_others if n_others else 0.0
        if share > FOREIGN_MAX_SHARE:
            continue
        out.append({"node": nd, "name": str(names[c]), "pid": int(pid[k]),
                    "cpu_pct": round(float(np.median(cpu[m])), 1), "seen_elsewhere": round(share, 3), "new": new})
    out.sort(key=lambda d: (not d["new"], -d["cpu_pct"]))
    return out[:3]


def _n_distinct(a: np.ndarray) -> int:
    """``len(np.unique(a))`` of integer codes, by counting when they are small and non-negative."""
    if len(a) and a.min() >= 0 and a.max() < 4 * len(a) + 1024:
        return int(np.count_nonzero(np.bincount(a)))
    return len(np.unique(a))


def _unique_codes(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` of integer codes, by counting when they are small and non-negative."""
    if len(a) and a.min() >= 0 and a.max() < 4 * len(a) + 1024:
        return np.flatnonzero(np.bincount(a))
    return np.unique(a)


def _accel(t, sus: np.ndarray, node_codes: tuple | None = None) -> dict:
    import pyarrow.compute as pc

    if "accel" not in t.column_names or t.column("accel").null_count == t.num_rows:
        return {}
    ac = t.column("accel")                               # flattened chunk by chunk, as in _foreign
    lens = pc.list_value_length(ac).fill_null(0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(ac)
    if len(flat) == 0:
        return {}
    row = np.repeat(np.arange(t.num_rows), lens)
    clock = pc.struct_field(flat, "clock_mhz").to_numpy(zero_copy_only=False).astype(np.float64)
    temp = pc.struct_field(flat, "temp_c").to_numpy(zero_copy_only=False).astype(np.float64)
    idx = pc.struct_field(flat, "index").to_numpy(zero_copy_only=False)
    on_s = sus[row]
    if not on_s.any():
        return {}
    fleet_clock, fleet_temp = ((_med_without(clock, on_s), _med_without(temp, on_s)) if not on_s.all()
                               else (_med(clock), _med(temp)))
    node_row, node_names = node_codes if node_codes is not None else _codes(t.column("node"))
    # the suspect nodes' slowest device: lowest median clock over the samples (the suspect entries only)
    si = np.flatnonzero(on_s)
    node, idx, clock, temp = node_row[row[si]], idx[si], clock[si], temp[si]
    keys = sorted({(int(n), int(i)) for n, i in zip(node, idx)})
    best = None
    for n, i in keys:
        m = (node == n) & (idx == i)
        c, tc = _med(clock[m]), _med(temp[m])
        if c is not None and (best is None or c < best[2]):
            best = (str(node_names[n]), i, c, tc)
    if best is None or fleet_clock is None:
        return {}
    n, i, c, tc = best
    down = c <= CLOCK_DROP * fleet_clock or (tc is not None and fleet_temp is not None and tc >= fleet_temp + TEMP_RISE_C)
    return {"node": n, "index": i, "clock_mhz": c, "temp_c": tc, "fleet_clock_mhz": fleet_clock,
            "fleet_temp_c": fleet_temp, "down_clocked": bool(down)}


def gc_evidence(ctx, ranks, t_lo: int, t_hi: int, steps: int) -> dict:
    """GC records in ``[t_lo, t_hi]``: the suspect ``ranks``' collections per step and pause ms per step
    against the other ranks' (per rank), and the suspects' highest generation. ``{}`` without records."""
    w = getattr(ctx, "gc", None)
    t = w.select(int(t_lo), int(t_hi)) if w is not None and len(w) else None
    if t is None or "rank" not in t.column_names:
        return {"records": 0} if w is not None else {}
    rk = t.column("rank").to_numpy(zero_copy_only=False).astype(np.int64)
    dur = _col(t, "duration_ms")
    gen = _col(t, "generation")
    sus = np.isin(rk, np.asarray(list(ranks), dtype=np.int64))
    steps = max(int(steps), 1)
    n_sus = max(len(set(ranks)), 1)
    R = max(int(getattr(ctx, "world_size", 0)) - n_sus, 1)
    return {
        "records": int(len(rk)),
        "suspect_per_step": round(float(sus.sum()) / n_sus / steps, 3),
        "suspect_ms_per_step": round(float(np.nansum(dur[sus])) / n_sus / steps, 3),
        "others_per_step": round(float((~sus).sum()) / R / steps, 4),
        "others_ms_per_step": round(float(np.nansum(dur[~sus])) / R / steps, 4),
        "max_generation": None if not sus.any() or np.all(np.isnan(gen[sus])) else int(np.nanmax(gen[sus])),
    }


def comm_evidence(ctx, ranks, step_lo: int, step_hi: int) -> dict:
    """Comm records of steps ``[step_lo, step_hi]``: median ``time_ms`` per (op, group) of the suspect
    ``ranks`` against the same op on the other ranks. ``{}`` without records."""
    w = getattr(ctx, "comm", None)
    t = w.select(int(step_lo), int(step_hi)) if w is not None and len(w) else None
    if t is None or "rank" not in t.column_names:
        return {}
    rk = t.column("rank").to_numpy(zero_copy_only=False).astype(np.int64)
    sus = np.isin(rk, np.asarray(list(ranks), dtype=np.int64))
    if not sus.any():
        return {"records": int(len(rk))}
    import pyarrow as pa
    import pyarrow.compute as pc

    tm = _col(t, "time_ms")
    # op and group as integer codes of the suspects' rows only (no Python object per row: the window holds
    # up to 400k rows); the other ranks' rows of an op string by one comparison of the column
    op = t.column("op")
    si = np.flatnonzero(sus)
    sel = pa.array(si)
    opc, op_names = _value_codes(op.take(sel))
    if "group" in t.column_names:
        grc, gr_names = _value_codes(t.column("group").take(sel))
    else:
        grc, gr_names = np.zeros(len(si), dtype=np.int64), [None]
    plain = pa.types.is_string(op.type) or pa.types.is_large_string(op.type)
    if not plain:
        opc_all, names_all = _value_codes(op)
    out = []
    for c in sorted(np.unique(opc).tolist(), key=lambda c: op_names[c]):
        m = opc == c
        groups = sorted({str(g) for g in (gr_names[x] for x in np.unique(grc[m]).tolist()) if g is not None})
        v = op_names[c]
        if not plain:
            same = opc_all == names_all.index(v)
        elif v is None:
            same = pc.is_null(op).to_numpy(zero_copy_only=False)
        else:
            same = pc.fill_null(pc.equal(op, pa.scalar(v, op.type)), False).to_numpy(zero_copy_only=False)
        out.append({"op": str(v), "groups": groups[:4], "suspect_ms": _med(tm[si[m]]),
                    "others_ms": _med(tm[~sus & same])})
    return {"records": int(len(rk)), "ops": out}


def _value_codes(col) -> tuple[np.ndarray, list]:
    """(int64 codes, values) of a column, equal values one code (null: the value None)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    d = pc.dictionary_encode(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
    names = d.dictionary.to_pylist() + [None]
    codes = pc.fill_null(d.indices, len(names) - 1).to_numpy(zero_copy_only=False).astype(np.int64)
    canon: dict = {}
    remap = np.array([canon.setdefault(v, len(canon)) for v in names], dtype=np.int64)
    return remap[codes], list(canon)


def decide(phase_cause: str, host: dict | None = None, gc: dict | None = None, comm: dict | None = None,
           excess_ms: float | None = None, wait_rise_ms: float | None = None) -> tuple[str, str]:
    """Final cause from the phase comparison and the host / GC / comm evidence; returns
    ``(cause, reason)``.

    - a down-clocked or hot accelerator on the suspect node -> ``computation``;
    - else, when the ranks report their run-queue wait (``host["cpu_wait_reported"]``: the stepwatch
      probe), contention is measured, not guessed: the host gap (``cpu``, where that wait goes) names
      ``cpu``, with the node's foreign process as the reason when there is one; so does a process *new*
      on the node beside a rank whose run-queue wait rose too (``wait_rise_ms``, its host gap over its
      peers', >= 1 ms and >= 10% of ``excess_ms``) whatever phase grew most (its helper threads' wait
      for the CPU is its main thread's compute, and the probe reads the wait every few steps); a
      foreign process beside any other phase, the wait unchanged, changes nothing (the rank got its CPU);
    - else a foreign process on the suspect node (:func:`host_evidence` ``foreign``) -> ``cpu``
      (contention slows dispatch and kernels launch late, so it can show as compute time too);
    - else GC records worth at least half the excess time per step -> ``gc`` (producers that send GC
      records but no ``gc_ms``);
    - else comm records of the suspects at least 20% above the others' when the phases point nowhere
      (``unknown`` / ``parallelism``) -> ``communication``;
    - otherwise the phase that grew most.
    """
    host, gc, comm = host or {}, gc or {}, comm or {}
    acc = host.get("accel") or {}
    if acc.get("down_clocked") and phase_cause in ("computation", "cpu", "unknown", "parallelism"):
        return "computation", (f"accelerator {acc.get('index')} on {acc.get('node')} at {acc.get('clock_mhz')} "
                               f"MHz / {acc.get('temp_c')} °C vs fleet {acc.get('fleet_clock_mhz')} MHz / "
                               f"{acc.get('fleet_temp_c')} °C")
    fr = host.get("foreign") or []
    measured = bool(host.get("cpu_wait_reported"))
    waited = (measured and wait_rise_ms is not None and excess_ms is not None and wait_rise_ms >= 1.0
              and wait_rise_ms >= 0.1 * excess_ms and phase_cause in ("computation", "unknown", "parallelism"))
    if waited and any(p.get("new") for p in fr):
        fr = [p for p in fr if p.get("new")]
        phase_cause = "cpu"
    if fr and (phase_cause == "cpu" or (not measured and phase_cause in ("computation", "io", "unknown",
                                                                         "parallelism"))):
        p = fr[0]
        return "cpu", (("waiting for a CPU (run queue); " if measured else "")
                       + f"foreign process {p['name']} (pid {p['pid']}) at {p['cpu_pct']:.0f}% CPU on {p['node']}"
                       + (", new there" if p.get("new") else "")
                       + f", absent from {100 * (1 - p['seen_elsewhere']):.0f}% of the other nodes")
    if measured and phase_cause == "cpu":
        return "cpu", "waiting for a CPU (run queue); no foreign process in the host samples"
    if (excess_ms and gc.get("suspect_ms_per_step") is not None
            and gc["suspect_ms_per_step"] - (gc.get("others_ms_per_step") or 0.0) >= 0.5 * excess_ms
            and phase_cause != "gc"):
        return "gc", f"GC records: {gc['suspect_ms_per_step']:.1f} ms of pauses per step vs " \
                     f"{gc.get('others_ms_per_step') or 0.0:.2f} ms on the other ranks"
    if phase_cause in ("unknown", "parallelism"):
        for o in comm.get("ops") or []:
            if o["suspect_ms"] and o["others_ms"] and o["suspect_ms"] >= 1.2 * o["others_ms"]:
                return "communication", (f"{o['op']} on {','.join(o['groups'])} takes {o['suspect_ms']:.1f} ms vs "
                                         f"{o['others_ms']:.1f} ms elsewhere")
    return phase_cause, "phase breakdown"


def job_host_shift(ctx, before: tuple[int, int], after: tuple[int, int], steps: tuple[int, int]) -> dict:
    """Job-wide host and GC evidence of a change: medians over all nodes of ``cpu_util``,
    ``cpu_iowait``, ``load1``, ``rdma_retrans`` in the ``before`` and ``after`` time spans (ns), GC
    collections and pause ms per rank and step, and processes that use >= 50% of a core on at least a
    fifth of the nodes after the change but were not among their top processes before. ``{}`` when no
    window holds both spans. Computed once per state of the job's windows and spans (``changepoint`` and
    ``mfu`` ask the same question on the step a job-wide change is reported); each caller gets its own
    copy."""
    w = getattr(ctx, "host", None)
    memo = getattr(w, "memo", None)
    if not isinstance(memo, dict):
        return _job_host_shift(ctx, before, after, steps)
    g = getattr(ctx, "gc", None)
    key = ("job_host_shift", tuple(before), tuple(after), tuple(steps), int(getattr(ctx, "world_size", 0)),
           getattr(w, "version", None), id(g), getattr(g, "version", None) if g is not None else None)
    got = memo.get(key)
    if got is None or got[0] is not g:
        if len(memo) >= 16:                          # (bounded: the host window empties it on every batch)
            memo.clear()
        got = memo[key] = (g, _job_host_shift(ctx, before, after, steps))
    return copy.deepcopy(got[1])


def _job_host_shift(ctx, before: tuple[int, int], after: tuple[int, int], steps: tuple[int, int]) -> dict:
    out: dict = {}
    w = getattr(ctx, "host", None)
    if w is not None and len(w):
        tb, ta = w.select(*before), w.select(*after)
        if tb is not None and ta is not None:
            for c in ("cpu_util", "cpu_iowait", "load1", "rdma_retrans"):
                out[c] = {"before": _med(_col(tb, c)), "after": _med(_col(ta, c))}
            new = _new_procs(tb, ta)
            if new:
                out["new_processes"] = new
    g = getattr(ctx, "gc", None)
    if g is not None and len(g):
        R = max(int(getattr(ctx, "world_size", 0)), 1)
        res = {}
        for name, span, n in (("before", before, steps[0]), ("after", after, steps[1])):
            t = g.select(*span)
            k = 0 if t is None else t.num_rows
            ms = 0.0 if t is None else float(np.nansum(_col(t, "duration_ms")))
            res[name] = {"per_rank_step": round(k / R / max(n, 1), 4), "ms_per_rank_step": round(ms / R / max(n, 1), 4)}
        out["gc"] = res
    return out


def _new_procs(tb, ta) -> list[dict]:
    import pyarrow.compute as pc

    def procs(t, before: dict | None = None):
        """name -> (share of the nodes, median CPU): the median only with ``before`` given, of a name that
        can be reported (new: on under 5% of the nodes before, on 20% after); the trainer's own processes
        are on every node, and theirs was a median of every top-process entry of the window."""
        if "top_procs" not in t.column_names:
            return {}
        tp = t.column("top_procs").combine_chunks()
        lens = pc.list_value_length(tp).fill_null(0).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(tp)
        if not len(flat):
            return {}
        row = np.repeat(np.arange(t.num_rows), lens)
        nc, names = _codes(flat.field("name").fill_null(""))
        node, _ = _codes(t.column("node"))
        cpu = flat.field("cpu_pct").to_numpy(zero_copy_only=False).astype(np.float64)
        out = {}
        n_nodes = max(_n_distinct(node), 1)
        big = cpu >= FOREIGN_MIN_PCT
        node_of = node[row]                        # each process entry's node (once, not per name)
        for c in _unique_codes(nc[big]).tolist():
            m = (nc == c) & big
            share = _n_distinct(node_of[m]) / n_nodes
            want = before is not None and share >= 0.2 and before.get(names[c], (0.0,))[0] < 0.05
            out[names[c]] = (share, float(np.median(cpu[m])) if want else None)
        return out
    b = procs(tb)
    a = procs(ta, b)
    return [{"name": k, "nodes_share": round(v[0], 3), "cpu_pct": round(v[1], 1)}
            for k, v in sorted(a.items()) if v[0] >= 0.2 and b.get(k, (0.0, 0.0))[0] < 0.05][:3]


def confirm_shift(cause: str, ev: dict, kind: str = "regression") -> tuple[str, str]:
    """The job-wide cause of a change, checked against :func:`job_host_shift` evidence: a process
    that appeared on many nodes names ``cpu``; otherwise the phase cause stands and the reason quotes
    the host metric that moved with it (iowait for io, RDMA retransmits for communication, GC rate
    for gc)."""
    if not ev:
        return cause, "phase breakdown"
    up = kind == "regression"
    newp = ev.get("new_processes") or []
    if up and newp and cause in ("cpu", "computation", "unknown", "parallelism"):
        p = newp[0]
        return "cpu", (f"process {p['name']} appeared on {p['nodes_share']:.0%} of the nodes at "
                       f"{p['cpu_pct']:.0f}% CPU")
    pick = {"io": ("cpu_iowait", "iowait"), "communication": ("rdma_retrans", "RDMA retransmits"),
            "cpu": ("cpu_util", "host CPU")}.get(cause)
    if pick and pick[0] in ev:
        b, a = ev[pick[0]]["before"], ev[pick[0]]["after"]
        if b is not None and a is not None and ((a > b) if up else (a < b)):
            return cause, f"phase breakdown; {pick[1]} {b} -> {a}"
    if cause == "gc" and "gc" in ev:
        g = ev["gc"]
        return cause, (f"phase breakdown; GC pauses {g['before']['ms_per_rank_step']} -> "
                       f"{g['after']['ms_per_rank_step']} ms per rank and step")
    return cause, "phase breakdown"

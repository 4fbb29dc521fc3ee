"""Per-job metrics for Prometheus, with a cardinality that does not grow with the number of ranks.

:class:`JobMetrics` is a custom collector registered on the processor's registry (so it is served on
the same ``--metrics-port`` as the processor's own health metrics). The processor feeds it from three
places, each O(S x R) numpy per closed step block or O(rows) per table:

* :meth:`JobMetrics.on_block` — every block of closed, aligned steps (``StepBlock``: S steps x R ranks);
* :meth:`JobMetrics.on_rows` — the ``efficiency`` (MFU, goodput) and ``comm_bw`` (bus bandwidth) rows
  the efficiency detectors produce;
* :meth:`JobMetrics.on_alert` — every alert, firing and resolved (and the open alerts found in the store
  when a job is rebuilt, so a restarted processor still counts them).

What a scrape returns, per job (label ``job``; every duration in seconds, every share a 0..1 ratio):

=============================================  =========  ====================================================
metric                                         type       meaning
=============================================  =========  ====================================================
``stepwatch_job_step_duration_seconds``        summary    step time (median over the ranks of each step);
                                                          ``quantile`` 0.5, 0.99 and 1 (the max) over the last
                                                          ``window_steps`` closed steps; ``_sum``/``_count``
                                                          over the processor's lifetime (rate() them)
``stepwatch_job_tokens_total``                 counter    tokens trained (global; from the efficiency rows)
``stepwatch_job_samples_total``                counter    samples trained (global)
``stepwatch_job_busy_spread_ratio``            gauge      median over the window of (max - median) / median of
                                                          the ranks' busy time (step minus collective wait)
``stepwatch_job_jitter_ratio``                 gauge      share of the window's steps slower than 1.1x the
                                                          median of the 21 steps up to them
``stepwatch_job_mfu_ratio``                    gauge      model FLOPs utilisation of the newest step with one
``stepwatch_job_goodput_ratio``                gauge      productive share of the wall time over the window
``stepwatch_job_ranks_reporting``              gauge      ranks that reported the newest closed step
``stepwatch_job_world_size``                   gauge      ranks in the job's topology
``stepwatch_job_last_step``                    gauge      newest closed step number
``stepwatch_job_last_step_timestamp_seconds``  gauge      its end (event time, Unix seconds)
``stepwatch_job_bus_bandwidth_bytes_per_second``  gauge   achieved bus bandwidth (nccl-tests convention) per
                                                          collective ``op``, median over its groups
``stepwatch_job_bus_bandwidth_peak_ratio``     gauge      per ``op``, the worst group's bus bandwidth over
                                                          its link's peak
``stepwatch_job_alerts_firing``                gauge      open alerts per ``kind`` and ``cause`` (a
                                                          ``kind,cause`` seen once stays, at 0, while the job
                                                          lives; point kinds count for ``point_hold_s``)
``stepwatch_job_slowest_rank_busy_seconds``    gauge      the ``top_k`` ranks with the longest busy time
                                                          (exponentially smoothed over steps), labels
                                                          ``rank`` and ``node``; with hysteresis (an
                                                          exported rank stays until one ``margin`` slower
                                                          displaces it), so healthy ranks a hair apart do
                                                          not churn series; from the ``2/smoothing``-th step
=============================================  =========  ====================================================

Series per job: 5 (the summary) + 10 fixed, 2 per collective kind (at most ``MAX_OPS`` kinds), 1 per (alert
kind, cause) seen, at most ``top_k`` slow ranks — the same at 64 and at 100,000 ranks. Plus, once per
processor, ``stepwatch_job_metrics_jobs`` (jobs exported) and ``stepwatch_job_metrics_jobs_left_out``.

Bounds (a scrape must stay small whatever the telemetry says; docs/limits.md):

* at most ``max_jobs`` jobs (500) are exported per scrape: the jobs with the most open alerts first,
  then the most recently active. Troubled jobs are what a dashboard or an alert rule needs; among the
  healthy ones the newest data is the most useful. The rest are left out of that scrape and counted
  in ``stepwatch_job_metrics_jobs_left_out`` (6,000 jobs exported in full were 72,001 series, 4.8 MB);
* every label value (job, node, op, kind, cause) is at most ``MAX_LABEL_CHARS`` (128) characters:
  longer ones are cut and end with ``~`` and 16 hex digits of their SHA-256, so distinct values stay
  distinct series (a node name of 200,000 characters became a label before).

Lifecycle: a job enters on its first block; it **leaves the registry** (all its series vanish) when no
block, row or alert arrived for ``job_ttl_s`` seconds (wall clock), or when :meth:`forget` is called.
Thread safety: the processor thread updates, the exporter's HTTP thread collects; one lock guards both.
"""
from __future__ import annotations

import hashlib
import heapq
import threading
import time

import numpy as np
import pyarrow as pa

from stepwatch.detectors.causes import nanmedian

#: alert kinds reported once (no ``resolved`` follows): counted as firing for ``point_hold_s``
POINT_KINDS = frozenset({"regression", "recovery", "mfu_regression"})
JITTER_NEIGHBOURS = 21
JITTER_SLOW = 1.1
QUANTILES = (0.5, 0.99, 1.0)
MAX_LABEL_CHARS = 128
MAX_OPS = 16          # collective kinds exported per job (op names come from the telemetry)


def bounded_label(v: str, limit: int = MAX_LABEL_CHARS) -> str:
    """``v`` if at most ``limit`` characters, else its head, ``~`` and 16 hex digits of its SHA-256
    (``limit`` characters in all: distinct long values stay distinct)."""
    if len(v) <= limit:
        return v
    digest = hashlib.sha256(v.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return v[:max(limit - 17, 0)] + "~" + digest


class _Job:
    __slots__ = ("job", "step_s", "spread", "n", "pos", "count", "sum_s", "ranks_reporting", "world_size",
                 "last_step", "last_t", "ewma", "top", "nodes", "mfu", "wall", "prod", "eff_n", "tokens", "samples", "bw", "alerts",
                 "combos", "touched", "snapshot")

    def __init__(self, job: str, window: int):
        self.job = job
        self.step_s = np.full(window, np.nan)      # ring: job step time per step (s)
        self.spread = np.full(window, np.nan)      # ring: busy spread per step
        self.n = 0                                 # steps in the ring (<= window)
        self.pos = 0                               # next ring slot
        self.count = 0                             # steps seen (summary _count)
        self.sum_s = 0.0                           # their step time (summary _sum)
        self.ranks_reporting = 0
        self.world_size = 0
        self.last_step = -1
        self.last_t = 0.0
        self.ewma: np.ndarray | None = None        # (R,) smoothed busy ms per rank
        self.top = np.empty(0, dtype=np.int64)     # ranks exported as the slowest (with hysteresis)
        self.nodes = np.empty(0, dtype=object)
        self.mfu = np.nan
        self.wall = np.zeros(window)               # ring over efficiency rows: wall and productive ms
        self.prod = np.zeros(window)
        self.eff_n = 0
        self.tokens = self.samples = None          # totals from the efficiency rows (None: never reported)
        self.bw: dict[str, tuple[float, float]] = {}    # op -> (busbw bytes/s, worst util)
        self.alerts: dict[str, tuple[str, str, float | None]] = {}   # alert_id -> (kind, cause, hold deadline)
        self.combos: set[tuple[str, str]] = set()
        self.touched = time.monotonic()
        self.snapshot: dict | None = None


class JobMetrics:
    """The per-job collector (see the module docs). ``registry``: where to register (None: don't);
    ``top_k``: slow ranks exported per job; ``window_steps``: steps the quantiles, spread, jitter and
    goodput look at; ``job_ttl_s``: idle seconds before a job leaves the registry; ``smoothing``: EWMA
    weight of a new step in the per-rank busy time that ranks the slowest; ``margin``: how much slower
    (relative) a rank must be to displace an exported slow rank (hysteresis); ``point_hold_s``: how long a
    point alert (regression, recovery) counts as firing."""

    def __init__(self, registry=None, *, top_k: int = 5, window_steps: int = 256, job_ttl_s: float = 600.0,
                 smoothing: float = 0.2, margin: float = 0.03, point_hold_s: float = 900.0,
                 max_jobs: int = 500, clock=time.monotonic):
        if top_k < 0 or window_steps < JITTER_NEIGHBOURS or job_ttl_s <= 0 or not 0 < smoothing <= 1:
            raise ValueError("jobmetrics: need top_k >= 0, window_steps >= 21, job_ttl_s > 0, 0 < smoothing <= 1")
        if max_jobs < 0:
            raise ValueError(f"jobmetrics: max_jobs must be >= 0, not {max_jobs!r}")
        self.max_jobs = int(max_jobs)      # jobs exported per scrape (see the module docs)
        self.top_k, self.window = int(top_k), int(window_steps)
        self.job_ttl_s, self.smoothing, self.point_hold_s = float(job_ttl_s), float(smoothing), float(point_hold_s)
        self.margin = float(margin)
        self.warmup = int(np.ceil(2 / self.smoothing))     # steps before slow ranks are exported
        self.clock = clock
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    # ------------------------------------------------------------------ feeding
    def _get(self, job: str) -> _Job:
        j = self._jobs.get(job)
        if j is None:
            j = self._jobs[job] = _Job(job, self.window)
        j.touched = self.clock()
        j.snapshot = None
        return j

    def on_block(self, ctx, block) -> None:
        """One closed block of steps of ``ctx.job`` (``detectors.base.StepBlock``)."""
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2:
            return
        step = block.step_ms
        busy = block.busy_ms
        with np.errstate(invalid="ignore", divide="ignore"):
            med = nanmedian(step, axis=1)                                    # (S,) job step time, ms
            bmed = nanmedian(busy, axis=1)
            bmax = np.nanmax(np.where(np.isfinite(busy), busy, -np.inf), axis=1)
            spread = np.where((bmed > 0) & np.isfinite(bmax), (bmax - bmed) / bmed, np.nan)
        reporting = np.isfinite(step[-1]).sum()
        with self._lock:
            j = self._get(ctx.job)
            ok = np.isfinite(med)
            for v, sp in zip(med[ok] / 1e3, spread[ok]):                     # O(S) scalars into the rings
                j.step_s[j.pos], j.spread[j.pos] = v, sp
                j.pos = (j.pos + 1) % self.window
                j.n = min(j.n + 1, self.window)
            j.count += int(ok.sum())
            j.sum_s += float(np.sum(med[ok])) / 1e3
            j.ranks_reporting = int(reporting)
            j.world_size = int(getattr(ctx, "world_size", 0) or step.shape[1])
            j.last_step = max(j.last_step, int(block.steps[-1]))
            j.last_t = max(j.last_t, float(block.t_end[-1]) / 1e9)
            j.nodes = np.asarray(ctx.nodes, dtype=object)
            R = step.shape[1]
            if j.ewma is None or len(j.ewma) != R:
                old, j.ewma = j.ewma, np.full(R, np.nan)
                if old is not None:
                    j.ewma[:min(R, len(old))] = old[:min(R, len(old))]
            a = self.smoothing
            for row in busy:                                                 # S vectorised (R,) updates
                fin = np.isfinite(row)
                new = np.where(np.isnan(j.ewma), row, (1 - a) * j.ewma + a * row)
                j.ewma = np.where(fin, new, j.ewma)
            if j.count >= self.warmup:                 # first let the smoothing settle (no churn from step 0)
                j.top = self._slowest(j.ewma, j.top)

    def _slowest(self, ewma: np.ndarray, top: np.ndarray) -> np.ndarray:
        """The ranks to export as the slowest: the top ``top_k`` by smoothed busy time, with hysteresis
        so that healthy ranks a hair apart do not churn series: an exported rank stays until a rank
        more than ``margin`` slower displaces it (or it stops reporting). O(R) per block (one
        argpartition of the ranks)."""
        k = min(self.top_k, int(np.isfinite(ewma).sum()))
        if k == 0:
            return np.empty(0, dtype=np.int64)
        if len(top) == k and np.isfinite(ewma[top]).all():
            thr = float(ewma[top].min()) * (1 + self.margin)     # fast path: nobody outside is that slow
            with np.errstate(invalid="ignore"):
                if int(np.count_nonzero(ewma > thr)) == int(np.count_nonzero(ewma[top] > thr)):
                    return top
        e = np.where(np.isfinite(ewma), ewma, -np.inf)
        cand = np.argpartition(-e, k - 1)[:k] if k < len(e) else np.arange(len(e))
        cand = cand[np.argsort(-e[cand], kind="stable")]
        keep = [int(r) for r in top if r < len(e) and np.isfinite(e[r])]
        for c in cand.tolist():
            if c in keep:
                continue
            if len(keep) < k:
                keep.append(c)
                continue
            weakest = min(keep, key=lambda r: e[r])
            if e[c] > e[weakest] * (1 + self.margin):
                keep[keep.index(weakest)] = c
            else:
                break                                   # candidates only get smaller from here
        return np.asarray(keep[:k], dtype=np.int64)

    def on_rows(self, table: str, t: pa.Table) -> None:
        """Rows the processor buffers for the store; ``efficiency`` and ``comm_bw`` are used."""
        if table not in ("efficiency", "comm_bw") or t.num_rows == 0:
            return
        jobs = t.column("job").to_numpy(zero_copy_only=False)
        for job in np.unique(jobs):
            sel = jobs == job
            part = t.filter(pa.array(sel))
            if table == "efficiency":
                self._efficiency(str(job), part)
            else:
                self._comm_bw(str(job), part)

    def _efficiency(self, job: str, t: pa.Table) -> None:
        mfu = t.column("mfu").to_numpy(zero_copy_only=False).astype(np.float64)
        wall = t.column("wall_ms").to_numpy(zero_copy_only=False).astype(np.float64)
        prod = t.column("productive_ms").to_numpy(zero_copy_only=False).astype(np.float64)
        ok = np.isfinite(wall) & np.isfinite(prod) & (wall > 0)
        tok = t.column("tokens").to_numpy(zero_copy_only=False).astype(np.float64)
        smp = t.column("samples").to_numpy(zero_copy_only=False).astype(np.float64)
        with self._lock:
            j = self._get(job)
            if np.isfinite(tok).any():
                j.tokens = (j.tokens or 0.0) + float(np.nansum(tok))
            if np.isfinite(smp).any():
                j.samples = (j.samples or 0.0) + float(np.nansum(smp))
            fin = np.flatnonzero(np.isfinite(mfu))
            if len(fin):
                j.mfu = float(mfu[fin[-1]])
            for w, p in zip(wall[ok][-self.window:], prod[ok][-self.window:]):
                i = j.eff_n % self.window
                j.wall[i], j.prod[i] = w, p
                j.eff_n += 1

    def _comm_bw(self, job: str, t: pa.Table) -> None:
        # the newest analysis window only: rows with the largest step_hi
        hi = t.column("step_hi").to_numpy()
        newest = hi == hi.max()
        ops = t.column("op").to_numpy(zero_copy_only=False)[newest]
        bus = t.column("busbw_gbps").to_numpy(zero_copy_only=False).astype(np.float64)[newest]
        util = t.column("util").to_numpy(zero_copy_only=False).astype(np.float64)[newest]
        with self._lock:
            j = self._get(job)
            for op in np.unique(ops):
                if str(op) not in j.bw and len(j.bw) >= MAX_OPS:
                    continue
                m = ops == op
                b, u = bus[m], util[m]
                j.bw[str(op)] = (float(nanmedian(b)) * 1e9 if np.isfinite(b).any() else np.nan,
                                 float(np.nanmin(u)) if np.isfinite(u).any() else np.nan)

    def on_alert(self, alert) -> None:
        """An alert, firing or resolved (``detectors.base.Alert``)."""
        kind, cause = str(alert.kind), str(alert.cause or "unknown")
        with self._lock:
            j = self._get(alert.job)
            j.combos.add((kind, cause))
            if alert.status == "resolved":
                j.alerts.pop(alert.alert_id, None)
            else:
                hold = self.clock() + self.point_hold_s if kind in POINT_KINDS else None
                j.alerts[alert.alert_id] = (kind, cause, hold)

    def forget(self, job: str) -> None:
        with self._lock:
            self._jobs.pop(job, None)

    def jobs(self) -> list[str]:
        with self._lock:
            self._expire()
            return sorted(self._jobs)

    # ------------------------------------------------------------------ collecting
    def _expire(self) -> None:
        now = self.clock()
        for job in [k for k, j in self._jobs.items() if now - j.touched > self.job_ttl_s]:
            del self._jobs[job]

    def _values(self, j: _Job) -> dict:
        """The job's exported values (cached until the job changes)."""
        if j.snapshot is not None:
            return j.snapshot
        v: dict = {}
        if j.n:
            order = (np.arange(j.pos - j.n, j.pos)) % self.window             # oldest .. newest
            st = j.step_s[order]
            v["quantiles"] = [(q, float(np.quantile(st, q))) for q in QUANTILES]
            v["spread"] = float(nanmedian(j.spread[order]))
            if j.n >= 2:
                k = min(JITTER_NEIGHBOURS, j.n)
                padded = np.concatenate([np.full(k - 1, np.nan), st])
                win = np.lib.stride_tricks.sliding_window_view(padded, k)    # (n, k): up to each step
                local = nanmedian(win, axis=1)
                v["jitter"] = float(np.mean(st > JITTER_SLOW * local))
        if j.eff_n:
            n = min(j.eff_n, self.window)
            w = float(np.sum(j.wall[:n]))
            v["goodput"] = float(np.sum(j.prod[:n]) / w) if w > 0 else np.nan
        if j.ewma is not None and len(j.top):
            idx = j.top[np.argsort(-j.ewma[j.top], kind="stable")]
            v["slowest"] = [(int(r), str(j.nodes[r]) if r < len(j.nodes) else "", float(j.ewma[r]) / 1e3)
                            for r in idx]
        j.snapshot = v
        return v

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
        P = "stepwatch_job_"
        fams = {
            "step": Metric(P + "step_duration_seconds",
                           "Job step time (median over the ranks of each step): quantiles over the last "
                           "closed steps (1 = max), sum and count over the processor's lifetime", "summary"),
            "tokens": CounterMetricFamily(P + "tokens", "Tokens trained (global: replication over tp/pp removed), "
                                          "rate() it for tokens/s", labels=["job"]),
            "samples": CounterMetricFamily(P + "samples", "Samples trained (global), rate() it for samples/s",
                                           labels=["job"]),
            "spread": GaugeMetricFamily(P + "busy_spread_ratio", "Median over recent steps of (max - median) / "
                                        "median of the ranks' busy time", labels=["job"]),
            "jitter": GaugeMetricFamily(P + "jitter_ratio", "Share of recent steps slower than 1.1x the median "
                                        "of the 21 steps up to them", labels=["job"]),
            "mfu": GaugeMetricFamily(P + "mfu_ratio", "Model FLOPs utilisation of the newest step that has one",
                                     labels=["job"]),
            "goodput": GaugeMetricFamily(P + "goodput_ratio", "Productive share of the wall time over recent steps",
                                         labels=["job"]),
            "ranks": GaugeMetricFamily(P + "ranks_reporting", "Ranks that reported the newest closed step",
                                       labels=["job"]),
            "world": GaugeMetricFamily(P + "world_size", "Ranks in the job's topology", labels=["job"]),
            "last": GaugeMetricFamily(P + "last_step", "Newest closed step number", labels=["job"]),
            "last_t": GaugeMetricFamily(P + "last_step_timestamp_seconds",
                                        "End of the newest closed step (event time, Unix seconds)", labels=["job"]),
            "bw": GaugeMetricFamily(P + "bus_bandwidth_bytes_per_second", "Achieved bus bandwidth per collective "
                                    "kind (nccl-tests convention), median over its groups", labels=["job", "op"]),
            "bw_ratio": GaugeMetricFamily(P + "bus_bandwidth_peak_ratio", "Per collective kind, the worst group's "
                                          "bus bandwidth over its link's peak", labels=["job", "op"]),
            "alerts": GaugeMetricFamily(P + "alerts_firing", "Open alerts by kind and cause",
                                        labels=["job", "kind", "cause"]),
            "slow": GaugeMetricFamily(P + "slowest_rank_busy_seconds", "Busy time per step of the job's slowest "
                                      "ranks (top k, smoothed over steps)", labels=["job", "rank", "node"]),
        }
        with self._lock:
            self._expire()
            now = self.clock()
            chosen = self._jobs.items()
            if len(self._jobs) > self.max_jobs:          # the most open alerts, then the most recent
                chosen = heapq.nlargest(self.max_jobs, chosen, key=lambda kv: (len(kv[1].alerts), kv[1].touched))
            for name, j in sorted(chosen):
                job = bounded_label(name)
                v = self._values(j)
                if "quantiles" in v:
                    for q, x in v["quantiles"]:
                        fams["step"].add_sample(P + "step_duration_seconds", {"job": job, "quantile": _q(q)}, x)
                    fams["step"].add_sample(P + "step_duration_seconds_sum", {"job": job}, j.sum_s)
                    fams["step"].add_sample(P + "step_duration_seconds_count", {"job": job}, float(j.count))
                    fams["spread"].add_metric([job], v["spread"])
                    if "jitter" in v:
                        fams["jitter"].add_metric([job], v["jitter"])
                    fams["ranks"].add_metric([job], j.ranks_reporting)
                    fams["world"].add_metric([job], j.world_size)
                    fams["last"].add_metric([job], j.last_step)
                    fams["last_t"].add_metric([job], j.last_t)
                if j.tokens is not None:
                    fams["tokens"].add_metric([job], j.tokens)
                if j.samples is not None:
                    fams["samples"].add_metric([job], j.samples)
                if np.isfinite(j.mfu):
                    fams["mfu"].add_metric([job], j.mfu)
                if "goodput" in v and np.isfinite(v["goodput"]):
                    fams["goodput"].add_metric([job], v["goodput"])
                for op, (b, u) in sorted(j.bw.items()):
                    fams["bw"].add_metric([job, bounded_label(op)], b)
                    fams["bw_ratio"].add_metric([job, bounded_label(op)], u)
                firing: dict[tuple[str, str], int] = dict.fromkeys(j.combos, 0)
                for aid, (kind, cause, hold) in list(j.alerts.items()):
                    if hold is not None and now > hold:
                        del j.alerts[aid]
                        continue
                    firing[(kind, cause)] = firing.get((kind, cause), 0) + 1
                for (kind, cause), n in sorted(firing.items()):
                    fams["alerts"].add_metric([job, bounded_label(kind), bounded_label(cause)], n)
                for rank, node, sec in v.get("slowest", ()):
                    fams["slow"].add_metric([job, str(rank), bounded_label(node)], sec)
            njobs, left_out = len(chosen), len(self._jobs) - len(chosen)
        yield from fams.values()
        yield GaugeMetricFamily("stepwatch_job_metrics_jobs", "Jobs whose metrics this scrape exports", njobs)
        yield GaugeMetricFamily("stepwatch_job_metrics_jobs_left_out",
                                "Jobs with metrics left out of this scrape (over the job metrics' max_jobs)",
                                left_out)


def _q(q: float) -> str:
    return "1" if q == 1.0 else repr(q)


def add_args(p) -> None:
    """``stepwatch process`` flags of the per-job metrics."""
    g = p.add_argument_group("per-job Prometheus metrics (served with --metrics-port)")
    g.add_argument("--job-metrics-top-k", type=int, default=5, metavar="K",
                   help="slowest ranks exported per job (rank and node labels; 0: none)")
    g.add_argument("--job-metrics-ttl", type=float, default=600.0, metavar="S",
                   help="seconds without data after which a job's series leave the registry")
    g.add_argument("--job-metrics-max-jobs", type=int, default=500, metavar="N",
                   help="jobs exported per scrape: the most open alerts first, then the most recently active "
                        "(the rest are counted in stepwatch_job_metrics_jobs_left_out)")


def configure_from_args(jm: JobMetrics | None, a) -> None:
    if jm is None:
        return
    if a.job_metrics_top_k < 0 or a.job_metrics_ttl <= 0:
        raise SystemExit("stepwatch process: --job-metrics-top-k must be >= 0 and --job-metrics-ttl > 0")
    if a.job_metrics_max_jobs < 0:
        raise SystemExit(f"stepwatch process: --job-metrics-max-jobs must be >= 0, not {a.job_metrics_max_jobs}")
    jm.top_k, jm.job_ttl_s = int(a.job_metrics_top_k), float(a.job_metrics_ttl)
    jm.max_jobs = int(a.job_metrics_max_jobs)

"""The ``comm_bw`` detector (:class:`CommBandwidth`): achieved bus bandwidth per (collective kind, group)
against the link's peak, stored in ``comm_bw``; diagnoses ``comm_small_messages``, ``comm_slow_link``,
``comm_sync_bound``."""
from __future__ import annotations

from collections import deque

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepwatch.agents.probe.collectives import device_family

from .steady import SteadyGate
from .base import Alert, Detector, JobContext, StepBlock
from . import settings
from .settings import Setting
from .busbw import comm_analysis
from .causes import SUGGESTIONS
from .commagg import _CommAggregate
from .effcommon import _Episodes, _pending_add, _r

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
      the evidence lists the ranks that wait least. A job sync-bound from its steady state on (the way its
      ranks' noise makes them wait: two ranks on a busy host) is so by nature: its ``comm_bw`` rows say
      ``sync-bound``, no alert; only an episode after ``clear`` evaluations without it is alerted.

    A window comes due when its step closes, and is analysed once its comm rows are in (Kafka orders
    nothing across topics: the processor handles a poll's steps before its comm rows, and a fast job's
    steps close long before them): at once when the job's newest comm step is at least the window's last
    step plus ``lag``, else when comm rows arrive (:meth:`on_context`) or event time moves (:meth:`tick`);
    a window whose rows never come is dropped when its steps leave the aggregate. Rows are written for
    any window with a step of comm rows; findings need ``min_steps`` of them. When every rank of the job
    has ended (:meth:`end`), the windows still due are analysed with what they have and the steps after
    the last window written get one last window (rows only): a job shorter than a window has its rows.

    Nothing is judged before the job's step time is steady (:mod:`~stepwatch.detectors.steady`): the
    analysis windows start at the stable stretch.

    Settings: :attr:`SETTINGS` (the list below is made from it).
    """

    name = "comm_bw"
    outputs = {"alerts": "alerts", "comm_bw": "comm_bw"}          # rows: drain_rows()["comm_bw"]

    SETTINGS = (
        Setting("window", 20, 1, 100000, "steps", "steps per analysis window (at least 2)", live=False),
        Setting("every", 10, 1, 100000, "steps", "analyse when the step number enters a new multiple of this"),
        Setting("lag", 2, 0, 1000, "steps", "newest steps left out (their comm rows may still be on the way)",
                live=False),
        Setting("min_steps", 8, 1, 100000, "steps", "steps of comm rows a window needs", live=False),
        Setting("small_div", 16.0, 1.0, None, "", "\"small\" = below the link's saturation size / this"),
        Setting("small_share", 0.5, 0.0, 1.0, "share", "share of calls that must be small"),
        Setting("min_calls", 4, 1, None, "calls", "calls per rank and step for small messages to matter"),
        Setting("min_comm_share", 0.1, 0.0, 1.0, "share of the step", "collectives' share of the step time for "
                "small-messages / sync-bound"),
        Setting("slow_ratio", 0.5, 0.0, 1.0, "x peers", "slow link: bus bandwidth below this x the peers' median"),
        Setting("min_peers", 3, 1, None, "groups", "peer groups needed to judge a slow link"),
        Setting("sync_share", 0.6, 0.0, 1.0, "share", "sync-bound: wait / time in collectives at least this"),
        Setting("sync_margin", 0.1, 0.0, 1.0, "share", "a job within this below sync_share is sync-bound by nature "
                "too (hysteresis)"),
        Setting("straggler_share", 0.1, 0.0, 1.0, "share of the ranks", "sync-bound is left to slow_rank when this "
                "few ranks explain the wait"),
        Setting("clear", 3, 1, 100000, "evaluations", "evaluations without the finding to resolve", live=False),
        Setting("link_gbps", None, unit="GB/s", meaning="peak bus bandwidth per link type, a table (overrides "
                "LINK_GBPS)", check=settings.table_of_positive),
        Setting("link", None, meaning="force one link type for every group", check=settings.short_name),
        Setting("max_pending", 8192, 1, 10_000_000, "rows", "comm_bw rows kept until the processor drains them",
                live=False),
        Setting("max_due", 64, 1, 1_000_000, "windows", "windows come due waiting for their comm rows (beyond: the "
                "oldest gives way)", live=False),
    )

    def __init__(self, **kw):
        self._bind(kw)
        self._eps = _Episodes(self.clear)
        self._steady = SteadyGate()               # nothing judged in the warm-up (detectors.steady)
        self._sync_native: bool | None = None     # sync-bound at the first steady evaluation: the job's own way
        self._sync_clear = 0                      # evaluations since without it
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
        self._due: deque = deque(maxlen=self.max_due)   # windows come due, waiting for their comm rows
        self._hi_done: int | None = None            # the newest window end with rows written
        self._ended = False                         # the job's end was seen (:meth:`end`)

    def new_baseline(self) -> None:
        """The job announced a change of its own (``probe.mark_change``): its sync-bound baseline starts
        again, after a fresh warm-up (what the job does when it is sync-bound is judged anew)."""
        self._steady.reset()
        self._sync_native = None

    def _derive(self) -> None:
        if self.window < 2 or self.every < 1 or self.lag < 0 or self.min_steps < 1 or self.clear < 1 or \
                self.min_peers < 1:
            raise ValueError("comm_bw: need window >= 2, every >= 1, lag >= 0, min_steps >= 1, clear >= 1, "
                             "min_peers >= 1")
        self.link_gbps = dict(self.settings["link_gbps"] or {})

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

    def prepare(self, ctx: JobContext) -> None:
        """A job whose layout is known before its first block (its topology): the aggregate over its comm
        window is made now, with the integer codes of its ranks' nodes that every analysis reads (at 100k
        ranks ~15 ms, paid by the first evaluation otherwise), while the window holds no rows yet (the
        first :meth:`_pull` then folds them all, as it would have)."""
        w, nodes = getattr(ctx, "comm", None), getattr(ctx, "nodes", None)
        if self._agg is not None or self._n or getattr(w, "_parts", None) is None or len(w._parts):
            return
        self._pull(ctx)                                  # (no rows: makes the aggregate only)
        if self._agg is not None:
            self._agg._node_codes(nodes)

    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2 or block.step_ms.shape[1] == 0:
            return []
        self._pull(ctx)
        if not self._steady.steady:
            self._steady.warm(block)
        med = block.step_median()
        for s in range(S):
            i = self._n % len(self._st)
            self._st[i], self._ms[i], self._te[i] = block.steps[s], med[s], block.t_end[s]
            self._n += 1
            b = int(block.steps[s]) // self.every
            if b != self._bucket:
                self._bucket = b
                self._come_due(int(block.steps[s]))
        return self._drain_due(ctx)

    def tick(self, ctx: JobContext, now_ns: int) -> list[Alert]:
        """Event time moved (host samples, the ranks' goodbyes): windows whose comm rows came since are
        analysed; once every rank of the job has ended, the rest (:meth:`end`)."""
        if not self._due and (self._ended or not _job_ended(ctx)):
            return []
        self._pull(ctx)
        out = self._drain_due(ctx)
        if not self._ended and _job_ended(ctx):
            out += self.end(ctx, wait=True)
        return out

    def on_context(self, ctx: JobContext, kind: str) -> list[Alert]:
        """Comm rows reached the job's window (Kafka orders nothing across topics: a poll's steps are
        handled before its comm rows, and a fast job's steps close long before): the windows that came
        due waiting for them are analysed now."""
        if kind != "comm":
            return []
        return self.tick(ctx, 0)

    def end(self, ctx: JobContext, wait: bool = False) -> list[Alert]:
        """The job ended: every window still due is analysed with the rows it has, and the steps after
        the last window written get a last window (``window`` steps up to the newest closed step, at
        least one step of comm rows; measured, not judged): a job shorter than a window, or whose
        last steps no window reached, has its rows. ``wait``: only once its comm rows have caught up
        with its steps (the newest comm step at least the newest closed step minus ``lag``). Once."""
        if self._ended or self._n == 0:
            return []
        self._pull(ctx)
        top = int(self._st.max())
        newest = getattr(getattr(ctx, "comm", None), "newest", None)
        if wait and newest is not None and newest < top - self.lag:
            return []
        self._ended = True
        out = self._drain_due(ctx, final=True)
        if self._hi_done is None or top > self._hi_done:
            w = self._window(top + self.lag, top)
            if w is not None:
                out += self._evaluate(ctx, *w, tail=True)
        return out

    def _window(self, step_now: int, hi: int | None = None) -> tuple | None:
        """The analysis window that comes due at ``step_now`` (``lag`` steps back unless ``hi``), from the
        ring of recent steps: (lo, hi, median step time, t_end of hi, its first step, step_now, t_end of the
        newest step, steps in it); None without a step in it."""
        hi = step_now - self.lag if hi is None else hi
        lo = hi - self.window + 1
        m = (self._st >= lo) & (self._st <= hi)
        n = int(m.sum())
        if not n:
            return None
        step_ms = float(np.nanmedian(self._ms[m])) if np.isfinite(self._ms[m]).any() else float("nan")
        t_hi = int(self._te[m][np.argmax(self._st[m])])
        t_now = int(self._te[(self._n - 1) % len(self._st)])
        return lo, hi, step_ms, t_hi, int(self._st[m].min()), step_now, t_now, n

    def _come_due(self, step_now: int) -> None:
        w = self._window(step_now)
        if w is not None and w[-1] >= self.min_steps:
            self._due.append(w)

    def _drain_due(self, ctx: JobContext, final: bool = False) -> list[Alert]:
        """Analyse the windows due, oldest first, once their comm rows are in: the job's newest comm step
        is at least the window's last step plus ``lag`` (as when the window came due with its rows on
        time), or the window's first steps are leaving the aggregate, or ``final``. A window waits
        otherwise (at most ``max_due`` of them: the oldest gives way)."""
        out: list[Alert] = []
        if not self._due:
            return out
        newest = getattr(getattr(ctx, "comm", None), "newest", None)
        agg = self._agg
        floor = agg.newest - agg.W if agg is not None and agg.newest is not None else None
        while self._due:
            w = self._due[0]
            if not (final or newest is None or newest >= w[1] + self.lag or floor is not None and w[0] <= floor):
                break
            self._due.popleft()
            if getattr(ctx, "comm", None) is not None and len(ctx.comm):
                out += self._evaluate(ctx, *w)
        return out

    def _evaluate(self, ctx: JobContext, lo: int, hi: int, step_ms: float, t_hi: int, step_first: int,
                  step_now: int, t_now: int, n_steps: int, tail: bool = False) -> list[Alert]:
        # its rows are measured always; findings are judged only past the warm-up (no evidence before),
        # over at least ``min_steps`` steps of comm rows, and never on the last window of an ended job
        t = None
        if self._agg is None:
            t = ctx.comm.select(lo, hi)
            if t is None:
                return []
        fam = device_family((ctx.info or {}).get("device_type"))
        if self._agg is not None:
            res = self._agg.analyse(lo, hi, ctx.nodes, fam, step_ms, self.link_gbps, self.link)
        else:
            res = comm_analysis(t, ctx.nodes, fam, step_ms, self.link_gbps, self.link)
        if not res or res.get("steps", 0) < 1:
            return []
        judge = (not tail and self._steady.steady and lo >= self._steady.start
                 and res["steps"] >= self.min_steps)
        g = res.get("groups")
        present: set = set()
        alerts: list[Alert] = []
        diag = np.full(len(g["op"]) if g else 0, None, dtype=object)
        comm_share = res.get("comm_share") or 0.0
        if g:
            # small messages (job-wide)
            small = g["bytes_per_call"] < g["saturate_bytes"] / self.small_div
            calls = g["calls"]
            share = float(calls[small].sum() / calls.sum()) if calls.sum() > 0 else 0.0
            cps = float(calls.sum() / max(res["ranks"] * res["steps"], 1))
            if judge and share >= self.small_share and cps >= self.min_calls and comm_share >= self.min_comm_share:
                diag[small] = "small-messages"
                present.add("small")
                alerts += self._eps.seen("small", lambda: self._small_alert(ctx, g, res, small, share, cps,
                                                                           step_first, step_now, t_now))
            # slow link (per group, against peers of the same op, size, link and payload class)
            bus = g["busbw_gbps"]
            for idx, ref in _peer_medians(g, bus, self.min_peers):
                for j, r in zip(idx.tolist(), ref.tolist()):
                    if judge and r > 0 and bus[j] < self.slow_ratio * r:
                        diag[j] = "slow-link"
                        key = f"slow|{g['op'][j]}|{g['group'][j]}"
                        present.add(key)
                        alerts += self._eps.seen(key, lambda j=j, ref=r: self._slow_alert(
                            ctx, t, res, g, j, ref, step_ms, step_first, step_now, t_now))
        # sync-bound (job-wide), unless a few stragglers explain it (slow_rank names them)
        sync = False
        ws = res.get("wait_share")
        if ws is not None and len(res["rank_wait"][1]):
            # only the wait above each step's least one is waiting for a peer: what every rank waits on
            # a step is the collective's own latency (a clean 2-rank gloo job on a busy host: ~7 ms on
            # both ranks, every step), which a sync-bound diagnosis must not count
            mw = float(np.mean(res["rank_wait"][1]))
            ws = ws * max(0.0, 1.0 - res.get("floor_wait", 0.0) / mw) if mw > 0 else ws
        if judge and ws is not None and ws >= self.sync_share and comm_share >= self.min_comm_share:
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
                sync = True
                if self._sync_native is None:
                    self._sync_native = True             # so from its steady state on: the job's own way
                self._sync_clear = 0
                if not self._sync_native:
                    present.add("sync")
                    alerts += self._eps.seen("sync", lambda: self._sync_alert(ctx, res, ranks, wait, ws,
                                                                             comm_share, step_first, step_now,
                                                                             t_now))
        if judge and not sync and ws is not None:
            # hysteresis: a wait share within ``sync_margin`` below the threshold is the same nature (a clean
            # 128-rank job with heavy-tailed, autocorrelated noise wandered 0.5-0.6 and crossed it at 0.601:
            # a false episode in a random sweep); only a job that was clearly not sync-bound can begin one
            near = ws >= self.sync_share - self.sync_margin and comm_share >= self.min_comm_share
            if self._sync_native is None:
                self._sync_native = near                 # not sync-bound (nor nearly) when first judged
            elif self._sync_native:
                self._sync_clear = 0 if near else self._sync_clear + 1
                if self._sync_clear >= self._eps.clear:
                    self._sync_native = False            # it went away: a later episode is a change
        if g:
            k = len(g["op"])
            self._hi_done = hi if self._hi_done is None else max(self._hi_done, hi)
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
        if not judge:
            return []
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


def _job_ended(ctx) -> bool:
    """Every rank of the job has ended (its goodbye, or the agent saw it go), or its end was judged."""
    life = getattr(ctx, "life", None)
    if life is None:
        return False
    if life.outcome is not None:
        return True
    return bool(life.first) and len(life.first) >= max(int(getattr(ctx, "world_size", 0) or 0), 1)


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

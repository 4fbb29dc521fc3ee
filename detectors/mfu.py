"""The ``mfu`` detector (:class:`Mfu`): per closed step the model FLOPs, MFU and goodput, stored in the
``efficiency`` table; a change point on the work-normalised step time alerts ``mfu_regression``. Device
peaks come from ``agents/probe/collectives.py`` (:func:`peak_tflops`), overridable by a user table
(:func:`load_peak_table`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from stepwatch.agents.probe.collectives import norm_dtype, peak_tflops

from . import settings
from .base import Alert, Detector, JobContext, StepBlock
from .settings import Setting
from .causes import nanmedian
from .effcommon import _pending_add

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


def model_flops_per_token(info: dict) -> tuple[float | None, str | None]:
    """(whole-model training FLOPs per token, its source): ``model_flops_per_token`` from the topology
    with the probe's ``flops_source`` (``user``, ``counted`` or ``analytic``: agents/probe/flops.py; a
    figure without a source was given by the user), else 6 x parameters (``params``: dense transformer,
    forward + backward, no attention term) with parameters = the ranks' mean ``model_params`` (each
    rank's share) x tp x pp; (None, None) without either."""
    f = info.get("model_flops_per_token")
    if f and f > 0:
        return float(f), _source(info)
    p = info.get("model_params")
    if p and p > 0:
        n = float(p) * int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)
        return 6.0 * n, "params"
    return None, None


def _source(info: dict) -> str:
    s = info.get("flops_source")
    return s if s in ("user", "counted", "analytic") else "user"



# --------------------------------------------------------------------------- MFU and goodput

class Mfu(Detector):
    """MFU and goodput per closed step (``efficiency`` rows) and MFU regressions (``mfu_regression``).

    Per step: ``step_ms`` = median over the ranks; ``devices`` = ranks that reported tokens (samples);
    global ``tokens`` = sum of the ranks' tokens / (tp x pp) (every rank of a tensor- or pipeline-parallel
    group reports the tokens of the micro-batches it works on; context-parallel ranks are taken to report
    their own shard of the sequence); ``model_flops`` = FLOPs per token x global tokens, FLOPs per token
    from the topology's ``model_flops_per_token`` (the user's, counted with ``FlopCounterMode`` or the
    analytic ``6N + 12 L H Q T``: agents/probe/flops.py) or 6 x parameters (dense transformers; parameters =
    mean of the ranks' ``model_params`` x tp x pp; FSDP/ZeRO-3 jobs count only a shard per rank and must
    give ``model_flops_per_token``); without tokens, ``model_flops_per_sample`` x global samples. The
    row's ``flops_source`` says which (``user``, ``counted``, ``analytic``, ``params``) and ``dtype`` whose
    peak was used.
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

    Settings: :attr:`SETTINGS` (the list below is made from it).
    """

    name = "mfu"
    outputs = {"alerts": "alerts", "efficiency": "efficiency"}    # rows: drain_rows()["efficiency"]

    SETTINGS = (
        Setting("peak_tflops", None, unit="TFLOPS", meaning="peak override: a number (all devices), a table or "
                "a JSON/YAML file path (unset: $STEPWATCH_PEAK_TFLOPS, then the built-in table)",
                check=settings.peak_tflops),
        Setting("baseline", 21, 1, 100000, "steps", "steps in the goodput baseline median", live=False),
        Setting("slow", 1.1, 1.0, None, "x baseline", "a step slower than this x the baseline is anomalous "
                "(excess not productive; above 1)"),
        Setting("min_effect", 0.05, 0.0, 10.0, "share", "minimum relative MFU change to alert"),
        Setting("min_t", 5.0, 0.0, None, "standard errors", "minimum shift in standard errors"),
        Setting("window", 200, 10, 100000, "steps", "steps kept for the change-point search", live=False),
        Setting("critical_pct", 10.0, 0.0, 100.0, "%", "MFU drops costing more are ``critical``"),
        Setting("max_pending", 8192, 1, 10_000_000, "rows", "efficiency rows kept until the processor drains "
                "them", live=False),
    )

    def __init__(self, **kw):
        self._bind(kw)
        self._hist = np.full(self.baseline, np.nan)      # previous step medians (goodput baseline)
        self._nh = 0
        self._last_t = None
        self._flops_ref = None                           # model FLOPs per device of the first MFU step
        self._mfu = np.full(self.window + 8, np.nan)     # recent MFU by step (evidence)
        self._mfu_step = np.full(self.window + 8, -1, dtype=np.int64)
        self._pending: list[pa.Table] = []
        self.peak_source = ""

    def _derive(self) -> None:
        from .changepoint import ChangePoint
        if self.baseline < 1 or self.slow <= 1.0 or self.max_pending < 1:
            raise ValueError("mfu: need baseline >= 1, slow > 1, max_pending >= 1")
        src = self.peak_tflops if self.peak_tflops is not None else os.environ.get("STEPWATCH_PEAK_TFLOPS")
        self.table = load_peak_table(src)
        cp = dict(window=self.window, min_effect=self.min_effect, min_t=self.min_t, critical_pct=self.critical_pct,
                  phases=False)     # the MFU series' change points: retuned with these settings, state kept
        self._cp = settings.retune(self._cp, cp) if hasattr(self, "_cp") else ChangePoint(**cp)

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
        fpt, src = model_flops_per_token(info)
        flops = np.full(S, np.nan)
        source = np.full(S, src, dtype=object)
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
                source = np.where(use, _source(info), source)
                if block.tokens is None:
                    devices = np.where(block.samples_ranks > 0, block.samples_ranks, devices)
        peak, self.peak_source = peak_tflops(info.get("device_type"), info.get("dtype"), self.table)
        source = np.where(np.isfinite(flops), source, None)
        return tokens, samples, flops, devices, peak, source

    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        S = len(block)
        if S == 0 or block.step_ms.ndim != 2 or block.step_ms.shape[1] == 0:
            return []
        med = block.step_median()
        tokens, samples, flops, devices, peak, source = self._per_step(ctx, block)
        dt = norm_dtype((ctx.info or {}).get("dtype"))
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
                "flops_source": pa.array(source[ok].tolist(), pa.string()),
                "dtype": pa.array([dt] * int(ok.sum()), pa.string()),
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
        if good.all():                            # the usual case: scaled where read (ChangePoint.update_scaled)
            found = self._cp.update_scaled(ctx, block, k)
        else:
            found = self._cp.update(ctx, StepBlock(block.steps[good], block.t_end[good],
                                                   *(getattr(block, f)[good] * k[good] for f in fields)))
        out = []
        for a in found:
            if a.kind != "regression":
                continue                          # an MFU rise is not alerted
            ev = dict(a.evidence)
            sb, sa = ev.get("segment_before"), ev.get("segment_after")
            mb, ma = self._mfu_between(*sb) if sb else None, self._mfu_between(*sa) if sa else None
            ev.update({"mfu_before": mb, "mfu_after": ma, "peak": self.peak_source,
                       "flops_source": model_flops_per_token(ctx.info or {})[1],
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

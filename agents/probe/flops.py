"""FLOPs per token (or sample) for MFU, and the compute dtype, told by the training process.

Where the MFU detector's FLOPs come from, best first; the hello says which (``flops_source``, stored in the
``topology`` and ``efficiency`` tables):

- ``user``: the user's own figure, ``probe.init(model_flops_per_token=...)`` / ``STEPWATCH_MODEL_FLOPS_PER_TOKEN``
  or :meth:`Flops.set_flops_per_token` (one call). It wins over the other two: a later count or shape keeps
  it (the counted figure is still returned).
- ``counted``: :meth:`Flops.count_flops` runs one real training step (forward, backward, optimizer) under
  ``torch.utils.flop_counter.FlopCounterMode`` once and divides by the step's tokens (samples). The
  counter counts the matrix products (mm, bmm, convolutions, attention); element-wise work (norms,
  activations, the optimizer's update) is not counted, as in every MFU figure. That step runs slower
  (the counter intercepts every op): it is a step of the run; its time is an outlier the goodput and
  change-point detectors already tolerate. Attention is counted as model FLOPs: torch's counter gives the
  fused SDPA kernels' backward with the recomputed scores (hardware FLOPs, 7/6 of the model's attention),
  here 2 x the forward as in PaLM; the CPU kernel, which torch's counter leaves out, gets torch's SDPA
  formula. Activation checkpointing's recomputed forwards are counted (the counter sees them run): give the
  figure (``set_flops_per_token``) or the shape for such jobs.
- ``analytic``: :meth:`Flops.set_model_shape` with the transformer's shape: ``6 N + 12 L H Q T`` per token
  (PaLM appendix B; nanoGPT's ``estimate_mfu``): N the parameters that take part in matrix products (those
  of ``nn.Embedding`` modules that no other module shares are left out: a lookup is no product; a token
  embedding tied to the output layer is kept), L layers, H heads, Q head size (H Q = hidden size), T the
  sequence length. The attention term is what 6 N leaves out: 17 % of the FLOPs of GPT-2-124M at 1,024
  tokens, most of them at 8k-128k tokens.
- ``params``: none of these: the detector's 6 x ``model_params`` (counted from the optimizer; dense
  transformers, no attention term).

The dtype the matrix products run in goes into the hello as ``dtype`` (which device peak applies) unless
the user gave one: the autocast dtype when autocast is on for the model's device at its forward, else the
parameters' dtype (fp32 on CUDA with ``torch.set_float32_matmul_precision("high"|"medium")``: ``tf32``).
It is looked at once: in the counted step, or at the first forward after the primary optimizer's first step
(:meth:`Flops.watch_dtype_once`; one global forward pre-hook that removes itself).

torch is reached only inside these functions, as the program loaded it (:func:`.torchref.loaded`: the probe
never imports torch itself).
"""
from __future__ import annotations

import sys

from .torchref import loaded

FLOPS_SOURCES = ("user", "counted", "analytic", "params")


def analytic_flops_per_token(params: float, layers: int, heads: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token of a dense decoder transformer: ``6 N + 12 L H Q T`` (forward + backward;
    Q = hidden / heads). ``params`` (N): parameters taking part in matrix products."""
    for k, v in (("params", params), ("layers", layers), ("heads", heads), ("hidden", hidden),
                 ("seq_len", seq_len)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"analytic_flops_per_token: {k} must be a positive number, got {v!r}")
    if hidden % heads:
        raise ValueError(f"analytic_flops_per_token: hidden ({hidden}) is not a multiple of heads ({heads})")
    q = hidden // heads
    return 6.0 * float(params) + 12.0 * layers * heads * q * seq_len


def matmul_params(model) -> int:
    """Parameters of ``model`` that take part in matrix products: all, less those owned only by
    ``nn.Embedding`` modules (a lookup; a token embedding tied to a Linear output layer stays)."""
    torch = loaded()
    emb, other = set(), set()
    for m in model.modules():
        target = emb if isinstance(m, torch.nn.Embedding) else other
        for p in m.parameters(recurse=False):
            target.add(id(p))
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in emb and id(p) not in other:
            continue
        n += int(p.numel())
    return n


#: the fused attention kernels F.scaled_dot_product_attention dispatches to, (forward, backward); layout
#: (batch, heads, sequence, head size)
_SDPA_OPS = (("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"),
             ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
             ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"),
             ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"))


def _model_flops_mapping() -> dict:
    """``FlopCounterMode(custom_mapping=...)`` for model FLOPs of attention: torch counts the fused kernels'
    backward with the recomputed scores (5 products for the forward's 2: hardware FLOPs); MFU counts the
    model's (PaLM: backward = 2 x forward), so every SDPA backward counts 2 x its forward here, and the CPU
    kernel, for which torch has no formula, gets torch's forward formula."""
    torch = loaded()
    fc = loaded("torch.utils.flop_counter")

    def fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query_shape, key_shape, value_shape)

    def bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * fc.sdpa_flop_count(query_shape, key_shape, value_shape)

    out = {}
    for f, b in _SDPA_OPS:
        fop, bop = getattr(torch.ops.aten, f, None), getattr(torch.ops.aten, b, None)
        if fop is not None and fop not in fc.flop_registry:
            out[fop] = fwd
        if bop is not None:
            out[bop] = bwd
    return out


def count_step_flops(fn, *args, **kwargs) -> tuple[int, object]:
    """``fn(*args, **kwargs)`` run once under ``FlopCounterMode`` (model FLOPs of attention, see
    :func:`_model_flops_mapping`): (FLOPs counted, fn's result)."""
    FlopCounterMode = loaded("torch.utils.flop_counter").FlopCounterMode
    with FlopCounterMode(display=False, custom_mapping=_model_flops_mapping()) as fc:
        out = fn(*args, **kwargs)
    return int(fc.get_total_flops()), out


def compute_dtype(module) -> str | None:
    """The dtype ``module``'s matrix products run in now: autocast's where it is on for the module's device,
    else its parameters' (fp32 on CUDA with TF32 matmuls allowed: ``tf32``); None without parameters."""
    torch = loaded()
    p = next(iter(module.parameters()), None)
    if p is None:
        return None
    dev = p.device.type
    try:
        if torch.is_autocast_enabled(dev):
            return _short(torch.get_autocast_dtype(dev))
    except (RuntimeError, TypeError):               # a device type autocast does not know
        pass
    if p.dtype == torch.float32 and dev == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return _short(p.dtype)


def _short(dtype) -> str:
    s = str(dtype).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}.get(
        s, "fp8" if s.startswith("float8") else s)


class _DtypeWatch:
    """A global forward pre-hook that records the compute dtype at the first forward (into ``flops``, a
    :class:`Flops`, when given), then removes itself."""

    def __init__(self, flops: "Flops | None"):
        torch = loaded()
        self.flops = flops
        self.seen: str | None = None
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self)

    def __call__(self, module, inputs):
        if self.handle is None or next(iter(module.parameters()), None) is None:
            return None
        self.remove()
        try:
            self.seen = compute_dtype(module)
        except Exception:  # noqa: BLE001 - telemetry never fails a forward
            return None
        if self.seen and self.flops is not None:
            self.flops.set_dtype_seen(self.seen)
        return None

    def remove(self):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class Flops:
    """The probe's FLOPs figure and compute dtype (a part :class:`~stepwatch.agents.probe.core.Probe` composes;
    the probe's ``set_flops_per_token``, ``count_flops`` and ``set_model_shape`` call it, after ``init``).

    ``extra``: the probe's hello fields (its topology), where the figure, its source and the dtype go;
    ``hello_changed``: called after each change (the hello is rebuilt and sent again)."""

    def __init__(self, extra: dict, hello_changed):
        self.extra = extra
        self.hello_changed = hello_changed
        self.counted_flops: int | None = None      # the last count_flops figure (whatever source won)
        self._dtype_watch: _DtypeWatch | None = None

    def watch_dtype_once(self) -> None:
        """At the next forward of a module with parameters, put its compute dtype into the hello (unless the
        user gave ``dtype``). Called once, at the primary optimizer's first step."""
        if "dtype" in self.extra or sys.modules.get("torch") is None or self._dtype_watch:
            return
        try:
            self._dtype_watch = _DtypeWatch(self)
        except Exception:  # noqa: BLE001
            self._dtype_watch = None

    def set_flops_per_token(self, flops: float, *, per: str = "token") -> None:
        """The user's own training FLOPs per token (``per="sample"``: per sample) of the whole model: wins
        over a count and a shape."""
        key = _key(per)
        if not isinstance(flops, (int, float)) or isinstance(flops, bool) or not 0 < flops < 1e30:
            raise ValueError(f"set_flops_per_token: flops must be a positive number below 1e30, got {flops!r}")
        self._set_flops(key, float(flops), "user")

    def count_flops(self, step_fn, *args, tokens: int | None = None, samples: int | None = None, **kwargs):
        """Run ``step_fn(*args, **kwargs)`` (one real training step: forward, backward, optimizer) once under
        ``FlopCounterMode``; FLOPs / ``tokens`` (else / ``samples``) of that step become the job's FLOPs per
        token (sample), source ``counted``, and the dtype seen at the model's forward its ``dtype``, unless
        the user gave them. Returns ``step_fn``'s result; the count is in ``probe.counted_flops``."""
        if tokens is None and samples is None:
            raise ValueError("count_flops: give tokens= or samples= (the step's global batch on this rank)")
        n = tokens if tokens is not None else samples
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"count_flops: {'tokens' if tokens is not None else 'samples'} must be a positive "
                             f"integer, got {n!r}")
        watch = _DtypeWatch(None) if "dtype" not in self.extra else None
        try:
            flops, out = count_step_flops(step_fn, *args, **kwargs)
        finally:
            if watch is not None:
                watch.remove()
        self.counted_flops = flops
        if watch is not None and watch.seen:
            self.set_dtype_seen(watch.seen)
        if flops > 0:
            self._set_flops("model_flops_per_token" if tokens is not None else "model_flops_per_sample",
                            flops / n, "counted")
        return out

    def set_model_shape(self, *, layers: int, heads: int, hidden: int, seq_len: int, model=None,
                        params: float | None = None) -> float:
        """The analytic FLOPs per token ``6 N + 12 L H Q T`` (source ``analytic``; see the module). N:
        ``params`` (the whole model's, under tensor/pipeline parallelism too), else counted from ``model``
        (:func:`matmul_params`). Returns the figure."""
        if params is None:
            if model is None:
                raise ValueError("set_model_shape: give model= or params=")
            params = matmul_params(model)
        f = analytic_flops_per_token(params, layers, heads, hidden, seq_len)
        self._set_flops("model_flops_per_token", f, "analytic")
        return f

    # ---- internals
    def _set_flops(self, key: str, value: float, source: str) -> None:
        rank = FLOPS_SOURCES.index
        cur = self.extra.get("flops_source")
        if cur is None and ("model_flops_per_token" in self.extra or "model_flops_per_sample" in self.extra):
            cur = "user"                                   # given to init before this API existed
        if cur is not None and rank(cur) < rank(source):
            return                                         # a better source stays
        for k in ("model_flops_per_token", "model_flops_per_sample"):
            self.extra.pop(k, None)
        self.extra[key] = value
        self.extra["flops_source"] = source
        self.hello_changed()

    def set_dtype_seen(self, dtype: str) -> None:
        if "dtype" in self.extra:
            return
        self.extra["dtype"] = dtype
        self.hello_changed()


def _key(per: str) -> str:
    if per not in ("token", "sample"):
        raise ValueError(f"per must be 'token' or 'sample', got {per!r}")
    return f"model_flops_per_{per}"

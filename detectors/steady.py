"""Warm-up judged by the job's own data: when its step time has reached a steady state.

A job's first steps are no steady state: GPU clocks ramp, the caching allocator grows, ``torch.compile``
and autotuning run, DataLoader workers fill their queues, DDP rebuilds its buckets. How long that takes is
the job's, not a constant: a fixed 10-step warm-up read a GPU's 30-step ramp as a regression and its
end as a recovery. :class:`SteadyGate` watches the job's step time (the median over the ranks, as the
detectors that judge the job do) and says the job is **steady** once the medians of the last ``spans``
stretches of ``span`` steps agree: their spread is at most ``max(tol x level, z x the standard error of a
median difference)``, the standard error taken from the stretches' own spread (MAD). A job whose level
keeps moving is declared steady after ``max_steps`` steps all the same (it is then judged as it is:
a trend is not a warm-up forever).

The detectors that judge a job against its own past (``changepoint``, ``jitter``, ``mfu``, ``comm_bw``)
each hold a gate: they judge nothing before it opens, and the steps before the stable stretch
(:attr:`SteadyGate.start`) are no baseline. The gate starts over when the job announces a change of
its own (:func:`stepwatch.agents.probe.mark_change`: the processor gives those detectors fresh instances
at that step) or restarts.

Cost: O(ranks sampled) per step (one median) until the gate opens, then nothing. State: a ring of
``spans x span`` numbers.
"""
from __future__ import annotations

import math

import numpy as np

from .base import StepBlock
from .causes import nanmedian

#: the default gate: 3 stretches of 10 steps agreeing within 3% (or 3 standard errors), at least 20 steps
#: from the job's start, at most 500
DEFAULTS = {"span": 10, "spans": 3, "tol": 0.03, "z": 3.0, "min_steps": 20, "max_steps": 500}


class SteadyGate:
    """See the module docs. ``warm(block)`` -> how many of the block's first steps are still warm-up."""

    def __init__(self, span: int = 10, spans: int = 3, tol: float = 0.03, z: float = 3.0, min_steps: int = 20,
                 max_steps: int = 500, sample: int = 256):
        if span < 2 or spans < 2 or not 0 <= tol < 1 or z < 0 or min_steps < 0 or max_steps < min_steps:
            raise ValueError("steady gate: need span >= 2, spans >= 2, 0 <= tol < 1, z >= 0, "
                             "0 <= min_steps <= max_steps")
        self.span, self.spans, self.tol, self.z = int(span), int(spans), float(tol), float(z)
        self.min_steps, self.max_steps, self.sample = int(min_steps), int(max_steps), int(sample)
        self.reset()

    def reset(self) -> None:
        self.steady = False
        self.start: int | None = None         # first step of the stable stretch (None: not steady yet)
        self.opened_at: int | None = None     # the step at which it was judged steady
        self.forced = False                   # opened by max_steps, not by stability
        self._ring = np.full(self.span * self.spans, np.nan)
        self._steps = np.full(self.span * self.spans, -1, dtype=np.int64)
        self._n = 0

    def warm(self, block: StepBlock) -> int:
        """Feed ``block``; the number of its leading steps that are still warm-up (0 once steady)."""
        S = len(block)
        if self.steady or S == 0:
            return 0
        R = block.step_ms.shape[1] if block.step_ms.ndim == 2 else 0
        if R == 0:
            return S
        cols = np.arange(0, R, max(1, -(-R // self.sample)))
        v = nanmedian(block.step_ms[:, cols], axis=1)
        W = len(self._ring)
        for s in range(S):
            if not np.isfinite(v[s]):
                continue
            self._ring[self._n % W], self._steps[self._n % W] = v[s], block.steps[s]
            self._n += 1
            if self._n >= max(self.min_steps, W) and self._stable() or self._n >= self.max_steps:
                self.steady, self.forced = True, self._n >= self.max_steps and not self._stable()
                self.opened_at = int(block.steps[s])
                oldest = self._steps[self._n % W] if self._n >= W else self._steps[0]
                self.start = int(oldest) if not self.forced else int(block.steps[s]) + 1
                return s + 1
        return S

    def _stable(self) -> bool:
        W, n = len(self._ring), self._n
        if n < W:
            return False
        i = n % W
        v = np.concatenate((self._ring[i:], self._ring[:i])).reshape(self.spans, self.span)
        meds = np.median(v, axis=1)
        level = float(np.median(meds))
        mad = float(np.median(np.abs(v - meds[:, None]))) * 1.4826
        se = mad * math.sqrt(math.pi / 2) * math.sqrt(2.0 / self.span)
        return float(meds.max() - meds.min()) <= max(self.tol * level, self.z * se)

    def state(self) -> dict:
        return {"steady": self.steady, "start": self.start, "opened_at": self.opened_at, "forced": self.forced}

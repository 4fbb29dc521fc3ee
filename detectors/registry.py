"""The detectors the processor runs, in one explicit dict (no registration by import side effects).

Each detector class declares its settings once, in ``SETTINGS`` (:mod:`.settings`: name, default, range,
unit, meaning, whether a change applies at runtime), and takes them as keyword arguments; :func:`build` makes one instance of every registered detector (per job) from a settings
mapping such as the ``detectors:`` section of the processor configuration::

    build({"slow_rank": {"k": 3, "n": 8}, "changepoint": {"min_effect": 0.1}})

A detector can be left out with ``{"name": {"enabled": False}}``.
"""
from __future__ import annotations

from .base import Detector
from .settings import defaults
from .changepoint import ChangePoint
from .commbw import CommBandwidth
from .dataloader import DataLoader
from .jitter import Jitter
from .lifecycle import Lifecycle
from .mfu import Mfu
from .slowrank import SlowRank
from .stall import Stall

REGISTRY: dict[str, type[Detector]] = {
    "slow_rank": SlowRank,
    "changepoint": ChangePoint,
    "jitter": Jitter,
    "stall": Stall,
    "mfu": Mfu,
    "comm_bw": CommBandwidth,
    "dataloader": DataLoader,
    "lifecycle": Lifecycle,
}


def settings_of(cls: type[Detector]) -> dict[str, object]:
    """The keyword settings a detector class accepts, with their defaults (from its ``SETTINGS``)."""
    return defaults(cls.SETTINGS)


def build(settings: dict[str, dict] | None = None) -> list[Detector]:
    """Fresh instances of every registered detector, in :data:`REGISTRY` order.

    ``settings`` maps a detector name to its keyword settings (plus the optional ``enabled`` flag).
    An unknown detector name or setting raises :class:`ValueError` naming it; invalid values raise the
    detector's own :class:`ValueError`.
    """
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(REGISTRY))
    if unknown:
        raise ValueError(f"unknown detector(s) {', '.join(map(repr, unknown))}; known: {', '.join(REGISTRY)}")
    out: list[Detector] = []
    for name, cls in REGISTRY.items():
        raw = settings.get(name) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"settings for detector {name!r} must be a mapping, not {type(raw).__name__}")
        kw = dict(raw)
        enabled = kw.pop("enabled", True)
        allowed = settings_of(cls)
        bad = sorted(set(kw) - set(allowed))
        if bad:
            raise ValueError(f"unknown setting(s) {', '.join(map(repr, bad))} for detector {name!r}; "
                             f"known: {', '.join(allowed)}")
        if enabled:
            out.append(cls(**kw))
    return out

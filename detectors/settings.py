"""A setting declared once: its name, default, valid range, unit, meaning and whether it changes at runtime.

A detector (or the processor) lists its settings in a class attribute ``SETTINGS``, a tuple of
:class:`Setting`. Everything else reads that tuple:

* the constructor: :func:`bind` checks each keyword argument (type and range; the error names the
  field and the value), refuses unknown names, and sets the attributes the code reads (``self.k``);
* introspection: :func:`signature` (``inspect.signature(SlowRank)`` shows the names and defaults) and
  :func:`doc` (the "Settings" part of the class docstring);
* ``stepwatch config defaults``, the settings table of docs/configuration.md and the validation of a
  configuration file (:mod:`stepwatch.config`);
* a reload: a ``live`` setting is set on the running detector (its state kept), a change of one that
  is not ``live`` (it sizes the detector's memory or is baked into its state) gives a fresh detector
  (:func:`retune`).

stdlib only: it sits below the detectors and the stream processor.
"""
from __future__ import annotations

import inspect
import math
import numbers
import os
import stat
from dataclasses import dataclass
from typing import Callable


class SettingError(ValueError):
    """A value a setting refuses: ``where`` names the setting (``slow_rank.k``, ``detectors.stall.hang_s``),
    ``why`` says what is wrong with the value (and the valid range)."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


def show(v, n: int = 60) -> str:
    """``repr(v)`` for a message, at most ``n`` characters (control characters escaped by repr; an int too
    large to print in decimal by its size)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"<a {v.bit_length()}-bit integer>"
    if isinstance(v, (dict, list)):
        return f"<a {'table' if isinstance(v, dict) else 'array'} of {len(v)}>"
    try:
        r = repr(v)
    except Exception:  # noqa: BLE001 - a value that cannot be shown is named by its type
        return f"<{type(v).__name__}>"
    return r if len(r) <= n else r[:n - 1] + "…"


def range_text(lo, hi) -> str:
    if lo is None and hi is None:
        return "any"
    if hi is None:
        return f">= {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"{lo} .. {hi}"


@dataclass(frozen=True)
class Setting:
    """One setting. ``lo``/``hi``: the valid range (None: unbounded). ``live``: a change applies to the
    running detector (False: a change gives a fresh one; for the processor: it applies to jobs started
    after it). ``kind``: ``int``, ``float`` or ``bool`` (taken from the default when it is one; a setting
    whose default is None and that has a range is a number). ``check``: the validator of a free-form
    setting, ``check(where, value) -> value`` raising :class:`SettingError`."""

    name: str
    default: object
    lo: float | None = None
    hi: float | None = None
    unit: str = ""
    meaning: str = ""
    live: bool = True
    kind: type | None = None
    check: Callable | None = None

    @property
    def type(self) -> type | None:
        if self.kind is not None:
            return self.kind
        if isinstance(self.default, bool):
            return bool
        if isinstance(self.default, int):
            return int
        if isinstance(self.default, float) or self.lo is not None or self.hi is not None:
            return float
        return None

    @property
    def valid(self) -> str:
        return range_text(self.lo, self.hi)

    def validate(self, v, where: str | None = None, ranges: bool = True):
        """``v`` checked against the setting's type and range (``ranges=False``: the type only); returns it
        (ints as int, floats as float). The default itself (None included) is always valid. Raises
        :class:`SettingError` naming ``where`` (default: the setting's name) and the value."""
        where = where or self.name
        if self.check is not None:
            return v if v is None and self.default is None else self.check(where, v)
        t = self.type
        if v is None and self.default is None:
            return None
        if t is bool:
            if not isinstance(v, bool):
                raise SettingError(where, f"must be true or false, not {show(v)}")
            return v
        if t in (int, float):
            rng = range_text(self.lo, self.hi)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or \
                    (not isinstance(v, numbers.Integral) and not math.isfinite(v)):
                raise SettingError(where, f"must be a number in {rng}, not {show(v)}")
            if t is int and not isinstance(v, numbers.Integral) and not float(v).is_integer():
                raise SettingError(where, f"must be a whole number in {rng}, not {show(v)}")
            if ranges and (self.lo is not None and v < self.lo) or (ranges and self.hi is not None and v > self.hi) or \
                    (isinstance(v, numbers.Integral) and abs(int(v)) >= 2**63):
                raise SettingError(where, f"{show(v)} is out of range (valid: {rng})")
            return int(v) if t is int else float(v)
        return v


def table(settings) -> dict[str, Setting]:
    return {s.name: s for s in settings}


def defaults(settings) -> dict[str, object]:
    return {s.name: s.default for s in settings}


def values(settings, kw: dict, owner: str, ranges: bool = True) -> dict[str, object]:
    """Every setting's value: ``kw``'s (validated; ``ranges=False``: its type only) or the default. An
    unknown name is refused."""
    spec = table(settings)
    for k in kw:
        if k not in spec:
            raise SettingError(f"{owner}.{show(k, 40) if not isinstance(k, str) else k}",
                               f"unknown setting (known: {', '.join(spec)})")
    return {s.name: s.validate(kw[s.name], f"{owner}.{s.name}", ranges) if s.name in kw else s.default
            for s in settings}


def bind(obj, settings, kw: dict, owner: str, ranges: bool = True) -> dict[str, object]:
    """Set every setting of ``settings`` on ``obj`` as an attribute (``kw``'s value, validated, or the
    default) and keep them all in ``obj.settings``; returns that dict."""
    vals = values(settings, kw, owner, ranges)
    for k, v in vals.items():
        setattr(obj, k, v)
    obj.settings = vals
    return vals


def signature(settings, self_param: bool = False) -> inspect.Signature:
    """The keyword-only signature the settings make (what ``inspect.signature`` shows)."""
    ps = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] if self_param else []
    ps += [inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=s.default,
                             annotation=s.type.__name__ if s.type else inspect.Parameter.empty)
           for s in settings]
    return inspect.Signature(ps)


def _default_text(s: Setting) -> str:
    return "None" if s.default is None else repr(s.default)


def doc(settings, indent: str = "    ") -> str:
    """The "Settings" part of a docstring: ``name=default  meaning [unit; valid range; when it applies]``."""
    out = [f"{indent}Settings (keyword arguments, defaults):"]
    for s in settings:
        facts = [x for x in (s.unit, f"valid {s.valid}" if s.type in (int, float) else "",
                             "live" if s.live else "a change starts the detector afresh") if x]
        out.append(f"{indent}    {s.name}={_default_text(s)}  {s.meaning} [{'; '.join(facts)}]")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------- free-form validators

def positive(where: str, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < 1e300 or \
            not math.isfinite(v):
        raise SettingError(where, f"must be a number > 0, not {show(v)}")
    return float(v)


def table_of_positive(where: str, v) -> dict:
    if not isinstance(v, dict) or len(v) > 64:
        raise SettingError(where, f"must be a table of at most 64 name = number, not {show(v)}")
    return {k: positive(f"{where}.{_key(k)}", x) for k, x in v.items()}


def _key(k) -> str:
    k = str(k)
    return k if k.replace("_", "a").replace("-", "a").isalnum() and k.isascii() and 0 < len(k) <= 64 \
        else show(k, 40)


def peak_tflops(where: str, v):
    """A number, a table, or the path of a JSON/YAML file, a regular one of at most 64 KiB (the detector
    reads it: never a FIFO or device to wait on)."""
    if isinstance(v, dict):
        return table_of_positive(where, v)
    if isinstance(v, str):
        try:
            st = os.stat(v)
        except (OSError, ValueError) as e:
            raise SettingError(where, f"{show(v)}: cannot read: {getattr(e, 'strerror', None) or e}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size > 65536:
            raise SettingError(where, f"{show(v)} is not a regular file of at most 65536 bytes")
        return v
    return positive(where, v)


def short_name(where: str, v):
    if not isinstance(v, str) or len(v) > 64:
        raise SettingError(where, f"must be a name of at most 64 characters, not {show(v)}")
    return v


# ---------------------------------------------------------------------------- runtime changes

class Configurable:
    """A class whose keyword settings are declared in ``SETTINGS``: its ``__signature__`` and the
    "Settings" part of its docstring are made from them. :meth:`_bind` (called by ``__init__``) sets them
    and calls :meth:`_derive`, which computes what derives from settings (and checks how they combine):
    it runs again after a live change (:func:`retune`), so it must read settings only and set no state."""

    SETTINGS: tuple = ()
    name = "settings"

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "SETTINGS" in cls.__dict__:
            cls.__signature__ = signature(cls.SETTINGS)
            if "__init__" in cls.__dict__:
                cls.__init__.__signature__ = signature(cls.SETTINGS, self_param=True)
            cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n\n" + inspect.cleandoc(doc(cls.SETTINGS)) + "\n"

    def _bind(self, kw: dict) -> None:
        bind(self, type(self).SETTINGS, kw, self.name)
        self._derive()

    def _derive(self) -> None:
        """Attributes computed from the settings, and the settings' cross-checks. Default: none."""


def retune(obj, kw: dict):
    """``obj`` with the settings ``kw`` in force (those left out: their defaults). When only ``live``
    settings change they are set on ``obj`` and :meth:`Configurable._derive` runs again (its state is
    kept): ``obj`` is returned. When a setting that is not ``live`` changes, a fresh instance is returned.
    Raises :class:`SettingError` (or the class's own ValueError) before anything changes."""
    cls = type(obj)
    new = values(cls.SETTINGS, kw, obj.name)
    changed = {k for k, v in new.items() if not _same(v, obj.settings[k])}
    if not changed:
        return obj
    if any(not s.live for s in cls.SETTINGS if s.name in changed):
        return cls(**kw)
    old = obj.settings
    for k in changed:
        setattr(obj, k, new[k])
    obj.settings = new
    try:
        obj._derive()
    except Exception:
        for k in changed:                      # refused by the cross-checks: the settings in force stay
            setattr(obj, k, old[k])
        obj.settings = old
        obj._derive()
        raise
    return obj


def _same(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001
        return False

"""The processor's configuration file: detector settings, limits and the profiling policy, in one TOML file.

``stepwatch process --config FILE`` reads it (or ``$STEPWATCH_CONFIG``); ``stepwatch config defaults``
prints every setting with its default, valid range and meaning; ``stepwatch config check FILE`` validates a
file. The processor reloads it on SIGHUP: new settings apply from the next step, detector state is kept
(see :func:`apply`); a file that does not validate is refused with the setting's name and valid range,
and the settings in force stay. The layout (docs/configuration.md)::

    [processor]                     # limits
    flush_interval_s = 1.0
    [detectors.stall]               # any detector of stepwatch.detectors.registry, any of its settings
    hang_s = 60
    [detectors.jitter]
    enabled = false
    [profiling]                     # targeted profiling policy (the key stays in STEPWATCH_PROFILING_PRIVATE_KEY[_FILE])
    steps = 10
    [profiling.on]                  # alert kind -> profiler
    slow_rank = "torch"
    [[jobs]]                        # per-job overrides, by job-name pattern (fnmatch), in file order
    match = "llama-*"
    [jobs.detectors.stall]
    hang_s = 300
"""
from __future__ import annotations

import fnmatch
import inspect
import logging
import math
import os
import re
import stat
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stepwatch.configfile import (MAX_BYTES, MAX_DEPTH, MAX_DIGITS, MAX_MESSAGE, ConfigError,  # noqa: F401
                                 decode, read_bytes)

log = logging.getLogger("stepwatch.config")

INF = math.inf

#: the processor's limits: name -> (default, lo, hi, meaning). ``live``: applied on reload to running jobs.
PROCESSOR = {
    "flush_interval_s": (1.0, 0.05, 3600.0, "seconds between store flushes (live)"),
    "max_buffer_rows": (1_000_000, 1000, 100_000_000, "rows buffered before a flush is forced (live)"),
    "lateness_s": (10.0, 0.0, 3600.0, "seconds of event time before an incomplete step closes (new jobs)"),
    "window_steps": (128, 8, 65536, "steps x ranks kept per job in the alignment ring (new jobs)"),
    "replay_steps": (256, 0, 65536, "steps replayed from the store into a job's fresh detectors (new jobs)"),
    "idle_close_s": (5.0, 0.1, 3600.0, "seconds without input after which open steps are closed (live)"),
}
_LIVE = ("flush_interval_s", "max_buffer_rows", "idle_close_s")

#: targeted profiling policy: name -> (default, lo, hi, meaning); ``on`` is a table alert kind -> profiler
PROFILING = {
    "steps": (10, 1, 1000, "steps profiled per command"),
    "ttl_s": (120.0, 1.0, 86400.0, "lifetime of a command (also the profile's deadline), seconds"),
    "max_in_flight": (4, 1, 1024, "ranks profiling at once, at most"),
    "max_suspects": (2, 1, 64, "suspect ranks profiled per alert"),
    "reference": (True, None, None, "also profile a healthy reference rank to compare with"),
}
PROFILERS = ("torch", "py-spy", "host")

#: valid ranges of the detectors' settings (lo, hi; None: unbounded); the defaults and meanings come
#: from the detector classes (their keyword defaults and the "Settings" part of their docstrings)
RANGES: dict[str, dict[str, tuple]] = {
    "slow_rank": {"k": (1, 1000), "n": (1, 1000), "clear_steps": (1, 100000), "z_min": (0.0, None),
                  "min_effect": (0.0, 10.0), "mad_floor": (0.0, 1.0), "min_peers": (1, None),
                  "critical_pct": (0.0, 100.0), "small_effect": (0.0, 1.0),
                  "node_share": (0.0, 1.0), "group_share": (0.0, 1.0), "ref_z": (0.0, 100.0),
                  "span_z": (0.0, 100.0), "big_ref_z": (0.0, 100.0), "big_span_z": (0.0, 100.0),
                  "alpha": (1e-15, 0.5), "member_share": (0.0, 1.0), "min_alert_effect": (0.0, 1.0),
                  "small_alert_effect": (0.0, 1.0)},
    "changepoint": {"window": (10, 100000), "every": (1, 100000), "min_size": (1, 10000), "min_effect": (0.0, 10.0),
                    "min_t": (0.0, None), "penalty_c": (0.0, None), "smooth": (1, 1001), "phase_sample": (1, None),
                    "critical_pct": (0.0, 100.0), "floor_share": (0.0, 1.0), "persist": (0.0, 1.0),
                    "phase_min_effect": (0.0, 10.0), "phase_min_share": (0.0, 1.0), "phase_small_share": (0.0, 1.0), "phase_small_effect": (0.0, 100.0), "min_steps": (1, 100000), "warmup": (0, 100000),
                    "phase_min_cost": (0.0, 100.0), "phase_step_share": (0.0, 10.0)},
    "jitter": {"threshold": (1.0, None), "window": (1, 100000), "ratio": (0.0, 1.0), "native_alpha": (0.0, 1.0), "clear_window": (1, 100000),
               "baseline": (1, 100000), "spike": (1.0, None), "min_periods": (2, 1000), "min_every": (1, 100000),
               "history": (8, 1000000), "warmup": (0, 100000)},
    "stall": {"k": (1, 100000), "min_reporting": (0.01, 1.0), "hang_s": (0.1, None), "hang_steps": (1, 1000000),
              "max_alerts": (1, 10000), "hang_first_s": (0.1, None), "hang_eval_s": (0.1, None),
              "hang_checkpoint_s": (0.1, None)},
    "mfu": {"baseline": (1, 100000), "slow": (1.0, None), "min_effect": (0.0, 10.0), "min_t": (0.0, None),
            "window": (10, 100000), "critical_pct": (0.0, 100.0), "max_pending": (1, 10_000_000)},
    "comm_bw": {"window": (1, 100000), "every": (1, 100000), "lag": (0, 1000), "min_steps": (1, 100000),
                "small_div": (1.0, None), "small_share": (0.0, 1.0), "min_calls": (1, None),
                "min_comm_share": (0.0, 1.0), "slow_ratio": (0.0, 1.0), "min_peers": (1, None),
                "sync_share": (0.0, 1.0), "sync_margin": (0.0, 1.0), "straggler_share": (0.0, 1.0), "clear": (1, 100000),
                "max_pending": (1, 10_000_000)},
    "dataloader": {"window": (1, 100000), "every": (1, 100000), "min_steps": (1, 100000), "empty_share": (0.0, 1.0),
                   "min_data_share": (0.0, 1.0), "job_share": (0.0, 1.0), "clear": (1, 100000)},
    "lifecycle": {"grace_s": (0.001, 600.0), "culprit_window_s": (0.001, 600.0), "settle_s": (0.0, 600.0),
                  "sched_wait_s": (0.0, 600.0)},
}


#: settings that size a detector's memory (rings, windows, caps; some are allocated only at the first step,
#: so comparing fresh instances cannot tell): changing one gives that detector a fresh start on reload
RESIZING: dict[str, set[str]] = {
    "slow_rank": {"n"},
    "changepoint": {"window", "smooth", "phase_sample", "min_size", "min_steps"},
    "jitter": {"window", "clear_window", "baseline", "history", "min_periods"},
    "mfu": {"window", "baseline", "max_pending"},
    "comm_bw": {"window", "lag", "min_steps", "max_pending"},
    "dataloader": {"window", "min_steps"},
}


MAX_JOBS = 1000                     # [[jobs]] entries (each is validated by building its detectors)
MAX_PATTERN = 256                   # characters of a [[jobs]] match pattern


def _show(v, n: int = 60) -> str:
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


def _name(k) -> str:
    """A key as it may appear in a message: as is when it is a plain name, else its clipped repr."""
    k = str(k)
    return k if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", k) else _show(k, 40)


def _registry():
    from stepwatch.detectors.registry import REGISTRY, settings_of
    return REGISTRY, settings_of


def meanings(cls) -> dict[str, str]:
    """A detector's setting -> meaning, from the "Settings" part of its docstring."""
    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    part = doc.split("Settings (keyword arguments, defaults):", 1)
    if len(part) < 2:
        return out
    last = None
    for line in part[1].splitlines():
        m = re.match(r"^\s{0,8}([a-z_][a-z0-9_]*)=(\S+)\s+(.*)$", line)
        if m:
            last = m.group(1)
            out[last] = m.group(3).strip()
        elif last and line.strip() and line.startswith(" " * 10):
            out[last] += " " + line.strip()
        elif not line.strip():
            last = None
    return out


def _range_text(lo, hi) -> str:
    if lo is None and hi is None:
        return "any"
    if hi is None:
        return f">= {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"{lo} .. {hi}"


def _check_value(where: str, v, default, lo, hi):
    """``v`` checked against the type of ``default`` and [lo, hi]; returns it (ints as int)."""
    if isinstance(default, bool) or (default is None and isinstance(v, bool)):
        if not isinstance(v, bool):
            raise ConfigError(f"{where}: must be true or false, not {_show(v)}")
        return v
    if isinstance(default, (int, float)) or lo is not None or hi is not None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            raise ConfigError(f"{where}: must be a number in {_range_text(lo, hi)}, not {_show(v)}")
        if isinstance(default, int) and not isinstance(default, bool) and isinstance(v, float) and \
                not v.is_integer():
            raise ConfigError(f"{where}: must be a whole number in {_range_text(lo, hi)}, not {_show(v)}")
        if (lo is not None and v < lo) or (hi is not None and v > hi) or (isinstance(v, int) and abs(v) >= 2**63):
            raise ConfigError(f"{where}: {_show(v)} is out of range (valid: {_range_text(lo, hi)})")
        return int(v) if isinstance(default, int) and not isinstance(default, bool) else v
    return v


def _positive(where: str, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e300 or \
            (isinstance(v, float) and not math.isfinite(v)):
        raise ConfigError(f"{where}: must be a number > 0, not {_show(v)}")
    return float(v)


def _table_of_positive(where: str, v) -> dict:
    if not isinstance(v, dict) or len(v) > 64:
        raise ConfigError(f"{where}: must be a table of at most 64 name = number, not {_show(v)}")
    return {k: _positive(f"{where}.{_name(k)}", x) for k, x in v.items()}


def _peak_tflops(where: str, v):
    """mfu.peak_tflops: a number, a table, or the path of a JSON/YAML file, a regular one of at most
    64 KiB (the detector reads it: never a FIFO or device to wait on)."""
    if isinstance(v, dict):
        return _table_of_positive(where, v)
    if isinstance(v, str):
        try:
            st = os.stat(v)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: {_show(v)}: cannot read: {getattr(e, 'strerror', None) or e}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size > 65536:
            raise ConfigError(f"{where}: {_show(v)} is not a regular file of at most 65536 bytes")
        return v
    return _positive(where, v)


def _short_str(where: str, v):
    if not isinstance(v, str) or len(v) > 64:
        raise ConfigError(f"{where}: must be a name of at most 64 characters, not {_show(v)}")
    return v


#: settings that are not numbers or switches: (detector, setting) -> validator(where, value) -> value
FREEFORM = {("mfu", "peak_tflops"): _peak_tflops, ("comm_bw", "link_gbps"): _table_of_positive,
            ("comm_bw", "link"): _short_str}


def _detectors(raw, where: str) -> dict[str, dict]:
    REGISTRY, settings_of = _registry()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a table of detectors")
    out = {}
    for name, kw in raw.items():
        if name not in REGISTRY:
            raise ConfigError(f"{where}.{_name(name)}: unknown detector (known: {', '.join(REGISTRY)})")
        if not isinstance(kw, dict):
            raise ConfigError(f"{where}.{name}: must be a table of settings, not {_show(kw)}")
        defaults = settings_of(REGISTRY[name])
        rng = RANGES.get(name, {})
        clean = {}
        for k, v in kw.items():
            w = f"{where}.{name}.{_name(k)}"
            if k == "enabled":
                clean[k] = _check_value(w, v, True, None, None)
                continue
            if k not in defaults:
                raise ConfigError(f"{w}: unknown setting (known: enabled, {', '.join(defaults)})")
            lo, hi = rng.get(k, (None, None))
            clean[k] = FREEFORM[(name, k)](w, v) if (name, k) in FREEFORM else _check_value(w, v, defaults[k], lo, hi)
        _build_one(f"{where}.{name}", name, clean)     # the detector's own cross-checks
        out[name] = clean
    return out


def _build_one(where: str, name: str, kw: dict):
    """A detector built with ``kw`` (``enabled`` aside): its own cross-checks (e.g. slow_rank's k <= n)
    refuse the settings as a :class:`ConfigError` naming ``where``, whatever the detector raises."""
    REGISTRY, _ = _registry()
    try:
        return REGISTRY[name](**{k: v for k, v in kw.items() if k != "enabled"})
    except Exception as e:  # noqa: BLE001 - a detector's refusal, whatever its type, refuses the file
        raise ConfigError(f"{where}: {type(e).__name__}: {str(e)[:200]}") from None


@dataclass
class Config:
    processor: dict = field(default_factory=lambda: {k: v[0] for k, v in PROCESSOR.items()})
    detectors: dict = field(default_factory=dict)          # detector -> settings (only those the file sets)
    jobs: list = field(default_factory=list)               # [(pattern, {detector: settings})], file order
    profiling: dict = field(default_factory=dict)          # the [profiling] table as given (validated)
    path: str | None = None

    def detector_settings(self, job: str | None) -> dict[str, dict]:
        """The detector settings for a job: the file's, then every matching ``[[jobs]]`` entry in order."""
        out = {k: dict(v) for k, v in self.detectors.items()}
        for pat, dets in self.jobs:
            if job is not None and fnmatch.fnmatchcase(job, pat):
                for name, kw in dets.items():
                    out.setdefault(name, {}).update(kw)
        return out

    def profiling_settings(self, base):
        """Apply the ``[profiling]`` policy to :class:`~stepwatch.stream.profiling.ProfilingSettings`
        (None: profiling is off, no key)."""
        if base is None or not self.profiling:
            return base
        p = dict(self.profiling)
        if p.pop("enabled", True) is False:
            return None
        on = p.pop("on", None)
        for k, v in p.items():
            setattr(base, k, v)
        if on is not None:
            base.alert_kinds = dict(on)
        return base


def parse(data: dict, path: str | None = None) -> Config:
    """A validated :class:`Config` from a parsed TOML document; raises :class:`ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError("the configuration must be a TOML table")
    unknown = sorted(set(data) - {"processor", "detectors", "jobs", "profiling"})
    if unknown:
        raise ConfigError(f"{_name(unknown[0])}: unknown section (known: processor, detectors, jobs, profiling)")
    c = Config(path=path)
    proc = data.get("processor", {})
    if not isinstance(proc, dict):
        raise ConfigError(f"processor: must be a table, not {_show(proc)}")
    for k, v in proc.items():
        if k not in PROCESSOR:
            raise ConfigError(f"processor.{_name(k)}: unknown setting (known: {', '.join(PROCESSOR)})")
        d, lo, hi, _ = PROCESSOR[k]
        c.processor[k] = _check_value(f"processor.{k}", v, d, lo, hi)
    c.detectors = _detectors(data.get("detectors", {}), "detectors")
    jobs = data.get("jobs", [])
    if not isinstance(jobs, list):
        raise ConfigError(f"jobs: must be an array of tables ([[jobs]]), not {_show(jobs)}")
    if len(jobs) > MAX_JOBS:
        raise ConfigError(f"jobs: {len(jobs)} entries, at most {MAX_JOBS}")
    for i, j in enumerate(jobs):
        if not isinstance(j, dict) or not isinstance(j.get("match"), str) or not j["match"]:
            got = _show(j.get("match")) if isinstance(j, dict) else _show(j)
            raise ConfigError(f"jobs[{i}].match: required, a job-name pattern such as \"llama-*\", not {got}")
        if len(j["match"]) > MAX_PATTERN:
            raise ConfigError(f"jobs[{i}].match: {_show(j['match'])} is longer than {MAX_PATTERN} characters")
        extra = sorted(set(j) - {"match", "detectors"})
        if extra:
            raise ConfigError(f"jobs[{i}].{_name(extra[0])}: unknown key (known: match, detectors)")
        c.jobs.append((j["match"], _detectors(j.get("detectors", {}), f"jobs[{i}].detectors")))
    _check_merged(c)
    prof = data.get("profiling", {})
    if not isinstance(prof, dict):
        raise ConfigError(f"profiling: must be a table, not {_show(prof)}")
    for k, v in prof.items():
        if k == "enabled":
            c.profiling[k] = _check_value("profiling.enabled", v, True, None, None)
        elif k == "on":
            if not isinstance(v, dict) or any(not isinstance(p, str) or p not in PROFILERS for p in v.values()):
                raise ConfigError(f"profiling.on: must map alert kinds to one of {', '.join(PROFILERS)}, "
                                  f"not {_show(v)}")
            c.profiling[k] = dict(v)
        elif k in PROFILING:
            d, lo, hi, _ = PROFILING[k]
            c.profiling[k] = _check_value(f"profiling.{k}", v, d, lo, hi)
        else:
            raise ConfigError(f"profiling.{_name(k)}: unknown setting (known: enabled, on, {', '.join(PROFILING)})")
    return c


def _check_merged(c: Config) -> None:
    """The settings a job gets are the file's with the matching ``[[jobs]]`` entries over them: a detector
    built with the file's settings and each entry's (and with all entries, as for a job every pattern
    matches) must pass its cross-checks too (``k`` in [detectors.slow_rank], ``n`` in a job entry)."""
    layers = [(f"jobs[{i}]", [d]) for i, (_, d) in enumerate(c.jobs)]
    if len(c.jobs) > 1:
        layers.append(("jobs[*]", [d for _, d in c.jobs]))
    for where, dets in layers:
        names = {n for d in dets for n in d}
        for name in names:
            kw = dict(c.detectors.get(name, {}))
            for d in dets:
                kw.update(d.get(name, {}))
            _build_one(f"{where}.detectors.{name} (over detectors.{name})", name, kw)


def load(path: str | Path) -> Config:
    """Read and validate a configuration file. Raises :class:`ConfigError`, and nothing else, for any
    content (the message names the file, the setting and the value): not UTF-8, larger than
    :data:`MAX_BYTES`, nested deeper than :data:`MAX_DEPTH`, a number of more than :data:`MAX_DIGITS`
    digits, not TOML, empty (what a reader sees of a file being rewritten: an intentional "every
    default" file says so with a comment or an empty ``[processor]`` table), or a setting that does
    not validate."""
    p = Path(path)
    return loads(read_bytes(p), p)


def loads(raw: bytes, p="<config>") -> Config:
    """:func:`load` of a file's bytes (``p`` names it in messages); raises only :class:`ConfigError`."""
    data = decode(raw, p)
    try:
        return parse(data, str(p))
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


# ---------------------------------------------------------------------------- defaults

def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(v)
    return str(v)


def defaults_text() -> str:
    """Every setting with its default, valid range and meaning, as a TOML file (what ``stepwatch config
    defaults`` prints; loading it gives the defaults)."""
    REGISTRY, settings_of = _registry()
    out = ["# stepwatch processor configuration: every setting with its default.",
           "# Use: stepwatch process --config FILE (reloaded on SIGHUP). Settings left out keep their default.",
           "", "[processor]"]
    for k, (d, lo, hi, m) in PROCESSOR.items():
        out.append(f"{k} = {_toml(d)}    # {m}; valid {_range_text(lo, hi)}")
    for name, cls in REGISTRY.items():
        out += ["", f"[detectors.{name}]", "enabled = true    # false: the detector does not run"]
        mean = meanings(cls)
        for k, d in settings_of(cls).items():
            lo, hi = RANGES.get(name, {}).get(k, (None, None))
            m = mean.get(k, "")
            if d is None:
                out.append(f"# {k} =    # default: unset; {m}")
            else:
                out.append(f"{k} = {_toml(d)}    # {m}; valid {_range_text(lo, hi)}")
    out += ["", "[profiling]    # targeted profiling on alerts (needs STEPWATCH_PROFILING_PRIVATE_KEY[_FILE]; docs/profiling.md)",
            "enabled = true    # false: no profiling commands even with a key"]
    for k, (d, lo, hi, m) in PROFILING.items():
        out.append(f"{k} = {_toml(d)}    # {m}" + (f"; valid {_range_text(lo, hi)}" if lo is not None else ""))
    from stepwatch.stream.profiling import DEFAULT_ALERT_KINDS
    out += ["", "[profiling.on]    # alert kind -> profiler (" + " | ".join(PROFILERS) + ")"]
    out += [f"{k} = {_toml(v)}" for k, v in DEFAULT_ALERT_KINDS.items()]
    out += ["", "# Per-job overrides, by job-name pattern (fnmatch: * ? [abc]); every matching entry applies,",
            "# in file order, over the settings above:", "# [[jobs]]", '# match = "llama-*"',
            "# [jobs.detectors.stall]", "# hang_s = 300", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------- applying to a processor

def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and \
            a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def retune(det, cls, old_kw: dict, new_kw: dict):
    """``det`` with ``new_kw`` in force and its state kept: the attributes a fresh detector built with
    ``new_kw`` has differently from one built with ``old_kw`` are the settings (and what derives from
    them); only those are replaced. When a setting of :data:`RESIZING` changes, or such an attribute is an
    array or a bounded deque, the settings size the detector's memory and a fresh detector is returned."""
    if old_kw == new_kw:
        return det
    a, b = cls(**old_kw), cls(**new_kw)
    sizing = RESIZING.get(getattr(cls, "name", ""), set())
    if any(old_kw.get(k, object()) != new_kw.get(k, object()) for k in sizing & (set(old_kw) | set(new_kw))):
        log.info("detector %s: new settings resize its state; it starts afresh", cls.name)
        return b
    changed = [k for k in b.__dict__ if k not in a.__dict__ or not _same(a.__dict__[k], b.__dict__[k])]
    if any(isinstance(b.__dict__[k], (np.ndarray, deque)) for k in changed):
        log.info("detector %s: new settings resize its state; it starts afresh", getattr(det, "name", cls))
        return b
    for k in changed:
        setattr(det, k, b.__dict__[k])
    return det


def _profiling_plan(proc, old: Config, new: Config):
    """What to put in force for ``[profiling]``: None (nothing changes) or ``(issuer, settings)``. The key
    is read again (``STEPWATCH_PROFILING_PRIVATE_KEY[_FILE]``: a rotated Secret takes effect); a key
    that cannot be read now keeps the one in force. ``enabled = false`` stops new commands (answers to
    those sent are still stored); ``enabled = true`` on a processor that has a key starts issuing."""
    cur = getattr(proc, "profiling", None)
    if old.profiling == new.profiling and cur is None:
        return None
    from stepwatch.agents import profiling as keys
    from stepwatch.stream.profiling import Issuer, ProfilingSettings
    try:
        base = ProfilingSettings.from_env()
    except (keys.KeyError_, ValueError) as e:
        log.error("configuration reload: the profiling key cannot be read (%s); the key in force stays", e)
        base = ProfilingSettings(key=cur.settings.key) if cur is not None else None
    ps = new.profiling_settings(base)
    if ps is None:
        if cur is None:
            return (None, None)
        off = ProfilingSettings(key=cur.settings.key, alert_kinds={})     # no alert kind is profiled
        return (cur, off)
    if cur is not None:
        return (cur, ps)
    if getattr(proc, "producer", None) is None:
        raise ConfigError("cannot change at runtime: profiling.enabled (the processor has not started)")
    return (Issuer(ps, proc.kafka, proc.producer), ps)


def apply(proc, new: Config) -> dict:
    """Put ``new`` in force on a running :class:`~stepwatch.stream.processor.Processor` (from its loop
    thread, between messages): live limits, the ``[profiling]`` policy, then every job's detectors
    retuned in place (state kept; see :func:`retune`), added or removed when ``enabled`` changed.
    Everything is checked before anything changes: a job whose merged settings a detector refuses
    raises :class:`ConfigError` and nothing is applied. Returns what changed (job -> detectors)."""
    REGISTRY, _ = _registry()
    old = proc.detector_settings if isinstance(proc.detector_settings, Config) else Config()
    plans = {}
    for job, rt in proc.jobs.items():
        o, n = old.detector_settings(job), new.detector_settings(job)
        if o == n:
            continue
        have = {d.name: d for d in rt.detectors}
        plan = []
        for name, cls in REGISTRY.items():
            okw, nkw = dict(o.get(name, {})), dict(n.get(name, {}))
            on_old, on_new = okw.pop("enabled", True), nkw.pop("enabled", True)
            if not on_new:
                continue
            _build_one(f"job {_show(job)}: detectors.{name}", name, nkw)     # refused before anything changes
            plan.append((have.get(cls.name) if on_old else None, cls, okw, nkw))
        plans[job] = (rt, plan, sorted(set(o) | set(n)))
    prof = _profiling_plan(proc, old, new)
    # commit (nothing above changed the processor)
    for k in _LIVE:
        setattr(proc, k, new.processor[k])
    if prof is not None:
        proc.profiling, proc.profiling_settings = prof
    changed = {}
    for job, (rt, plan, names) in plans.items():
        rt.detectors = [retune(d, cls, okw, nkw) if d is not None else cls(**nkw) for d, cls, okw, nkw in plan]
        changed[job] = names
    proc.detector_settings = new
    return changed


def _count(proc, result: str) -> None:
    m = getattr(getattr(proc, "metrics", None), "config_reloads", None)
    if m is not None:
        m.labels(result).inc()


def reload(proc, path: str) -> bool:
    """SIGHUP or a changed file: load ``path`` and apply it. A file that does not load (any content:
    :func:`load` raises only :class:`ConfigError`) or cannot be applied is refused, logged with the
    setting's name and value and counted (``stepwatch_processor_config_reloads{result="refused"}``); the
    settings in force stay and the processor goes on. True when applied."""
    try:
        new = load(path)
        changed = apply(proc, new)
    except ConfigError as e:
        log.error("configuration %s refused, the settings in force stay: %s", path, e)
        _count(proc, "refused")
        return False
    except Exception as e:  # noqa: BLE001 - a configuration never stops the processor (a bug here: logged)
        log.error("configuration %s refused (internal error %s: %s), the settings in force stay", path,
                  type(e).__name__, str(e)[:200])
        _count(proc, "refused")
        return False
    _count(proc, "applied")
    ps = getattr(proc, "profiling_settings", None)
    prof = "off" if ps is None or not getattr(ps, "alert_kinds", None) else \
        "on for " + ", ".join(sorted(ps.alert_kinds))
    log.warning("configuration %s reloaded (%d job(s) retuned); targeted profiling %s", path, len(changed), prof)
    return True


class FileWatch:
    """Whether a file changed since the last look (inode, size, mtime; at most every ``every_s``): a
    ConfigMap mounted by Kubernetes is swapped in place (a new ``..data`` symlink target)."""

    def __init__(self, path: str, every_s: float = 5.0):
        import time
        self.path, self.every_s, self._clock = path, every_s, time.monotonic
        self._last = self._clock()
        self._sig = self._stat()

    def _stat(self):
        import os
        try:
            st = os.stat(self.path)
            return (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            return None

    def changed(self) -> bool:
        now = self._clock()
        if now - self._last < self.every_s:
            return False
        self._last = now
        sig = self._stat()
        if sig is None or sig == self._sig:
            return False
        self._sig = sig
        return True


# ---------------------------------------------------------------------------- CLI

def processor_kwargs(cfg: Config | None, a=None) -> dict:
    """``Processor`` keyword arguments: the file's limits, where ``stepwatch process`` was not given the
    corresponding flag (``--flush-interval``, ``--lateness``: a flag given wins)."""
    kw = dict(cfg.processor) if cfg is not None else {}
    for flag, k in (("flush_interval", "flush_interval_s"), ("lateness", "lateness_s")):
        v = getattr(a, flag, None) if a is not None else None
        if v is not None:
            kw[k] = v
    return kw


def register(sub) -> None:
    c = sub.add_parser("config", help="the processor's configuration file: print the defaults, check a file")
    cs = c.add_subparsers(dest="config_cmd", metavar="ACTION")
    cs.add_parser("defaults", help="print every setting with its default, valid range and meaning (TOML)")
    ck = cs.add_parser("check", help="validate a configuration file")
    ck.add_argument("file")
    ck.add_argument("--job", help="also print the detector settings that apply to this job")
    c.set_defaults(func=_cmd)


def _cmd(a) -> int:
    import json
    import sys
    if a.config_cmd == "defaults":
        sys.stdout.write(defaults_text())
        return 0
    if a.config_cmd == "check":
        try:
            c = load(a.file)
        except ConfigError as e:
            print(f"stepwatch config: {e}", file=sys.stderr)
            return 2
        print(f"{a.file}: valid ({len(c.detectors)} detector section(s), {len(c.jobs)} job override(s))")
        if a.job:
            print(json.dumps(c.detector_settings(a.job), indent=2, sort_keys=True))
        return 0
    print("stepwatch config: say defaults or check FILE", file=sys.stderr)
    return 2

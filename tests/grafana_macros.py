"""Grafana's query-time rewriting of a panel's SQL for the DuckDB datasource, done in Python (a test
helper: the tests import it as ``grafana_macros``; not part of the package).

What Grafana does to ``rawSql`` before DuckDB sees it happens in two stages, and :func:`expand`
reproduces both so that tests can run every panel's SQL exactly as Grafana would send it:

1. **Frontend: template variables** (Grafana's ``templateSrv.replace`` with the
   ``interpolateVariable`` formatter of ``@grafana/plugin-ui``'s ``SqlDatasource``, which the
   ``motherduck-duckdb-datasource`` frontend extends). ``$name``, ``${name}`` and ``[[name]]`` are
   replaced by the variable's current value:

   * a single value of a variable that is neither *multi* nor *include All*: the value with every
     ``'`` doubled and **no** surrounding quotes (so panels write ``job = '${job}'``);
   * a *multi* / *include All* variable: each value quoted as a SQL literal (``'a'``), joined with
     ``,`` (so panels write ``job IN (${job})``); *All* means every option of the variable, or the
     variable's ``allValue`` verbatim when it has one;
   * ``${name:raw}`` inserts the value(s) unescaped, comma-joined; ``${name:sqlstring}`` always
     quotes;
   * built-ins: ``$__interval`` (e.g. ``1m``, ``30s``, ``500ms``), ``$__interval_ms`` (an integer),
     ``$__from`` / ``$__to`` (epoch milliseconds). Unknown variables are left as they are.

2. **Backend: macros** (the plugin's Go backend: ``sqlds`` calling the SDK's
   ``sqlutil.Interpolate`` with ``sqlutil.DefaultMacros`` plus the plugin's own ``timeFrom`` /
   ``timeTo``). Macros are applied longest name first; arguments are split on top-level commas and
   trimmed. Times are the dashboard range in UTC formatted as RFC 3339 with whole seconds (Go's
   ``time.RFC3339``: fractions are truncated):

   * ``$__timeFilter(col)`` -> ``col >= '2025-01-01T00:00:00Z' AND col <= '2025-01-01T06:00:00Z'``
   * ``$__timeFrom()`` -> ``'2025-01-01T00:00:00Z'``; ``$__timeTo()`` -> ``'2025-01-01T06:00:00Z'``
     (the DuckDB plugin's override: a quoted literal; given a column argument it is an error)
   * ``$__interval`` / ``$__interval_ms`` (when the frontend left them) as above;
   * ``$__timeGroup(col, period)`` -> the SDK's ``datepart(...)`` list (not valid DuckDB: stepwatch
     panels bucket with ``$__interval_ms`` instead); ``$__table`` / ``$__column`` -> empty.

DuckDB compares a ``TIMESTAMP WITH TIME ZONE`` column with such a ``'…Z'`` literal by casting the
literal, so ``$__timeFilter(t_end)`` works on the store's ``timestamp[ns, tz=UTC]`` columns.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

ALL = "$__all"


@dataclass
class Variable:
    """A dashboard template variable as the expansion needs it."""

    name: str
    value: str | list[str]                 # current value(s); ALL for "All"
    multi: bool = False
    include_all: bool = False
    all_value: str | None = None
    options: list[str] = field(default_factory=list)   # what "All" stands for


def format_interval(ms: int) -> str:
    """Grafana's interval text for a number of milliseconds (``gtime.FormatInterval``)."""
    ms = int(ms)
    if ms >= 365 * 86_400_000:
        return f"{ms // (365 * 86_400_000)}y"
    if ms >= 7 * 86_400_000:
        return f"{ms // (7 * 86_400_000)}w"
    if ms >= 86_400_000:
        return f"{ms // 86_400_000}d"
    if ms >= 3_600_000:
        return f"{ms // 3_600_000}h"
    if ms >= 60_000:
        return f"{ms // 60_000}m"
    if ms >= 1000:
        return f"{ms // 1000}s"
    return f"{ms}ms"


def _rfc3339(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _as_dt(t) -> datetime:
    if isinstance(t, datetime):
        return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
    return datetime.fromtimestamp(int(t) / 1e9, tz=timezone.utc)   # ns since epoch


def _quote(v: str) -> str:
    return "'" + str(v).replace("'", "''") + "'"


def _format_var(var: Variable, fmt: str | None) -> str:
    vals = var.value
    if vals == ALL or (isinstance(vals, list) and vals == [ALL]):
        if var.all_value is not None and fmt is None:
            return var.all_value
        vals = list(var.options)
    if fmt == "raw":
        return ",".join(vals) if isinstance(vals, list) else str(vals)
    if fmt == "sqlstring":
        return ",".join(_quote(v) for v in (vals if isinstance(vals, list) else [vals]))
    if fmt is not None:
        raise ValueError(f"variable format {fmt!r} of ${{{var.name}}} is not implemented here")
    if isinstance(vals, list):
        return ",".join(_quote(v) for v in vals)
    if var.multi or var.include_all:
        return _quote(vals)
    return str(vals).replace("'", "''")


_VAR_RE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?::([^}]+))?\}")


def expand_variables(sql: str, variables: dict[str, Variable] | None, interval_ms: int,
                     time_from: datetime, time_to: datetime) -> str:
    """Stage 1 (frontend): template variables and Grafana's built-in ``$__`` variables."""
    variables = variables or {}
    builtin = {"__interval": format_interval(interval_ms), "__interval_ms": str(int(interval_ms)),
               "__from": str(int(time_from.timestamp() * 1000)), "__to": str(int(time_to.timestamp() * 1000))}

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(4)
        fmt = m.group(3) or m.group(5)
        if name in builtin:
            return builtin[name]
        var = variables.get(name)
        if var is None:
            return m.group(0)
        return _format_var(var, fmt)
    return _VAR_RE.sub(repl, sql)


def _parse_args(s: str) -> tuple[list[str] | None, int]:
    """Bracketed argument list at the start of ``s`` -> (args, length); (None, 0) if none."""
    if not s.startswith("("):
        return None, 0
    args, depth, cur = [], 0, []
    for i, ch in enumerate(s):
        if ch == "(":
            depth += 1
            if depth == 1:
                continue
        elif ch == ")":
            depth -= 1
            if depth == 0:
                args.append("".join(cur).strip())
                return args, i + 1
        elif ch == "," and depth == 1:
            args.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    raise ValueError("failed to parse macro arguments (missing close bracket?)")


def expand_macros(sql: str, time_from: datetime, time_to: datetime, interval_ms: int) -> str:
    """Stage 2 (plugin backend): ``$__timeFilter`` and friends, as ``sqlutil.Interpolate`` does."""
    f, t = _rfc3339(time_from), _rfc3339(time_to)

    def no_arg(args):
        return args is None or (len(args) == 1 and args[0] == "")

    def time_filter(args):
        if args is None or len(args) != 1:
            raise ValueError(f"$__timeFilter: expected 1 argument, received {0 if args is None else len(args)}")
        return f"{args[0]} >= '{f}' AND {args[0]} <= '{t}'"

    def time_from_(args):
        if not no_arg(args):
            raise ValueError(f"$__timeFrom: expected 0 arguments, received {len(args)}")
        return f"'{f}'"

    def time_to_(args):
        if not no_arg(args):
            raise ValueError(f"$__timeTo: expected 0 arguments, received {len(args)}")
        return f"'{t}'"

    def time_group(args):
        if args is None or len(args) != 2:
            raise ValueError("$__timeGroup: expected 2 arguments")
        order = ["minute", "hour", "day", "month", "year"]
        if args[1] not in order:
            return ""
        parts = [f"datepart({p}, {args[0]})" for p in order[order.index(args[1]):]]
        return ",".join(parts)

    macros = {
        "interval_ms": lambda a: str(int(interval_ms)),
        "timeFilter": time_filter,
        "timeFrom": time_from_,
        "timeGroup": time_group,
        "interval": lambda a: format_interval(interval_ms),
        "timeTo": time_to_,
        "column": lambda a: "",
        "table": lambda a: "",
    }
    for name in sorted(macros, key=len, reverse=True):
        rx = re.compile(r"\$__" + name + r"\b")
        while True:
            m = rx.search(sql)
            if not m:
                break
            args, length = _parse_args(sql[m.end():])
            full = sql[m.start():m.end() + length]
            sql = sql.replace(full, macros[name](args))
    return sql


def expand(sql: str, time_from, time_to, interval_ms: int = 1000,
           variables: dict[str, Variable] | None = None) -> str:
    """Both stages: the SQL DuckDB receives from Grafana for this range, interval and variables.

    ``time_from`` / ``time_to`` are datetimes or int nanoseconds since the epoch (UTC).
    """
    tf, tt = _as_dt(time_from), _as_dt(time_to)
    return expand_macros(expand_variables(sql, variables, interval_ms, tf, tt), tf, tt, interval_ms)

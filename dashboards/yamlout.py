"""A small YAML writer for Grafana provisioning files (no PyYAML dependency).

Emits block mappings and sequences; scalars are JSON-encoded (a JSON string, number, boolean or
null is a valid YAML flow scalar), except multi-line strings, which become literal block scalars
(``|-`` / ``|``) so that long SQL such as the datasource ``initSql`` stays readable in a ConfigMap.
Empty mappings and sequences are written as ``{}`` / ``[]``.
"""
from __future__ import annotations

import json


def _scalar(v) -> str:
    if isinstance(v, float) and v.is_integer():
        return json.dumps(v)
    return json.dumps(v, ensure_ascii=False)


def _block(s: str, indent: int) -> str | None:
    """A literal block scalar for ``s``, or None when ``s`` cannot be written as one exactly."""
    if "\n" not in s or "\r" in s or "\t" in s or s != s.rstrip(" "):
        return None
    lines = s.split("\n")
    if any(ln != ln.rstrip(" ") for ln in lines) or (lines[0][:1] == " "):
        return None   # trailing spaces / a leading space on the first line do not round-trip
    chomp = "|-" if not s.endswith("\n") else "|"
    body = lines if chomp == "|-" else lines[:-1]
    if chomp == "|" and s.endswith("\n\n"):
        return None   # "keep" chomping would be needed
    pad = " " * indent
    return chomp + "\n" + "\n".join((pad + ln) if ln else "" for ln in body)


def _emit(v, indent: int, out: list[str], prefix: str) -> None:
    pad = " " * indent
    if isinstance(v, dict):
        if not v:
            out.append(prefix + "{}")
            return
        first = True
        for k, x in v.items():
            key = _scalar(str(k)) if not _plain_key(str(k)) else str(k)
            lead = prefix if first else pad
            first = False
            if isinstance(x, (dict, list)) and x:
                out.append(f"{lead}{key}:")
                if isinstance(x, dict):
                    _emit(x, indent + 2, out, " " * (indent + 2))
                else:
                    _emit(x, indent, out, pad)
            elif isinstance(x, str) and (b := _block(x, indent + 2)) is not None:
                out.append(f"{lead}{key}: {b}")
            else:
                out.append(f"{lead}{key}: " + ("{}" if x == {} else "[]" if x == [] else _scalar(x)))
        return
    if isinstance(v, list):
        if not v:
            out.append(prefix + "[]")
            return
        for i, x in enumerate(v):
            lead = prefix if i == 0 else pad
            if isinstance(x, dict) and x:
                _emit(x, indent + 2, out, lead + "- ")
            elif isinstance(x, list) and x:
                out.append(lead + "-")
                _emit(x, indent + 2, out, " " * (indent + 2))
            elif isinstance(x, str) and (b := _block(x, indent + 2)) is not None:
                out.append(f"{lead}- {b}")
            else:
                out.append(lead + "- " + ("{}" if x == {} else "[]" if x == [] else _scalar(x)))
        return
    out.append(prefix + _scalar(v))


def _plain_key(k: str) -> bool:
    return bool(k) and all(c.isalnum() or c in "_-." for c in k) and not k[0].isdigit() and k[0] not in "-."


def dumps(obj, header: str | None = None) -> str:
    """YAML text for ``obj`` (dicts, lists, str, int, float, bool, None)."""
    out: list[str] = []
    if header:
        out.extend("# " + ln if ln else "#" for ln in header.splitlines())
    _emit(obj, 0, out, "")
    return "\n".join(out) + "\n"

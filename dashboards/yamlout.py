"""YAML text of Grafana provisioning files, written by PyYAML.

One setting beyond PyYAML's defaults: a multi-line string is written as a literal block scalar
(``|-`` / ``|``), so that long SQL such as the datasource ``initSql`` stays readable in a ConfigMap
(PyYAML itself falls back to a quoted scalar where a block cannot hold the string exactly). Keys keep
their order, lines are not folded, and non-ASCII text is written as is.
"""
from __future__ import annotations

import yaml


class _Dumper(yaml.SafeDumper):
    """SafeDumper whose multi-line strings are literal blocks."""


def _str(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


def dumps(obj, header: str | None = None) -> str:
    """YAML text for ``obj`` (dicts, lists, str, int, float, bool, None), after ``header`` as comments."""
    text = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, allow_unicode=True, default_flow_style=False,
                     width=1 << 30)
    if not header:
        return text
    return "".join(f"# {ln}\n" if ln else "#\n" for ln in header.splitlines()) + text

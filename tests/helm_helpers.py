"""Shared by the tests of the Helm chart (tests/test_helm_*.py): the value sets (the defaults and the
chart's ``ci/*.yaml``), the chart rendered by Helm's own library (``helm-python-sdk``, cached per value
set), small accessors of the rendered objects, and ``_parse`` (argparse that raises instead of exiting)."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "stepwatch"
RELEASE, NAMESPACE = "sw", "stepwatch"
FULL = f"{RELEASE}-stepwatch"
K8S_VERSION = kubernetes_validate.latest_version()

#: measured by `stepwatch bench overhead` (stepwatch/devtools/bench_overhead.py): 8 ranks, all plug-ins, 1 Hz
AGENT_CPU_MILLICORES, AGENT_RSS_MB = 16, 96

VALUE_SETS = {
    "defaults": yaml.safe_load((CHART / "ci" / "minimal-values.yaml").read_text()),
    "nvidia-sasl": yaml.safe_load((CHART / "ci" / "nvidia-sasl-values.yaml").read_text()),
    "ascend-profiling": yaml.safe_load((CHART / "ci" / "ascend-profiling-values.yaml").read_text()),
    "scale-out": yaml.safe_load((CHART / "ci" / "scale-out-values.yaml").read_text()),
    "alerting": yaml.safe_load((CHART / "ci" / "alerting-values.yaml").read_text()),
}
MINIMAL = VALUE_SETS["defaults"]
PUBLIC_KEY = VALUE_SETS["ascend-profiling"]["profiling"]["publicKey"]       # a real Ed25519 public key


# ------------------------------------------------------------------------------------------ helpers
_chart = helm.Chart.load(CHART)
_cache: dict[str, tuple[list[dict], str]] = {}


def render(values: dict) -> tuple[list[dict], str]:
    """(objects, NOTES.txt) of the chart rendered with ``values``."""
    out = _chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objs = [d for path, text in sorted(out.items()) if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]
    return objs, out.get("stepwatch/templates/NOTES.txt", "")


def rendered(name: str) -> list[dict]:
    if name not in _cache:
        _cache[name] = render(VALUE_SETS[name])
    return _cache[name][0]


def notes(name: str) -> str:
    rendered(name)
    return _cache[name][1]


def find(objs, kind, name=None):
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return hits


def one(objs, kind, name):
    hits = find(objs, kind, name)
    assert len(hits) == 1, f"expected one {kind} {name}, found {[o['metadata']['name'] for o in find(objs, kind)]}"
    return hits[0]


def pod_spec(o: dict) -> dict:
    if o["kind"] == "CronJob":
        return o["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return o["spec"]["template"]["spec"]


def containers(o: dict) -> list[dict]:
    s = pod_spec(o)
    return s.get("initContainers", []) + s["containers"]


def container(o: dict, name: str) -> dict:
    return next(c for c in containers(o) if c["name"] == name)


def mounts(c: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def volumes(o: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod_spec(o).get("volumes", [])}


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def workloads(objs):
    return [o for o in objs if o["kind"] in ("DaemonSet", "Deployment", "Job", "CronJob")]


def cpu_m(q: str) -> float:
    q = str(q)
    return float(q[:-1]) if q.endswith("m") else float(q) * 1000


def mem_mb(q: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi)?", str(q))
    return float(m.group(1)) * {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, None: 1 / (1 << 20)}[m.group(2)] * 1.048576


def with_values(**over) -> dict:
    """MINIMAL deep-merged with dotted-key overrides, e.g. with_values(**{"processor.replicas": 4})."""
    v = json.loads(json.dumps(MINIMAL))
    for dotted, val in over.items():
        d = v
        *path, last = dotted.split(".")
        for k in path:
            d = d.setdefault(k, {})
        d[last] = val
    return v


PG = {"catalog": "postgres", "postgres": {"connection": "host=pg dbname=lake user=sw"}}


class _ParseError(Exception):
    pass


def _parse(p: argparse.ArgumentParser, args: list[str]):
    """``p.parse_args(args)``, raising (not exiting) with the args and argparse's message on error."""
    def error(msg):
        raise _ParseError(f"{' '.join(args)}: {msg}")

    def patch(parser):
        parser.error = error
        for act in parser._actions:
            if isinstance(act, argparse._SubParsersAction):
                for sub in act.choices.values():
                    patch(sub)
    patch(p)
    return p.parse_args(args)

"""The Grafana files the Helm chart embeds, generated from this package (never copied by hand).

The chart (``helm/stepwatch``) reads them with ``.Files.Get`` / ``.Files.Glob`` from
``helm/stepwatch/files/grafana/``, which holds exactly what ``stepwatch grafana export --snapshot-dir
/var/lib/stepwatch/grafana/snapshot`` writes: the datasource reads the snapshot the chart's publisher
writes (:mod:`.snapshot`), never the lake, and the chart substitutes ``<grafana.snapshot.mountPath>/snapshot``
for that path. After changing the dashboards, the datasource or the alert rules::

    python -m stepwatch.dashboards.helmfiles            # rewrites helm/stepwatch/files/grafana/
    python -m stepwatch.dashboards.helmfiles --check    # exit 1 if the chart's copies are stale

``tests/test_helm_render.py`` runs the same comparison. The Prometheus-only Overview (:mod:`.promdash`) goes
to ``files/grafana-prometheus/`` (a ConfigMap with ``grafana.prometheusDashboards.enabled``).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from .build import check_or_write
from .export import DEFAULT_DATA_ROOT, DEFAULT_SNAPSHOT_DIR, export

#: the chart in a source checkout (``<repo>/helm/stepwatch``); pass ``--chart`` elsewhere
CHART_DIR = Path(__file__).resolve().parent.parent / "helm" / "stepwatch"
SUBDIR = Path("files") / "grafana"
PROM_SUBDIR = Path("files") / "grafana-prometheus"


def expected_files(snapshot_dir: str = DEFAULT_SNAPSHOT_DIR) -> dict[str, str]:
    """File name -> text, as ``stepwatch grafana export --snapshot-dir SNAPSHOT_DIR`` writes them (the
    chart embeds them with the default and puts its own snapshot path in place of it)."""
    with tempfile.TemporaryDirectory() as tmp:
        return {p.name: p.read_text(encoding="utf-8")
                for p in export(tmp, DEFAULT_DATA_ROOT, snapshot_dir=snapshot_dir)}


def expected_prometheus_files() -> dict[str, str]:
    """File name -> text of the Prometheus-only dashboards (``files/grafana-prometheus/``)."""
    from . import build, promdash
    return {f"{uid}.json": build.render(d) for uid, d in promdash.build_all().items()}


def _subdirs() -> list[tuple[Path, dict[str, str]]]:
    return [(SUBDIR, expected_files()), (PROM_SUBDIR, expected_prometheus_files())]


def stale(chart_dir: str | Path = CHART_DIR) -> list[str]:
    """Names of the chart's Grafana files that are missing, differ from the export, or are extra
    (``grafana-prometheus/<name>`` for the Prometheus-only dashboards)."""
    bad = []
    for sub, want in _subdirs():
        d = Path(chart_dir) / sub
        have = {p.name: p.read_text(encoding="utf-8") for p in d.iterdir() if p.is_file()} if d.is_dir() else {}
        pre = "" if sub == SUBDIR else f"{sub.name}/"
        bad += sorted(pre + n for n in set(want) | set(have) if want.get(n) != have.get(n))
    return bad


def write(chart_dir: str | Path = CHART_DIR) -> list[Path]:
    """(Re)write ``<chart>/files/grafana/`` from the export (and ``files/grafana-prometheus/``); removes
    files the generators no longer make."""
    out = []
    for sub, want in _subdirs():
        d = Path(chart_dir) / sub
        d.mkdir(parents=True, exist_ok=True)
        for p in d.iterdir():
            if p.is_file() and p.name not in want:
                p.unlink()
        for name, text in sorted(want.items()):
            p = d / name
            if not p.exists() or p.read_text(encoding="utf-8") != text:
                tmp = p.with_name(f".{name}.tmp")
                tmp.write_text(text, encoding="utf-8")
                tmp.replace(p)
            out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stepwatch.dashboards.helmfiles",
                                 description="Write the Grafana files embedded in the Helm chart.")
    ap.add_argument("--chart", type=Path, default=CHART_DIR, help=f"chart directory (default {CHART_DIR})")
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    a = ap.parse_args(argv)
    if not (a.chart / "Chart.yaml").is_file():
        print(f"{a.chart} is not a chart directory (no Chart.yaml): pass --chart", file=sys.stderr)
        return 2
    return check_or_write(a.check, lambda: stale(a.chart), lambda: write(a.chart), "chart Grafana files",
                          "python -m stepwatch.dashboards.helmfiles")


if __name__ == "__main__":
    sys.exit(main())

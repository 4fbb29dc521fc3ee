"""Small builders for Grafana dashboard JSON (schemaVersion 39, Grafana 10.4+).

A :class:`Dashboard` collects panels laid out on Grafana's 24-column grid, template variables and
annotation queries. Every SQL it embeds (panel targets, SQL annotations, query variables) is also
recorded as a :class:`SqlCheck` naming the columns Grafana will read from the result, so that tests
can run each one against a real store after Grafana's macro expansion (``tests/grafana_macros.py``).
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from .datasource import DS_REF

SCHEMA_VERSION = 39
TAG = "stepwatch"
GRAFANA_DS = {"type": "grafana", "uid": "-- Grafana --"}


@dataclass(frozen=True)
class SqlCheck:
    """One SQL text embedded in a dashboard, with what its consumer needs from the result."""

    dashboard: str          # dashboard uid
    where: str              # "panel <id> <title> / <refId>", "annotation <name>", "variable <name>"
    sql: str
    columns: tuple[str, ...]
    format: str = "table"   # table | time_series
    nonempty: bool = True


def sql(text: str) -> str:
    return textwrap.dedent(text).strip()


def bucket(col: str) -> str:
    """Start of the ``$__interval`` bucket holding ``col`` (a TIMESTAMPTZ), as a TIMESTAMPTZ."""
    return f"to_timestamp(floor(epoch_ms({col}) / $__interval_ms) * $__interval_ms / 1000)"


def target(q: str, fmt: str = "table", ref: str = "A") -> dict:
    return {"refId": ref, "datasource": dict(DS_REF), "editorMode": "code", "format": fmt,
            "rawQuery": True, "rawSql": q}


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    variables: list[dict] = field(default_factory=list)
    panels: list[dict] = field(default_factory=list)
    annotations: list[dict] = field(default_factory=list)
    checks: list[SqlCheck] = field(default_factory=list)
    time_from: str = "now-6h"
    _x: int = 0
    _y: int = 0
    _row_h: int = 0
    _next_id: int = 1

    # ------------------------------------------------------------------ layout
    def _place(self, w: int, h: int) -> dict:
        if self._x + w > 24:
            self._x, self._y, self._row_h = 0, self._y + self._row_h, 0
        pos = {"h": h, "w": w, "x": self._x, "y": self._y}
        self._x += w
        self._row_h = max(self._row_h, h)
        return pos

    def row(self, title: str) -> None:
        if self._x:
            self._x, self._y, self._row_h = 0, self._y + self._row_h, 0
        self.panels.append({"id": self._take_id(), "type": "row", "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self._y}, "panels": []})
        self._y += 1

    def _take_id(self, want: int | None = None) -> int:
        pid = want if want is not None else self._next_id
        self._next_id = max(self._next_id, pid + 1)
        return pid

    # ------------------------------------------------------------------ variables / annotations
    def query_variable(self, name: str, label: str, q: str, *, multi: bool = False, include_all: bool = False,
                       columns: tuple[str, ...] = ()) -> None:
        q = sql(q)
        self.variables.append({
            "type": "query", "name": name, "label": label, "datasource": dict(DS_REF),
            "query": q, "definition": q, "refresh": 2, "sort": 1, "regex": "",
            "multi": multi, "includeAll": include_all, "options": [],
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if include_all else {},
            "hide": 0, "skipUrlSync": False,
        })
        self.checks.append(SqlCheck(self.uid, f"variable {name}", q, columns or (name,)))

    def sql_annotation(self, name: str, q: str, color: str) -> None:
        """Annotations from a DuckDB query: columns time, timeEnd, text, tags (comma-separated)."""
        q = sql(q)
        self.annotations.append({"name": name, "datasource": dict(DS_REF), "enable": True, "hide": False,
                                 "iconColor": color, "target": target(q, "table", "Anno")})
        self.checks.append(SqlCheck(self.uid, f"annotation {name}", q, ("time", "timeEnd", "text", "tags")))

    def tag_annotation(self, name: str, tags: list[str], color: str) -> None:
        """Grafana's own annotations (those :class:`AnnotationSink` posts) filtered by tags."""
        self.annotations.append({"name": name, "datasource": dict(GRAFANA_DS), "enable": True, "hide": False,
                                 "iconColor": color,
                                 "target": {"type": "tags", "tags": tags, "matchAny": False, "limit": 200}})

    # ------------------------------------------------------------------ panels
    def panel(self, kind: str, title: str, q: str, columns: tuple[str, ...], *, w: int = 12, h: int = 8,
              fmt: str = "table", description: str = "", unit: str | None = None, options: dict | None = None,
              defaults: dict | None = None, overrides: list | None = None, panel_id: int | None = None,
              nonempty: bool = True, transformations: list | None = None) -> dict:
        q = sql(q)
        pid = self._take_id(panel_id)
        fd = {"custom": {}}
        if unit:
            fd["unit"] = unit
        fd.update(defaults or {})
        p = {"id": pid, "type": kind, "title": title, "description": description, "datasource": dict(DS_REF),
             "gridPos": self._place(w, h), "targets": [target(q, fmt)],
             "fieldConfig": {"defaults": fd, "overrides": overrides or []}, "options": options or {}}
        if transformations:
            p["transformations"] = transformations
        self.panels.append(p)
        self.checks.append(SqlCheck(self.uid, f"panel {pid} {title!r} / A", q, columns, fmt, nonempty))
        return p

    def timeseries(self, title: str, q: str, columns, *, stack: bool = False, bars: bool = False,
                   points: bool = False, fmt: str = "time_series", min0: bool = True, **kw) -> dict:
        custom = {"drawStyle": "bars" if bars else "points" if points else "line",
                  "lineWidth": 1, "fillOpacity": 60 if stack or bars else 10, "showPoints": "never" if not points else "always",
                  "pointSize": 4, "spanNulls": False, "lineInterpolation": "linear", "axisSoftMin": 0 if min0 else None,
                  "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
        custom = {k: v for k, v in custom.items() if v is not None}
        defaults = {"custom": custom, **kw.pop("defaults", {})}
        opts = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "desc"}}
        return self.panel("timeseries", title, q, tuple(columns), fmt=fmt, defaults=defaults, options=opts, **kw)

    def stat(self, title: str, q: str, column: str, *, w: int = 4, h: int = 4, thresholds: list | None = None,
             decimals: int | None = None, **kw) -> dict:
        """A stat of the numeric column(s) of a one-row query (``column``: the one that must exist)."""
        defaults = {"color": {"mode": "thresholds"},
                    "thresholds": {"mode": "absolute", "steps": thresholds or [{"color": "green", "value": None}]}}
        if decimals is not None:
            defaults["decimals"] = decimals
        opts = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value", "graphMode": "none", "justifyMode": "auto", "textMode": "auto",
                "orientation": "auto"}
        return self.panel("stat", title, q, (column,), w=w, h=h, defaults=defaults, options=opts, **kw)

    def table(self, title: str, q: str, columns, *, links: dict[str, str] | None = None,
              units: dict[str, str] | None = None, **kw) -> dict:
        overrides = []
        for col, url in (links or {}).items():
            overrides.append({"matcher": {"id": "byName", "options": col},
                              "properties": [{"id": "links", "value": [{"title": f"open {col}", "url": url}]}]})
        for col, unit in (units or {}).items():
            overrides.append({"matcher": {"id": "byName", "options": col},
                              "properties": [{"id": "unit", "value": unit}]})
        opts = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"], "fields": ""}}
        defaults = {"custom": {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": True}}
        return self.panel("table", title, q, tuple(columns), overrides=overrides, options=opts,
                          defaults=defaults, **kw)

    def heatmap(self, title: str, q: str, columns, *, value_name: str, unit: str = "ms", **kw) -> dict:
        opts = {"calculate": False, "cellGap": 1,
                "color": {"mode": "scheme", "scheme": "Oranges", "scale": "exponential", "exponent": 0.5,
                          "steps": 64, "reverse": False, "fill": "dark-orange"},
                "rowsFrame": {"layout": "unknown", "value": value_name},
                "yAxis": {"axisPlacement": "left", "reverse": False, "axisLabel": "ranks"},
                "cellValues": {"unit": unit}, "showValue": "never",
                "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
                "legend": {"show": True}, "exemplars": {"color": "rgba(255,0,255,0.7)"},
                "filterValues": {"le": 1e-9}}
        return self.panel("heatmap", title, q, tuple(columns), fmt="time_series", options=opts, **kw)

    def piechart(self, title: str, q: str, columns, **kw) -> dict:
        opts = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": True},
                "pieType": "donut", "displayLabels": ["name", "value"],
                "legend": {"displayMode": "table", "placement": "right", "showLegend": True, "values": ["value"]},
                "tooltip": {"mode": "single", "sort": "none"}}
        return self.panel("piechart", title, q, tuple(columns), options=opts, **kw)

    def bargauge(self, title: str, q: str, columns, **kw) -> dict:
        opts = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": True},
                "orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
                "valueMode": "color", "namePlacement": "auto", "sizing": "auto", "minVizHeight": 16,
                "minVizWidth": 8, "maxVizHeight": 300}
        return self.panel("bargauge", title, q, tuple(columns), options=opts, **kw)

    def text(self, title: str, content: str, *, w: int = 24, h: int = 3) -> dict:
        p = {"id": self._take_id(), "type": "text", "title": title, "gridPos": self._place(w, h),
             "options": {"mode": "markdown", "content": textwrap.dedent(content).strip()}}
        self.panels.append(p)
        return p

    # ------------------------------------------------------------------ output
    def json(self) -> dict:
        builtin = {"builtIn": 1, "datasource": dict(GRAFANA_DS), "enable": True, "hide": True,
                   "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": [TAG],
            "editable": True,
            "graphTooltip": 1,
            "timezone": "utc",
            "fiscalYearStartMonth": 0,
            "liveNow": False,
            "refresh": "30s",
            "schemaVersion": SCHEMA_VERSION,
            "time": {"from": self.time_from, "to": "now"},
            "timepicker": {},
            "weekStart": "",
            "links": [{"type": "dashboards", "tags": [TAG], "asDropdown": True, "includeVars": True,
                       "keepTime": True, "title": "stepwatch", "icon": "external link", "targetBlank": False,
                       "tooltip": "", "url": ""}],
            "annotations": {"list": [builtin] + self.annotations},
            "templating": {"list": self.variables},
            "panels": self.panels,
        }

"""Dashboards as code: the checked-in JSON is the generator's output, the structure is what Grafana
10.4+ loads, and every panel's SQL — expanded the way the DuckDB plugin expands Grafana's macros —
runs on a store written by the simulator and returns the columns its panel reads."""
from __future__ import annotations

import re
from datetime import datetime, timezone

import duckdb
import pyarrow as pa
import pytest

from stepwatch.wire import tables as wire
from stepwatch.devtools.simulate import Simulation
from stepwatch.dashboards import build
from stepwatch.dashboards.alerting import ALERT_KINDS, POINT_KINDS, alert_rules, rule_sql
from stepwatch.dashboards.datasource import DATASOURCE_UID, PLUGIN_ID, init_sql
from stepwatch.detectors.base import Alert
from stepwatch.storage.store import LakeStore
from stepwatch.storage import extensions

import grafana_macros as macros   # tests/grafana_macros.py: Grafana's expansion of a panel's SQL

pytestmark = pytest.mark.unit

T0 = 1_735_689_600 * 10**9          # 2025-01-01T00:00:00Z, step 0 starts here
STEPS, RANKS = 120, 64
SLOW_RANK, CONTENDED_RANK = 13, 9
S = 10**9
CHECKS = build.sql_checks()
DASHES = build.build_all()


def make_alerts(t_end: dict[int, int]) -> list[Alert]:
    """Alerts of every kind, timed on the simulated steps (``t_end``: step -> end time, ns)."""
    jit = Alert(job="j1", kind="jitter", status="firing", step_first=50, step_detected=60, t_detected=t_end[60],
                ranks=[3], nodes=["node-0000"], cause="gc", cost_pct=3.0, suggestion="raise the GC threshold")
    return [
        Alert(job="j1", kind="slow_rank", status="firing", step_first=40, step_detected=48, t_detected=t_end[48],
              ranks=[SLOW_RANK], nodes=["node-0001"], cause="computation", cost_pct=22.0, severity="critical",
              suggestion="isolate slow nodes", evidence={"busy_ms": 1300.0, "peer_median_ms": 1000.0}),
        Alert(job="j1", kind="regression", status="firing", step_first=60, step_detected=75, t_detected=t_end[75],
              cause="io", cost_pct=12.0, suggestion="more DataLoader workers"),
        Alert(job="j1", kind="recovery", status="firing", step_first=90, step_detected=100, t_detected=t_end[100],
              cause="io", cost_pct=0.0, suggestion="-"),
        jit,
        Alert(job="j1", kind="jitter", status="resolved", step_first=50, step_detected=90, t_detected=t_end[90],
              ranks=[3], nodes=["node-0000"], cause="gc", cost_pct=3.0, suggestion=jit.suggestion,
              alert_id=jit.alert_id),
        Alert(job="j1", kind="stall", status="firing", step_first=110, step_detected=115, t_detected=t_end[115],
              ranks=[CONTENDED_RANK], nodes=["node-0001"], cause="cpu", cost_pct=100.0,
              suggestion="stop the competing process"),
    ]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("grafana-store")
    sim = Simulation(job="j1", ranks=RANKS, steps=STEPS, step_ms=1000.0, seed=1, t0_ns=T0, pp=2,
                     faults=[f"slow-rank:rank={SLOW_RANK},pct=30,start=40",
                             f"cpu-contention:rank={CONTENDED_RANK},start=30", "gc-storm:rank=3,start=50,end=80"],
                     comm=True)
    g = sim.generate(0, STEPS)
    steps = g["steps"]
    t_end = dict(zip(steps.column("step").to_pylist(), steps.column("t_end").cast(pa.int64()).to_pylist()))
    alerts = pa.Table.from_pylist([a.row() for a in make_alerts(t_end)], schema=wire.ALERTS)
    st = LakeStore(root).init()
    from stepwatch.stream.offline import efficiency_tables
    eff = efficiency_tables(sim.topology(), steps, g["comm"])     # what the processor's efficiency detectors write
    st.write_flush({"topology": [sim.topology()], "steps": [steps], "host": [g["host"]], "gc": [g["gc"]],
                    "alerts": [alerts], "comm": [g["comm"]], **{k: [v] for k, v in eff.items()}}, {})
    # every panel's SQL below runs through the datasource's own initSql: locked down, lake read-only
    # ... with the extensions in a flat folder, as the Grafana pod's init container copies them
    ext = extensions.copy_to(tmp_path_factory.mktemp("grafana-ext"))[0].parent
    con = duckdb.connect()
    con.execute(init_sql(str(root), ext_dir=ext))
    yield con
    con.close()


def test_the_datasource_cannot_touch_files_outside_the_lake(store, tmp_path):
    """What a Grafana editor could type into a panel: every file outside the lake is out of reach,
    the lake is read-only, and the lockdown cannot be undone."""
    for sql in ["SELECT * FROM read_text('/etc/passwd')", "SELECT * FROM read_csv('/etc/passwd')",
                "SELECT * FROM glob('/etc/*')", f"COPY (SELECT 1) TO '{tmp_path}/x.csv'",
                f"ATTACH '{tmp_path}/other.duckdb' AS other", "INSTALL httpfs", "LOAD httpfs",
                "SET enable_external_access = true", "SET allowed_directories = ['/']",
                "RESET lock_configuration", "INSERT INTO lake.alerts (job) VALUES ('x')", "DELETE FROM lake.steps"]:
        with pytest.raises(duckdb.Error):
            store.execute(sql).fetchall()
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "other.duckdb").exists()
    assert store.execute("SELECT count(*) > 0 FROM steps").fetchone() == (True,)


RANGE = (datetime(2024, 12, 31, 23, 59, tzinfo=timezone.utc), datetime(2025, 1, 1, 0, 10, tzinfo=timezone.utc))
INTERVAL_MS = 5000
OPTIONS = {"job": ["j1"], "node": ["node-0001"]}


def variables_for(uid: str, all_selected: bool = True) -> dict[str, macros.Variable]:
    out = {}
    for v in DASHES[uid]["templating"]["list"]:
        val = macros.ALL if (v["includeAll"] and all_selected) else OPTIONS[v["name"]][0]
        out[v["name"]] = macros.Variable(v["name"], val, v["multi"], v["includeAll"], None, OPTIONS[v["name"]])
    return out


def run(con, sql: str):
    cur = con.execute(sql)
    return [d[0] for d in cur.description], cur.fetchall()


# ----------------------------------------------------------------------------- generated files
def test_checked_in_json_equals_generator_output():
    assert build.stale() == [], "dashboards/json is out of date: run python -m stepwatch.dashboards.build"


def test_dashboards_are_grafana_10_4_json_on_the_duckdb_datasource():
    assert set(DASHES) == {"stepwatch-overview", "stepwatch-job", "stepwatch-node", "stepwatch-alerts"}
    for uid, d in DASHES.items():
        assert d["schemaVersion"] == 39 and d["uid"] == uid and "stepwatch" in d["tags"]
        assert "id" not in d and "version" not in d
        names = [v["name"] for v in d["templating"]["list"]]
        assert names[0] == "job"
        jv = d["templating"]["list"][0]
        assert jv["type"] == "query" and jv["datasource"] == {"type": PLUGIN_ID, "uid": DATASOURCE_UID}
        assert jv["query"].startswith("SELECT DISTINCT job FROM steps")
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids))
        for p in d["panels"]:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
            for t in p.get("targets", []):
                assert p["datasource"] == t["datasource"] == {"type": PLUGIN_ID, "uid": DATASOURCE_UID}
                assert t["format"] in ("table", "time_series") and t["rawSql"]
    assert [v["name"] for v in DASHES["stepwatch-node"]["templating"]["list"]] == ["job", "node"]


def test_every_embedded_sql_is_checked():
    """No SQL in the JSON escapes the run-every-query test below."""
    found = set()
    for uid, d in DASHES.items():
        for p in d["panels"]:
            found |= {(uid, t["rawSql"]) for t in p.get("targets", [])}
        found |= {(uid, a["target"]["rawSql"]) for a in d["annotations"]["list"] if "rawSql" in a.get("target", {})}
        found |= {(uid, v["query"]) for v in d["templating"]["list"]}
    assert found == {(c.dashboard, c.sql) for c in CHECKS}


def test_the_panels_the_issue_asks_for():
    titles = {uid: " | ".join(p["title"] for p in d["panels"]) for uid, d in DASHES.items()}
    for want in ("Jobs", "Step time p50 / max", "Throughput", "Jitter ratio", "Firing alerts"):
        assert want in titles["stepwatch-overview"]
    for want in ("Step time (change points", "Busy time per rank (ranks x steps)", "Slowest ranks",
                 "Phase breakdown", "Alerts"):
        assert want in titles["stepwatch-job"]
    for want in ("Host CPU", "I/O wait", "Top processes", "NIC", "Accelerator", "GC pauses"):
        assert want in titles["stepwatch-node"]
    assert "Alerts" in titles["stepwatch-alerts"]
    job = DASHES["stepwatch-job"]
    assert any(p["type"] == "heatmap" for p in job["panels"])
    phase = next(p for p in job["panels"] if p["title"] == "Phase breakdown")
    assert phase["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    annos = job["annotations"]["list"]
    assert any(a["name"] == "Change points" and "FROM alerts" in a["target"]["rawSql"] for a in annos)
    assert any(a.get("target", {}).get("type") == "tags" and "job:${job}" in a["target"]["tags"] for a in annos)


# ----------------------------------------------------------------------------- every SQL runs
@pytest.mark.parametrize("check", CHECKS, ids=[f"{c.dashboard}:{c.where}" for c in CHECKS])
def test_panel_sql_runs_on_a_simulated_store(store, check):
    for all_selected in (True, False):
        sql = macros.expand(check.sql, *RANGE, INTERVAL_MS, variables_for(check.dashboard, all_selected))
        assert "$" not in sql.replace("$$", ""), f"unexpanded macro/variable in {check.where}"
        cols, rows = run(store, sql)
        missing = [c for c in check.columns if c not in cols]
        assert not missing, f"{check.where}: missing columns {missing}; got {cols}"
        if check.nonempty:
            assert rows, f"{check.where}: no rows"
        if check.format == "time_series":
            assert cols[0] == "time" and all(r[0] is not None for r in rows)
            times = [r[0] for r in rows]
            assert times == sorted(times), f"{check.where}: time series not ordered by time"


def _check(uid: str, title: str):
    return next(c for c in CHECKS if c.dashboard == uid and c.where.endswith(f"{title!r} / A"))


def test_panels_show_the_injected_faults(store):
    def q(uid, title):
        c = _check(uid, title)
        return run(store, macros.expand(c.sql, *RANGE, INTERVAL_MS, variables_for(uid)))
    cols, rows = q("stepwatch-job", "Slowest ranks")
    top = dict(zip(cols, rows[0]))
    assert top["rank"] == SLOW_RANK and top["node"] == "node-0001" and top["cost_pct"] > 5
    assert top["alert_cause"] == "computation" and top["alert_cost_pct"] == 22.0
    cols, rows = q("stepwatch-node", "Top processes (latest sample)")
    assert rows[0][cols.index("name")] == "monitor-plugin"
    cols, rows = q("stepwatch-job", "Busy time per rank (ranks x steps)")
    assert len({r[1] for r in rows}) <= build.HEATMAP_ROWS
    cols, rows = q("stepwatch-overview", "Firing alerts")
    kinds = {r[cols.index("kind")] for r in rows}
    assert kinds == {"slow_rank", "regression", "recovery", "stall"}      # the jitter alert was resolved


def test_change_points_are_regions_from_first_step_to_detection(store):
    c = next(c for c in CHECKS if c.where == "annotation Change points")
    cols, rows = run(store, macros.expand(c.sql, *RANGE, INTERVAL_MS, variables_for("stepwatch-job")))
    assert len(rows) == 2
    for r in rows:
        a = dict(zip(cols, r))
        assert a["time"] < a["timeEnd"] and "kind:" in a["tags"] and a["text"]


def test_time_filter_limits_rows(store):
    c = _check("stepwatch-job", "Step time (change points and alerts marked)")
    narrow = (datetime(2025, 1, 1, tzinfo=timezone.utc), datetime(2025, 1, 1, 0, 0, 30, tzinfo=timezone.utc))
    _, rows = run(store, macros.expand(c.sql, *narrow, 1000, variables_for("stepwatch-job")))
    assert 25 <= len(rows) <= 31


# ----------------------------------------------------------------------------- alert rules
def test_alert_rule_sql_returns_open_alerts_with_labels(store):
    assert len(alert_rules(folder_uid="x")) == len(ALERT_KINDS) == 5
    window = (T0, T0 + 600 * S)
    for kind in ALERT_KINDS:
        cols, rows = run(store, macros.expand(rule_sql(kind), *window, 1000))
        assert cols == ["job", "incident", "cause", "ranks", "nodes", "severity", "suggestion", "firing"]
        if kind == "jitter":
            assert rows == []            # resolved
        else:
            assert len(rows) == 1 and rows[0][0] == "j1" and rows[0][-1] == 1.0
    late = (T0 + 3600 * S, T0 + 3700 * S)   # an hour later, point kinds have aged out
    for kind in POINT_KINDS:
        assert run(store, macros.expand(rule_sql(kind), *late, 1000))[1] == []
    assert run(store, macros.expand(rule_sql("slow_rank"), *late, 1000))[1]


# ----------------------------------------------------------------------------- macro expansion
def test_macro_expansion_follows_the_plugin():
    tf = datetime(2025, 1, 1, 0, 0, 0, 900000, tzinfo=timezone.utc)
    tt = datetime(2025, 1, 1, 6, 0, 0, tzinfo=timezone.utc)
    e = macros.expand("WHERE $__timeFilter(t_end) AND t > $__timeFrom() AND t < $__timeTo()", tf, tt)
    assert e == ("WHERE t_end >= '2025-01-01T00:00:00Z' AND t_end <= '2025-01-01T06:00:00Z' "
                 "AND t > '2025-01-01T00:00:00Z' AND t < '2025-01-01T06:00:00Z'")
    assert macros.expand("$__interval_ms $__interval", tf, tt, 60_000) == "60000 1m"
    assert macros.expand("$__interval", tf, tt, 500) == "500ms"
    one = {"job": macros.Variable("job", "it's")}
    assert macros.expand("job = '${job}' OR job = '$job' OR [[job]]", tf, tt, 1, one) == \
        "job = 'it''s' OR job = 'it''s' OR it''s"
    many = {"job": macros.Variable("job", ["a", "b'c"], multi=True)}
    assert macros.expand("job IN (${job})", tf, tt, 1, many) == "job IN ('a','b''c')"
    everything = {"job": macros.Variable("job", macros.ALL, multi=True, include_all=True, options=["x", "y"])}
    assert macros.expand("job IN ($job)", tf, tt, 1, everything) == "job IN ('x','y')"
    custom = {"job": macros.Variable("job", macros.ALL, include_all=True, all_value="SELECT job FROM steps")}
    assert macros.expand("job IN ($job)", tf, tt, 1, custom) == "job IN (SELECT job FROM steps)"
    assert macros.expand("$unknown ${other}", tf, tt, 1, one) == "$unknown ${other}"
    with pytest.raises(ValueError):
        macros.expand("$__timeFrom(t)", tf, tt)
    with pytest.raises(ValueError):
        macros.expand("$__timeFilter(a, b)", tf, tt)
    assert re.search(r"'2025-01-01T00:00:00Z'", macros.expand("$__timeFrom( )", tf, tt))

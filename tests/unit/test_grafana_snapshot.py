"""Grafana's connection reaches only the views: it opens the snapshot the publisher writes, with the
exact settings of the provisioning file stepwatch exports (parsed, as the plugin reads it: the
``path``'s DSN parameters, then ``initSql``), and every attack on the lake, the files, the network or
the settings is refused, while every panel's SQL still returns rows."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
import yaml

from stepwatch.wire import tables as wire
from stepwatch.dashboards import datasource, snapshot
from stepwatch.devtools.simulate import Simulation
from stepwatch.storage.store import LakeStore

import grafana_macros as macros   # tests/grafana_macros.py
from test_grafana_dashboards import (CHECKS, INTERVAL_MS, RANGE, RANKS, STEPS, T0, make_alerts,  # noqa: F401
                                     variables_for)

pytestmark = pytest.mark.unit


def parse_path(path: str) -> tuple[str, dict]:
    """A datasource ``path`` as go-duckdb reads it: the file and the DSN parameters as DuckDB config (also
    run in GRAFANA_SIDE's process, which has only its source)."""
    file, _, query = path.partition("?")
    return file, dict(kv.split("=", 1) for kv in query.split("&") if kv)


def grafana_connect(provisioning_yaml: str) -> duckdb.DuckDBPyConnection:
    """What the DuckDB plugin does with the provisioned datasource: open ``jsonData.path`` with its DSN
    parameters as configuration, then run ``initSql``."""
    ds = yaml.safe_load(provisioning_yaml)["datasources"][0]
    file, cfg = parse_path(ds["jsonData"]["path"])
    con = duckdb.connect(file, config=cfg)
    con.execute(ds["jsonData"]["initSql"])
    return con


@pytest.fixture(scope="module")
def world():
    """A lake written by the processor's store, and its published snapshot in a directory the test
    makes world-traversable (the Grafana user of the last test must reach it)."""
    base = Path(tempfile.mkdtemp(prefix="sw-grafana-"))
    os.chmod(base, 0o755)
    lake_dir = base / "lake-root"
    sim = Simulation(job="j1", ranks=RANKS, steps=STEPS, step_ms=1000.0, seed=1, t0_ns=T0, pp=2,
                     faults=["slow-rank:rank=13,pct=30,start=40", "cpu-contention:rank=9,start=30",
                             "gc-storm:rank=3,start=50,end=80"], comm=True)
    g = sim.generate(0, STEPS)
    steps = g["steps"]
    t_end = dict(zip(steps.column("step").to_pylist(), steps.column("t_end").cast(pa.int64()).to_pylist()))
    alerts = pa.Table.from_pylist([a.row() for a in make_alerts(t_end)], schema=wire.ALERTS)
    from stepwatch.stream.offline import efficiency_tables
    eff = efficiency_tables(sim.topology(), steps, g["comm"])
    st = LakeStore(lake_dir).init()
    st.write_flush({"topology": [sim.topology()], "steps": [steps], "host": [g["host"]], "gc": [g["gc"]],
                    "alerts": [alerts], "comm": [g["comm"]], **{k: [v] for k, v in eff.items()}}, {})
    st.close()
    snap = base / "grafana"
    res = snapshot.publish(lake_dir, snap, window_s=0)
    assert res.rows["steps"] == STEPS * RANKS
    prov = datasource.provisioning_file(None, snapshot_dir=str(snap))
    con = grafana_connect(prov)
    yield {"base": base, "lake": lake_dir, "snap": snap, "prov": prov, "con": con}
    con.close()
    for d, _, _ in os.walk(base):
        os.chmod(d, 0o755)
    import shutil
    shutil.rmtree(base)


def refused(con, sql: str) -> str:
    with pytest.raises(duckdb.Error) as e:
        con.execute(sql).fetchall()
    return str(e.value)


def test_the_provisioned_datasource_names_no_lake_and_no_extension(world):
    ds = yaml.safe_load(world["prov"])["datasources"][0]["jsonData"]
    text = ds["path"] + ds["initSql"]
    for word in ("ducklake", "sqlite", "postgres", "LOAD", "INSTALL", "ATTACH", "lake.sqlite"):
        assert word not in text
    assert parse_path(ds["path"])[1] == {"access_mode": "READ_ONLY"}


def test_every_attack_of_the_issue_is_refused(world):
    con, lake, snap = world["con"], world["lake"], world["snap"]
    cat = lake / "lake.sqlite"
    data_file = next((lake / "lake").rglob("*.parquet"))
    grafana_db = world["base"] / "grafana.db"          # what Grafana keeps its API keys in
    s = duckdb.connect(str(grafana_db))
    s.execute("CREATE TABLE api_key AS SELECT 'secret' AS key")
    s.close()
    attacks = [
        f"SELECT * FROM sqlite_scan('{cat}', 'ducklake_data_file')",
        f"SELECT * FROM sqlite_scan('{grafana_db}', 'api_key')",
        f"ATTACH '{cat}' AS cat (TYPE sqlite)",
        f"ATTACH '{grafana_db}' AS g (READ_ONLY)",
        f"ATTACH '{lake}/lake/new.duckdb' AS n",
        f"ATTACH '{snap}/data/new.duckdb' AS n",
        "ATTACH ':memory:' AS m",
        f"COPY (SELECT 1 AS a) TO '{data_file}'",
        f"COPY (SELECT 1 AS a) TO '{world['base']}/x.csv'",
        f"SELECT * FROM read_parquet('{data_file}')",
        f"SELECT * FROM read_text('{cat}')",
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM postgres_scan('host=127.0.0.1 port=9', 'public', 't')",
        "SELECT * FROM read_parquet('http://127.0.0.1:9/x.parquet')",
        "INSTALL sqlite", "LOAD sqlite", "INSTALL httpfs", "LOAD postgres",
        "SET enable_external_access = true", "SET allowed_directories = ['/']", "SET lock_configuration = false",
        "RESET lock_configuration", "SET autoload_known_extensions = true", "SET access_mode = 'READ_WRITE'",
        "CREATE OR REPLACE VIEW steps AS SELECT * FROM steps WHERE false",
        "CREATE TABLE x AS SELECT 1", "DROP VIEW steps",
    ]
    for sql in attacks:
        refused(con, sql)
    assert not (lake / "lake" / "new.duckdb").exists() and not (world["base"] / "x.csv").exists()
    # ... and every other connection (another dashboard) still sees every step
    assert con.cursor().execute("SELECT count(*) FROM steps").fetchone() == (STEPS * RANKS,)


@pytest.mark.parametrize("check", CHECKS, ids=[f"{c.dashboard}:{c.where}" for c in CHECKS])
def test_every_panel_sql_returns_rows_from_the_snapshot(world, check):
    sql = macros.expand(check.sql, *RANGE, INTERVAL_MS, variables_for(check.dashboard, True))
    cur = world["con"].execute(sql)
    cols = [d[0] for d in cur.description]
    rows = cur.fetchall()
    assert not [c for c in check.columns if c not in cols], (check.where, cols)
    if check.nonempty:
        assert rows, f"{check.where}: no rows"


def test_a_new_publish_is_seen_without_reconnecting(world, tmp_path):
    con = world["con"]
    before = con.execute("SELECT count(*) FROM alerts").fetchone()[0]
    st = LakeStore(world["lake"])
    extra = pa.Table.from_pylist([make_alerts({s: T0 + s * 10**9 for s in range(STEPS)})[0].row()],
                                 schema=wire.ALERTS)
    st.write_flush({"alerts": [extra]}, {})
    st.close()
    snapshot.publish(world["lake"], world["snap"], window_s=0)
    assert con.execute("SELECT count(*) FROM alerts").fetchone()[0] == before + 1


GRAFANA_SIDE = r"""
import json, os, sys
import duckdb, yaml
""" + inspect.getsource(parse_path) + r"""
ds = yaml.safe_load(open(sys.argv[1]).read())["datasources"][0]["jsonData"]
if os.geteuid() == 0:
    os.setgid(65534); os.setuid(65534)          # Grafana runs as its own user, not the publisher's
file, cfg = parse_path(ds["path"])
con = duckdb.connect(file, config=cfg)
con.execute(ds["initSql"])
snap = sys.argv[2]
out = {"steps": con.execute("SELECT count(*) FROM steps").fetchone()[0]}
for name, sql in {"overwrite": f"COPY (SELECT 1 AS a) TO '{snap}/data/steps.parquet' (FORMAT parquet, USE_TMP_FILE false)",
                  "overwrite_tmp": f"COPY (SELECT 1 AS a) TO '{snap}/data/steps.parquet' (FORMAT parquet)",
                  "new": f"COPY (SELECT 1 AS a) TO '{snap}/data/x.parquet' (FORMAT parquet)",
                  "wal": f"COPY (SELECT 1 AS a) TO '{snap}/stepwatch.duckdb.wal' (FORMAT csv)"}.items():
    try:
        con.execute(sql)
        out[name] = "written"
    except duckdb.Error as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_the_grafana_user_cannot_write_the_snapshot(world):
    """DuckDB lets the connection read ``data/`` (it has no read-only variant of allowed_directories);
    the publisher leaves the files and folders read-only, so Grafana's own user cannot write them."""
    prov = world["base"] / "ds.yaml"
    prov.write_text(world["prov"])
    os.chmod(prov, 0o644)
    p = subprocess.run([sys.executable, "-c", GRAFANA_SIDE, str(prov), str(world["snap"])],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["steps"] == STEPS * RANKS
    for k in ("overwrite", "overwrite_tmp", "new", "wal"):
        assert out[k] != "written" and "ermission denied" in out[k], (k, out[k])
    assert not (world["snap"] / "data" / "x.parquet").exists()
    assert world["con"].execute("SELECT count(*) FROM steps").fetchone() == (STEPS * RANKS,)


def test_cli_publish_then_export_gives_a_datasource_that_reads_it(world, tmp_path):
    from stepwatch.dashboards.grafana_cmd import register
    import argparse
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    snap = world["base"] / "cli-snap"
    a = ap.parse_args(["grafana", "publish", "--data-dir", str(world["lake"]), "--snapshot-dir", str(snap),
                       "--once", "--window-days", "0"])
    assert a.func(a) == 0
    a = ap.parse_args(["grafana", "export", "--out", str(tmp_path / "out"), "--snapshot-dir", str(snap)])
    assert a.func(a) == 0
    con = grafana_connect((tmp_path / "out" / "datasources.yaml").read_text())
    assert con.execute("SELECT count(*) FROM job_steps").fetchone() == (STEPS,)
    refused(con, f"SELECT * FROM sqlite_scan('{world['lake']}/lake.sqlite', 'ducklake_data_file')")
    con.close()


@pytest.mark.parametrize("cmd", ["export", "provision"])
def test_cli_without_snapshot_dir_warns_that_panel_sql_reaches_the_lake(cmd, tmp_path, monkeypatch, capsys):
    """`stepwatch grafana export/provision` without --snapshot-dir still write the lake datasource, and
    say on stderr what it exposes and what to use instead; with --snapshot-dir they say nothing of it.
    (provision: the argument checks pass, then it fails on the unreachable URL: no traffic leaves
    127.0.0.1.)"""
    from stepwatch.cli import main
    monkeypatch.delenv("STEPWATCH_GRAFANA_SNAPSHOT_DIR", raising=False)
    token = tmp_path / "token"
    token.write_text("t")
    args = {"export": ["grafana", "export", "--out", str(tmp_path / "out")],
            "provision": ["grafana", "provision", "--url", "http://127.0.0.1:9", "--token-file", str(token),
                          "--timeout", "1"]}[cmd]
    main(args + ["--data-root", "/var/lib/stepwatch/data"])
    err = capsys.readouterr().err
    assert f"stepwatch grafana {cmd}: warning: without --snapshot-dir" in err
    for what in ("sqlite_scan", "rewrite", "catalog", "stepwatch grafana publish", "--snapshot-dir"):
        assert what in err
    main(args + ["--snapshot-dir", "/var/lib/stepwatch/grafana/snapshot"])
    assert "warning" not in capsys.readouterr().err

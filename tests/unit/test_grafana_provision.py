"""``provision`` against a stand-in Grafana on 127.0.0.1 that checks every request against Grafana's
published API spec: it creates everything, a second run changes nothing, and the documented error
answers (401, 409, 412) are handled with a retry or a clear message."""
from __future__ import annotations

import argparse
import copy
import json
import re

import pytest

from grafana_fake import (T_FIRST, FakeGrafana, api_spec, grafana, optional_spec,  # noqa: F401 (fixtures)
                          sample_alert)
from stepwatch.dashboards import alerting, build
from stepwatch.dashboards.annotations import AnnotationSink
from stepwatch.dashboards.grafana_cmd import register
from stepwatch.dashboards.datasource import DATASOURCE_UID, PLUGIN_ID, provisioning_doc
from stepwatch.dashboards.export import export
from testkit import free_port
from stepwatch.dashboards.grafana import (GrafanaAuthError, GrafanaConflictError, GrafanaError, TOKEN_ENV,
                                          TOKEN_FILE_ENV, contains, provision, read_token)
from stepwatch.dashboards.datasource import init_sql

pytestmark = pytest.mark.unit

ROOT = "/var/lib/stepwatch/data"
N_OBJECTS = 1 + 1 + len(build.BUILDERS) + len(alerting.ALERT_KINDS)


def writes(g: FakeGrafana, since: int = 0):
    return [(r.method, r.path) for r in g.requests[since:] if r.method in ("POST", "PUT", "DELETE", "PATCH")]


def test_provision_creates_everything_then_changes_nothing(grafana):
    res = provision(grafana.url, grafana.token, ROOT)
    assert [c.action for c in res.changes] == ["created"] * N_OBJECTS
    assert set(grafana.dashboards) == set(build.build_all())
    assert set(grafana.rules) == {alerting.rule_uid(k) for k in alerting.ALERT_KINDS}
    ds = grafana.datasources[DATASOURCE_UID]
    assert ds["type"] == PLUGIN_ID and ds["jsonData"] == {"path": "", "initSql": init_sql(ROOT)}
    for d in grafana.dashboards.values():
        assert d["folderUid"] == "stepwatch"
    for r in grafana.rules.values():
        assert r["folderUID"] == "stepwatch" and r["labels"]["kind"] in alerting.ALERT_KINDS
        assert r["data"][0]["datasourceUid"] == DATASOURCE_UID
    n = len(grafana.requests)

    again = provision(grafana.url, grafana.token, ROOT)
    assert not again.changed and [c.action for c in again.changes] == ["unchanged"] * N_OBJECTS
    assert writes(grafana, n) == [], "a second run must not write anything"
    assert {r.method for r in grafana.requests[n:]} == {"GET"}
    assert grafana.violations == []


def test_every_request_validates_against_the_grafana_api_spec(api_spec, tmp_path):
    g = FakeGrafana(spec=api_spec).start()
    try:
        provision(g.url, g.token, ROOT)
        g.dashboards["stepwatch-job"]["dashboard"]["panels"].pop()      # drift: one update of each kind
        g.datasources[DATASOURCE_UID]["jsonData"]["initSql"] = "SELECT 1"
        g.rules["stepwatch-stall"]["title"] = "edited"
        g.folders["stepwatch"]["title"] = "renamed"
        res = provision(g.url, g.token, ROOT)
        assert sorted(c.uid for c in res.changes if c.action == "updated") == \
            sorted(["stepwatch", DATASOURCE_UID, "stepwatch-job", "stepwatch-stall"])
        sink = AnnotationSink(g.url, g.token, backoff_s=0.01)
        sink.submit(sample_alert("firing"), t_first_ns=T_FIRST)
        sink.submit(sample_alert("resolved"))
        assert sink.close(5)
    finally:
        g.stop()
    methods = {(r.method, r.template) for r in g.requests}
    assert {("GET", "/folders/{folder_uid}"), ("POST", "/folders"), ("PUT", "/folders/{folder_uid}"),
            ("GET", "/datasources/uid/{uid}"), ("POST", "/datasources"), ("PUT", "/datasources/uid/{uid}"),
            ("GET", "/dashboards/uid/{uid}"), ("POST", "/dashboards/db"),
            ("GET", "/v1/provisioning/alert-rules/{UID}"), ("POST", "/v1/provisioning/alert-rules"),
            ("PUT", "/v1/provisioning/alert-rules/{UID}"), ("POST", "/annotations")} <= methods
    assert all(r.template for r in g.requests), "every request path is one the spec has"
    assert g.violations == []


def test_the_validator_catches_what_grafana_would_reject(api_spec):
    auth = {"authorization": "Bearer x", "content-type": "application/json"}
    ok = json.dumps({"text": "t", "time": 1, "tags": ["a"]}).encode()
    assert api_spec.validate_request("POST", "/api/annotations", auth, ok) == []
    bad = [
        ("POST", "/api/annotations", json.dumps({"time": 1}).encode(), "required field 'text'"),
        ("POST", "/api/annotations", json.dumps({"text": "t", "time": "1"}).encode(), "expected integer"),
        ("POST", "/api/annotations", json.dumps({"text": "t", "panelId": None}).encode(), "null"),
        ("POST", "/api/annotations", json.dumps({"text": "t", "tag": ["x"]}).encode(), "not in the spec"),
        ("PATCH", "/api/dashboards/db", b"{}", "method not allowed"),
        ("GET", "/api/no/such/thing", b"", "no such path"),
        ("POST", "/api/v1/provisioning/alert-rules",
         json.dumps({**alerting.alert_rule("stall", folder_uid="f"), "for": "soon"}).encode(), "not a duration"),
        ("POST", "/api/v1/provisioning/alert-rules",
         json.dumps({**alerting.alert_rule("stall", folder_uid="f"), "noDataState": "Nope"}).encode(), "not one of"),
        ("POST", "/api/v1/provisioning/alert-rules",
         json.dumps({**alerting.alert_rule("stall", folder_uid="f"), "uid": "bad uid!"}).encode(), "does not match"),
        ("POST", "/api/dashboards/db", json.dumps({"dashboard": {}, "folderUID": "x"}).encode(), "folderUID"),
    ]
    for method, path, body, why in bad:
        errs = api_spec.validate_request(method, path, auth, body)
        assert any(why in e for e in errs), (method, path, why, errs)
    assert any("Authorization" in e for e in api_spec.validate_request("GET", "/api/folders/x", {}, b""))
    assert api_spec.validate_response("PUT", "/datasources/uid/{uid}", 409, {"message": "x"}) != []
    assert api_spec.validate_response("POST", "/dashboards/db", 412, {"message": "x", "status": "version-mismatch"}) == []


def test_drift_is_repaired_and_only_the_drifted_object_is_written(grafana):
    provision(grafana.url, grafana.token, ROOT)
    grafana.dashboards["stepwatch-node"]["dashboard"]["title"] = "hand edited"
    n = len(grafana.requests)
    res = provision(grafana.url, grafana.token, ROOT)
    assert [(c.uid, c.action) for c in res.changes if c.action != "unchanged"] == [("stepwatch-node", "updated")]
    assert writes(grafana, n) == [("POST", "/api/dashboards/db")]
    post = [r for r in grafana.requests[n:] if r.method == "POST"][0]
    assert post.body["overwrite"] is False and post.body["dashboard"]["version"] == 1     # optimistic update
    assert grafana.dashboards["stepwatch-node"]["dashboard"]["title"] == "stepwatch / Node"
    assert grafana.violations == []


def test_401_is_a_clear_error_without_the_token(grafana):
    secret = "glsa_do-not-print-me"
    with pytest.raises(GrafanaAuthError) as e:
        provision(grafana.url, secret, ROOT, token_source="the token file given by --token-file")
    msg = str(e.value)
    assert "401" in msg and "--token-file" in msg and grafana.url in msg and secret not in msg
    assert grafana.requests[0].status == 401 and len(grafana.requests) == 1
    assert grafana.violations == []


def test_412_version_mismatch_is_retried_with_overwrite(grafana):
    provision(grafana.url, grafana.token, ROOT)
    grafana.dashboards["stepwatch-job"]["dashboard"]["panels"].pop()
    grafana.fail("POST", r"^/api/dashboards/db$", 412,
                 {"message": "The dashboard has been changed by someone else", "status": "version-mismatch"})
    n = len(grafana.requests)
    res = provision(grafana.url, grafana.token, ROOT)
    assert [(c.uid, c.action) for c in res.changes if c.action != "unchanged"] == [("stepwatch-job", "updated")]
    posts = [r for r in grafana.requests[n:] if r.method == "POST"]
    assert [p.status for p in posts] == [412, 200]
    assert posts[0].body["overwrite"] is False and posts[1].body["overwrite"] is True
    assert grafana.dashboards["stepwatch-job"]["dashboard"]["panels"] == build.build_all()["stepwatch-job"]["panels"]
    assert grafana.violations == []


def test_412_name_exists_is_a_clear_conflict(grafana):
    provision(grafana.url, grafana.token, ROOT, alert_rules=False)
    squatter = copy.deepcopy(grafana.dashboards["stepwatch-job"])
    squatter["dashboard"]["uid"] = "someone-elses"
    grafana.dashboards["someone-elses"] = squatter
    del grafana.dashboards["stepwatch-job"]
    with pytest.raises(GrafanaConflictError, match=r"412.*name-exists.*'stepwatch / Job'"):
        provision(grafana.url, grafana.token, ROOT, alert_rules=False)
    assert grafana.violations == []


def test_409_folder_title_taken_is_a_clear_conflict(grafana):
    grafana.folders["other-uid"] = {"id": 7, "uid": "other-uid", "title": "stepwatch", "version": 1}
    with pytest.raises(GrafanaConflictError, match=r"409.*folder titled 'stepwatch'.*--folder-uid"):
        provision(grafana.url, grafana.token, ROOT)
    assert grafana.violations == []


def test_409_folder_created_meanwhile_is_fine(grafana):
    """Our GET says 404, someone creates the folder, our POST gets 409: read it again and go on."""
    grafana.folders["stepwatch"] = {"id": 3, "uid": "stepwatch", "title": "stepwatch", "version": 1}
    grafana.fail("GET", r"^/api/folders/stepwatch$", 404, {"message": "folder not found"})
    res = provision(grafana.url, grafana.token, ROOT, alert_rules=False)
    assert res.changes[0].action == "unchanged"
    assert [(r.method, r.status) for r in grafana.requests[:3]] == [("GET", 404), ("POST", 409), ("GET", 200)]
    assert grafana.violations == []


def test_409_datasource_name_taken_is_a_clear_conflict(grafana):
    grafana.datasources["other"] = {"id": 9, "uid": "other", "name": "stepwatch", "type": "postgres",
                                    "access": "proxy", "version": 1}
    with pytest.raises(GrafanaConflictError, match=r"409.*datasource named 'stepwatch'"):
        provision(grafana.url, grafana.token, ROOT)
    assert grafana.violations == []


def test_read_only_datasource_is_not_overwritten(grafana):
    provision(grafana.url, grafana.token, ROOT)
    grafana.datasources[DATASOURCE_UID].update(readOnly=True, jsonData={"path": "", "initSql": "old"})
    with pytest.raises(GrafanaConflictError, match="provisioned from a file"):
        provision(grafana.url, grafana.token, ROOT)


def test_server_errors_and_unreachable_grafana_are_clear(grafana):
    grafana.fail("GET", r"^/api/folders/", 500, {"message": "database is locked"})
    with pytest.raises(GrafanaError, match="500: database is locked"):
        provision(grafana.url, grafana.token, ROOT)
    port = free_port()
    with pytest.raises(GrafanaError, match="cannot reach Grafana"):
        provision(f"http://127.0.0.1:{port}", "t", ROOT, timeout=2)


def test_custom_datasource_uid_reaches_every_reference(grafana):
    provision(grafana.url, grafana.token, ROOT, datasource_uid="sw-ds", datasource_name="sw")
    text = json.dumps([grafana.dashboards, grafana.rules])
    assert DATASOURCE_UID not in text and '"uid": "sw-ds"' in text
    assert grafana.datasources["sw-ds"]["name"] == "sw"


def test_contains_compares_what_we_set():
    assert contains({"a": 1, "b": [1, {"c": 2, "x": 0}], "extra": 1}, {"a": 1, "b": [1, {"c": 2}]})
    assert not contains({"a": 1, "b": [1]}, {"a": 1, "b": [1, 2]})
    assert not contains({"a": True}, {"a": 1}) and contains({"a": 1.0}, {"a": 1})


# ----------------------------------------------------------------------------- token and CLI
def test_token_comes_from_a_file_or_the_environment(tmp_path):
    f = tmp_path / "token"
    f.write_text("  file-token\n")
    assert read_token(f, env={}) == ("file-token", "the token file given by --token-file")
    assert read_token(None, env={TOKEN_FILE_ENV: str(f)})[0] == "file-token"
    assert read_token(None, env={TOKEN_ENV: "env-token"}) == ("env-token", f"${TOKEN_ENV}")
    with pytest.raises(GrafanaError, match="no Grafana token"):
        read_token(None, env={})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(GrafanaError, match="empty"):
        read_token(tmp_path / "empty", env={})
    with pytest.raises(GrafanaError) as e:
        read_token(tmp_path / "glsa_secret-looking-path", env={})
    assert "glsa_secret" not in str(e.value)


def parser():
    p = argparse.ArgumentParser(prog="stepwatch")
    register(p.add_subparsers(dest="cmd"))
    return p


def test_cli_provision_twice_and_refuses_a_token_flag(grafana, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    tok = tmp_path / "tok"
    tok.write_text(grafana.token)
    argv = ["grafana", "provision", "--url", grafana.url, "--token-file", str(tok), "--data-root", ROOT]
    a = parser().parse_args(argv)
    assert a.func(a) == 0
    out = capsys.readouterr().out
    assert "created" in out and grafana.token not in out
    a = parser().parse_args(argv)
    assert a.func(a) == 0
    assert capsys.readouterr().out.strip().endswith("nothing to change")
    with pytest.raises(SystemExit):
        parser().parse_args(["grafana", "provision", "--url", grafana.url, "--token", "glsa_abc"])
    err = capsys.readouterr().err
    assert "never taken on the command line" in err and "glsa_abc" not in err
    bad = tmp_path / "bad"
    bad.write_text("wrong")
    a = parser().parse_args(["grafana", "provision", "--url", grafana.url, "--token-file", str(bad),
                             "--data-root", ROOT])
    assert a.func(a) == 1
    err = capsys.readouterr().err
    assert "401" in err and "wrong" not in err
    assert grafana.violations == []


def test_cli_export_writes_configmap_ready_files(tmp_path, capsys):
    a = parser().parse_args(["grafana", "export", "--out", str(tmp_path / "out"), "--data-root", "/data/sw"])
    assert a.func(a) == 0
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted([f"{u}.json" for u in build.build_all()]
                           + ["datasources.yaml", "alert-rules.yaml", "dashboards-provider.yaml"])
    assert all(re.fullmatch(r"[-._a-zA-Z0-9]+", n) for n in names)
    for uid, dash in build.build_all().items():
        assert json.loads((tmp_path / "out" / f"{uid}.json").read_text()) == dash
    ds_text = (tmp_path / "out" / "datasources.yaml").read_text()
    assert "motherduck-duckdb-datasource" in ds_text and "initSql: |-" in ds_text
    try:
        import yaml
    except ImportError:
        pytest.skip("PyYAML not installed: the YAML round-trip check needs it (files above were checked as text)")
    assert yaml.safe_load(ds_text) == provisioning_doc("/data/sw")
    rules = yaml.safe_load((tmp_path / "out" / "alert-rules.yaml").read_text())
    assert [r["uid"] for r in rules["groups"][0]["rules"]] == [alerting.rule_uid(k) for k in alerting.ALERT_KINDS]
    assert rules["groups"][0]["rules"][0]["data"][0]["model"]["rawSql"] == alerting.rule_sql("slow_rank")


def test_export_refuses_a_relative_data_root(tmp_path):
    with pytest.raises(ValueError, match="absolute"):
        export(tmp_path, "relative/data")


def test_grafana_urls_with_a_sub_path():
    from stepwatch.dashboards.grafana import make_api
    assert make_api("http://h:3000", "t").client.url == "http://h:3000/api"
    assert make_api("https://h/grafana", "t").client.url == "https://h/grafana/api"
    assert make_api("https://h/grafana/?verify=false", "t").client.verify is False
    with pytest.raises(GrafanaError, match="http"):
        make_api("grafana:3000", "t")

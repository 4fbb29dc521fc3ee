"""The Helm chart's Prometheus and Alertmanager parts: the processor's Alertmanager flags, the
Prometheus-only dashboard, the PrometheusRule and its runbooks, checked and unit-tested by promtool
(helpers: helm_helpers.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helm_helpers import FULL, NAMESPACE, ROOT, VALUE_SETS, container, find, mounts, one, _parse, rendered, volumes
from stepwatch.dashboards import helmfiles

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------- Prometheus and Alertmanager
def test_alertmanager_urls_credentials_and_job_metrics_reach_the_processor():
    from stepwatch.cli import build_parser
    objs = rendered("alerting")
    proc = one(objs, "Deployment", f"{FULL}-processor")
    c = container(proc, "processor")
    a = _parse(build_parser(), c["args"])
    assert a.alertmanager == VALUE_SETS["alerting"]["alertmanager"]["urls"]            # the HA pair: both
    assert (a.alertmanager_auth, a.alertmanager_credentials_file, a.alertmanager_resend) == \
        ("basic", "/etc/stepwatch/alertmanager/credentials", 30.0)
    assert a.grafana_link_url == "https://grafana.example.com" and a.grafana_url is None   # links only
    assert (a.job_metrics_top_k, a.job_metrics_ttl) == (8, 600.0)
    assert mounts(c)["/etc/stepwatch/alertmanager"]["readOnly"] is True
    assert volumes(proc)["alertmanager-credentials"]["secret"] == {
        "secretName": "stepwatch-alertmanager", "defaultMode": 0o440,
        "items": [{"key": "credentials", "path": "credentials"}]}
    plain = container(one(rendered("defaults"), "Deployment", f"{FULL}-processor"), "processor")
    assert "--alertmanager" not in plain["args"] and "/etc/stepwatch/alertmanager" not in mounts(plain)
    # the per-job metrics' `job` label (the training job) survives the scrape; the agents' is the scrape job
    sms = {o["metadata"]["name"]: o["spec"]["endpoints"][0] for o in find(objs, "ServiceMonitor")}
    assert sms[f"{FULL}-processor"]["honorLabels"] is True and "honorLabels" not in sms[f"{FULL}-agent"]


def test_prometheus_only_overview_ships_alone_when_duckdb_is_off():
    objs = rendered("alerting")
    cms = [o for o in find(objs, "ConfigMap") if o["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert [o["metadata"]["name"] for o in cms] == [f"{FULL}-dashboard-overview-prometheus"]
    assert cms[0]["data"] == helmfiles.expected_prometheus_files()
    dash = json.loads(cms[0]["data"]["stepwatch-overview-prometheus.json"])
    assert {p["datasource"]["type"] for p in dash["panels"] if "datasource" in p} == {"prometheus"}
    assert not [o for o in find(objs, "ConfigMap") if "grafana_datasource" in o["metadata"]["labels"]]
    assert not [o for o in rendered("defaults") if o["metadata"]["name"].endswith("overview-prometheus")]


RULES = {"StepwatchProcessorDown", "StepwatchProcessorAbsent", "StepwatchProcessorLagGrowing",
         "StepwatchDeadletterRate", "StepwatchAgentKafkaUnreachable", "StepwatchAgentSpoolGrowing",
         "StepwatchAlertDeliveryFailing"}


def _rule_file(tmp_path) -> Path:
    rule = one(rendered("alerting"), "PrometheusRule", FULL)
    p = tmp_path / "rules.yaml"
    p.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return p


def test_prometheus_rule_for_the_pipelines_health_has_runbooks_in_the_docs():
    rule = one(rendered("alerting"), "PrometheusRule", FULL)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == RULES
    base = VALUE_SETS["alerting"]["prometheusRule"]["runbookBaseUrl"]
    doc = (ROOT / "docs" / "alerting.md").read_text()
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
        assert r["annotations"]["runbook_url"] == f"{base}#{r['alert'].lower()}"
        assert f"### {r['alert']}\n" in doc, f"docs/alerting.md has no runbook section for {r['alert']}"
        assert f'job="{FULL}-processor",namespace="{NAMESPACE}"' in r["expr"] or \
            f'job="{FULL}-agent",namespace="{NAMESPACE}"' in r["expr"]
    assert not find(rendered("scale-out"), "PrometheusRule")                            # opt-in


@pytest.mark.skipif(not shutil.which("promtool"), reason="Debian's prometheus package (promtool) is not installed")
def test_promtool_checks_the_rendered_rules_and_they_fire_on_a_broken_pipeline(tmp_path):
    rules = _rule_file(tmp_path)
    r = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(RULES)} rules found" in r.stdout
    # promtool's rule unit tests: series of a broken pipeline -> the alerts that must fire. promtool compares
    # annotations too: they are checked (templated) on StepwatchProcessorDown, left out of the others
    groups = yaml.safe_load(rules.read_text())["groups"]
    for g in groups:
        for rule in g["rules"]:
            if rule["alert"] != "StepwatchProcessorDown":
                rule.pop("annotations")
    rules.write_text(yaml.safe_dump({"groups": groups}))
    proc = f'job="{FULL}-processor",namespace="{NAMESPACE}",pod="p0"'
    agent = f'job="{FULL}-agent",namespace="{NAMESPACE}",pod="a0",node="n7"'
    tests = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": f"up{{{proc}}}", "values": "1 1 0x10"},
            {"series": f"stepwatch_processor_lag_messages{{{proc},topic=\"stepwatch.steps\",partition=\"0\"}}",
             "values": "0+2000x40"},
            {"series": f"stepwatch_processor_records_in_total{{{proc},kind=\"steps\"}}", "values": "0+1000x40"},
            {"series": f"stepwatch_processor_records_dropped_total{{{proc},reason=\"deadletter\"}}",
             "values": "0+50x40"},
            {"series": f"stepwatch_agent_kafka_up{{{agent}}}", "values": "1 0x10"},
            {"series": f"stepwatch_agent_spool_bytes{{{agent}}}", "values": "0+1000000x40"},
            {"series": f"stepwatch_alertmanager_alerts_failed_total{{{proc},url=\"http://am:9093\"}}",
             "values": "0 0 3x10"},
        ],
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "StepwatchProcessorDown", "exp_alerts": [{"exp_labels": {
                "severity": "warning", "job": f"{FULL}-processor", "namespace": NAMESPACE, "pod": "p0"},
                "exp_annotations": {
                    "summary": "A stepwatch processor cannot be scraped.",
                    "description": f"Processor {NAMESPACE}/p0 has been down for 5 minutes: the jobs on its Kafka "
                                   "partitions move to the other processors of the group, or wait.",
                    "runbook_url": VALUE_SETS["alerting"]["prometheusRule"]["runbookBaseUrl"]
                    + "#stepwatchprocessordown"}}]},
            {"eval_time": "14m", "alertname": "StepwatchProcessorAbsent", "exp_alerts": [{"exp_labels": {
                "severity": "critical"}}]},
            {"eval_time": "30m", "alertname": "StepwatchProcessorLagGrowing", "exp_alerts": [{"exp_labels": {
                "severity": "warning", "namespace": NAMESPACE, "pod": "p0"}}]},
            {"eval_time": "20m", "alertname": "StepwatchDeadletterRate", "exp_alerts": [{"exp_labels": {
                "severity": "warning", "namespace": NAMESPACE, "pod": "p0"}}]},
            {"eval_time": "8m", "alertname": "StepwatchAgentKafkaUnreachable", "exp_alerts": [{"exp_labels": {
                "severity": "warning", "job": f"{FULL}-agent", "namespace": NAMESPACE, "pod": "a0",
                "node": "n7"}}]},
            {"eval_time": "30m", "alertname": "StepwatchAgentSpoolGrowing", "exp_alerts": [{"exp_labels": {
                "severity": "warning", "job": f"{FULL}-agent", "namespace": NAMESPACE, "pod": "a0",
                "node": "n7"}}]},
            {"eval_time": "5m", "alertname": "StepwatchAlertDeliveryFailing", "exp_alerts": [{"exp_labels": {
                "severity": "warning", "namespace": NAMESPACE, "pod": "p0"}}]},
            {"eval_time": "3m", "alertname": "StepwatchAgentSpoolGrowing", "exp_alerts": []},
        ]}]}
    tf = tmp_path / "rules_test.yaml"
    tf.write_text(yaml.safe_dump(tests))
    r = subprocess.run(["promtool", "test", "rules", str(tf)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

"""The Helm chart: helm lint, the values schema's and templates' errors on bad values, every rendered
object validated against the Kubernetes JSON schema (``kubernetes-validate``, offline, strict), NOTES.txt,
the chart README's value table and the processor's config file (helpers: helm_helpers.py)."""
from __future__ import annotations

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from helm_helpers import (CHART, FULL, K8S_VERSION, MINIMAL, NAMESPACE, PG, PUBLIC_KEY, RELEASE, VALUE_SETS, _chart,
                          notes, render, with_values)

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------------ lint, schema
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_passes_without_warnings(name):
    r = helm.lint(CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE)
    assert r["errors"] == []
    assert [m for m in r["messages"] if m["severity"] >= 2] == []     # 1 = INFO ("icon is recommended")


BAD_VALUES = [
    (with_values(**{"store.lake": {"catalog": "postgres"}}), "at '/store/lake'"),
    (with_values(**{"store.lake": {"catalog": "postgres", "postgres": {"connection": "host=pg password=x"}}}),
     "at '/store/lake/postgres/connection'"),
    (with_values(**{"store.lake": {"dataPath": "s3://bucket/prefix"}}), "at '/store/lake'"),
    (with_values(**{"store.lake": {"catalog": "duckdb"}}), "at '/store/lake/catalog'"),
    # a SQLite catalog keeps its data on the store volume; several processors need PostgreSQL
    (with_values(**{"store.lake": {"dataPath": "s3://bucket/prefix", "s3": {"credentialsSecret": {"name": "s3"}}}}),
     "at '/store/lake/dataPath'"),
    (with_values(**{"processor.replicas": 4}), "at '/store/lake/catalog'"),
    ({}, "at '/kafka': missing property 'bootstrapServers'"),
    (with_values(**{"kafka.bootstrapServers": ""}), "at '/kafka/bootstrapServers': minLength: got 0, want 1"),
    (with_values(**{"kafka.bootstrapServers": "kafka without port"}), "at '/kafka/bootstrapServers'"),
    (with_values(**{"processor.replicas": -1}), "at '/processor/replicas': minimum: got -1, want 0"),
    (with_values(**{"processor.replica": 4}), "at '/processor': additional properties 'replica' not allowed"),
    (with_values(**{"kafka.securityProtocol": "SASL"}), "at '/kafka/securityProtocol'"),
    (with_values(**{"agent.runAsUser": 0}), "at '/agent/runAsUser': minimum: got 0, want 1"),
    (with_values(**{"compaction.mode": "daily"}), "at '/compaction/mode'"),
    (with_values(**{"profiling.traceDir.hostPath": "traces"}), "at '/profiling/traceDir/hostPath'"),
    (with_values(**{"profiling.maxSteps": 0}), "at '/profiling/maxSteps': minimum: got 0, want 1"),
    (with_values(**{"grafana.snapshot.mountPath": "grafana"}), "at '/grafana/snapshot/mountPath'"),
    (with_values(**{"grafana.snapshot.mountPath": "/var/lib/it's"}), "at '/grafana/snapshot/mountPath'"),
    (with_values(**{"kafka.topics.partitionsByTopic": {"stepz": 3}}),
     "at '/kafka/topics/partitionsByTopic': additional properties 'stepz' not allowed"),
    (with_values(**{"alertmanager.urls": ["alertmanager:9093"]}), "at '/alertmanager/urls/0'"),
    (with_values(**{"alertmanager.authType": "token"}), "at '/alertmanager/authType'"),
    (with_values(**{"prometheusRule.deadletterRatio": 5}), "at '/prometheusRule/deadletterRatio'"),
]


@pytest.mark.parametrize("values,message", BAD_VALUES, ids=[m.split("'")[1] + ":" + m.split(":")[-1].strip()[:20]
                                                              for _, m in BAD_VALUES])
def test_invalid_values_fail_with_the_schemas_message(values, message):
    with pytest.raises(helm.HelmValuesError) as e:
        _chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(e.value)
    assert "values don't meet the specifications of the schema" in str(e.value)
    r = helm.lint(CHART, values, strict=True)
    assert any(message in err for err in r["errors"])


BAD_COMBINATIONS = [
    ({"processor.replicas": 4, "store.lake": PG}, "processor.replicas=4 needs data files every replica reaches"),
    ({"processor.replicas": 2, "store.lake": PG, "store.persistence": {"enabled": False}},
     "processor.replicas=2 with the data files on the store volume needs store.persistence.enabled"),
    ({"processor.replicas": 2, "store.lake": PG, "store.persistence": {"accessModes": ["ReadWriteMany"]},
      "compaction.mode": "sidecar"}, "compaction.mode=sidecar runs one compactor per processor"),
    ({"store.persistence": {"enabled": False}}, "compaction.mode=cronjob needs store.persistence.enabled"),
    ({"kafka.securityProtocol": "SASL_SSL", "kafka.sasl": {"mechanism": "PLAIN", "username": "u"}},
     "kafka.securityProtocol=SASL_SSL needs kafka.sasl.passwordSecret.name"),
    ({"kafka.securityProtocol": "SASL_PLAINTEXT"}, "kafka.securityProtocol=SASL_PLAINTEXT needs kafka.sasl.mechanism"),
    ({"kafka.tls": {"secret": "ca"}}, "kafka.tls.secret is set but kafka.securityProtocol is PLAINTEXT"),
    ({"profiling.pySpy": {"enabled": True}}, "profiling.pySpy was removed: the agent never runs py-spy"),
    ({"profiling.enabled": True, "profiling.signingKeySecret": {"name": "k", "key": "signing-key.pem"}, "profiling.publicKey": PUBLIC_KEY,
      "profiling.traceDir": {"hostPath": "/run/stepwatch/traces", "keepMB": 0}},
     "profiling.traceDir.hostPath=/run/stepwatch/traces collides with /run/stepwatch"),
    ({"profiling.enabled": True, "profiling.signingKeySecret": {"name": "k", "key": "signing-key.pem"}, "profiling.publicKey": PUBLIC_KEY,
      "profiling.traceDir": {"hostPath": "/var/lib/stepwatch", "keepMB": 0}},
     "profiling.traceDir.hostPath=/var/lib/stepwatch collides with /var/lib/stepwatch/spool"),
    ({"profiling.enabled": True}, "profiling.enabled needs profiling.signingKeySecret.name"),
    ({"profiling.enabled": True, "profiling.signingKeySecret": {"name": "k", "key": "signing-key.pem"}},
     "profiling.enabled needs profiling.publicKey"),
    ({"profiling.hmacKeySecret": {"name": "k", "key": "hmac-key"}}, "profiling.hmacKeySecret was removed"),
    ({"processor.grafanaAnnotations": True}, "processor.grafanaAnnotations needs grafana.url"),
    ({"grafana.provisionJob": {"enabled": True}}, "grafana.provisionJob.enabled needs grafana.url"),
    # issue 26: the lake datasource is gone from the chart; its old values fail with the reason
    ({"grafana.dataRoot": "/var/lib/stepwatch/data"}, "grafana.dataRoot was removed: Grafana no longer attaches the lake"),
    ({"grafana.lake": {"connection": "host=pg user=ro"}}, "grafana.lake was removed: Grafana no longer attaches the lake"),
    ({"grafana.snapshot.enabled": False}, "grafana.datasource.enabled and grafana.provisionJob.enabled need "
                                          "grafana.snapshot.enabled"),
    ({"store.persistence.enabled": False, "compaction.mode": "sidecar"},
     "grafana.snapshot.enabled needs store.persistence.enabled"),
    ({"agent.nodeGroups": {"nvidia": {"enabled": False}, "ascend": {"enabled": False}}},
     "no agent.nodeGroups entry is enabled"),
    ({"alertmanager.credentialsSecret": {"name": "am", "key": "credentials"}},
     "alertmanager.credentialsSecret.name is set but alertmanager.urls is empty"),
]


@pytest.mark.parametrize("over,message", BAD_COMBINATIONS, ids=[m.split(" ")[0] for _, m in BAD_COMBINATIONS])
def test_inconsistent_values_fail_with_a_clear_message(over, message):
    with pytest.raises(helm.HelmRenderError) as e:
        render(with_values(**over))
    assert message in str(e.value)


# ----------------------------------------------------------------- Kubernetes schema of every object
#: prometheus-operator's CRDs: kubernetes-validate bundles only the core Kubernetes schemas, so these are
#: checked against the fields of monitoring.coreos.com/v1 the chart uses (required ones as the CRDs declare
#: them), by test_prometheus_operator_objects_match_their_crd_fields below
CRD_API = "monitoring.coreos.com/v1"
_STR = {"type": "string", "minLength": 1}
CRD_SCHEMAS = {
    "ServiceMonitor": {"type": "object", "required": ["selector", "endpoints"], "properties": {
        "selector": {"type": "object", "required": ["matchLabels"],
                     "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                                    "additionalProperties": {"type": "string"}}}},
        "namespaceSelector": {"type": "object"},
        "endpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["port"], "properties": {
                "port": _STR, "path": _STR, "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                "scheme": {"enum": ["http", "https"]}}}}}},
    "PrometheusRule": {"type": "object", "required": ["groups"], "properties": {
        "groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "rules"], "properties": {
                "name": _STR, "rules": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["expr"], "properties": {
                        "alert": _STR, "record": _STR, "expr": {"type": ["string", "integer"]},
                        "for": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}}}}}}},
}


def _objects_to_validate(crd: bool = False):
    for name in VALUE_SETS:
        objs = render(VALUE_SETS[name])[0]
        for o in objs:
            if (o["apiVersion"] == CRD_API) == crd:
                yield pytest.param(o, id=f"{name}:{o['kind']}/{o['metadata']['name']}")


@pytest.mark.parametrize("obj", list(_objects_to_validate()))
def test_manifest_validates_against_the_kubernetes_schema(obj):
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{obj['kind']} {obj['metadata']['name']} is not a valid Kubernetes {K8S_VERSION} object: "
                    f"{'.'.join(map(str, e.path))}: {e.message}")


@pytest.mark.parametrize("obj", list(_objects_to_validate(crd=True)))
def test_prometheus_operator_objects_match_their_crd_fields(obj):
    assert obj["kind"] in CRD_SCHEMAS, f"a {CRD_API} kind the chart renders has no schema here: {obj['kind']}"
    assert obj["metadata"].get("namespace") == NAMESPACE and obj["metadata"]["name"]
    try:
        jsonschema.validate(obj["spec"], CRD_SCHEMAS[obj["kind"]])
    except jsonschema.ValidationError as e:
        pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: spec.{'.'.join(map(str, e.path))}: {e.message}")


def test_the_crd_objects_are_rendered_by_some_value_set():
    kinds = {p.values[0]["kind"] for p in _objects_to_validate(crd=True)}
    assert kinds == set(CRD_SCHEMAS), kinds


# ---------------------------------------------------------------------------------- docs and NOTES
def test_notes_tell_how_a_training_pod_reaches_the_agent():
    text = notes("defaults")
    assert "STEPWATCH_SOCKET_DIR" in text and "path: /run/stepwatch" in text
    assert "pod-security.kubernetes.io/enforce=privileged" in text
    assert "SYS_PTRACE" not in text and "traces" not in text                # profiling is off
    prof = notes("ascend-profiling")
    assert "as uid 10001 without capabilities" in prof
    assert "mountPath: /data/stepwatch/traces" in prof and "path: /data/stepwatch/traces" in prof
    # what profiling needs in a training pod (issue 16): the agent's group, the socket directory
    # read-only, ctl/ writable, the public key and the probe's own trace directory
    assert "supplementalGroups: [10001]" in prof and "readOnly: true" in prof
    assert "mountPath: /run/stepwatch/ctl" in prof and "path: /run/stepwatch/ctl" in prof
    assert f'STEPWATCH_PROFILING_PUBLIC_KEY' in prof and PUBLIC_KEY in prof
    assert "STEPWATCH_PROFILE_DIR" in prof and "value: /data/stepwatch/traces" in prof
    assert "supplementalGroups: [10001]" in text and "stepwatch-ctl" not in text
    assert "SYS_PTRACE" in prof and "never gets SYS_PTRACE" in prof


def _value_keys(d: dict, prefix="") -> list[str]:
    """Dotted keys of values.yaml, not descending into Kubernetes objects and free-form maps."""
    opaque = {"affinity", "resources", "tolerations", "nodeSelector", "env", "volumes", "volumeMounts",
              "updateStrategy", "labels", "annotations", "config", "partitionsByTopic", "livenessProbe",
              "readinessProbe", "podAnnotations", "podLabels", "commonLabels", "nodeGroups", "extraEnv"}
    keys = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and k not in opaque:
            keys += _value_keys(v, key + ".")
        else:
            keys.append(key)
    return keys


def test_readme_documents_every_value():
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [k for k in _value_keys(values) + ["kafka.bootstrapServers"] if f"`{k}`" not in readme]
    assert not missing, f"helm/stepwatch/README.md lacks rows for {missing}"
    for group in values["agent"]["nodeGroups"]:
        assert f"`agent.nodeGroups.{group}" in readme


def test_processor_config_is_rendered_into_a_configmap_the_processor_reads():
    """processor.config -> TOML in a ConfigMap mounted where --config points; it validates as stepwatch.config."""
    import tomllib

    from stepwatch import config as swconfig
    cfg = {"processor": {"flush_interval_s": 2.0}, "detectors": {"stall": {"hang_s": 120, "k": 4},
                                                                 "jitter": {"enabled": False}},
           "jobs": [{"match": "llama-*", "detectors": {"slow_rank": {"k": 3, "n": 8}}}]}
    objs, _ = render(with_values(**{"processor.config": cfg}))
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"{FULL}-processor-config")
    c = swconfig.parse(tomllib.loads(cm["data"]["config.toml"]))
    assert c.detector_settings("llama-7b") == {"stall": {"hang_s": 120, "k": 4}, "jitter": {"enabled": False},
                                               "slow_rank": {"k": 3, "n": 8}}
    assert c.processor["flush_interval_s"] == 2.0
    dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == f"{FULL}-processor")
    ctr = dep["spec"]["template"]["spec"]["containers"][0]
    path = ctr["args"][ctr["args"].index("--config") + 1]
    mount = next(m for m in ctr["volumeMounts"] if m["name"] == "config")
    assert path == mount["mountPath"] + "/config.toml"
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    # the defaults: an empty (comment-only) file, valid
    objs, _ = render(MINIMAL)
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"{FULL}-processor-config")
    assert swconfig.parse(tomllib.loads(cm["data"]["config.toml"])).detectors == {}

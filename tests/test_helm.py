"""The Helm chart (helm/stepwatch), rendered and linted by Helm's own library (PyPI ``helm-python-sdk``,
which binds Helm v4's Go SDK), every rendered object validated against the Kubernetes JSON schema of
the newest release that ``kubernetes-validate`` bundles (offline; strict: unknown fields fail).

Value sets: the defaults (plus the one required value, the Kafka bootstrap servers) and the chart's
``ci/*.yaml`` (chart-testing's convention): NVIDIA nodes with SASL_SSL Kafka, Ascend nodes with signed
profiling commands, four processors with ServiceMonitors.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from stepwatch.dashboards import build, helmfiles
from stepwatch.dashboards.export import DEFAULT_DATA_ROOT

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


# ------------------------------------------------------------------------------ generated Grafana files
def test_chart_grafana_files_are_what_grafana_export_writes_now(tmp_path):
    from stepwatch.cli import main
    assert main(["grafana", "export", "--out", str(tmp_path)]) == 0
    exported = {p.name: p.read_text(encoding="utf-8") for p in tmp_path.iterdir()}
    embedded = {p.name: p.read_text(encoding="utf-8") for p in (CHART / "files" / "grafana").iterdir()
                if not p.name.startswith("datasources-postgres")}     # the chart's variants (helmfiles)
    assert embedded == exported, ("helm/stepwatch/files/grafana is stale: run "
                                  "python -m stepwatch.dashboards.helmfiles")
    assert helmfiles.stale(CHART) == []
    assert helmfiles.main(["--chart", str(CHART), "--check"]) == 0


@pytest.mark.parametrize("name", ["defaults", "nvidia-sasl", "ascend-profiling", "scale-out"])
def test_configmap_dashboards_equal_the_generator(name):
    objs = rendered(name)
    want = helmfiles.expected_files()
    cms = [o for o in find(objs, "ConfigMap") if o["metadata"]["labels"].get("grafana_dashboard") == "1"]
    got = {k: v for o in cms for k, v in o["data"].items()}
    assert set(got) == {f"{uid}.json" for uid in build.build_all()}
    for key, text in got.items():
        assert text == want[key]                             # byte for byte what `grafana export` writes
        assert json.loads(text)["uid"] == key[:-len(".json")]
    for o in cms:
        assert len(o["data"]) == 1                           # one dashboard per ConfigMap
        assert o["metadata"]["namespace"] == VALUE_SETS[name].get("grafana", {}).get("namespace", NAMESPACE)


@pytest.mark.parametrize("name", ["defaults", "ascend-profiling"])
def test_configmap_datasource_is_the_export_for_grafanas_data_root(name):
    data_root = VALUE_SETS[name].get("grafana", {}).get("dataRoot", DEFAULT_DATA_ROOT)
    cm = one(rendered(name), "ConfigMap", f"{FULL}-grafana-datasource")
    assert cm["metadata"]["labels"]["grafana_datasource"] == "1"
    assert cm["data"] == {"stepwatch-datasource.yaml": helmfiles.expected_files(data_root)["datasources.yaml"]}
    ds = yaml.safe_load(cm["data"]["stepwatch-datasource.yaml"])["datasources"][0]
    assert f"ATTACH 'ducklake:sqlite:{data_root}/lake.sqlite' AS lake (DATA_PATH '{data_root}/lake/', READ_ONLY)" \
        in ds["jsonData"]["initSql"]


@pytest.mark.parametrize("name", ["scale-out", "nvidia-sasl"])
def test_configmap_datasource_with_a_postgres_catalog_is_the_export_for_grafanas_view(name):
    """The datasource Grafana gets for a PostgreSQL catalog: its connection (a read-only role in
    scale-out), the data path as it sees it, the same lockdown, S3 keys from Grafana's environment."""
    from stepwatch.dashboards.datasource import init_sql
    v = VALUE_SETS[name]
    conn = v["grafana"].get("lake", {}).get("connection") or v["store"]["lake"]["postgres"]["connection"]
    data_path = v["store"]["lake"].get("dataPath") or v["grafana"].get("dataRoot", DEFAULT_DATA_ROOT) + "/lake"
    cm = one(rendered(name), "ConfigMap", f"{FULL}-grafana-datasource")
    ds = yaml.safe_load(cm["data"]["stepwatch-datasource.yaml"])["datasources"][0]
    assert ds["jsonData"]["initSql"] == init_sql("/var/lib/stepwatch/data", catalog=f"postgres:{conn}",
                                                 data_path=data_path)
    assert "__STEPWATCH" not in cm["data"]["stepwatch-datasource.yaml"]
    if data_path.startswith("s3://"):
        assert "KEY_ID '${AWS_ACCESS_KEY_ID}'" in ds["jsonData"]["initSql"]


def test_alert_rules_configmap_is_opt_in_and_generated():
    assert not [o for o in rendered("defaults") if o["metadata"]["name"].endswith("alert-rules")]
    cm = one(rendered("scale-out"), "ConfigMap", f"{FULL}-grafana-alert-rules")
    assert cm["metadata"]["labels"]["grafana_alert"] == "1"
    assert cm["data"] == {"stepwatch-alert-rules.yaml": helmfiles.expected_files()["alert-rules.yaml"]}


# ---------------------------------------------------------------------------------- kinds and labels
EXPECTED_KINDS = {
    "defaults": {"ServiceAccount", "PriorityClass", "DaemonSet", "Deployment", "Service", "PodDisruptionBudget",
                 "PersistentVolumeClaim", "CronJob", "ConfigMap"},
    "nvidia-sasl": {"ServiceAccount", "PriorityClass", "DaemonSet", "Deployment", "Service", "PodDisruptionBudget",
                    "PersistentVolumeClaim", "CronJob", "ConfigMap", "Job"},
    "ascend-profiling": {"ServiceAccount", "PriorityClass", "DaemonSet", "Deployment", "Service",
                         "PodDisruptionBudget", "PersistentVolumeClaim", "ConfigMap"},
    "scale-out": {"ServiceAccount", "PriorityClass", "DaemonSet", "Deployment", "Service", "PodDisruptionBudget",
                  "CronJob", "ConfigMap", "ServiceMonitor"},              # (data on S3: no volume)
    "alerting": {"ServiceAccount", "PriorityClass", "DaemonSet", "Deployment", "Service", "PodDisruptionBudget",
                 "PersistentVolumeClaim", "CronJob", "ConfigMap", "ServiceMonitor", "PrometheusRule"},
}


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_kinds_labels_and_selectors(name):
    objs = rendered(name)
    assert {o["kind"] for o in objs} == EXPECTED_KINDS[name]
    assert not find(objs, "Secret"), "the chart never creates Secrets: it references existing ones"
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names))
    for o in objs:
        lab = o["metadata"]["labels"]
        assert lab["app.kubernetes.io/name"] == "stepwatch"
        assert lab["app.kubernetes.io/instance"] == RELEASE
        assert lab["app.kubernetes.io/managed-by"] == "Helm"
        assert lab["helm.sh/chart"] == "stepwatch-0.1.0"
        if o["kind"] != "PriorityClass":                    # cluster-scoped
            assert o["metadata"]["namespace"] in (NAMESPACE, "monitoring")
    for w in find(objs, "DaemonSet") + find(objs, "Deployment"):
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    for svc in find(objs, "Service"):
        matched = [w for w in find(objs, "DaemonSet") + find(objs, "Deployment")
                   if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert matched, f"Service {svc['metadata']['name']} selects no pods"
        assert all(any(p["containerPort"] == svc["spec"]["ports"][0]["port"] for c in pod_spec(w)["containers"]
                       for p in c.get("ports", [])) for w in matched)
    for pdb in find(objs, "PodDisruptionBudget"):
        dep = one(objs, "Deployment", f"{FULL}-processor")
        assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
        assert pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_pod_is_hardened(name):
    """No service-account token, seccomp RuntimeDefault, no privilege escalation, read-only root,
    capabilities dropped; non-root except the init container that hands over the node directories
    (CHOWN/FOWNER only). The agent is non-root without capabilities in every value set, profiling
    included (py-spy runs in the training pod, not in the agent)."""
    for w in workloads(rendered(name)):
        spec = pod_spec(w)
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in containers(w):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            added = sc["capabilities"].get("add", [])
            if c["name"] == "node-dirs":
                assert added == ["CHOWN", "FOWNER"] and sc["runAsUser"] == 0
            else:
                assert added == [], f"{w['metadata']['name']}/{c['name']} adds {added}"
                assert spec["securityContext"]["runAsNonRoot"] is True
                assert spec["securityContext"]["runAsUser"] == 10001
            assert "resources" in c and c["resources"]["requests"]


# ------------------------------------------------------------------------------------------- agents
def test_agent_daemonsets_default():
    objs = rendered("defaults")
    ds = {o["metadata"]["labels"]["stepwatch.io/node-group"]: o for o in find(objs, "DaemonSet")}
    assert set(ds) == {"nvidia", "ascend"}
    aff = {g: json.dumps(d["spec"]["template"]["spec"]["affinity"]) for g, d in ds.items()}
    assert "nvidia.com/gpu.present" in aff["nvidia"] and "huawei-Ascend910" in aff["ascend"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(ds["nvidia"])["tolerations"])
    assert any(t["key"] == "huawei.com/Ascend910" for t in pod_spec(ds["ascend"])["tolerations"])
    pc = one(objs, "PriorityClass", f"{FULL}-agent")
    assert pc["preemptionPolicy"] == "Never" and pc["globalDefault"] is False
    for g, d in ds.items():
        spec = pod_spec(d)
        assert spec["hostPID"] is True and spec["hostNetwork"] is True
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert spec["priorityClassName"] == pc["metadata"]["name"]
        assert d["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "10%"
        agent = container(d, "agent")
        m, v = mounts(agent), volumes(d)
        assert m["/host/proc"]["readOnly"] is True and v[m["/host/proc"]["name"]]["hostPath"]["path"] == "/proc"
        assert m["/host/sys"]["readOnly"] is True and v[m["/host/sys"]["name"]]["hostPath"]["path"] == "/sys"
        assert v[m["/run/stepwatch"]["name"]]["hostPath"] == {"path": "/run/stepwatch", "type": "DirectoryOrCreate"}
        assert v[m["/var/lib/stepwatch/spool"]["name"]]["hostPath"]["path"] == "/var/lib/stepwatch/spool"
        assert mounts(container(d, "node-dirs")).keys() == {"/run/stepwatch", "/var/lib/stepwatch/spool"}
        assert "trace-dir" not in volumes(d)                                      # profiling is off
        assert agent["command"] == ["stepwatch"] and agent["args"][0] == "agent"
        a = agent["args"]
        assert a[a.index("--socket-dir") + 1] == "/run/stepwatch"
        assert a[a.index("--socket-mode") + 1] == "0660"                          # not 0666: the group only
        assert a[a.index("--metrics-addr") + 1] == "$(POD_IP)"
        assert not [x for x in a if x.startswith("--profile")]
        e = env(agent)
        assert e["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert e["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert e["STEPWATCH_BOOTSTRAP"]["value"] == MINIMAL["kafka"]["bootstrapServers"]
        port = agent["ports"][0]
        assert port["name"] == "metrics" and a[a.index("--metrics-port") + 1] == str(port["containerPort"])
        for probe in ("livenessProbe", "readinessProbe"):
            assert agent[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
        res = agent["resources"]
        assert AGENT_CPU_MILLICORES < cpu_m(res["requests"]["cpu"]) <= 50           # measured + headroom
        assert AGENT_RSS_MB < mem_mb(res["requests"]["memory"]) <= mem_mb(res["limits"]["memory"]) <= 512
        assert cpu_m(res["limits"]["cpu"]) >= 5 * cpu_m(res["requests"]["cpu"])   # start-up and replay bursts
        assert "SYS_PTRACE" not in json.dumps(d)
    assert env(container(ds["nvidia"], "agent"))["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    asc = mounts(container(ds["ascend"], "agent"))
    assert asc["/usr/local/sbin/npu-smi"]["readOnly"] is True
    assert volumes(ds["ascend"])["npu-smi"]["hostPath"]["type"] == "File"
    assert "/usr/local/sbin/npu-smi" not in mounts(container(ds["nvidia"], "agent"))


def test_nvidia_nodes_with_sasl_kafka():
    objs = rendered("nvidia-sasl")
    ds = find(objs, "DaemonSet")
    assert [d["metadata"]["name"] for d in ds] == [f"{FULL}-agent-nvidia"]
    assert pod_spec(ds[0])["runtimeClassName"] == "nvidia"
    kafka_clients = [(w, c) for w in workloads(objs) for c in pod_spec(w)["containers"]
                     if c["name"] in ("agent", "processor", "create-topics")]
    assert len(kafka_clients) == 3
    for w, c in kafka_clients:
        e = env(c)
        assert e["STEPWATCH_KAFKA_SECURITY_PROTOCOL"]["value"] == "SASL_SSL"
        assert e["STEPWATCH_KAFKA_SASL_MECHANISM"]["value"] == "SCRAM-SHA-512"
        assert e["STEPWATCH_KAFKA_USERNAME"]["value"] == "stepwatch"
        assert e["STEPWATCH_KAFKA_PASSWORD_FILE"]["value"] == "/etc/stepwatch/kafka-sasl/password"
        assert "STEPWATCH_KAFKA_PASSWORD" not in e                 # the password itself is never in the spec
        sasl = volumes(w)[mounts(c)["/etc/stepwatch/kafka-sasl"]["name"]]["secret"]
        assert sasl["secretName"] == "stepwatch-kafka"
        assert sasl["items"] == [{"key": "password", "path": "password"}]
        assert mounts(c)["/etc/stepwatch/kafka-sasl"]["readOnly"] is True
        tls = volumes(w)[mounts(c)["/etc/stepwatch/kafka-tls"]["name"]]["secret"]
        assert tls["secretName"] == "stepwatch-kafka-ca"
        assert c["args"][c["args"].index("--ssl-cafile") + 1] == "/etc/stepwatch/kafka-tls/ca.crt"
        assert c["args"][c["args"].index("--partitions") + 1] == "24"
    # topics: created by a pre-install hook before anything runs; agents then never create topics
    job = one(objs, "Job", f"{FULL}-create-topics")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    script = one(objs, "ConfigMap", f"{FULL}-create-topics")
    assert script["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(script["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        job["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert script["data"]["create-topics.py"] == (CHART / "files" / "create-topics.py").read_text().rstrip("\n")
    a = container(job, "create-topics")["args"]
    assert json.loads(a[a.index("--partitions-by-topic") + 1]) == {"steps": 48}
    assert a[a.index("--replication-factor") + 1] == "3"
    assert "--no-create-topics" in container(ds[0], "agent")["args"]
    # alerts as Grafana annotations: the token comes from a Secret file
    proc = one(objs, "Deployment", f"{FULL}-processor")
    pa = container(proc, "processor")["args"]
    assert pa[pa.index("--grafana-url") + 1] == "http://grafana.monitoring.svc:3000"
    assert pa[pa.index("--grafana-token-file") + 1] == "/etc/stepwatch/grafana/token"
    assert volumes(proc)["grafana-token"]["secret"]["secretName"] == "stepwatch-grafana"
    assert proc["spec"]["replicas"] == 2 and proc["spec"]["strategy"]["type"] == "RollingUpdate"


def test_ascend_nodes_with_profiling():
    objs = rendered("ascend-profiling")
    ds = find(objs, "DaemonSet")
    assert [d["metadata"]["name"] for d in ds] == [f"{FULL}-agent-ascend"]
    d = ds[0]
    spec = pod_spec(d)
    assert spec["nodeSelector"] == {"node-role.kubernetes.io/training": "true"}
    assert {t["key"] for t in spec["tolerations"]} == {"huawei.com/Ascend910", "huawei.com/Ascend310P", "training"}
    agent = container(d, "agent")
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}          # no ptrace: py-spy is not here
    assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["runAsNonRoot"] is True
    # the trace directory: a hostPath mounted at its node path, passed as --profile-dir (the path the
    # training pods see, since they mount the same hostPath at the same path), with the limits
    a = agent["args"]
    assert a[a.index("--profile-dir") + 1] == "/data/stepwatch/traces"
    assert a[a.index("--profile-keep-mb") + 1] == "1024"
    assert a[a.index("--profile-cooldown") + 1] == "120" and a[a.index("--profile-max-steps") + 1] == "50"
    tv = volumes(d)[mounts(agent)["/data/stepwatch/traces"]["name"]]
    assert tv["hostPath"] == {"path": "/data/stepwatch/traces", "type": "DirectoryOrCreate"}
    assert not mounts(agent)["/data/stepwatch/traces"].get("readOnly")             # the agent deletes old traces
    init = container(d, "node-dirs")
    assert "/data/stepwatch/traces" in mounts(init)
    script = init["command"][-1]
    assert "chown 10001:10001 /run/stepwatch /run/stepwatch/ctl /var/lib/stepwatch/spool /data/stepwatch/traces" \
        in script
    assert "chmod 3770 /run/stepwatch/ctl" in script and "chmod 0750 /run/stepwatch" in script
    assert "chmod 1770 /data/stepwatch/traces" in script and "1777" not in script
    proc = one(objs, "Deployment", f"{FULL}-processor")
    # the processors sign: only they get the private key; agents hold the public key only
    pc = container(proc, "processor")
    assert env(pc)["STEPWATCH_PROFILING_PRIVATE_KEY_FILE"]["value"] == "/etc/stepwatch/profiling/signing-key.pem"
    key = volumes(proc)[mounts(pc)["/etc/stepwatch/profiling"]["name"]]["secret"]
    assert key == {"secretName": "stepwatch-profiling", "defaultMode": 0o440,
                   "items": [{"key": "signing-key.pem", "path": "signing-key.pem"}]}
    assert env(agent)["STEPWATCH_PROFILING_PUBLIC_KEY"]["value"] == PUBLIC_KEY
    assert "/etc/stepwatch/profiling" not in mounts(agent) and "profiling-key" not in volumes(d)
    assert "STEPWATCH_PROFILING_PRIVATE_KEY_FILE" not in env(agent)
    assert env(container(proc, "processor"))["STEPWATCH_PROFILE_ON"]["value"].endswith("regression=py-spy")
    assert "trace-dir" not in volumes(proc)                                         # only the agents need it
    # compaction as a sidecar of the single processor, no CronJob
    assert not find(objs, "CronJob")
    ca = container(proc, "compact")["args"]
    assert ca[:3] == ["compact", "--data-dir", "/var/lib/stepwatch/data"]
    assert ca[ca.index("--every") + 1] == "600" and ca[ca.index("--retention-days") + 1] == "14"
    assert proc["spec"]["strategy"]["type"] == "Recreate"             # ReadWriteOnce store


def test_profiling_defaults_pass_the_trace_dir_and_limits():
    objs, text = render(with_values(**{"profiling.enabled": True,
                                       "profiling.signingKeySecret": {"name": "k", "key": "signing-key.pem"}, "profiling.publicKey": PUBLIC_KEY}))
    for d in find(objs, "DaemonSet"):
        agent = container(d, "agent")
        a = agent["args"]
        assert a[a.index("--profile-dir") + 1] == "/var/lib/stepwatch/traces"
        assert a[a.index("--profile-keep-mb") + 1] == "2048"
        assert a[a.index("--profile-cooldown") + 1] == "60" and a[a.index("--profile-max-steps") + 1] == "200"
        assert volumes(d)[mounts(agent)["/var/lib/stepwatch/traces"]["name"]]["hostPath"]["path"] == \
            "/var/lib/stepwatch/traces"
    # NOTES: the training pod mounts the trace hostPath at the same path, and what py-spy needs there
    assert "mountPath: /var/lib/stepwatch/traces" in text and "path: /var/lib/stepwatch/traces" in text
    assert "SYS_PTRACE" in text and "ptrace_scope=0" in text


def test_agent_stays_non_root_without_capabilities_with_profiling():
    """py-spy is started by the probe inside the training process against its own pid: the agent only
    verifies and forwards commands, so no value set (profiling on, py-spy chosen for an alert kind)
    gives it root, a capability, or SYS_PTRACE anywhere in the chart."""
    on = {"profiling.enabled": True, "profiling.signingKeySecret": {"name": "k", "key": "signing-key.pem"}, "profiling.publicKey": PUBLIC_KEY,
          "processor.extraEnv": [{"name": "STEPWATCH_PROFILE_ON", "value": "slow_rank=py-spy,regression=py-spy"}]}
    sets = [rendered(name) for name in VALUE_SETS] + [render(with_values(**on))[0]]
    for objs in sets:
        assert "SYS_PTRACE" not in json.dumps(objs)
        for d in find(objs, "DaemonSet"):
            spec = pod_spec(d)
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["runAsGroup"] == 10001
            sc = container(d, "agent")["securityContext"]
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
            assert "runAsUser" not in sc                                  # nothing overrides the pod's uid


# -------------------------------------------------------------------------------- processors, store
def test_processors_scaled_to_four_with_servicemonitors():
    objs = rendered("scale-out")
    proc = one(objs, "Deployment", f"{FULL}-processor")
    assert proc["spec"]["replicas"] == 4
    assert proc["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    c = container(proc, "processor")
    a = c["args"]
    assert a[:3] == ["process", "--data-dir", "/var/lib/stepwatch/data"]
    assert a[a.index("--group") + 1] == "stepwatch-processor"
    assert a[a.index("--metrics-addr") + 1] == "0.0.0.0"
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    anti = pod_spec(proc)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == proc["spec"]["selector"]["matchLabels"]
    # the lake: PostgreSQL catalog (password from a Secret), data on S3 (keys from a Secret), no volume
    assert not find(objs, "PersistentVolumeClaim") and volumes(proc)["data"] == {"name": "data", "emptyDir": {}}
    cron = one(objs, "CronJob", f"{FULL}-compact")
    for pod, c in ((proc, container(proc, "processor")), (cron, container(cron, "compact"))):
        env = {e["name"]: e for e in c["env"]}
        assert env["STEPWATCH_LAKE_CATALOG"]["value"] == \
            "postgres:host=pg.db.svc port=5432 dbname=stepwatch user=stepwatch sslmode=require"
        # the catalog's password: the Secret mounted as a file the process reads (storage/lake.py)
        assert env["STEPWATCH_LAKE_PASSWORD_FILE"]["value"] == "/etc/stepwatch/lake-catalog/password"
        assert "PGPASSWORD" not in env
        assert {"name": "lake-catalog-password", "mountPath": "/etc/stepwatch/lake-catalog",
                "readOnly": True} in c["volumeMounts"]
        assert volumes(pod)["lake-catalog-password"]["secret"] == {
            "secretName": "stepwatch-lake-pg", "defaultMode": 0o440, "items": [{"key": "password", "path": "password"}]}
        assert env["STEPWATCH_LAKE_DATA_PATH"]["value"] == "s3://ml-telemetry/stepwatch"
        assert env["STEPWATCH_S3_ENDPOINT"]["value"] == "minio.storage.svc:9000"
        assert env["STEPWATCH_S3_URL_STYLE"]["value"] == "path" and env["STEPWATCH_S3_USE_SSL"]["value"] == "false"
        assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "stepwatch-lake-s3",
                                                                        "key": "access-key-id"}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "secret-access-key"
        assert not any("PASSWORD" in e.get("value", "") or "password=" in e.get("value", "") for e in env.values())
    one(objs, "PodDisruptionBudget", f"{FULL}-processor")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid" and cron["spec"]["schedule"] == "*/30 * * * *"
    assert "affinity" not in pod_spec(cron)                          # no volume: runs anywhere
    assert container(cron, "compact")["args"][-2:] == ["--retention-days", "90"]
    sms = {o["metadata"]["name"]: o for o in find(objs, "ServiceMonitor")}
    assert set(sms) == {f"{FULL}-processor", f"{FULL}-agent"}
    for sm in sms.values():
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        svc = one(objs, "Service", sm["metadata"]["name"])
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
        assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert one(objs, "Service", f"{FULL}-agent")["spec"]["clusterIP"] == "None"
    for o in find(objs, "ConfigMap"):                                # Grafana's (the processor's is mounted)
        assert o["metadata"]["namespace"] == (NAMESPACE if o["metadata"]["name"] == f"{FULL}-processor-config"
                                              else "monitoring")
    dash = [o for o in find(objs, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
    assert all(o["metadata"]["annotations"] == {"grafana_folder": "stepwatch"} for o in dash)


def test_defaults_store_and_compaction_on_one_node():
    objs = rendered("defaults")
    proc = one(objs, "Deployment", f"{FULL}-processor")
    assert proc["spec"]["replicas"] == 1 and proc["spec"]["strategy"] == {"type": "Recreate"}
    assert one(objs, "PersistentVolumeClaim", f"{FULL}-data")["spec"]["accessModes"] == ["ReadWriteOnce"]
    cron = one(objs, "CronJob", f"{FULL}-compact")
    term = pod_spec(cron)["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["labelSelector"]["matchLabels"] == proc["spec"]["selector"]["matchLabels"]   # RWO: same node
    assert not find(objs, "ServiceMonitor") and not find(objs, "Job")
    assert [c["name"] for c in pod_spec(proc)["containers"]] == ["processor"]


def test_grafana_provision_job_tells_grafana_where_a_postgres_lake_is():
    objs, _ = render(with_values(**{"grafana.url": "http://grafana:3000",
                                    "grafana.tokenSecret": {"name": "grafana-sa", "key": "token"},
                                    "grafana.provisionJob": {"enabled": True},
                                    "grafana.lake": {"connection": "host=pg dbname=lake user=ro"},
                                    "store.lake": {**PG, "dataPath": "s3://bkt/p",
                                                   "s3": {"credentialsSecret": {"name": "s3"}}}}))
    env = {e["name"]: e["value"] for e in container(one(objs, "Job", f"{FULL}-grafana-provision"), "provision")["env"]}
    assert env == {"STEPWATCH_GRAFANA_LAKE_CATALOG": "postgres:host=pg dbname=lake user=ro",
                   "STEPWATCH_GRAFANA_LAKE_DATA_PATH": "s3://bkt/p"}


def test_grafana_provision_job_is_an_opt_in_post_install_hook():
    objs, text = render(with_values(**{"grafana.url": "http://grafana:3000",
                                       "grafana.tokenSecret": {"name": "grafana-sa", "key": "token"},
                                       "grafana.provisionJob": {"enabled": True},
                                       "grafana.dashboards": {"enabled": False},
                                       "grafana.datasource": {"enabled": False}}))
    job = one(objs, "Job", f"{FULL}-grafana-provision")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    c = container(job, "provision")
    assert c["args"][:2] == ["grafana", "provision"]
    assert c["args"][c["args"].index("--token-file") + 1] == "/etc/stepwatch/grafana/token"
    assert c["args"][c["args"].index("--data-root") + 1] == DEFAULT_DATA_ROOT
    assert volumes(job)["grafana-token"]["secret"]["secretName"] == "grafana-sa"
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"] == [f"{FULL}-processor-config"]
    assert "grafana-provision Job provisions" in text


# ------------------------------------------------------------------ the flags exist in the real CLIs
def _agent_parser() -> argparse.ArgumentParser:
    from stepwatch.agents.cli import register
    p = argparse.ArgumentParser(prog="stepwatch")
    register(p.add_subparsers(dest="cmd"))
    return p


def _subcommands(p: argparse.ArgumentParser) -> set[str]:
    return {n for a in p._actions if isinstance(a, argparse._SubParsersAction) for n in a.choices}


def test_the_stepwatch_command_has_the_agent_subcommand():
    # the chart's DaemonSet runs `stepwatch agent`
    from stepwatch.cli import build_parser
    assert "agent" in _subcommands(build_parser())


def _topics_parser() -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("create_topics", CHART / "files" / "create-topics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.parser()


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


@pytest.mark.parametrize("name", list(VALUE_SETS) + ["provision-job"])
def test_rendered_commands_parse_with_the_real_clis(name):
    """Every container's command line is accepted by the parser of the command it runs."""
    from stepwatch.cli import build_parser
    if name == "provision-job":
        objs, _ = render(with_values(**{"grafana.url": "http://g:3000", "grafana.tokenSecret": {"name": "t", "key": "token"},
                                        "grafana.provisionJob": {"enabled": True, "alertRules": False}}))
    else:
        objs = rendered(name)
    seen = set()
    for w in workloads(objs):
        for c in containers(w):
            cmd = c["command"]
            if cmd[0] == "sh":
                continue
            if cmd[0] == "python":
                assert cmd[1] == "/etc/stepwatch/scripts/create-topics.py"
                _parse(_topics_parser(), c["args"])
                seen.add("create-topics")
                continue
            assert cmd == ["stepwatch"]
            sub = c["args"][0]
            parser = build_parser()
            if sub == "agent" and sub not in _subcommands(parser):
                parser = _agent_parser()          # until stepwatch/cli.py registers agents.cli (see below)
            a = _parse(parser, c["args"])
            seen.add(sub)
            if sub == "process":
                assert a.group == "stepwatch-processor" and a.metrics_port == 9108
            if sub == "agent":
                assert a.socket_dir == "/run/stepwatch" and a.metrics_port == 9109
                if name == "ascend-profiling":
                    assert (a.profile_dir, a.profile_keep_mb, a.profile_cooldown, a.profile_max_steps) == \
                        ("/data/stepwatch/traces", 1024.0, 120.0, 50)
    assert seen >= {"process"} | ({"agent"} if name != "provision-job" else set())


def test_create_topics_script_against_the_broker(broker):
    """The hook Job's script, run for real: creates the ten topics with the configured partitions,
    then finds them all there on the next run (pre-upgrade)."""
    from kafka import KafkaConsumer
    spec = importlib.util.spec_from_file_location("create_topics", CHART / "files" / "create-topics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prefix = f"helm{uuid.uuid4().hex[:6]}."
    args = ["--bootstrap", broker.bootstrap, "--topic-prefix", prefix, "--partitions", "3",
            "--replication-factor", "1", "--partitions-by-topic", '{"steps": 5}']
    assert mod.main(args) == 0
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap)
    try:
        topics = {t for t in c.topics() if t.startswith(prefix)}
        assert len(topics) == 10                                      # (inflight: issue 18)
        assert len(c.partitions_for_topic(prefix + "steps")) == 5
        assert len(c.partitions_for_topic(prefix + "alerts")) == 3
    finally:
        c.close()
    assert mod.main(args) == 0                                        # idempotent
    assert mod.main(args + ["--partitions-by-topic", '{"stepz": 2}']) == 2


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
    (with_values(**{"grafana.dataRoot": "data"}), "at '/grafana/dataRoot'"),
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


PG = {"catalog": "postgres", "postgres": {"connection": "host=pg dbname=lake user=sw"}}
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
def _objects_to_validate():
    for name in VALUE_SETS:
        objs = render(VALUE_SETS[name])[0]
        for o in objs:
            yield pytest.param(o, id=f"{name}:{o['kind']}/{o['metadata']['name']}")


@pytest.mark.parametrize("obj", list(_objects_to_validate()))
def test_manifest_validates_against_the_kubernetes_schema(obj):
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        assert obj["apiVersion"] == "monitoring.coreos.com/v1", e.message
        by = {"PrometheusRule": "test_prometheus_rule_for_the_pipelines_health_has_runbooks_in_the_docs and "
                                "promtool (test_promtool_checks_the_rendered_rules_and_they_fire_on_a_broken_pipeline)"}
        pytest.skip(f"{obj['kind']} is a prometheus-operator CRD: kubernetes-validate bundles only the core "
                    f"Kubernetes {K8S_VERSION} schemas, so its fields are checked by "
                    f"{by.get(obj['kind'], 'test_processors_scaled_to_four_with_servicemonitors')} instead")
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{obj['kind']} {obj['metadata']['name']} is not a valid Kubernetes {K8S_VERSION} object: "
                    f"{'.'.join(map(str, e.path))}: {e.message}")


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

"""The objects of the Helm chart (helm/stepwatch), rendered by Helm's own library (PyPI ``helm-python-sdk``,
which binds Helm v4's Go SDK), every rendered object validated against the Kubernetes JSON schema of
the newest release that ``kubernetes-validate`` bundles (offline; strict: unknown fields fail).

Value sets: the defaults (plus the one required value, the Kafka bootstrap servers) and the chart's
``ci/*.yaml`` (chart-testing's convention): NVIDIA nodes with SASL_SSL Kafka, Ascend nodes with signed
profiling commands, four processors with ServiceMonitors.
"""
from __future__ import annotations

import json

import pytest
import yaml

from helm_helpers import (AGENT_CPU_MILLICORES, AGENT_RSS_MB, CHART, FULL, MINIMAL, NAMESPACE, PG, PUBLIC_KEY,
                          RELEASE, VALUE_SETS, container, containers, cpu_m, env, find, mem_mb, mounts, notes, one,
                          pod_spec, render, rendered, volumes, with_values, workloads)
from stepwatch.dashboards import build, helmfiles
from stepwatch.dashboards.export import DEFAULT_SNAPSHOT_DIR

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------ generated Grafana files
def test_chart_grafana_files_are_what_grafana_export_writes_now(tmp_path):
    from stepwatch.cli import main
    assert main(["grafana", "export", "--out", str(tmp_path), "--snapshot-dir", DEFAULT_SNAPSHOT_DIR]) == 0
    exported = {p.name: p.read_text(encoding="utf-8") for p in tmp_path.iterdir()}
    embedded = {p.name: p.read_text(encoding="utf-8") for p in (CHART / "files" / "grafana").iterdir()}
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


def _snapshot_dir(values: dict) -> str:
    return values.get("grafana", {}).get("snapshot", {}).get("mountPath", "/var/lib/stepwatch/grafana") + "/snapshot"


@pytest.mark.parametrize("name", ["defaults", "nvidia-sasl", "ascend-profiling", "scale-out"])
def test_configmap_datasource_reads_the_snapshot_and_nothing_of_the_lake(name):
    """Issue 26: Grafana's datasource is the export for the publisher's snapshot (at the chart's path),
    opened read-only with the snapshot's lockdown as initSql: no extension, no catalog, no lake path, no
    lake credential, in every set-up (SQLite on the store volume; PostgreSQL with data on S3)."""
    from stepwatch.dashboards.snapshot import datasource_path, lockdown_sql
    v, snap = VALUE_SETS[name], _snapshot_dir(VALUE_SETS[name])
    cm = one(rendered(name), "ConfigMap", f"{FULL}-grafana-datasource")
    assert cm["metadata"]["labels"]["grafana_datasource"] == "1"
    text = cm["data"]["stepwatch-datasource.yaml"]
    assert cm["data"] == {"stepwatch-datasource.yaml": helmfiles.expected_files(snap)["datasources.yaml"]}
    ds = yaml.safe_load(text)["datasources"][0]
    assert ds["jsonData"] == {"path": datasource_path(snap), "initSql": lockdown_sql(snap)}
    assert ds["jsonData"]["path"].endswith("?access_mode=READ_ONLY")
    lake = v.get("store", {}).get("lake", {})
    for word in ["ATTACH", "LOAD", "ducklake", "sqlite", "postgres", "httpfs", "SECRET", "AWS_", "s3://",
                 "lake", "/var/lib/stepwatch/data", "password", "${"] + \
            [x for x in (lake.get("dataPath"), lake.get("postgres", {}).get("connection")) if x]:
        assert word not in json.dumps(ds), f"the datasource of {name} names {word!r}"
    pub = one(rendered(name), "Deployment", f"{FULL}-grafana-publisher")
    c = container(pub, "publish")
    assert c["args"][c["args"].index("--snapshot-dir") + 1] == snap        # the path the datasource opens
    assert mounts(c)[snap.rsplit("/", 1)[0]]["name"] == "snapshot"


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


@pytest.mark.parametrize("name", ["defaults", "nvidia-sasl", "ascend-profiling", "scale-out"])
def test_grafana_publisher_is_one_non_root_read_only_writer_with_the_processors_lake(name):
    """The publisher: one replica (Recreate: one writer of the snapshot), non-root, read-only root
    filesystem, no capability, resources set; it reaches the lake exactly as the processor does (same
    lake environment, store volume and catalog password file), and its snapshot volume is the PVC
    whose claim the NOTES tell Grafana to mount read-only at the same path."""
    objs, v = rendered(name), VALUE_SETS[name]
    pub = one(objs, "Deployment", f"{FULL}-grafana-publisher")
    assert pub["spec"]["replicas"] == 1 and pub["spec"]["strategy"] == {"type": "Recreate"}
    spec = pod_spec(pub)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
    assert spec["automountServiceAccountToken"] is False
    [c] = spec["containers"]
    assert not spec.get("initContainers")
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["privileged"] is False
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert c["args"][:2] == ["grafana", "publish"]
    proc = container(one(objs, "Deployment", f"{FULL}-processor"), "processor")
    assert c.get("env", []) == [e for e in proc.get("env", []) if e["name"].startswith(("STEPWATCH_LAKE", "STEPWATCH_S3",
                                                                                        "AWS_"))]
    lake_mounts = {p: m for p, m in mounts(proc).items() if m["name"] in ("data", "lake-catalog-password")}
    assert {p: m for p, m in mounts(c).items() if m["name"] != "snapshot" and p != "/tmp"} == lake_mounts
    assert mounts(c)["/tmp"]["name"] == "tmp" and "emptyDir" in volumes(pub)["tmp"]
    snap_claim = volumes(pub)["snapshot"]["persistentVolumeClaim"]["claimName"]
    existing = v.get("grafana", {}).get("snapshot", {}).get("persistence", {}).get("existingClaim")
    assert snap_claim == (existing or f"{FULL}-grafana-snapshot")
    assert bool(find(objs, "PersistentVolumeClaim", f"{FULL}-grafana-snapshot")) is not bool(existing)
    grafana_notes = notes(name)[notes(name).index("4. Grafana"):]
    mount_path = _snapshot_dir(v).rsplit("/", 1)[0]
    assert f"mountPath: {mount_path}, readOnly: true" in grafana_notes
    if not existing:
        assert f"existingClaim: {snap_claim}}}" in grafana_notes


def test_no_lake_credential_reaches_a_grafana_object():
    """Nothing the chart gives Grafana (its ConfigMaps, in Grafana's namespace) carries the lake's
    connection, data path or a Secret of the lake; only the publisher (release namespace) has them."""
    objs = rendered("scale-out")
    lake = VALUE_SETS["scale-out"]["store"]["lake"]
    for o in objs:
        if o["metadata"].get("namespace") == "monitoring":
            text = yaml.safe_dump(o)
            for secret in (lake["postgres"]["connection"], lake["dataPath"], lake["postgres"]["passwordSecret"]["name"],
                           lake["s3"]["credentialsSecret"]["name"]):
                assert secret not in text, f"{o['kind']} {o['metadata']['name']} names {secret!r}"


def test_grafana_provision_job_provisions_the_snapshot_datasource():
    objs, _ = render(with_values(**{"grafana.url": "http://grafana:3000",
                                    "grafana.tokenSecret": {"name": "grafana-sa", "key": "token"},
                                    "grafana.provisionJob": {"enabled": True},
                                    "grafana.snapshot": {"mountPath": "/srv/grafana-snap"},
                                    "store.lake": {**PG, "dataPath": "s3://bkt/p",
                                                   "s3": {"credentialsSecret": {"name": "s3"}}}}))
    c = container(one(objs, "Job", f"{FULL}-grafana-provision"), "provision")
    assert c["args"][c["args"].index("--snapshot-dir") + 1] == "/srv/grafana-snap/snapshot"
    assert "--data-root" not in c["args"] and not c.get("env")          # no lake for Grafana's datasource
    ds = yaml.safe_load(one(objs, "ConfigMap", f"{FULL}-grafana-datasource")["data"]["stepwatch-datasource.yaml"])
    assert ds["datasources"][0]["jsonData"]["path"].startswith("/srv/grafana-snap/snapshot/stepwatch.duckdb?")


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
    assert c["args"][c["args"].index("--snapshot-dir") + 1] == DEFAULT_SNAPSHOT_DIR
    assert volumes(job)["grafana-token"]["secret"]["secretName"] == "grafana-sa"
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"] == [f"{FULL}-processor-config"]
    assert "grafana-provision Job provisions" in text

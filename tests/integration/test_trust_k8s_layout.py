"""Issue 16, profiling in Kubernetes as the chart ships it, reproduced on this machine: the chart is
rendered, its init container's own script runs as root with only CHOWN and FOWNER on three fresh
"hostPath" directories, the agent runs as uid 10001 with the DaemonSet's own arguments and
environment, and a training process runs as another uid (20002) with what the chart's NOTES tell a
training pod to have (supplemental group, environment). The socket directory is read-only to it (its
mode), ``ctl/`` is where its probe binds. A command signed with the processor's private key goes
through the real broker and the agent to the probe, which profiles 3 steps with torch.profiler and
writes the trace in the trace directory; the ``profiles`` row comes back through Kafka.

Today this fails: the probe cannot bind its control socket in the agent's directory, so the agent
answers 'failed: the probe of this rank takes no commands' and profiling never works."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import yaml

from stepwatch.wire.decode import decode
from stepwatch.agents import profiling
from stepwatch.agents.profiling import protocol
from testkit import ROOT, free_port
from stepwatch.kafkaio import make_consumer, make_producer
from stepwatch.stream.profiling import Issuer, ProfilingSettings

pytestmark = pytest.mark.integration

pytest.importorskip("torch", reason="the probe profiles a real PyTorch loop (pip install torch==2.13.0)")
helm_python = pytest.importorskip("helm_python", reason="renders the chart (pip install helm-python-sdk)")

AGENT_UID = AGENT_GID = 10001
TRAIN_UID = 20002
OTHER_UID = 30003
NODE = "node-k8s"
CHART = str(ROOT / "helm" / "stepwatch")
PEM, PUB = protocol.keygen()
if shutil.which("setpriv") is None:
    pytest.skip("setpriv (util-linux) is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("reproducing the chart's uids needs root (setpriv)", allow_module_level=True)


def as_user(uid: int, gid: int, groups: list[int], argv: list[str]) -> list[str]:
    """``argv`` as uid/gid with exactly these supplementary groups. CAP_DAC_READ_SEARCH stays ambient
    only so the interpreter under /root can be read: it grants no write, connect or unlink anywhere."""
    g = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", *g, "--inh-caps=-all,+dac_read_search",
            "--ambient-caps=-all,+dac_read_search", "--bounding-set=-all,+dac_read_search", *argv]


def render(kafka) -> tuple[dict, dict, str]:
    """(agent DaemonSet, values, NOTES) of the chart with profiling on."""
    values = {"kafka": {"bootstrapServers": kafka.bootstrap, "topicPrefix": kafka.prefix,
                        "topics": {"partitions": 2}},
              "profiling": {"enabled": True, "publicKey": PUB,
                            "signingKeySecret": {"name": "stepwatch-profiling", "key": "signing-key.pem"},
                            "traceDir": {"hostPath": "/var/lib/stepwatch/traces", "keepMB": 64}}}
    chart = helm_python.Chart.load(CHART)
    out = chart.render(values=values, name="sw", namespace="stepwatch", is_install=True)
    objs = [d for p, t in out.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]
    ds = next(o for o in objs if o["kind"] == "DaemonSet")
    return ds, values, out["stepwatch/templates/NOTES.txt"]


def notes_pod(notes: str) -> dict:
    """The training pod spec the NOTES print (it is YAML)."""
    block = notes[notes.index("     spec:"):notes.index("   and in the training script")]
    return yaml.safe_load(textwrap.dedent(block))["spec"]


TRAIN = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from stepwatch import probe
    p = probe.init(rank=0, world_size=1, auto=False, flush_ms=50)
    x = torch.randn(64, 64)
    stop = sys.argv[1]
    while not os.path.exists(stop):
        with probe.step():
            (x @ x).sum()
            time.sleep(0.02)
    s = probe.stats()
    print(json.dumps({"ctl": p._ctl.path if p._ctl else None, "steps": s["steps"]}))
""")


def test_one_profile_end_to_end_in_the_charts_layout(kafka, tmp_path):
    ds, values, notes = render(kafka)
    base = tempfile.mkdtemp(prefix="sw-k8s-", dir="/tmp")
    os.chmod(base, 0o755)
    host = {"/run/stepwatch": f"{base}/run/stepwatch", "/var/lib/stepwatch/spool": f"{base}/spool",
            "/var/lib/stepwatch/traces": f"{base}/traces"}

    def on_node(text: str) -> str:
        for k in sorted(host, key=len, reverse=True):
            text = text.replace(k, host[k])
        return text

    procs: list[subprocess.Popen] = []
    try:
        for d in host.values():                                    # hostPath type DirectoryOrCreate: root 0755
            os.makedirs(d, 0o755)
        # 1. the init container's own script, as root with CHOWN and FOWNER only
        spec = ds["spec"]["template"]["spec"]
        init = next(c for c in spec["initContainers"] if c["name"] == "node-dirs")
        assert init["securityContext"]["capabilities"]["add"] == ["CHOWN", "FOWNER"]
        for _ in range(2):                                         # and again: an agent restart
            r = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all,+chown,+fowner", *init["command"][:2],
                                on_node(init["command"][2])], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
        sock, ctl, traces = host["/run/stepwatch"], host["/run/stepwatch"] + "/ctl", host["/var/lib/stepwatch/traces"]
        for d, mode in ((sock, 0o750), (ctl, 0o3770), (traces, 0o1770), (host["/var/lib/stepwatch/spool"], 0o700)):
            st = os.stat(d)
            assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (AGENT_UID, AGENT_GID, mode), (d, oct(st.st_mode))

        # 2. the agent as uid 10001, with the DaemonSet's arguments and environment
        agent_c = next(c for c in spec["containers"] if c["name"] == "agent")
        args = [on_node(a) for a in agent_c["args"]]
        args[args.index("--metrics-addr") + 1] = "127.0.0.1"
        args[args.index("--metrics-port") + 1] = str(free_port())
        env = {"PATH": os.environ["PATH"], "NODE_NAME": NODE}
        for e in agent_c["env"]:
            if "value" in e:
                env[e["name"]] = on_node(e["value"]).replace("/host/proc", "/proc").replace("/host/sys", "/sys")
        assert env[protocol.ENV_PUBLIC] == PUB and protocol.ENV_PRIVATE_FILE not in env
        alog = open(tmp_path / "agent.log", "w")
        agent = subprocess.Popen(as_user(AGENT_UID, AGENT_GID, [], [sys.executable, "-m", "stepwatch.cli", "-v", *args]),
                                 env=env, stdout=alog, stderr=subprocess.STDOUT)
        procs.append(agent)
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{sock}/agent.sock") and time.monotonic() < deadline:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()
            time.sleep(0.2)
        st = os.stat(f"{sock}/agent.sock")
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (AGENT_UID, AGENT_GID, 0o660)

        # 3. the training process as uid 20002 with what the NOTES give a training pod
        pod = notes_pod(notes)
        groups = pod["securityContext"]["supplementalGroups"]
        assert groups == [AGENT_GID]
        c = pod["containers"][0]
        tenv = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
        for e in c["env"]:
            tenv[e["name"]] = on_node(str(e["value"])) if "value" in e else NODE       # fieldRef spec.nodeName
        assert tenv[protocol.ENV_PUBLIC] == PUB and tenv["STEPWATCH_PROFILE_DIR"] == traces
        m = {v["mountPath"]: v for v in c["volumeMounts"]}
        assert m["/run/stepwatch"]["readOnly"] is True and not m["/run/stepwatch/ctl"].get("readOnly")
        stop = tmp_path / "STOP"
        os.chmod(tmp_path, 0o777)
        train = subprocess.Popen(as_user(TRAIN_UID, TRAIN_UID, groups, [sys.executable, "-c", TRAIN, str(stop)]),
                                 env=tenv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(train)

        # the socket directory is read-only to the training user; ctl/ takes its probe's socket
        probe_sock = None
        deadline = time.monotonic() + 120
        while probe_sock is None and time.monotonic() < deadline:
            assert train.poll() is None, train.communicate()[1][-3000:]
            socks = [f for f in os.listdir(ctl) if f.startswith("probe-")]
            probe_sock = f"{ctl}/{socks[0]}" if socks else None
            time.sleep(0.2)
        assert probe_sock, "the probe never bound its control socket"
        st = os.stat(probe_sock)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (TRAIN_UID, AGENT_GID, 0o660)
        tries = textwrap.dedent(f"""
            import os, socket
            out = []
            try:
                open({sock + '/planted'!r}, 'w'); out.append('write-ok')
            except OSError as e: out.append(f'write-{{e.errno}}')
            try:
                os.unlink({probe_sock!r}); out.append('unlink-ok')
            except OSError as e: out.append(f'unlink-{{e.errno}}')
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                s.sendto(b'x', {sock + '/agent.sock'!r}); out.append('send-ok')
            except OSError as e: out.append(f'send-{{e.errno}}')
            print(' '.join(out))
        """)
        other = subprocess.run(as_user(OTHER_UID, OTHER_UID, [AGENT_GID], [sys.executable, "-c", tries]),
                               capture_output=True, text=True, timeout=60)
        # another tenant's pod (same group): cannot write in the socket dir nor remove this probe's socket
        assert other.stdout.split() == ["write-13", "unlink-1", "send-ok"], other
        outsider = subprocess.run(as_user(OTHER_UID, OTHER_UID, [], [sys.executable, "-c", tries]),
                                  capture_output=True, text=True, timeout=60)
        assert outsider.stdout.split() == ["write-13", "unlink-13", "send-13"], outsider    # not even the socket

        # 4. the processor's side: a command sealed with the private key, through the broker
        key = profiling.load_private_key(env={protocol.ENV_PRIVATE: PEM.decode()})
        watch = make_consumer(kafka, f"g-{time.time_ns()}")
        watch.subscribe([kafka.topic("profiles")])
        watch.poll(timeout_ms=1000)
        producer = make_producer(kafka)
        deadline = time.monotonic() + 60                           # the agent's control consumer is positioned
        while "profiling commands for node" not in (tmp_path / "agent.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "agent.log").read_text()[-3000:]
            time.sleep(0.2)
        iss = Issuer(ProfilingSettings(key=key, ttl_s=90.0), kafka, producer)
        cmd_id, refused = iss.issue(tenv["STEPWATCH_JOB"], {0: NODE}, [0], [], "torch", 3)
        assert refused == []
        row = None
        deadline = time.monotonic() + 120
        while row is None and time.monotonic() < deadline:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
            for msgs in watch.poll(timeout_ms=500).values():
                for msg in msgs:
                    h = dict(msg.headers)
                    t = decode(msg.value, h["content-type"], h["schema"]).table
                    for r in t.select(["cmd_id", "status", "steps", "node", "uri", "bytes", "detail"]).to_pylist():
                        if r["cmd_id"] == cmd_id and r["status"] != "busy":
                            row = r
        watch.close()
        producer.close(5)
        assert row is not None, "no profiles row: " + (tmp_path / "agent.log").read_text()[-3000:]
        assert row["status"] == "ok" and row["steps"] == 3 and row["node"] == NODE, row
        path = row["uri"][len("file://"):]
        assert os.path.dirname(path) == traces
        st = os.stat(path)
        assert st.st_uid == TRAIN_UID and st.st_mode & 0o777 == 0o640 and st.st_size == row["bytes"]
        stop.touch()
        out, err = train.communicate(timeout=60)
        assert train.returncode == 0, err[-3000:]
        assert re.search(r'"ctl": "[^"]+/ctl/probe-\d+\.sock"', out), out
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(base, ignore_errors=True)

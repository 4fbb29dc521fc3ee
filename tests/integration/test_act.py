"""``stepwatch act`` (issue 30): drain a node that keeps failing, from Alertmanager's webhook.

* The real Alertmanager (tests/promstack.py) routes stepwatch's alerts (built by the Alertmanager sink's
  :func:`postable_alert`, posted to its API) to two ``stepwatch act serve`` processes with a bearer token from a
  file: a dry-run one prints the ``scontrol`` command and drains nothing; an ``--execute`` one drains the real
  Slurm node (tests/slurmcluster.py) once two incidents named it, refuses a third within the cool-down, and
  ``stepwatch act undo`` resumes the node.
* The receiver itself, on a real socket: unauthenticated, malformed and oversized posts are refused; the hourly
  rate limit, host-list node names and the metrics by reason.
"""
from __future__ import annotations

import http.client
import io
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from promstack import ALERTMANAGER, MISSING_AM, Alertmanager, wait_until
from slurmcluster import started
from stepwatch.agents.act import Actor, ActMetrics, Policy, Receiver, Store, command
from stepwatch.dashboards.alertmanager import postable_alert
from stepwatch.detectors.base import Alert
from testkit import ROOT

pytestmark = pytest.mark.integration

TOKEN = "act-token-0123456789"


def _alert(job: str, kind: str, node: str, incident: str) -> dict:
    a = Alert(job=job, kind=kind, status="firing", step_first=10, step_detected=12, t_detected=time.time_ns(),
              ranks=[3], nodes=[node], cause="computation", severity="warning", incident_id=incident)
    return postable_alert(a, now_ns=time.time_ns(), resolve_after_s=600, point_hold_s=900)


def _post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _payload(*alerts: dict, version: str = "4") -> bytes:
    return json.dumps({"version": version, "status": "firing", "receiver": "act", "groupLabels": {},
                       "alerts": [{"status": "firing", "labels": a["labels"], "annotations": {},
                                   "fingerprint": "f" * 16} for a in alerts]}).encode()


def _state(slurm, node: str) -> str:
    """``sinfo -h -o %T -n <node>`` without Slurm's ``*`` (slurmd slow to answer a ping on a loaded machine:
    a flag apart from drain)."""
    return slurm.run("sinfo", "-h", "-o", "%T", "-n", node).stdout.strip().rstrip("*")


class ActProcess:
    """``stepwatch act serve`` as its own process; ready when it prints the port it listens on."""

    def __init__(self, state_dir, token_file, *extra: str, env=None):
        self.state_dir = state_dir
        self.proc = subprocess.Popen([sys.executable, "-m", "stepwatch.cli", "act", "serve", "--state-dir",
                                      str(state_dir), "--auth-file", str(token_file), "--port", "0", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        first = wait_until(lambda: [x for x in self.lines if "listening on" in x] or self.proc.poll() is not None,
                           30, "stepwatch act to listen")
        assert first is not True and self.proc.poll() is None, self.lines
        self.port = int(first[0].split("listening on 127.0.0.1:")[1].split()[0])
        self.url = f"http://127.0.0.1:{self.port}/alerts"

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def store(self) -> Store:
        return Store(str(self.state_dir))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def slurm():
    yield from started()


@pytest.mark.skipif(not ALERTMANAGER, reason=MISSING_AM)
def test_alertmanager_webhook_drains_the_slurm_node_after_two_incidents_and_undo_resumes_it(slurm, tmp_path):
    node = slurm.node
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    env = slurm.env
    dry = ActProcess(tmp_path / "dry", token, "--confirmations", "2", env=env)
    live = ActProcess(tmp_path / "live", token, "--execute", "--confirmations", "2", "--window", "10",
                      "--cooldown", "60", "--max-per-hour", "5", env=env)
    hook = {"authorization": {"type": "Bearer", "credentials_file": str(token)}}
    am = Alertmanager(tmp_path / "am").start({
        "route": {"receiver": "blackhole", "group_by": ["incident"], "group_wait": "1s", "group_interval": "1s",
                  "repeat_interval": "1h",
                  "routes": [{"receiver": "act-dry", "matchers": ['job="dryjob"']},
                             {"receiver": "act-live", "matchers": ['job="livejob"']}]},
        "receivers": [{"name": "blackhole"},
                      {"name": "act-dry", "webhook_configs": [{"url": dry.url, "send_resolved": False,
                                                               "http_config": hook}]},
                      {"name": "act-live", "webhook_configs": [{"url": live.url, "send_resolved": False,
                                                                "http_config": hook}]}]})

    def to_am(*alerts):
        code, text = _post(f"{am.url}/api/v2/alerts", json.dumps(list(alerts)).encode())
        assert code == 200, text

    try:
        # ---- dry run: two incidents name the node; the command is printed and stored, nothing drained
        to_am(_alert("dryjob", "slow_node", node, "inc-d000000000000001"),
              _alert("dryjob", "slow_node", node, "inc-d000000000000002"))
        rows = wait_until(lambda: [r for r in dry.store().actions() if r["outcome"] == "dry_run"], 30,
                          "the dry-run action")
        assert len(rows) == 1 and rows[0]["node"] == node and rows[0]["action"] == "drain"
        assert sorted(rows[0]["incidents"]) == ["inc-d000000000000001", "inc-d000000000000002"]
        want = f"update nodename={node} state=drain 'reason=stepwatch: slow_node inc-d00000000000000"
        assert want in rows[0]["command"] and rows[0]["command"].split()[0].endswith("scontrol")
        wait_until(lambda: any("would run:" in x and want in x for x in dry.lines), 10, "the printed command")
        assert _state(slurm, node) == "idle"

        # ---- executed: one incident is not enough; the second drains the node
        to_am(_alert("livejob", "slow_node", node, "inc-1000000000000001"))
        wait_until(lambda: [s for s in live.store().sightings() if s["incident"] == "inc-1000000000000001"], 30,
                   "the first sighting")
        assert live.store().actions() == []
        assert _state(slurm, node) == "idle"
        to_am(_alert("livejob", "rank_crash", node, "inc-1000000000000002"))
        done = wait_until(lambda: [r for r in live.store().actions() if r["outcome"] == "done"], 30, "the drain")
        assert len(done) == 1 and done[0]["result"].startswith("rc 0")
        assert sorted(done[0]["incidents"]) == ["inc-1000000000000001", "inc-1000000000000002"]
        assert done[0]["kinds"] == ["rank_crash", "slow_node"]
        state = wait_until(lambda: _state(slurm, node) in ("drained", "draining") and _state(slurm, node), 15,
                           "sinfo to show the node drained")
        assert state in ("drained", "draining")
        show = slurm.run("scontrol", "show", "node", node).stdout
        assert "Reason=stepwatch: rank_crash inc-1000000000000002" in show, show

        # ---- a third incident within the cool-down: refused, stored, nothing run
        to_am(_alert("livejob", "slow_node", node, "inc-1000000000000003"))
        refused = wait_until(lambda: [r for r in live.store().actions() if r["outcome"] == "refused"], 30,
                             "the refusal")
        assert refused[0]["reason"] == "cooldown" and f"action {done[0]['id']}" in refused[0]["result"]
        assert "inc-1000000000000003" in refused[0]["incidents"]
        assert [r["outcome"] for r in live.store().actions()] == ["done", "refused"]
        wait_until(lambda: any("refused (cooldown)" in x for x in live.lines), 10, "the printed refusal")

        # ---- undo by one command: the node is resumed
        u = subprocess.run([sys.executable, "-m", "stepwatch.cli", "act", "undo", str(done[0]["id"]),
                            "--state-dir", str(live.state_dir)], env=env, capture_output=True, text=True, timeout=60)
        assert u.returncode == 0, u.stdout + u.stderr
        assert f"scontrol update nodename={node} state=resume" in u.stdout
        assert _state(slurm, node) == "idle"
        last = live.store().actions()[-1]
        assert (last["action"], last["outcome"], last["undo_of"]) == ("resume", "done", done[0]["id"])
        again = subprocess.run([sys.executable, "-m", "stepwatch.cli", "act", "undo", "--node", node, "--state-dir",
                                str(live.state_dir)], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 1 and "no action on it left to undo" in again.stderr
        log = subprocess.run([sys.executable, "-m", "stepwatch.cli", "act", "log", "--state-dir",
                              str(live.state_dir)], capture_output=True, text=True, timeout=60)
        assert log.returncode == 0 and len(log.stdout.splitlines()) == 3 and "(cooldown)" in log.stdout
    finally:
        am.stop()
        dry.stop()
        live.stop()
        if "dr" in slurm.node_state():
            slurm.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)


def test_receiver_refuses_unauthenticated_malformed_and_oversized_posts_and_rate_limits(tmp_path):
    store = Store(str(tmp_path / "state"))
    metrics = ActMetrics()
    out = io.StringIO()
    actor = Actor(store, Policy(backend="k8s", confirmations=1, max_per_hour=1, cooldown_s=60), metrics, out=out)
    rec = Receiver(actor, ("bearer", TOKEN.encode()), max_body=4096)
    threading.Thread(target=rec.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{rec.port}/"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        ok = _payload(_alert("j", "slow_node", "node-a", "inc-a"))
        assert _post(url, ok)[0] == 401                                        # no credentials
        assert _post(url, ok, {"Authorization": "Bearer wrong"})[0] == 401
        assert _post(url, ok, {"Authorization": "Basic " + TOKEN})[0] == 401
        code, text = _post(url, _payload(_alert("j", "slow_node", "node-a", "inc-a"), version="3"), auth)
        assert code == 400 and "version" in text and "'3'" in text
        code, text = _post(url, json.dumps({"version": "4", "status": "firing", "alerts": [
            {"status": "firing", "labels": {"alertname": "slow_node", "nodes": 7}}]}).encode(), auth)
        assert code == 400 and "alerts[0].labels.nodes" in text and "7" in text
        assert _post(url, b"x" * 5000, auth)[0] == 413
        c = http.client.HTTPConnection("127.0.0.1", rec.port, timeout=10)     # chunked: no length, refused
        c.request("POST", "/", body=iter([ok]), headers={**auth, "Transfer-Encoding": "chunked"})
        assert c.getresponse().status == 411
        c.close()
        assert store.actions() == [] and store.sightings() == []               # nothing got through

        # a host list or a node list is never acted on; a real node is, once; the hour's budget is then spent
        code, _ = _post(url, _payload(_alert("j", "slow_node", "n[1-64]", "inc-x"),
                                      _alert("j", "rank_crash", "a,b", "inc-y")), auth)
        assert code == 200 and store.sightings() == []
        code, text = _post(url, ok, auth)
        assert code == 200 and json.loads(text)[0]["outcome"] == "dry_run"
        assert _post(url, ok, auth) == (200, "[]\n")                             # a repeat: nothing new, no row
        code, text = _post(url, _payload(_alert("j", "rank_crash", "node-b", "inc-b")), auth)
        assert json.loads(text)[0]["outcome"] == "refused" and json.loads(text)[0]["reason"] == "rate_limit"
        rows = store.actions()
        assert [(r["node"], r["outcome"], r["reason"]) for r in rows] == [("node-a", "dry_run", None),
                                                                           ("node-b", "refused", "rate_limit")]
        assert rows[0]["command"].endswith("cordon node-a") and "would run:" in out.getvalue()
        assert "1 action(s) in the last hour, at most 1" in rows[1]["result"]
    finally:
        rec.close()
    m = metrics.registry
    assert m.get_sample_value("stepwatch_act_requests_total", {"result": "unauthorized"}) == 3
    assert m.get_sample_value("stepwatch_act_requests_total", {"result": "bad_payload"}) == 2
    assert m.get_sample_value("stepwatch_act_requests_total", {"result": "too_large"}) == 1
    assert m.get_sample_value("stepwatch_act_requests_total", {"result": "no_length"}) == 1
    assert m.get_sample_value("stepwatch_act_decisions_total", {"outcome": "dry_run", "reason": "confirmed"}) == 1
    assert m.get_sample_value("stepwatch_act_decisions_total", {"outcome": "refused", "reason": "rate_limit"}) == 1
    assert m.get_sample_value("stepwatch_act_alerts_ignored_total") == 2
    with pytest.raises(Exception, match="not a host name"):
        command("slurm", "drain", "n1 state=resume", "r")


def test_the_documented_receiver_passes_amtool_and_routes_node_kinds_to_stepwatch_act(tmp_path):
    import re

    from promstack import AMTOOL
    if not AMTOOL:
        pytest.skip(MISSING_AM + " (amtool)")
    doc = (ROOT / "docs" / "baremetal.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if "stepwatch-act" in b)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    cfg = tmp_path / "alertmanager.yml"
    cfg.write_text(block.replace("/etc/alertmanager/stepwatch-act.token", str(token)))
    r = subprocess.run([AMTOOL, "check-config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr

    def route(*labels):
        r = subprocess.run([AMTOOL, "config", "routes", "test", f"--config.file={cfg}", *labels],
                           capture_output=True, text=True, timeout=60)
        return r.stdout.strip()
    assert route("source=stepwatch", "alertname=slow_node", "incident=inc-1") == "stepwatch-act"
    assert route("source=stepwatch", "alertname=rank_crash", "incident=inc-1") == "stepwatch-act"
    assert route("source=stepwatch", "alertname=slow_rank", "incident=inc-1") == "default"


def test_a_node_or_incident_ending_in_a_newline_is_never_acted_on(tmp_path):
    """Issue 26 (low), the ``$`` of an id pattern matches before a final newline: an alert naming node
    ``node-a\\n`` (or incident ``inc\\n``) posted to the real receiver was confirmed and its command built
    with the newline; a Slurm end state ``COMPLETED\\n`` passed the agent's check."""
    from stepwatch.agents.slurm import check_sched
    store, metrics = Store(str(tmp_path / "state")), ActMetrics()
    actor = Actor(store, Policy(backend="slurm", confirmations=1, max_per_hour=10, cooldown_s=60), metrics,
                  out=io.StringIO())
    rec = Receiver(actor, ("bearer", TOKEN.encode()), max_body=1 << 16)
    threading.Thread(target=rec.serve_forever, daemon=True).start()
    try:
        body = json.dumps({"version": "4", "status": "firing", "alerts": [
            {"status": "firing", "labels": {"alertname": "slow_node", "nodes": "node-a\n", "incident": "inc-a"}},
            {"status": "firing", "labels": {"alertname": "slow_node", "nodes": "node-b", "incident": "inc-b\n"}}]})
        code, text = _post(f"http://127.0.0.1:{rec.port}/", body.encode(), {"Authorization": f"Bearer {TOKEN}"})
        assert code == 200 and json.loads(text) == [], text
        assert store.actions() == [] and store.sightings() == []
    finally:
        rec.close()
    assert metrics.registry.get_sample_value("stepwatch_act_alerts_ignored_total") == 2
    with pytest.raises(Exception, match="not a host name"):
        command("slurm", "drain", "node-a\n", "r")
    with pytest.raises(ValueError, match="bad state"):
        check_sched({"event": "end", "job": "777", "state": "COMPLETED\n"})

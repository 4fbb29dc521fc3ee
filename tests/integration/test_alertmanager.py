"""Alerts to the real Alertmanager (Debian's prometheus-alertmanager 0.25 on free loopback ports).

An HA pair of Alertmanagers (the second with HTTP basic auth) receives every alert of a processor
watching a simulated job with a slow rank that ends: the first Alertmanager routes on ``job`` and
``severity`` to a webhook receiver (a local HTTP server here), which gets the firing notification
with the alert's annotations, then — after the processor is restarted in between — the resolved one,
and never a second firing one.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import uuid

import pytest

from promstack import ALERTMANAGER, AMTOOL, MISSING_AM, Alertmanager, Webhook, wait_until
from stepwatch.devtools.simsend import send_simulation
from stepwatch.devtools.simulate import Simulation
from stepwatch.dashboards.alertmanager import (AlertmanagerError, AlertmanagerSink, postable_alert,
                                               read_credentials)
from stepwatch.detectors.base import Alert
from stepwatch.stream.alertfanout import attach
from stepwatch.kafkaio import KafkaSettings, ensure_topics, make_producer
from stepwatch.stream.processor import Processor
from testkit import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = "amjob"
SLOW = 13
USER, PASSWORD = "stepwatch", "s3cret-pass"
GRAFANA = "http://grafana.example:3000"


def _route_config(hook_url: str | None) -> dict:
    receivers = [{"name": "blackhole"}]
    route = {"receiver": "blackhole", "group_by": ["alertname", "job", "alert_id"], "group_wait": "1s",
             "group_interval": "1s", "repeat_interval": "1h"}
    if hook_url:
        receivers.append({"name": "training-oncall",
                          "webhook_configs": [{"url": hook_url, "send_resolved": True}]})
        route["routes"] = [{"receiver": "training-oncall", "matchers": [f'job="{JOB}"', 'severity=~"warning|critical"']}]
    return {"route": route, "receivers": receivers}


def _fired(hook: Webhook, status: str) -> list[dict]:
    """Alerts of ``hook``'s notifications with this status (one entry per alert per notification)."""
    return [a for n in hook.notifications() if n.get("status") == status for a in n["alerts"]
            if a["labels"].get("alertname") == "slow_rank" and a["status"] == status]


@pytest.mark.skipif(not ALERTMANAGER, reason=MISSING_AM)
def test_slow_rank_alert_reaches_a_webhook_through_alertmanager_fires_once_and_resolves(broker, tmp_path):
    import bcrypt
    hook = Webhook()
    am1 = Alertmanager(tmp_path / "am1").start(_route_config(hook.url))
    am2 = Alertmanager(tmp_path / "am2").start(
        _route_config(None), web_config={"basic_auth_users": {USER: bcrypt.hashpw(PASSWORD.encode(),
                                                                                  bcrypt.gensalt(4)).decode()}})
    cred = tmp_path / "am-credentials"
    cred.write_text(f"{USER}:{PASSWORD}\n")
    auth = read_credentials(str(cred), "basic")
    kafka = KafkaSettings(bootstrap=broker.bootstrap, prefix=f"am{uuid.uuid4().hex[:6]}.", partitions=2)
    ensure_topics(kafka)
    sim = Simulation(job=JOB, ranks=64, steps=90, step_ms=100.0, seed=5,
                     faults=[f"slow-rank:rank={SLOW},pct=30,start=5,end=40"])
    prod = make_producer(kafka)

    def processor():
        p = Processor(kafka, tmp_path / "data", group="g-am", flush_interval_s=0.3, lateness_s=2.0,
                      idle_close_s=2.0, profiling=None)
        sink = AlertmanagerSink([am1.url, am2.url], authorization=auth, grafana_url=GRAFANA,
                                resend_interval_s=1.0, resolve_after_s=30.0, registry=p.metrics.registry)
        attach(p, [sink])
        stop = threading.Event()
        th = threading.Thread(target=p.run, kwargs={"stop_event": stop}, daemon=True)
        th.start()
        return p, sink, stop, th

    def shut(p, sink, stop, th):
        stop.set()
        th.join(30)
        assert not th.is_alive()
        sink.close(10)

    try:
        # ---- first processor: the fault starts, the alert fires and reaches the webhook
        p1 = processor()
        send_simulation(sim, prod, kafka, stop=30)
        firing = wait_until(lambda: _fired(hook, "firing"), 90, "the firing notification at the webhook")
        a = firing[0]
        lab, ann = a["labels"], a["annotations"]
        assert lab["alertname"] == "slow_rank" and lab["job"] == JOB and lab["severity"] in ("warning", "critical")
        assert lab["ranks"] == str(SLOW) and lab["nodes"] == f"node-{SLOW // 8:04d}" and lab["source"] == "stepwatch"
        stored = [x for x in p1[0].alerts if x.kind == "slow_rank" and x.status == "firing"]
        assert len(stored) == 1 and lab["alert_id"] == stored[0].alert_id and lab["cause"] == stored[0].cause
        assert ann["summary"].startswith("[FIRING] slow_rank job=amjob rank 13")
        assert ann["suggestion"] == stored[0].suggestion and ann["cost"].endswith("%")
        assert json.loads(ann["evidence"])                                   # the detector's evidence, as JSON
        link = urllib.parse.urlsplit(ann["dashboard"])
        q = urllib.parse.parse_qs(link.query)
        assert f"{link.scheme}://{link.netloc}{link.path}" == f"{GRAFANA}/d/stepwatch-job/stepwatch-job"
        assert q["var-job"] == [JOB] and int(q["from"][0]) < int(q["to"][0])
        assert a["generatorURL"] == ann["dashboard"]
        fp = {x["fingerprint"] for x in am1.alerts() if x["labels"]["alertname"] == "slow_rank"}
        assert len(fp) == 1
        # the HA partner got it too, behind basic auth (and refuses a request without it)
        hdr = {"Authorization": auth}
        assert [x for x in am2.alerts(headers=hdr) if x["labels"].get("alert_id") == lab["alert_id"]]
        with pytest.raises(urllib.error.HTTPError) as e:
            am2.alerts()
        assert e.value.code == 401
        # re-sends while firing (every resend_interval_s, to both): within the 3 s the test used to sleep
        wait_until(lambda: p1[1].stats()["sent"] >= 4, 3, "re-sends while firing")
        assert p1[1].stats()["failed"] == 0
        shut(*p1)

        # ---- restart: a fresh processor on the same store goes on; the fault ends, the alert resolves
        p2 = processor()
        send_simulation(sim, prod, kafka, start=30)
        resolved = wait_until(lambda: _fired(hook, "resolved"), 120, "the resolved notification at the webhook")
        assert resolved[0]["labels"] == lab                                # the same alert (same fingerprint)
        assert resolved[0]["fingerprint"] == a["fingerprint"] and a["fingerprint"] in fp
        assert p2[1].stats()["firing"] == 0
        assert p2[1].stats()["restored"] == 1 and p1[1].stats()["restored"] == 0   # taken over from the store
        restored = [x for x in p2[0].alerts if x.kind == "slow_rank"]
        assert [x.status for x in restored] == ["resolved"]               # not fired again after the restart
        time.sleep(3)                                                       # > 2 group_intervals
        firing_ids = [x["labels"]["alert_id"] for x in _fired(hook, "firing")]
        print(f"\nwebhook: {len(hook.notifications())} notification(s); firing alert ids {firing_ids}; "
              f"resolved {[x['labels']['alert_id'] for x in _fired(hook, 'resolved')]}")
        assert firing_ids == [lab["alert_id"]], "a second firing notification after the restart"
        assert [x for x in am2.alerts(headers=hdr) if x["labels"].get("alert_id") == lab["alert_id"]
                and x["status"]["state"] == "active"] == []                  # resolved on the partner too
        shut(*p2)
    finally:
        prod.close()
        am1.stop()
        am2.stop()
        hook.stop()


def test_postable_alert_labels_are_stable_and_endsat_follows_the_status():
    base = dict(job="j1", kind="slow_rank", step_first=10, step_detected=15, t_detected=2_000_000_000_000_000_000,
                ranks=[3], nodes=["n0"], cause="computation", severity="warning", cost_pct=12.5,
                suggestion="isolate the node", evidence={"t_first_ns": 1_999_999_990_000_000_000, "z": 9.1})
    now = 2_000_000_005_000_000_000
    f = postable_alert(Alert(status="firing", **base), now_ns=now, resolve_after_s=240, point_hold_s=900,
                       grafana_url="http://g")
    r = postable_alert(Alert(status="resolved", **{**base, "t_detected": now - 1_000_000_000}), now_ns=now,
                       resolve_after_s=240, point_hold_s=900, grafana_url="http://g")
    assert f["labels"] == r["labels"]                                   # same fingerprint firing and resolved
    assert f["labels"]["alert_id"] == Alert(status="firing", **base).alert_id
    assert f["startsAt"] == "2033-05-18T03:33:10.000Z" and f["endsAt"] == "2033-05-18T03:37:25.000Z"
    assert r["endsAt"] == "2033-05-18T03:33:24.000Z"
    assert f["annotations"]["cost"] == "12.5%" and json.loads(f["annotations"]["evidence"])["z"] == 9.1
    many = postable_alert(Alert(status="firing", **{**base, "ranks": list(range(40)), "nodes": [f"n{i}" for i in
                                                                                                range(5)]}),
                          now_ns=now, resolve_after_s=240, point_hold_s=900)
    assert "ranks" not in many["labels"] and "nodes" not in many["labels"]      # too many: annotations only
    assert many["annotations"]["ranks"].startswith("0,1,2") and "dashboard" not in many["annotations"]
    point = postable_alert(Alert(status="firing", **{**base, "kind": "regression", "ranks": [], "nodes": []}),
                           now_ns=now, resolve_after_s=240, point_hold_s=900)
    assert point["endsAt"] == "2033-05-18T03:48:10.000Z"                # startsAt + 15 min: no resolved follows


def test_credentials_file_and_urls_are_checked(tmp_path):
    f = tmp_path / "c"
    f.write_text("tok\n")
    assert read_credentials(str(f)) == "Bearer tok"
    with pytest.raises(AlertmanagerError, match="user:password"):
        read_credentials(str(f), "basic")
    with pytest.raises(AlertmanagerError, match="cannot read"):
        read_credentials(str(tmp_path / "missing"))
    with pytest.raises(AlertmanagerError, match="http"):
        AlertmanagerSink(["alertmanager:9093"])


def test_a_dead_alertmanager_neither_blocks_the_caller_nor_its_partner(tmp_path):
    """One URL refuses connections: submit stays non-blocking, the live partner gets every alert, the
    dead one retries with backoff and counts the alerts undelivered at close as failed."""
    if not ALERTMANAGER:
        pytest.skip(MISSING_AM)
    live = Alertmanager(tmp_path / "live").start(_route_config(None))
    from testkit import free_port
    dead = f"http://127.0.0.1:{free_port()}"
    sink = AlertmanagerSink([dead, live.url], resend_interval_s=60, backoff_s=0.05, backoff_max_s=0.2)
    try:
        t0 = time.perf_counter()
        for i in range(50):
            sink.submit(Alert(job="j", kind="jitter", status="firing", step_first=i, step_detected=i + 1,
                              t_detected=time.time_ns(), cause="gc"))
        assert time.perf_counter() - t0 < 0.1
        wait_until(lambda: len([x for x in live.alerts() if x["labels"]["job"] == "j"]) == 50, 20,
                   "the live Alertmanager to hold the 50 alerts")
        wait_until(lambda: sink.stats()["retried"] >= 2, 10, "retries against the dead URL")
    finally:
        sink.close(0.5)
        live.stop()
    st = sink.stats()
    assert st["sent"] == 50 and st["failed"] >= 1 and st["dropped"] == 0


@pytest.mark.skipif(not AMTOOL, reason=MISSING_AM + " (amtool)")
def test_the_documented_route_passes_amtool(tmp_path):
    import re
    import subprocess
    doc = (ROOT / "docs" / "alerting.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if b.startswith("route:"))
    cfg = tmp_path / "alertmanager.yml"
    cfg.write_text(block)
    r = subprocess.run([AMTOOL, "check-config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([AMTOOL, "config", "routes", "test", f"--config.file={cfg}", "source=stepwatch",
                        "job=llama-70b", "severity=critical", "alertname=slow_rank"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "training-pager", r.stdout + r.stderr
    r = subprocess.run([AMTOOL, "config", "routes", "test", f"--config.file={cfg}", "source=stepwatch",
                        "job=llama-70b", "severity=warning", "alertname=jitter"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "training-channel", r.stdout + r.stderr


@pytest.mark.skipif(not ALERTMANAGER, reason=MISSING_AM)
def test_stepwatch_process_cli_posts_to_alertmanager(broker, tmp_path):
    """`stepwatch process --alertmanager URL --alertmanager-credentials-file F`: the command's own wiring."""
    import subprocess
    import sys
    am = Alertmanager(tmp_path / "am").start(_route_config(None))
    kafka = KafkaSettings(bootstrap=broker.bootstrap, prefix=f"amcli{uuid.uuid4().hex[:6]}.", partitions=2)
    ensure_topics(kafka)
    cred = tmp_path / "token"
    cred.write_text("a-token\n")
    prod = make_producer(kafka)
    try:
        send_simulation(Simulation(job="clijob", ranks=32, steps=40, step_ms=100.0, seed=2,
                                   faults=["slow-rank:rank=5,pct=40,start=5"]), prod, kafka)
        p = subprocess.run([sys.executable, "-m", "stepwatch.cli", "process", "--bootstrap", broker.bootstrap,
                            "--topic-prefix", kafka.prefix, "--data-dir", str(tmp_path / "data"), "--group", "g-cli",
                            "--flush-interval", "0.3", "--lateness", "2", "--idle-exit", "6", "-q",
                            "--alertmanager", am.url, "--alertmanager-credentials-file", str(cred),
                            "--grafana-link-url", GRAFANA], capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stderr[-2000:]
        assert "[FIRING] slow_rank job=clijob rank 5" in p.stdout
        got = [a for a in am.alerts() if a["labels"].get("job") == "clijob"]
        assert [a["labels"]["alertname"] for a in got] == ["slow_rank"] and got[0]["labels"]["ranks"] == "5"
        assert got[0]["annotations"]["dashboard"].startswith(f"{GRAFANA}/d/stepwatch-job/")
    finally:
        prod.close()
        am.stop()


def test_credentials_in_the_url_become_basic_auth_and_stay_out_of_labels_and_logs(caplog):
    """``http://user:pw@host`` used to be taken as a host name (retried until shutdown, nothing
    delivered) with the password in the ``url`` metric label and the logs. A real HTTP server on
    127.0.0.1 that requires basic auth now gets the alert; the password is in no label and no log."""
    import base64
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from prometheus_client import CollectorRegistry, generate_latest

    user, pw = "stepwatch", "s3cr:et@pw"
    want = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()
    got, seen_auth = [], []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen_auth.append(self.headers.get("Authorization"))
            if self.headers.get("Authorization") != want:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="am"')
                self.end_headers()
                return
            got.extend(json.loads(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    reg = CollectorRegistry()
    url = f"http://{user}:{urllib.parse.quote(pw, safe='')}@127.0.0.1:{port}"
    caplog.set_level("DEBUG")
    sink = AlertmanagerSink([url], resend_interval_s=60, backoff_s=0.05, backoff_max_s=0.2, max_attempts=3,
                            registry=reg)
    try:
        sink.submit(Alert(job="j", kind="stall", status="firing", step_first=1, step_detected=2,
                          t_detected=time.time_ns(), cause="cpu"))
        wait_until(lambda: got, 10, "the basic-auth server to get the alert")
    finally:
        sink.close(2)
        srv.shutdown()
    assert got[0]["labels"]["job"] == "j" and seen_auth[0] == want
    metrics = generate_latest(reg).decode()
    assert f'url="http://127.0.0.1:{port}"' in metrics
    quoted = urllib.parse.quote(pw, safe="")
    for text in (metrics, caplog.text):
        assert pw not in text and quoted not in text and "s3cr" not in text
    with pytest.raises(AlertmanagerError, match="use one of them") as e:
        AlertmanagerSink([url], authorization="Bearer x")
    assert "s3cr" not in str(e.value)
    with pytest.raises(AlertmanagerError, match="credentials file") as e:
        AlertmanagerSink([f"http://{user}@127.0.0.1:{port}"])


def test_a_credentials_file_others_can_read_is_warned_about_and_a_rotated_one_is_used(tmp_path, caplog):
    """Issue 26 (low): ``--alertmanager-credentials-file`` at 0644 was accepted silently and read only at
    start, so a rotated token (a Kubernetes Secret swapped under the mount) failed every delivery with 401
    until a restart. Through the CLI's flags and a real HTTP server on 127.0.0.1 that accepts one token
    at a time: the mode is warned about by the flag's name (never the token); after the file is replaced
    the next alert goes with the new token; a file emptied mid-rewrite keeps the token in use."""
    import argparse
    import os
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from stepwatch.dashboards.alertmanager import add_args, sink_from_args

    want = ["Bearer tok-A-1111"]
    got, refused = [], []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Authorization") != want[0]:
                refused.append(self.headers.get("Authorization"))
                self.send_response(401)
                self.end_headers()
                return
            got.extend(a["labels"]["job"] for a in json.loads(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    cred = tmp_path / "credentials"
    cred.write_text("tok-A-1111\n")
    cred.chmod(0o644)
    p = argparse.ArgumentParser()
    add_args(p)
    a = p.parse_args(["--alertmanager", f"http://127.0.0.1:{srv.server_address[1]}",
                      "--alertmanager-credentials-file", str(cred)])
    caplog.set_level("DEBUG")

    def alert(job):
        return Alert(job=job, kind="stall", status="firing", step_first=1, step_detected=2,
                     t_detected=time.time_ns(), cause="cpu")
    sink = sink_from_args(a)
    try:
        warned = [r.getMessage() for r in caplog.records if r.name == "stepwatch.secrets"]
        assert warned == [f"--alertmanager-credentials-file={cred}: a secret file whose mode 0644 lets other "
                          "users read or change it (at most 0600: chmod 600 it)"], warned
        sink.submit(alert("j1"))
        wait_until(lambda: got == ["j1"], 10, "the alert with the first token")
        new = tmp_path / "credentials.new"                  # the Secret rotated: a new file replaces it
        new.write_text("tok-B-2222\n")
        new.chmod(0o600)
        os.replace(new, cred)
        want[0] = "Bearer tok-B-2222"
        sink.submit(alert("j2"))
        wait_until(lambda: got == ["j1", "j2"] or sink.stats()["failed"], 10, "the alert with the rotated token")
        assert got == ["j1", "j2"] and not refused, (got, refused)
        cred.write_text("")                                 # caught mid-rewrite: the token in use stays
        sink.submit(alert("j3"))
        wait_until(lambda: got == ["j1", "j2", "j3"] or sink.stats()["failed"], 10, "the alert mid-rewrite")
        assert got == ["j1", "j2", "j3"] and not refused, (got, refused)
    finally:
        sink.close(2)
        srv.shutdown()
    assert "tok-A" not in caplog.text and "tok-B" not in caplog.text

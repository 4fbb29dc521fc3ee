"""The console command as a user runs it: subprocesses, real broker, real store."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from testkit import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SW = [sys.executable, "-m", "stepwatch.cli"]


def run(*args, timeout=120, **kw):
    return subprocess.run(SW + list(args), capture_output=True, text=True, timeout=timeout, **kw)


def test_help_lists_subcommands():
    r = run("--help")
    assert r.returncode == 0
    for cmd in ("demo", "broker", "simulate", "process", "sql", "bench"):
        assert cmd in r.stdout


def test_broker_command_starts_answers_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    p = subprocess.Popen(SW + ["broker", "--port", str(port)], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert f"127.0.0.1:{port}" in line, line
    from stepwatch.kafkaio import cluster_id_of
    assert cluster_id_of(f"127.0.0.1:{port}")
    p.send_signal(signal.SIGINT)
    assert p.wait(20) == 0
    assert "broker stopped" in p.stdout.read()


def test_broker_refuses_a_taken_port():
    port = free_port()
    first = subprocess.Popen(SW + ["broker", "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert "ready" in first.stdout.readline()
        r = run("broker", "--port", str(port), timeout=60)
        assert r.returncode != 0
        assert "another broker holds the port" in r.stderr or "exited" in r.stderr
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(20)


def test_simulate_process_sql_and_metrics(broker, tmp_path):
    prefix = "cli."
    labels = tmp_path / "labels.json"
    r = run("simulate", "--bootstrap", broker.bootstrap, "--topic-prefix", prefix, "--job", "clijob",
            "--ranks", "64", "--steps", "60", "--fault", "slow-rank:rank=9,pct=40,start=20",
            "--labels", str(labels))
    assert r.returncode == 0, r.stderr
    assert json.loads(labels.read_text())[0]["ranks"] == [9]
    mport = free_port()
    data = tmp_path / "data"
    p = subprocess.Popen(SW + ["process", "--bootstrap", broker.bootstrap, "--topic-prefix", prefix,
                               "--data-dir", str(data), "--group", "cli", "--metrics-port", str(mport),
                               "--idle-exit", "3", "--flush-interval", "0.3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and p.poll() is None:
        try:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=2).read().decode()
            if re.search(r'stepwatch_processor_records_out_total\{table="steps"\} 3840', metrics):
                break
        except OSError:
            pass
        time.sleep(0.3)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert 'stepwatch_processor_records_in_total{kind="steps"} 3840.0' in metrics
    assert "stepwatch_processor_detector_seconds_bucket" in metrics
    assert "[FIRING] slow_rank job=clijob rank 9 on node-0001" in out
    r = run("sql", "--data-dir", str(data), "SELECT count(*) AS n FROM steps WHERE job='clijob'")
    assert r.returncode == 0 and "3840" in r.stdout, r.stdout + r.stderr
    r = run("sql", "--data-dir", str(data), "--format", "json",
            "SELECT rank, node FROM rank_busy WHERE job='clijob' ORDER BY busy_ms DESC LIMIT 1")
    assert json.loads(r.stdout) == [{"rank": 9, "node": "node-0001"}]
    r = run("sql", "--data-dir", str(data), "SELECT nope FROM steps")
    assert r.returncode == 1 and "nope" in r.stderr


def test_bad_fault_spec_is_a_clear_error(broker):
    r = run("simulate", "--bootstrap", broker.bootstrap, "--fault", "slow-rank:rank=x")
    assert r.returncode == 2 and "'rank'" in r.stderr


def test_sasl_needs_a_password_from_env_or_file(tmp_path):
    from stepwatch.kafkaio import KafkaSettings
    s = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="u")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_KAFKA_PASSWORD")}
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        with pytest.raises(ValueError, match="STEPWATCH_KAFKA_PASSWORD"):
            s.client_config()
        f = tmp_path / "pw"
        f.write_text("s3cret\n")
        s.password_file = str(f)
        cfg = s.client_config()
        assert cfg["sasl_plain_password"] == "s3cret" and cfg["security_protocol"] == "SASL_SSL"
        assert "s3cret" not in repr(s)
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_consumer_session_timeout_from_flag_or_environment_and_bounded(monkeypatch):
    """The consumer group session timeout (a join on the embedded broker takes about half of it): the
    flag, else STEPWATCH_KAFKA_SESSION_TIMEOUT_MS, else 6 s; out of range or not a number is refused
    with the setting's name and value."""
    import argparse

    from stepwatch.kafkaio import add_kafka_args, session_timeout_ms, settings_from_args
    p = argparse.ArgumentParser()
    add_kafka_args(p)
    monkeypatch.delenv("STEPWATCH_KAFKA_SESSION_TIMEOUT_MS", raising=False)
    assert settings_from_args(p.parse_args([])).session_timeout_ms == 6000
    monkeypatch.setenv("STEPWATCH_KAFKA_SESSION_TIMEOUT_MS", "2500")
    assert settings_from_args(p.parse_args([])).session_timeout_ms == 2500
    assert settings_from_args(p.parse_args(["--session-timeout-ms", "9000"])).session_timeout_ms == 9000
    for bad, msg in (("500", "500 is out of range"), ("2s", "'2s' is not a whole number")):
        with pytest.raises(ValueError, match=f"STEPWATCH_KAFKA_SESSION_TIMEOUT_MS: {msg}"):
            session_timeout_ms(bad)
    with pytest.raises(SystemExit):
        p.parse_args(["--session-timeout-ms", "10"])


def test_demo_finds_both_faults_and_reports_efficiency(tmp_path):
    """`make demo` as a user runs it (smaller): exit 0 only when both injected faults are found."""
    r = run("demo", "--ranks", "128", "--steps", "260", "--slow-rank", "77", "--data-dir", str(tmp_path / "demo"),
            timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert re.search(r"FOUND\s+slow rank 77 ", out) and re.search(r"FOUND\s+regression from step 200", out), out
    m = re.search(r"efficiency: MFU median ([\d.]+)% .*goodput ([\d.]+)%", out)
    assert m and 0 < float(m.group(1)) < 100 and 50 < float(m.group(2)) <= 100, out
    assert (tmp_path / "demo" / "report.html").stat().st_size > 10_000

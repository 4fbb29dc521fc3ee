"""A bad configuration file cannot stop a processor (issue 26, finding 3): the loader raises only
ConfigError, with the file, the setting and the value named and the message bounded, for any content
(not UTF-8, nested 5,000 deep, a 4,300-digit integer, empty as mid-rewrite, cut short, a FIFO); a real
``stepwatch process`` sent each of them with SIGHUP goes on with the settings in force, then applies a
good file, ``[profiling] enabled`` on and off again included; hypothesis fuzzes the loader."""
from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch import config as swconfig
from stepwatch import configfile
from stepwatch.devtools.fuzz_config import VALID, config_strategy, mutate_config
from testkit import free_port

pytestmark = pytest.mark.integration

BAD = {      # name -> (bytes, what the refusal says)
    "not-utf8": (b"[detectors.jitter]\nenabled = \xff\xfe\n", "not UTF-8 (byte 0xff at offset 29)"),
    "deep": (b"[processor]\nx = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested deeper than 32"),
    "huge-int": (b"[processor]\nmax_buffer_rows = 1" + b"0" * 4300 + b"\n", "line 2: a number of more than 40 digits"),
    "empty": (b"", "empty (a file being rewritten?)"),
    "partial": (b"[profiling]\nenabled = fal", "not valid TOML"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_bad_file_is_a_config_error_naming_the_file(tmp_path, name):
    data, msg = BAD[name]
    f = tmp_path / "c.toml"
    f.write_bytes(data)
    with pytest.raises(configfile.ConfigError) as e:
        swconfig.load(f)
    assert str(e.value).startswith(f"{f}: ") and msg in str(e.value), str(e.value)


def test_messages_name_the_setting_and_a_clipped_value(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[detectors.stall]\nhang_s = "' + "\\u001b[31m" * 5000 + '"\n')       # ANSI escapes
    with pytest.raises(configfile.ConfigError) as e:
        swconfig.load(f)
    m = str(e.value)
    assert m.startswith(f"{f}: detectors.stall.hang_s: must be a number in >= 0.1, not '\\x1b[31m")
    assert len(m) <= configfile.MAX_MESSAGE and "\x1b" not in m
    f.write_text("[detectors.slow_rank]\nk = 0x" + "f" * 3000 + "\n")           # parses; too large to print
    with pytest.raises(configfile.ConfigError, match=r"slow_rank.k: <a 12000-bit integer> is out of range"):
        swconfig.load(f)


def test_fifo_oversize_and_merged_cross_checks_are_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(configfile.ConfigError, match="not a regular file"):
        swconfig.load(fifo)                                          # refused, not waited on
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (configfile.MAX_BYTES + 1))
    with pytest.raises(configfile.ConfigError, match="larger than the 1048576"):
        swconfig.load(big)
    merged = tmp_path / "m.toml"          # each section alone is valid (k=5 of the defaults' n=13, n=6 of k=5 ...)
    merged.write_text("[detectors.slow_rank]\nk = 8\n[[jobs]]\nmatch = 'llama-*'\n[jobs.detectors.slow_rank]\nn = 9\n"
                      "[[jobs]]\nmatch = 'llama-7*'\n[jobs.detectors.slow_rank]\nn = 6\n")   # ... llama-7b: k=8 > n=6
    with pytest.raises(configfile.ConfigError, match=r"jobs\[1\].detectors.slow_rank \(over detectors.slow_rank\)"):
        swconfig.load(merged)
    peak = tmp_path / "p.toml"
    peak.write_text("[detectors.mfu]\npeak_tflops = '/dev/zero'\n")    # the detector would read it
    with pytest.raises(configfile.ConfigError, match="'/dev/zero' is not a regular file"):
        swconfig.load(peak)


def test_a_comment_only_file_still_means_every_default(tmp_path):
    """What the chart renders for ``processor.config: {}`` (a comment line) stays valid."""
    f = tmp_path / "c.toml"
    f.write_text("# rendered from the chart's processor.config\n")
    assert swconfig.load(f).detectors == {}


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(config_strategy().map(lambda x: x[0]),
                 st.tuples(st.randoms(use_true_random=False), st.integers(1, 3)).map(
                     lambda t: _mutated(t[0], t[1])),
                 st.binary(max_size=2000)))
def test_fuzz_the_loader_raises_only_config_error(data):
    try:
        c = swconfig.loads(data, "fuzz.toml")
    except configfile.ConfigError as e:
        assert len(str(e)) <= configfile.MAX_MESSAGE and str(e).startswith("fuzz.toml: ")
    else:
        assert isinstance(c, swconfig.Config)


def _mutated(rng, k: int) -> bytes:
    data = VALID
    for _ in range(k):
        data = mutate_config(data, rng)
    return data


def test_the_bench_boundary_finds_no_crash():
    from stepwatch.devtools.fuzz import BOUNDARIES
    r = BOUNDARIES["config-file"](800, 1)
    assert r["tried"] == 800 and r["crashes"] == 0 and r["hangs"] == 0, r
    assert r["accepted"] > 0 and r["refused"] > 0, r


# ---------------------------------------------------------------------------- a real processor, SIGHUP

def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_sighup_with_each_bad_file_keeps_the_processor_and_its_settings(kafka, tmp_path):
    """Config A (jitter off, profiling off; a signing key is set) is in force with a job running; each bad
    file arrives with SIGHUP and is refused by name while the processor goes on; then A again changes
    nothing (0 jobs retuned: A was still in force; an empty file taken as the defaults would have
    switched jitter back on), and B (jitter on, profiling on) is applied: 1 job retuned, profiling on."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    from stepwatch.devtools.simsend import send_table
    from stepwatch.devtools.simulate import Simulation
    from stepwatch.kafkaio import make_producer
    from test_config import _Lines
    seed = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    env = {**os.environ, "STEPWATCH_PROFILING_PRIVATE_KEY": base64.b64encode(seed).decode()}
    cfg = tmp_path / "stepwatch.toml"
    a_text = "[processor]\nflush_interval_s = 0.3\nlateness_s = 0.5\n[detectors.jitter]\nenabled = false\n" \
             "[profiling]\nenabled = false\n"
    cfg.write_text(a_text)
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "stepwatch.cli", "-v", "process", "--bootstrap", kafka.bootstrap,
                          "--topic-prefix", kafka.prefix, "--data-dir", str(tmp_path / "data"), "--group", "g-hcfg",
                          "--config", str(cfg), "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = _Lines(p.stdout), _Lines(p.stderr)
    prod = make_producer(kafka)
    try:
        err.wait(r"processing ")
        sim = Simulation(job="hup-a", ranks=4, ranks_per_node=4, steps=20, step_ms=1000.0, seed=1,
                         checkpoint_every=None)
        send_table(prod, kafka, "topology", sim.topology())
        t = sim.generate(0, 5)
        send_table(prod, kafka, "steps", t["steps"])
        prod.flush(30)
        deadline = time.monotonic() + 60
        while _metric(port, "stepwatch_processor_records_in_total") <= 0:     # the job exists
            assert time.monotonic() < deadline and p.poll() is None, "\n".join(err.lines[-20:])
            time.sleep(0.1)
        for name in ("not-utf8", "deep", "huge-int", "empty", "partial"):
            data, msg = BAD[name]
            n0 = len(err.lines)
            cfg.write_bytes(data)
            p.send_signal(signal.SIGHUP)
            k = err.wait(r"configuration .* refused", 30, n0)
            assert msg in err.lines[k] and str(cfg) in err.lines[k], (name, err.lines[k])
            assert "settings in force stay" in err.lines[k]
            assert p.poll() is None, name
        assert _metric(port, "stepwatch_processor_config_reloads_total") >= 5
        n0 = len(err.lines)
        cfg.write_text(a_text)
        p.send_signal(signal.SIGHUP)
        err.wait(r"configuration .* reloaded \(0 job\(s\) retuned\); targeted profiling off", 30, n0)
        n0 = len(err.lines)
        cfg.write_text("[processor]\nflush_interval_s = 0.3\nlateness_s = 0.5\n[profiling]\nenabled = true\n")
        p.send_signal(signal.SIGHUP)
        err.wait(r"configuration .* reloaded \(1 job\(s\) retuned\); targeted profiling on for "
                 r"regression, slow_node, slow_rank", 30, n0)
        n0 = len(err.lines)              # and off again: 'enabled = false' once logged "reloaded", changed nothing
        cfg.write_text(a_text)
        p.send_signal(signal.SIGHUP)
        err.wait(r"configuration .* reloaded \(1 job\(s\) retuned\); targeted profiling off", 30, n0)
        assert p.poll() is None
    finally:
        prod.close()
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


# ---------------------------------------------------------------------------- secret files

def test_secret_files_other_users_can_read_are_named_in_a_warning(tmp_path, caplog, monkeypatch):
    """The SASL password file, the lake's password file and the profiling signing key: 0644 is warned
    about by the variable that names it and its mode (never the content); 0600 passes quietly."""
    from stepwatch.agents import profiling
    from stepwatch.agents.profiling import protocol
    from stepwatch.kafkaio import KafkaSettings
    from stepwatch.storage.lake import password_from_file
    pw, lk, key = tmp_path / "kafka-pw", tmp_path / "lake-pw", tmp_path / "signing.key"
    pw.write_text("hunter2-kafka\n")
    lk.write_text("hunter2-lake\n")
    key.write_bytes(protocol.keygen()[0])
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.delenv("STEPWATCH_KAFKA_PASSWORD", raising=False)
    for mode, warned in ((0o644, True), (0o600, False)):
        for f in (pw, lk, key):
            f.chmod(mode)
        caplog.clear()
        with caplog.at_level("WARNING", logger="stepwatch.secrets"):
            assert KafkaSettings(password_file=str(pw))._password() == "hunter2-kafka"
            password_from_file({"STEPWATCH_LAKE_PASSWORD_FILE": str(lk)})
            assert profiling.load_private_key(env={protocol.ENV_PRIVATE_FILE: str(key)}) is not None
        text = "\n".join(r.getMessage() for r in caplog.records if r.name == "stepwatch.secrets")
        monkeypatch.delenv("PGPASSWORD", raising=False)
        if warned:
            assert f"--sasl-password-file={pw}: a secret file whose mode 0644 lets other users read" in text
            assert f"STEPWATCH_LAKE_PASSWORD_FILE={lk}: a secret file whose mode 0644" in text
            assert f"{protocol.ENV_PRIVATE_FILE}={key}: a secret file whose mode 0644" in text
            assert "chmod 600" in text and "hunter2" not in text
        else:
            assert text == ""

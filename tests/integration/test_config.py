"""The processor's configuration file (stepwatch.config): defaults printed, validation with the setting's
name and range, per-job overrides, and a round trip through a real ``stepwatch process`` on the broker:
a file overriding two detectors for one job pattern is applied on SIGHUP while jobs stream (in effect on
the next step, detector state kept), and a bad file is refused with a clear message while the settings in
force stay."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib

import numpy as np
import pytest

from stepwatch import config as swconfig
from stepwatch import configfile
from stepwatch.detectors.registry import REGISTRY, settings_of
from stepwatch.detectors.stall import Stall

pytestmark = pytest.mark.integration


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "stepwatch.cli", *args], capture_output=True, text=True, timeout=120,
                          **kw)


def test_defaults_print_every_setting_with_its_default_and_meaning_and_load_back(tmp_path):
    r = _cli("config", "defaults")
    assert r.returncode == 0, r.stderr
    doc = tomllib.loads(r.stdout)
    for name, cls in REGISTRY.items():
        sec = doc["detectors"][name]
        assert sec["enabled"] is True
        for k, d in settings_of(cls).items():
            if d is not None:
                assert sec[k] == d, (name, k)
            line = next(ln for ln in r.stdout.splitlines() if re.match(rf"^#? ?{k} =", ln) and
                        r.stdout.index(ln) > r.stdout.index(f"[detectors.{name}]"))
            assert "#" in line and len(line.split("#")[-1].strip()) > 10, line      # a meaning
    assert doc["processor"]["flush_interval_s"] == 1.0 and doc["profiling"]["steps"] == 10
    f = tmp_path / "defaults.toml"
    f.write_text(r.stdout)
    c = swconfig.load(f)
    for name, kw in c.detector_settings("any").items():
        kw = dict(kw)
        assert kw.pop("enabled") is True
        assert {k: v for k, v in settings_of(REGISTRY[name]).items() if v is not None} == kw
    assert _cli("config", "check", str(f)).returncode == 0


@pytest.mark.parametrize("text, msg", [
    ("[detectors.stall]\nhang_s = -1\n", "detectors.stall.hang_s: -1 is out of range (valid: >= 0.1)"),
    ("[detectors.slow_rank]\nk = 2.5\n", "detectors.slow_rank.k: must be a whole number in 1 .. 1000"),
    ("[detectors.jitter]\nratio = 3\n", "detectors.jitter.ratio: 3 is out of range (valid: 0.0 .. 1.0)"),
    ("[detectors.stal]\nk = 1\n", "detectors.stal: unknown detector"),
    ("[detectors.stall]\nhang = 1\n", "detectors.stall.hang: unknown setting"),
    ("[processor]\nflush_interval_s = 0\n", "processor.flush_interval_s: 0 is out of range (valid: 0.05 .. 3600.0)"),
    ("[[jobs]]\n[jobs.detectors.stall]\nk = 1\n", "jobs[0].match: required"),
    ("[[jobs]]\nmatch = 'a*'\n[jobs.detectors.stall]\nk = 0\n", "jobs[0].detectors.stall.k: 0 is out of range"),
    ("[profiling.on]\nslow_rank = 'gdb'\n", "profiling.on: must map alert kinds to one of torch, py-spy, host"),
    ("[detectors.stall\n", "not valid TOML"),
])
def test_invalid_settings_are_refused_with_name_and_range(tmp_path, text, msg):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(configfile.ConfigError) as e:
        swconfig.load(f)
    assert msg in str(e.value)


def test_config_check_exits_2_with_the_error_on_stderr(tmp_path):
    """`stepwatch config check` prints the loader's error (the cases above) and exits 2; once for a
    setting out of range and once for a file that is not TOML (each run starts an interpreter)."""
    for text, msg in (("[detectors.stall]\nhang_s = -1\n", "detectors.stall.hang_s: -1 is out of range"),
                      ("[detectors.stall\n", "not valid TOML")):
        f = tmp_path / "bad.toml"
        f.write_text(text)
        r = _cli("config", "check", str(f))
        assert r.returncode == 2 and msg in r.stderr, (r.returncode, r.stderr[-2000:])


def test_job_patterns_override_in_file_order():
    c = swconfig.parse(tomllib.loads('''
[detectors.stall]
hang_s = 60
[[jobs]]
match = "llama-*"
[jobs.detectors.stall]
hang_s = 300
[jobs.detectors.jitter]
enabled = false
[[jobs]]
match = "llama-70b*"
[jobs.detectors.stall]
k = 5
'''))
    assert c.detector_settings("gpt-1") == {"stall": {"hang_s": 60}}
    assert c.detector_settings("llama-7b") == {"stall": {"hang_s": 300}, "jitter": {"enabled": False}}
    assert c.detector_settings("llama-70b-x") == {"stall": {"hang_s": 300, "k": 5}, "jitter": {"enabled": False}}


def test_retune_keeps_detector_state_and_resizing_settings_start_afresh():
    d = Stall()
    d._ms[:5] = [100.0, 110.0, 90.0, 100.0, 105.0]
    d._ms_n = 5
    d._lead_n = 3
    same = swconfig.retune(d, Stall, {}, {"hang_s": 5.0, "hang_eval_s": 60.0})
    assert same is d and d.hang_s == 5.0 and d.hang_kind_s["eval"] == 60.0 and d.hang_kind_s["first"] == 1800.0
    assert d._ms_n == 5 and d._ms[2] == 90.0 and d._lead_n == 3          # the state is still there
    from stepwatch.detectors.jitter import Jitter
    j = Jitter()
    j2 = swconfig.retune(j, Jitter, {}, {"history": 64})               # sizes its memory: a fresh one
    assert j2 is not j and j2.history == 64
    from stepwatch.detectors.slowrank import SlowRank
    sr = SlowRank()
    assert swconfig.retune(sr, SlowRank, {}, {"k": 2}) is sr and sr.k == 2          # in place
    sr2 = swconfig.retune(sr, SlowRank, {"k": 2}, {"k": 2, "n": 4})                 # its ring is sized by n
    assert sr2 is not sr and sr2.n == 4


# ---------------------------------------------------------------------------- round trip through the CLI

def _send_steps(sim, prod, kafka, a, b, steps=True):
    from stepwatch.devtools.simsend import send_table
    for s in range(a, b):
        t = sim.generate(s, s + 1)
        for kind in (("steps", "host") if steps else ("host",)):
            send_table(prod, kafka, kind, t[kind])
    prod.flush(30)


def _wait_stored(data, sims, timeout: float = 60.0) -> None:
    """Until the store holds steps of every job in ``sims`` (the processor read them: its jobs exist)."""
    from stepwatch.storage.views import connect
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        try:
            got = {j for (j,) in connect(data).execute("SELECT DISTINCT job FROM steps").fetchall()}
        except Exception as e:  # noqa: BLE001 - no lake or no steps table before the first flush
            got = e
        if isinstance(got, set) and got >= set(sims):
            return
        time.sleep(0.1)
    raise AssertionError(f"steps of {sorted(sims)} not stored in {timeout}s: {got!r}")


class _Lines:
    """A subprocess's output lines, read on a thread."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.th = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.th.start()

    def _read(self, stream):
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait(self, pattern: str, timeout: float = 60.0, start: int = 0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(start, len(self.lines)):
                if re.search(pattern, self.lines[i]):
                    return i
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} in {timeout}s:\n" + "\n".join(self.lines[-30:]))


def test_sighup_applies_a_per_job_override_on_the_next_step_and_refuses_a_bad_file(kafka, tmp_path):
    from stepwatch.devtools.simsend import send_table
    from stepwatch.devtools.simulate import Simulation
    from stepwatch.kafkaio import make_producer
    cfg = tmp_path / "stepwatch.toml"
    cfg.write_text("[processor]\nflush_interval_s = 0.3\nlateness_s = 0.5\n")
    cmd = [sys.executable, "-m", "stepwatch.cli", "-v", "process", "--bootstrap", kafka.bootstrap, "--topic-prefix",
           kafka.prefix, "--data-dir", str(tmp_path / "data"), "--group", "g-cfg", "--config", str(cfg)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = _Lines(p.stdout), _Lines(p.stderr)
    fault_at = 30
    sims = {j: Simulation(job=j, ranks=16, ranks_per_node=4, steps=80, step_ms=1000.0, seed=3, checkpoint_every=None,
                          faults=[f"slow-rank:rank=5,pct=25,start={fault_at}"]) for j in ("live-a", "other-b")}
    prod = make_producer(kafka)
    try:
        err.wait(r"processing ")
        for j, sim in sims.items():
            send_table(prod, kafka, "topology", sim.topology())
            _send_steps(sim, prod, kafka, 0, fault_at)
        err.wait(r"assigned \d+ partitions", 60)
        # a file overriding two detectors for jobs named live-*; SIGHUP while the jobs stream (the processor
        # also notices the changed file by itself, within 5 s: whichever comes first retunes the job)
        _wait_stored(tmp_path / "data", sims)              # the first steps are in: the jobs exist to retune
        n0 = len(err.lines)
        cfg.write_text("[processor]\nflush_interval_s = 0.3\nlateness_s = 0.5\n\n[[jobs]]\nmatch = \"live-*\"\n"
                       "[jobs.detectors.slow_rank]\nk = 1\n[jobs.detectors.stall]\nhang_s = 3.0\n"
                       "hang_steps = 1\n")
        p.send_signal(signal.SIGHUP)
        err.wait(r"configuration .* reloaded \(1 job\(s\) retuned\)", 30, n0)
        for s in range(fault_at, fault_at + 10):           # the slow rank from step 30 on
            for sim in sims.values():
                _send_steps(sim, prod, kafka, s, s + 1)
            time.sleep(0.15)
        i = out.wait(r"\[FIRING\] slow_rank job=live-a rank 5", 60)
        m = re.search(r"from step (\d+) \(detected at (\d+)\)", out.lines[i])
        assert int(m.group(2)) == fault_at, out.lines[i]    # the next step: k=1 (of n=13)
        j = out.wait(r"\[FIRING\] slow_rank job=other-b rank 5", 60)
        m2 = re.search(r"\(detected at (\d+)\)", out.lines[j])
        assert int(m2.group(1)) > fault_at                  # the defaults for the job that does not match
        # a bad file: refused with the setting's name and range, the settings in force stay
        cfg.write_text("[detectors.stall]\nhang_s = -1\n")
        n0 = len(err.lines)
        p.send_signal(signal.SIGHUP)
        k = err.wait(r"refused", 30, n0)
        assert "detectors.stall.hang_s: -1 is out of range (valid: >= 0.1)" in err.lines[k]
        assert "settings in force stay" in err.lines[k]
        # live-a stops stepping while its host samples go on for 12 s (event time): the override's 3 s hang
        # threshold is still in force (the default, 30 s, would not fire; the usual lead of the host topic over
        # the steps topic in this test, a few seconds, is discounted first)
        for sim in sims.values():                          # both jobs: only live-a has the 3 s threshold
            _send_steps(sim, prod, kafka, fault_at + 10, fault_at + 22, steps=False)
        out.wait(r"\[FIRING\] job_hang job=live-a", 60)
        time.sleep(2.0)
        assert not any("job_hang job=other-b" in ln for ln in out.lines)
        assert p.poll() is None
    finally:
        prod.close()
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def test_every_numeric_detector_setting_has_a_valid_range():
    """A setting added to a detector declares its range with it (else a file could set any number, and
    `stepwatch config defaults` says "valid any")."""
    missing = [f"{n}.{st.name}" for n, cls in REGISTRY.items() for st in cls.SETTINGS
               if st.type in (int, float) and st.lo is None and st.hi is None]
    assert not missing, missing

"""Helpers for the tests that run stepwatch/devtools/demo_train.py (a real gloo training run) under ``stepwatch wrap``."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from stepwatch.agents.wrap import wrap_env

TRAIN = Path(importlib.util.find_spec("stepwatch.devtools.demo_train").origin)   # (without importing torch here)


def launch(socket_dir: str, job: str, env: dict) -> subprocess.Popen:
    """Start the training run (``SW_*`` settings in ``env``) under ``python -m stepwatch.agents.wrap``."""
    out = tempfile.mkdtemp(prefix="sw-train-")
    full = wrap_env(job=job, socket_dir=socket_dir)
    full.update({k: str(v) for k, v in env.items()})
    full["SW_OUT"] = out
    cmd = [sys.executable, "-m", "stepwatch.agents.wrap", "--", sys.executable, str(TRAIN)]
    p = subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.sw_out = out
    return p


def finish(p: subprocess.Popen, timeout: float = 120.0) -> tuple[dict[int, dict], dict[int, list[float]]]:
    """Wait for the run; returns each rank's probe counters and its step end times (wall clock)."""
    try:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        stats, ends = {}, {}
        for f in sorted(Path(p.sw_out).glob("rank*.json")):
            d = json.loads(f.read_text())
            stats[d["rank"]] = d["probe"]
            ends[d["rank"]] = d["ends"]
        return stats, ends
    finally:
        shutil.rmtree(p.sw_out, ignore_errors=True)


def run(socket_dir: str, job: str, env: dict, timeout: float = 120.0):
    return finish(launch(socket_dir, job, env), timeout)

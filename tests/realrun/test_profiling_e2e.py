"""Targeted profiling end to end (issue 5): 4 real gloo ranks on CPU under ``stepwatch wrap`` -> probe ->
node agent -> the embedded broker -> processor. Rank 2 does extra work inside
``record_function("slow_op")``; the processor's slow_rank alert makes it publish a signed command for
rank 2 and one healthy reference rank; the agent verifies it and hands it to the two probes, which run
torch.profiler for exactly N steps and write real traces; their summaries land in the ``profiles``
table and the side-by-side diff (alert re-emission and ``stepwatch profile diff``) names ``slow_op`` first.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from stepwatch.agents import profiling as prof
from stepwatch.agents.profiling import protocol
from stepwatch.agents.agent import Agent
from stepwatch.agents.wrap import wrap_env
from stepwatch.storage.views import connect
from stepwatch.stream.processor import Processor
from testkit import TESTS
from stepwatch.stream.profiling import ProfilingSettings

pytestmark = [pytest.mark.realrun, pytest.mark.slow]

pytest.importorskip("torch", reason="the end-to-end test trains a real PyTorch model (pip install torch==2.13.0)")

TRAIN = TESTS / "profile_train.py"
PEM, PUB = protocol.keygen()
KEY = prof.load_private_key(env={protocol.ENV_PRIVATE: PEM.decode()})       # the processor signs
KEYS = prof.load_public_keys(env={protocol.ENV_PUBLIC: PUB})                 # agents and probes verify


def launch(socket_dir: str, job: str, env: dict, out: str) -> subprocess.Popen:
    full = wrap_env(job=job, socket_dir=socket_dir)
    full.update({k: str(v) for k, v in env.items()}, SW_OUT=out)
    full[protocol.ENV_PUBLIC] = PUB
    cmd = [sys.executable, "-m", "stepwatch.agents.wrap", "--", sys.executable, str(TRAIN)]
    return subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_slow_rank_alert_triggers_profiles_of_suspect_and_reference_and_the_diff_names_the_slow_op(
        kafka, tmp_path, socket_dir):
    job, slow, n_steps = "prof-e2e", 2, 5
    traces = tmp_path / "traces"
    alerts, t_alert = [], {}
    agent = Agent(kafka, socket_dir=socket_dir, node="node-a", interval_s=0.3, spool_dir=tmp_path / "_spool",
                  plugins=["cpu"]).enable_profiling(KEYS, str(traces), cooldown_s=0.0).start()

    def on_alert(a):
        alerts.append(a)
        t_alert.setdefault(a.alert_id, time.monotonic())

    proc = Processor(kafka, tmp_path / "data", group="g-prof-e2e", flush_interval_s=0.3, on_alert=on_alert,
                     profiling=ProfilingSettings(key=KEY, steps=n_steps, ttl_s=60.0, max_in_flight=2))
    stop_a, stop_p = threading.Event(), threading.Event()
    ta = threading.Thread(target=agent.run, args=(stop_a,), daemon=True)
    tp = threading.Thread(target=proc.run, kwargs={"stop_event": stop_p}, daemon=True)
    ta.start()
    tp.start()
    out = tempfile.mkdtemp(prefix="sw-pe-out-")
    stop_file = os.path.join(out, "STOP")
    p = launch(socket_dir, job, {"STEPWATCH_PROFILE_DIR": traces, "SW_NPROC": 4, "SW_STEP_MS": 50, "SW_SLOW_RANK": slow, "SW_SLOW_EXTRA_MS": 30,
                                 "SW_STOP": stop_file, "SW_STEPS": 3000}, out)
    t0 = time.monotonic()
    try:
        deadline = t0 + 90
        while time.monotonic() < deadline and not (proc.profiling and proc.profiling.diffs):
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert ta.is_alive() and tp.is_alive()
            time.sleep(0.2)
        t_diff = time.monotonic()
        Path(stop_file).touch()
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
        assert proc.profiling.diffs, f"no profile diff after 90 s; agent {agent.stats()} issued " \
                                     f"{proc.profiling.issued} capped {proc.profiling.capped} alerts {alerts}"
        time.sleep(1.5)                                   # one more flush of the profiles rows
    finally:
        stop_a.set()
        ta.join(30)
        stop_p.set()
        tp.join(30)
        shutil.rmtree(out, ignore_errors=True)

    # the alert that asked: slow_rank naming rank 2; the command covered it and one healthy reference
    (pending, d), = proc.profiling.diffs
    assert pending.alert.kind == "slow_rank" and pending.alert.ranks == [slow]
    assert pending.suspects == [slow] and len(pending.reference) == 1 and pending.reference[0] != slow
    ref = pending.reference[0]
    # the diff names the injected operation first
    assert d["slower"][0]["name"] == "slow_op", d
    assert d["slower"][0]["suspect_ms"] > 15 and d["suspect_rank"] == slow and d["reference_rank"] == ref
    # ... and the alert was re-emitted with it (same id and status)
    again = [a for a in alerts if "profile_diff" in a.evidence]
    assert again and again[0].alert_id == pending.alert.alert_id and again[0].status == "firing"
    assert again[0].evidence["profile_diff"]["slower"][0]["name"] == "slow_op"

    # two real torch.profiler traces on disk, named job-r<rank>-<cmd_id>
    con = connect(tmp_path / "data")
    rows = con.execute("SELECT rank, status, uri, bytes, summary, role, reason, steps, started_at, finished_at "
                       "FROM profiles WHERE job = ? AND cmd_id = ? ORDER BY rank", [job, pending.cmd_id]).fetchall()
    assert [(r[0], r[1]) for r in rows] == sorted([(slow, "ok"), (ref, "ok")]), rows
    for rank, _, uri, size, summ, role, reason, steps, t_start, t_end in rows:
        path = uri[len("file://"):]
        assert os.path.basename(path) == f"{job}-r{rank}-{pending.cmd_id}.json.gz"
        assert os.path.getsize(path) == size > 1000
        import gzip
        trace = json.loads(gzip.open(path).read())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert ("slow_op" in names) == (rank == slow)
        assert role == ("suspect" if rank == slow else "reference") and reason == pending.alert.alert_id
        assert steps == n_steps and json.loads(summ)["steps"] == n_steps and t_end > t_start
    assert con.execute("SELECT count(*) FROM deadletter").fetchone()[0] == 0
    alert_rows = con.execute("SELECT count(*) FROM alerts WHERE alert_id = ? AND status = 'firing'",
                             [pending.alert.alert_id]).fetchone()[0]
    assert alert_rows == 1                        # the re-emission is not stored twice
    # ... while the comparison itself is stored, linked to the alert, for post-mortem SQL
    top = con.execute("SELECT name, delta_ms, suspect_rank, reference_rank FROM profile_diffs WHERE alert_id = ? "
                      "AND cmd_id = ? AND position > 0 ORDER BY position", [pending.alert.alert_id,
                                                                            pending.cmd_id]).fetchall()
    assert top[0][0] == "slow_op" and top[0][1] > 15 and top[0][2:] == (slow, ref), top
    doc_sql = ("SELECT a.kind, a.ranks, d.name, d.delta_ms, d.ratio FROM alerts a JOIN profile_diffs d USING "
               "(alert_id) WHERE a.status = 'firing' AND d.position BETWEEN 1 AND 3 ORDER BY a.t_detected, d.position")
    assert "slow_op" in [r[2] for r in con.execute(doc_sql).fetchall()]      # the query in docs/profiling.md

    # the CLI prints the same comparison from the table
    from stepwatch.cli import main
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["profile", "diff", pending.cmd_id, "--data-dir", str(tmp_path / "data")]) == 0
    text = buf.getvalue()
    first = next(line for line in text.splitlines() if "slow_op" in line or "aten::" in line)
    assert first.startswith("slow_op"), text
    print(f"alert -> diff {t_diff - t_alert[pending.alert.alert_id]:.1f}s; diff {d['slower'][:3]}")

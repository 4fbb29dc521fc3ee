"""Real hangs, located: 4 gloo ranks on CPU under ``stepwatch wrap`` (tests/hang_train.py), a node agent, the
broker and the processor configured by a file with a short hang threshold. Rank 3 hangs at step 20 while
the others block in the step's ``all_reduce``:

* ``python``: stuck in a Python function (``load_next_shard``, a ``time.sleep``) for 12 s, then goes on;
* ``mismatch``: calls ``broadcast`` where its peers call ``all_reduce`` (gloo blocks for good);
* ``sigstop``: stopped with SIGSTOP (nothing runs in it, its watchdog included).

Each time the ``job_hang`` alert names rank 3 and its node; for the first two the collective the others
wait in (op, group, sequence number) and rank 3's stack line; for the third the agent's view (the process
is stopped). The time from the hang (the newest step end) to the alert row in the store is printed and must
stay within the hang threshold + 5 s.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from stepwatch import config as swconfig
from stepwatch.agents.agent import Agent
from stepwatch.agents.wrap import wrap_env
from stepwatch.storage.views import connect
from stepwatch.stream.processor import Processor
from testkit import TESTS

pytestmark = [pytest.mark.realrun, pytest.mark.slow]

pytest.importorskip("torch", reason="trains a real PyTorch model (pip install torch)")

HANG_S = 4.0            # the processor's hang threshold, from the configuration file
SCRIPT = TESTS / "hang_train.py"


def _config(path: Path) -> swconfig.Config:
    path.write_text(f"[processor]\nflush_interval_s = 0.3\n\n[detectors.stall]\nhang_s = {HANG_S}\n")
    return swconfig.load(path)


def _alert(data: Path, job: str):
    con = connect(data)
    try:
        return con.execute("SELECT ranks, nodes, evidence, suggestion FROM alerts WHERE job = ? AND kind = 'job_hang' "
                           "AND status = 'firing'", [job]).fetchone()
    except Exception:  # noqa: BLE001 - no alerts table yet
        return None
    finally:
        con.close()


def _newest_step_end(data: Path, job: str) -> int:
    con = connect(data)
    try:
        return int(con.execute("SELECT max(epoch_ns(t_end)) FROM steps WHERE job = ?", [job]).fetchone()[0])
    finally:
        con.close()


@pytest.mark.parametrize("mode", ["python", "mismatch", "sigstop", "python-pure"])
def test_real_hang_names_the_rank_collective_and_stack(kafka, tmp_path, socket_dir, mode):
    job = f"hang-{mode}"
    pure = mode.endswith("-pure")                 # the probe's pure-Python hot path (no _probefast)
    mode = mode.removesuffix("-pure")
    cfg = _config(tmp_path / "stepwatch.toml")
    data = tmp_path / "data"
    agent = Agent(kafka, socket_dir=socket_dir, node="node-a", interval_s=0.5, spool_dir=tmp_path / "spool").start()
    proc = Processor(kafka, data, group=f"g-{job}", detector_settings=cfg, on_alert=lambda a: None,
                     **swconfig.processor_kwargs(cfg))
    stops = threading.Event(), threading.Event()
    threads = [threading.Thread(target=agent.run, args=(stops[0],), daemon=True),
               threading.Thread(target=proc.run, kwargs={"stop_event": stops[1]}, daemon=True)]
    for t in threads:
        t.start()
    out = tempfile.mkdtemp(prefix="sw-hang-")
    env = wrap_env(job=job, socket_dir=socket_dir)
    env.update(SW_HANG=mode, SW_HANG_RANK="3", SW_HANG_STEP="20", SW_HANG_S="12", SW_STEPS="40", SW_STEP_MS="50",
               SW_NPROC="4", SW_OUT=out, STEPWATCH_INFLIGHT_S="1", STEPWATCH_PROBE_PURE="1" if pure else "0")
    p = subprocess.Popen([sys.executable, "-m", "stepwatch.agents.wrap", "--", sys.executable, str(SCRIPT)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    found = t_found = None
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and found is None:
            assert p.poll() is None or mode == "python", p.communicate()[1][-3000:]
            found = _alert(data, job)
            t_found = time.time_ns()
            if found is None:
                time.sleep(0.2)
        assert found is not None, f"no job_hang stored; processor alerts: {[a.line() for a in proc.alerts]}"
        if mode == "python":
            _, err = p.communicate(timeout=90)           # the hang ends: the run finishes
            assert p.returncode == 0, err[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)             # the process group this test started
            p.communicate(timeout=30)
        time.sleep(1.5)                                  # the last flushes
        stops[0].set()
        threads[0].join(30)
        stops[1].set()
        threads[1].join(30)
        shutil.rmtree(out, ignore_errors=True)
    ranks, nodes, evidence, suggestion = found
    ev = json.loads(evidence)
    hang_start = _newest_step_end(data, job) if mode != "python" else None
    assert ranks == [3] and nodes == ["node-a"], (ranks, nodes, ev)
    inf = ev["inflight"]
    c = inf["culprits"][0]
    assert c["rank"] == 3 and c["node"] == "node-a"
    if mode == "python":
        assert c["what"] == "compute" and "load_next_shard" in c["at"] and "hang_train.py" in c["at"], c
        assert inf["waiting"]["op"] == "all_reduce" and inf["waiting"]["ranks"] == 3, inf
        assert "load_next_shard" in suggestion
    elif mode == "mismatch":
        assert c["what"] == "mismatch" and c["op"] == "broadcast" and c["seq"] == inf["waiting"]["seq"], c
        assert "hang_train.py" in c["at"] and "in train" in c["at"], c
        assert inf["waiting"]["op"] == "all_reduce" and inf["waiting"]["group"] == "world", inf
        assert "broadcast" in suggestion and "all_reduce" in suggestion
    else:
        assert c["what"] == "stopped" and c["source"] == "agent", c
        assert inf["waiting"]["op"] == "all_reduce" and inf["waiting"]["ranks"] == 3, inf
        assert "kill -CONT" in suggestion
    # the hang started at the newest step end (python: the newest step end before the alert)
    con = connect(data)
    if hang_start is None:
        hang_start = int(con.execute("SELECT max(epoch_ns(t_end)) FROM steps WHERE job = ? AND step < 20",
                                     [job]).fetchone()[0])
    n_inflight = con.execute("SELECT count(*) FROM inflight WHERE job = ?", [job]).fetchone()[0]
    con.close()
    assert n_inflight >= 4
    delay = (t_found - hang_start) / 1e9
    print(f"\n{job}: job_hang stored {delay:.1f} s after the hang began (threshold {HANG_S} s); "
          f"culprit {c['what']} at {c.get('at', '-')}; waiting in {inf['waiting']['op']} seq {inf['waiting']['seq']}")
    assert delay <= HANG_S + 5.0, delay

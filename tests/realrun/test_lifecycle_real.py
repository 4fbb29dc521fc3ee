"""A job's whole life, on real runs (issue 25): 2 gloo DDP ranks (stepwatch/devtools/ddp_train.py) under ``stepwatch
wrap`` with a node agent, the real broker and a processor whose hang threshold is short (4 s), so a false
hang at the job's end would have time to fire.

* a clean run that ends normally: a ``job_end`` event (outcome ``finished``) is stored, and no alert;
  as in tests/test_ddp_real.py the ranks get real-time priority once they run (where allowed), so that
  this shared 2-core machine's other work does not make one of them a real straggler;
* the ranks stopped by SIGTERM the way a scheduler ends a job: ``job_end`` with outcome ``stopped``, no alert;
* rank 1 ends mid-run (``os._exit(1)``, SIGKILL, an exception): one critical ``rank_crash`` naming rank 1,
  with how it ended (the exception's message; for the two that leave no word, that it ended without one),
  and its last step, within 5 s of the crash; no ``job_hang``. Rank 0 then fails too (gloo: the peer's connection closed), a
  consequence, not the culprit.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from stepwatch.devtools.ddp_train_path import ddp_train_file
from stepwatch.devtools.realrun import jitter_is_real, realtime, slowdown_is_real, straggle_is_real
from stepwatch.agents.agent import Agent
from stepwatch.agents.wrap import wrap_env
from stepwatch.storage.views import connect
from stepwatch.stream.processor import Processor

pytestmark = [pytest.mark.realrun, pytest.mark.slow]

pytest.importorskip("torch", reason="trains a real PyTorch model (pip install torch==2.13.0)")

SCRIPT = Path(ddp_train_file)
HANG_S = 4.0


class _Stack:
    def __init__(self, kafka, data: Path, socket_dir: str, group: str):
        self.agent = Agent(kafka, socket_dir=socket_dir, node="node-a", interval_s=0.5).start()
        self.proc = Processor(kafka, data, group=group, flush_interval_s=0.3, on_alert=lambda a: None,
                              detector_settings={"stall": {"hang_s": HANG_S}})
        self.stops = threading.Event(), threading.Event()
        self.threads = [threading.Thread(target=self.agent.run, args=(self.stops[0],), daemon=True),
                        threading.Thread(target=self.proc.run, kwargs={"stop_event": self.stops[1]}, daemon=True)]
        for t in self.threads:
            t.start()

    def close(self):
        for s, t in zip(self.stops, self.threads):
            s.set()
            t.join(30)


def _run(kafka, tmp_path, socket_dir, job, env, signal_at_step=None, settle_s=HANG_S + 4):
    stack = _Stack(kafka, tmp_path, socket_dir, group=f"g-{job}")
    out = tempfile.mkdtemp(prefix="sw-life-")
    progress = os.path.join(out, "progress")
    full = wrap_env(job=job, socket_dir=socket_dir)
    full.update({"SW_STEPS": "60", "SW_PAD_MS": "10", "SW_WIDTH": "128", "SW_OUT": out, "SW_PROGRESS": progress,
                 **{k: str(v) for k, v in env.items()}})
    try:
        p = subprocess.Popen([sys.executable, str(SCRIPT)], env=full, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        t_end = None
        rt = False
        deadline = time.monotonic() + 180
        while p.poll() is None and time.monotonic() < deadline:
            try:
                step = int(Path(progress).read_text() or -1)
            except (OSError, ValueError):
                step = -1
            if not rt and step >= 2:      # the ranks own their cores on this shared machine (test_ddp_real)
                rt = realtime(p.pid) or True
            if signal_at_step is not None and t_end is None:
                if step >= signal_at_step:
                    t_end = time.time()
                    os.killpg(p.pid, signal.SIGTERM)       # the scheduler ends the job: every process
            time.sleep(0.05)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("the training did not end")
        _, err = p.communicate()
        t_exit = time.time()
        time.sleep(settle_s)                               # past the hang threshold: no false hang may come
        events = [a for a in stack.proc.events if a.job == job]
        alerts = [a for a in stack.proc.alerts if a.job == job]
    finally:
        stack.close()
    for a in alerts + events:
        print(a.line())
    alerts = [a for a in alerts if not (a.kind == "jitter" and jitter_is_real(out, a.step_detected))]
    # a straggler the training script's own CPU clock confirms (the machine slowed that rank: a real
    # straggle, reported rightly), and the job-wide change in its incident, are not this test's subject
    real = {a.incident_id for a in alerts if a.kind == "slow_rank" and a.status == "firing"
            and all(straggle_is_real(out, r, a.step_first, a.step_detected) for r in a.ranks)}
    # (and the same alerts' later words: the resolution the job's end sends is the same alert id)
    ids = {a.alert_id for a in alerts if a.incident_id in real}
    for a in alerts:
        if a.incident_id in real or a.alert_id in ids:
            print(f"(confirmed by the script's own clock: {a.line()[:120]})")
    alerts = [a for a in alerts if a.incident_id not in real and a.alert_id not in ids]
    # a job-wide computation regression every rank's own CPU clock confirms (the machine slowed the whole job:
    # CI-like runs printed +7 % from step 33 of a clean 60-step run) is reported rightly; one the clock does
    # not show still fails the test
    seen = {a.alert_id for a in alerts if a.kind == "regression" and a.status == "firing" and a.cause == "computation"
            and slowdown_is_real(out, a.step_first, a.step_detected)}
    for a in alerts:
        if a.alert_id in seen:
            print(f"(confirmed by the script's own clock: {a.line()[:120]})")
    alerts = [a for a in alerts if a.alert_id not in seen]
    return p.returncode, err, events, alerts, (t_end or t_exit)


def _stored(data: Path, job: str):
    con = connect(data)
    try:
        return con.execute("SELECT kind, severity, status, evidence FROM alerts WHERE job = ? ORDER BY t_detected",
                           [job]).fetchall()
    finally:
        con.close()


#: what a job's life and end may raise: none of it on a clean run or a scheduler's stop
LIFE_KINDS = {"job_hang", "rank_crash", "exit_failed"}


def _the_end_raised_nothing(alerts, events, last_step: int):
    """The subject of the clean and the stopped run: the job's end is an event, never an alert. No alert
    of the job's life (a hang, a crash, a failed exit), none detected at the job's last steps (its end read
    as a slowdown or a stall), and none left firing once the job ended (the ``job_end`` closes what is
    open). A straggle of one rank mid-run that the script's own clock does not confirm is printed here
    and scored where such judgements are scored, over many runs: ``stepwatch eval --real``'s clean runs
    (docs/eval.md, where each counts as a false alert). On this shared 2-core machine the ranks run beside
    the broker, the agent and this test's processor: rank 1 of a clean run here was a real ~9 % straggler
    by the probe for 10 steps (its peer waited 1.3 ms more in the all-reduce each step) while the
    script's main-thread clock saw 3.5 % (the rest: gloo's threads, waits for a core outside the forward),
    in 2 of the last 5 full runs of this suite (CI's and a 2-core VM's)."""
    life = [a.line() for a in alerts if a.kind in LIFE_KINDS]
    assert not life, life
    late = [a.line() for a in alerts if a.status == "firing" and a.step_detected >= last_step - 2]
    assert not late, late
    fired = {a.alert_id for a in alerts if a.status == "firing"}
    resolved = {a.alert_id for a in alerts if a.status == "resolved"}
    assert fired <= resolved, [a.line() for a in alerts if a.alert_id in fired - resolved]
    ends = [e for e in events if e.kind == "job_end"]
    assert len(ends) == 1 and all(a.step_detected <= ends[0].step_detected for a in alerts), \
        [a.line() for a in alerts + events]
    for a in alerts:
        print(f"(a mid-run judgement, scored by eval --real: {a.line()[:160]})")


def test_a_clean_run_that_ends_normally_is_an_event_not_an_alert(kafka, tmp_path, socket_dir):
    rc, err, events, alerts, _ = _run(kafka, tmp_path, socket_dir, "life-clean", {})
    assert rc == 0, err[-2000:]
    assert [(e.kind, e.evidence["outcome"]) for e in events] == [("job_end", "finished")]
    assert events[0].evidence["ranks_ended"] == 2 and events[0].severity == "info"
    _the_end_raised_nothing(alerts, events, 59)
    rows = _stored(tmp_path, "life-clean")
    assert [(k, s) for k, s, _, _ in rows if k in LIFE_KINDS | {"job_end"}] == [("job_end", "info")]


def test_a_job_stopped_by_sigterm_is_an_event_not_a_hang(kafka, tmp_path, socket_dir):
    rc, err, events, alerts, _ = _run(kafka, tmp_path, socket_dir, "life-term", {"SW_STEPS": "400"},
                                      signal_at_step=40)
    assert [(e.kind, e.evidence["outcome"]) for e in events] == [("job_end", "stopped")]
    _the_end_raised_nothing(alerts, events, events[0].step_detected)


@pytest.mark.parametrize("how", ["exit", "raise"])      # (SIGKILL: as os._exit, no word; eval --real runs it)
def test_a_rank_that_crashes_is_named_as_a_crash_within_5_s(kafka, tmp_path, socket_dir, how):
    job = f"life-crash-{how}"
    rc, err, events, alerts, t_exit = _run(kafka, tmp_path, socket_dir, job,
                                           {"SW_CRASH_RANK": 1, "SW_CRASH_STEP": 50, "SW_CRASH_HOW": how,
                                            "SW_STEPS": 100, "SW_PAD_MS": 20})
    assert rc != 0
    kinds = [a.kind for a in alerts if a.status == "firing"]
    con = connect(tmp_path)
    ends = con.execute("SELECT rank, state, source, epoch_ns(t) - epoch_ns(min(t) OVER ()), "
                       "epoch_ns(since) - epoch_ns(min(t) OVER ()), exit_code, signal, error FROM inflight "
                       "WHERE job = ? ORDER BY t", [job]).fetchall()
    stored = dict(con.execute("SELECT rank, max(step) FROM steps WHERE job = ? GROUP BY rank", [job]).fetchall())
    con.close()
    print("in-flight rows (t, since relative to the first, ns):", *ends, sep="\n  ")
    assert kinds == ["rank_crash"], [a.line() for a in alerts]
    a = alerts[0]
    assert a.ranks == [1] and a.nodes == ["node-a"] and a.severity == "critical"
    end = a.evidence["end"]
    if how == "raise":
        assert end["how"] == "error" and "injected failure in rank 1" in end["error"], end
        assert "ddp_train.py" in a.evidence["at"] and "in train" in a.evidence["at"], a.evidence["at"]
    else:
        assert end["how"] == "gone", end                   # SIGKILL, os._exit: no word, the agent saw it go
    # its last step stored (a process that dies loses the steps its probe had not sent: those not closed
    # at its last drain. A drain comes at the first event flush_ms (500 ms) after the last one, on any
    # thread: a collective's event mid-step (DDP's hooks) drains while that step is still open, so the
    # steps lost are that open one and those that ended in the 500 ms after: 1 + 26 of these >= 20 ms steps,
    # step 22 at least of the 49 it ran (here: 39; 21-23 while a drain sent only its first step and kept
    # the rest for the next: test_probe_collectives.py::test_a_drain_sends_what_it_folded_once_flush_ms_passed)
    assert a.evidence["last_step"] == stored[1] and 49 - 27 <= stored[1] <= 49, (a.evidence, stored)
    delay = a.t_detected / 1e9 - a.evidence["end"]["t_ns"] / 1e9
    print(f"{how}: rank_crash {delay:.1f} s after the rank's end")
    assert delay <= 5.0
    assert not events                                      # a crash is not a job end

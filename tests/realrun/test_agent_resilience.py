"""Failures around real training: Kafka away for a while (the agent spools, then replays: every step
row reaches storage exactly once), and the agent killed mid-run (training keeps its pace, the probes
count their drops and find the next agent by themselves)."""
from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

from stepwatch.agents.agent import Agent
from stepwatch.storage.views import connect
from stepwatch.devtools.broker import EmbeddedBroker
from testkit import free_port
from stepwatch.kafkaio import KafkaSettings
from stepwatch.stream.processor import Processor

pytestmark = [pytest.mark.realrun, pytest.mark.slow]

pytest.importorskip("torch", reason="these tests train a real PyTorch model (pip install torch==2.13.0)")

import trainrun  # noqa: E402 - tests/trainrun.py


def _wait(cond, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def test_kafka_away_for_a_while_every_step_stored_exactly_once(socket_dir, tmp_path):
    port = free_port()
    kafka = KafkaSettings(bootstrap=f"127.0.0.1:{port}", prefix="late.", partitions=2)
    agent = Agent(kafka, socket_dir=socket_dir, node="node-b", interval_s=0.5, spool_dir=tmp_path / "spool",
                  send_timeout_s=1.0, retry_s=0.5)
    agent.start()
    stop_agent = threading.Event()
    t_agent = threading.Thread(target=agent.run, args=(stop_agent,), daemon=True)
    t_agent.start()
    job, steps, ranks = "late-kafka", 150, 2
    broker = proc = None
    stop_proc = threading.Event()
    try:
        train = trainrun.launch(socket_dir, job, {"SW_NPROC": ranks, "SW_STEPS": steps, "SW_STEP_MS": 40})
        m = agent.metrics
        # no broker yet: training runs and the agent spools (at least 60 steps of the 2 ranks)
        _wait(lambda: m.value(m.records_spooled, "steps") >= 2 * 60 or train.poll() is not None, 90,
              "the agent to spool step rows")
        assert train.poll() is None, "training finished before Kafka came back: the outage must be mid-run"
        assert m.value(m.records_out) == 0 and len(agent.spool) > 0
        broker = EmbeddedBroker(port=port, log_path=tmp_path / "broker.log").start()     # Kafka comes back
        proc = Processor(kafka, tmp_path / "data", group="g-late", flush_interval_s=0.3, on_alert=lambda a: None)
        t_proc = threading.Thread(target=proc.run, kwargs={"stop_event": stop_proc}, daemon=True)
        t_proc.start()
        assert train.poll() is None, "training should still be running when Kafka returns"
        stats, _ = trainrun.finish(train)
        assert all(s["steps"] == steps and s["dropped"] == 0 and s["sent"] + s["pending"] == steps
                   for s in stats.values()), stats
        pm = proc.metrics
        _wait(lambda: pm.value(pm.records_out, "steps") >= ranks * steps and proc.jobs.get(job) is not None
              and proc.jobs[job].state.open_steps() == 0, 90, "the processor to store every step")
        time.sleep(0.6)
        assert len(agent.spool) == 0 and agent.shipper.online
    finally:
        stop_agent.set()
        t_agent.join(30)
        stop_proc.set()
        if proc is not None:
            t_proc.join(30)
        if broker is not None:
            broker.stop()
    con = connect(tmp_path / "data")
    n, uniq = con.execute("SELECT count(*), count(DISTINCT (rank, step)) FROM steps WHERE job = ?", [job]).fetchone()
    assert n == uniq == ranks * steps
    assert con.execute("SELECT min(step), max(step) FROM steps WHERE job = ?", [job]).fetchone() == (0, steps - 1)
    # every rank's identity (a rank says hello again when it grows: the dtype seen at its first forward)
    assert con.execute("SELECT count(DISTINCT rank) FROM topology WHERE job = ?", [job]).fetchone()[0] == ranks
    assert m.value(m.records_spooled, "steps") >= 2 * 60
    assert m.value(m.records_out, "steps") >= ranks * steps


def test_agent_killed_training_keeps_pace_probes_count_drops_and_find_the_next_agent(socket_dir, tmp_path):
    log = open(tmp_path / "agent.log", "w+")
    first = subprocess.Popen([sys.executable, "-m", "stepwatch.agents.commands", "-v", "agent", "--no-kafka",
                              "--socket-dir", socket_dir, "--interval", "0.5", "--plugins", "load"],
                             stdout=log, stderr=subprocess.STDOUT)
    job, steps, ranks, step_ms = "agent-dies", 200, 2, 40
    second = None
    try:
        train = trainrun.launch(socket_dir, job, {"SW_NPROC": ranks, "SW_STEPS": steps, "SW_STEP_MS": step_ms})

        def served():
            log.seek(0)
            return log.read().count(f"of job {job}") >= ranks
        _wait(served, 90, "the first agent to serve both ranks")
        time.sleep(1.0)
        t_kill = time.time()
        first.send_signal(signal.SIGKILL)                 # dies without removing its socket file
        first.wait(10)
        time.sleep(2.0)                                   # training goes on with no agent
        t_back = time.time()
        second = Agent(None, socket_dir=socket_dir, node="node-c", interval_s=0.5, plugins=[]).start()
        stats, ends = trainrun.finish(train)
        time.sleep(0.3)
        second.drain()
    finally:
        if first.poll() is None:
            first.kill()
        log.close()
        if second is not None:
            second.close()
    assert train.returncode == 0
    for r, st in stats.items():
        assert st["steps"] == steps
        assert st["dropped_no_agent"] >= 10, st          # ~2 s of 40 ms steps went nowhere, counted
        # every step accounted for: delivered, waiting (sent at destroy_process_group) or counted lost
        assert st["sent"] + st["pending"] + st["backlog_frames"] + st["dropped"] == steps, st
    # the second agent learnt both ranks (the probes re-sent their hello) and got their steps
    idents = {(i.job, i.rank) for i in second.idents.values()}
    assert idents == {(job, 0), (job, 1)}
    assert second.metrics.value(second.metrics.records_in, "steps") >= ranks * 10
    # training kept its pace while no agent listened
    for r, e in ends.items():
        d = [b - a for a, b in zip(e, e[1:])]
        before = [x for x, t in zip(d, e[1:]) if t < t_kill]
        during = [x for x, t in zip(d, e[1:]) if t_kill <= t < t_back]
        assert len(before) >= 10 and len(during) >= 10, (len(before), len(during))
        assert statistics.median(during) < statistics.median(before) * 1.3 + 0.005, (before, during)

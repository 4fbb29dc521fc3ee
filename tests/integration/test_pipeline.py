"""End-to-end through the real broker: simulate -> Kafka -> processor -> Parquet -> DuckDB."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from stepwatch.wire import catalog
from stepwatch.wire import tables as wire
from stepwatch.wire.catalog import headers
from stepwatch.wire.encode import encode_arrow, encode_json
from stepwatch.devtools.simsend import send_simulation
from stepwatch.devtools.simulate import Simulation
from stepwatch.storage.views import connect
from stepwatch.kafkaio import make_producer, send_table
from stepwatch.stream.processor import Processor

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def run_processor(kafka, data, group, until, timeout=120, **kw):
    """Run an in-process processor until ``until(proc)`` is true; returns it (closed)."""
    proc = Processor(kafka, data, group=group, flush_interval_s=0.3, on_alert=lambda a: None, **kw)
    stop = threading.Event()
    th = threading.Thread(target=proc.run, kwargs={"stop_event": stop}, daemon=True)
    th.start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and th.is_alive():
            if until(proc):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"processor did not finish in {timeout}s: {proc.stats()}")
        time.sleep(0.5)   # one more flush
    finally:
        stop.set()
        th.join(30)
    assert not th.is_alive()
    return proc


def stored(proc, table="steps"):
    return proc.metrics.value(proc.metrics.records_out, table)


def test_end_to_end_finds_injected_faults_without_loss_or_duplicates(kafka, tmp_path):
    sim = Simulation(job="e2e", ranks=256, steps=160, seed=3,
                     faults=["slow-rank:rank=37,pct=30,start=40", "regression:start=110,pct=20,cause=io"])
    prod = make_producer(kafka)
    sent = send_simulation(sim, prod, kafka, rows_per_message=1000)
    prod.close()
    proc = run_processor(kafka, tmp_path, "g-e2e",
                         lambda p: stored(p) >= sent["steps"] and p.jobs["e2e"].state.open_steps() == 0)
    con = connect(tmp_path)
    n, uniq = con.execute("SELECT count(*), count(DISTINCT (rank, step)) FROM steps WHERE job='e2e'").fetchone()
    assert n == uniq == sent["steps"] == 256 * 160
    assert con.execute("SELECT count(*) FROM host").fetchone()[0] == sent["host"]
    assert con.execute("SELECT count(*) FROM gc").fetchone()[0] == sent["gc"]
    assert con.execute("SELECT count(*) FROM topology").fetchone()[0] == 256
    assert con.execute("SELECT count(*) FROM deadletter").fetchone()[0] == 0
    alerts = con.execute("SELECT kind, status, ranks, nodes, step_first, cause FROM alerts "
                         "WHERE status='firing' ORDER BY step_detected").fetchall()
    slow = [a for a in alerts if a[0] == "slow_rank"]
    assert len(slow) == 1, alerts
    assert slow[0][2] == [37] and slow[0][3] == [sim.nodes[37]]
    assert abs(slow[0][4] - 40) <= 5
    reg = [a for a in alerts if a[0] == "regression"]
    assert len(reg) == 1 and abs(reg[0][4] - 110) <= 10, alerts
    assert reg[0][5] == "io"
    # the alert also went to the alerts topic and to the console line
    assert any("slow_rank" in a.line() and "rank 37" in a.line() for a in proc.alerts)


def _proc_cmd(kafka, data, group):
    return [sys.executable, "-m", "stepwatch.cli", "process", "--bootstrap", kafka.bootstrap,
            "--topic-prefix", kafka.prefix, "--data-dir", str(data), "--group", group, "-q",
            "--flush-interval", "0.2", "--stats-json", str(data / "stats.json")]


def _count_files(data):
    return len(list((data / "lake" / "main" / "steps").glob("*/*.parquet")))


def test_sigkill_mid_stream_then_restart_loses_nothing_and_stores_nothing_twice(kafka, tmp_path):
    # the job ran in the past (its ~300 s of event time end before now): the producer sends it ~6 steps/s,
    # far faster than it ran, and a row more than max_future_skew_s (300 s) ahead of the receive time is
    # refused whenever its topic is read ahead of the steps that move the job's own clock (CI stored 2,851
    # and 2,826 of 2,991 gc rows that way). A real agent never sends the future.
    sim = Simulation(job="crash", ranks=512, steps=300, seed=5, faults=["slow-rank:rank=100,pct=30,start=40"],
                     t0_ns=time.time_ns() - 900 * 10**9)
    prod = make_producer(kafka)
    # the producer keeps sending (~6 steps/s) while processors are killed and restarted, and holds its last
    # 30 steps until both kills are done (however slow the machine, they fall mid-stream); then it sends
    # the rest briskly
    sent = {}
    brisk = threading.Event()

    def pace(step, _):
        if brisk.is_set():
            time.sleep(0.01)
            return
        time.sleep(0.15)
        if step >= sim.steps - 30:
            brisk.wait(600)
    failed = []

    def produce():
        try:            # send_simulation raises on a message the broker did not take: say so, not "lost"
            sent.update(send_simulation(sim, prod, kafka, chunk=1, rows_per_message=512, on_chunk=pace))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            failed.append(e)
    th = threading.Thread(target=produce, daemon=True)
    th.start()
    kills = 0
    for failpoint in (None, "before-commit"):
        env = dict(os.environ)
        if failpoint:
            env["STEPWATCH_FAILPOINT"] = failpoint
        p = subprocess.Popen(_proc_cmd(kafka, tmp_path, "g-crash"), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180          # (a loaded machine: 60 s stored nothing at load 48)
        start_files = _count_files(tmp_path)
        while time.monotonic() < deadline and p.poll() is None and _count_files(tmp_path) < start_files + 3:
            time.sleep(0.02)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        assert p.wait(10) in (-signal.SIGKILL, 137)
        kills += 1
    mid_stream = th.is_alive()
    brisk.set()
    before = connect(tmp_path).execute("SELECT count(*) FROM steps").fetchone()[0]
    th.join(120)
    prod.close()
    assert not failed and not th.is_alive(), f"the test's producer failed: {failed}"
    assert mid_stream and 0 < before < sent["steps"], "the kills should happen mid-stream"
    # restart and let it finish
    p = subprocess.Popen(_proc_cmd(kafka, tmp_path, "g-crash") + ["--idle-exit", "4"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err.decode()[-2000:]
    con = connect(tmp_path)
    dead = con.execute("SELECT source_topic, reason FROM deadletter LIMIT 5").fetchall()
    for table, key in (("steps", "(rank, step)"), ("host", "(node, t)"), ("gc", "(rank, t, generation)")):
        n, uniq = con.execute(f"SELECT count(*), count(DISTINCT {key}) FROM {table} WHERE job='crash'").fetchone()
        assert n == uniq == sent[table], (table, n, uniq, sent[table], dead, err.decode()[-1500:])
    assert not dead, dead
    assert con.execute("SELECT count(*) FROM topology").fetchone()[0] == 512
    # detector state was rebuilt from the store after each restart: the straggler is reported
    # exactly once, neither forgotten nor alerted twice
    alerts = con.execute("SELECT ranks, step_first FROM alerts WHERE job='crash' AND kind='slow_rank' "
                         "AND status='firing'").fetchall()
    assert alerts == [([100], alerts[0][1])] and abs(alerts[0][1] - 40) <= 5, alerts


def test_malformed_messages_go_to_deadletter_and_good_ones_are_stored(kafka, tmp_path):
    sim = Simulation(job="mixed", ranks=64, steps=30, seed=9)
    prod = make_producer(kafka)
    topo = sim.topology()
    send_table(prod, kafka, "topology", topo)
    prod.flush()
    tables = sim.generate(0, 30)
    good = tables["steps"]
    topic = kafka.topic("steps")
    hdr = headers("steps")
    bad_msgs = [
        (b"\x00\x01garbage\xff\xfe", hdr),                                           # not Arrow
        (encode_arrow(tables["host"].slice(0, 5)), hdr),                          # host rows on steps/1
        (encode_json([{"job": "mixed", "node": "node-0000", "rank": 1, "step": 999, "t_end": 1,
                            "step_ms": "NaN"},
                           {"job": "mixed", "node": "node-0000", "rank": 2, "step": 999, "t_end": 1,
                            "step_ms": 10.0, "data_ms": -4.0}]),
         headers("steps", catalog.JSON_CT)),                                        # NaN / negative
        (encode_json([{"job": "", "node": "n", "rank": 0, "step": 1, "t_end": 1, "step_ms": 1.0},
                           {"job": "../../etc", "node": "n", "rank": 0, "step": 1, "t_end": 1, "step_ms": 1.0}]),
         headers("steps", catalog.JSON_CT)),                                        # unknown / unsafe job
        (encode_json([{"job": "mixed", "node": "n", "rank": 5000, "step": 1, "t_end": 1, "step_ms": 1.0}]),
         headers("steps", catalog.JSON_CT)),                                        # rank outside topology
        (b"[]", [("content-type", b"application/json"), ("schema", b"steps/7")]),      # wrong schema version
    ]
    # interleave: good batch, bad message, good batch, ...
    offsets = np.linspace(0, good.num_rows, len(bad_msgs) + 2).astype(int)
    for i in range(len(offsets) - 1):
        send_table(prod, kafka, "steps", good.slice(offsets[i], offsets[i + 1] - offsets[i]), max_rows=500)
        if i < len(bad_msgs):
            value, h = bad_msgs[i]
            prod.send(topic, value, key=b"mixed", headers=h)
    prod.flush()
    prod.close()
    proc = run_processor(kafka, tmp_path, "g-bad",
                         lambda p: stored(p) >= good.num_rows and stored(p, "deadletter") >= 6)
    con = connect(tmp_path)
    assert con.execute("SELECT count(*) FROM steps WHERE job='mixed'").fetchone()[0] == good.num_rows
    reasons = [r[0] for r in con.execute("SELECT reason FROM deadletter ORDER BY source_offset, row").fetchall()]
    text = "\n".join(reasons)
    assert len(reasons) == 6, text      # one record per bad message (its bad rows summarised)
    assert "undecodable Arrow" in text
    assert "field 'step_ms'" in text and "nan" in text
    assert "field 'data_ms'" in text and "-4.0" in text
    assert "invalid job id ''" in text and "'../../etc'" in text
    assert "field 'rank': 5000 is outside world_size 64" in text
    assert "unsupported schema version" in text
    assert "required field 'step_ms'" in text or "missing" in text   # host rows under steps/1
    # whole-message errors keep the raw payload for replay
    raw = con.execute("SELECT payload FROM deadletter WHERE reason LIKE 'undecodable%'").fetchone()[0]
    assert raw == b"\x00\x01garbage\xff\xfe"
    assert proc.stats()["deadletter"] == 6

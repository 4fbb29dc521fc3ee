"""A slow-rank alert whose host samples are read after it was built (an agent samples the host after the
steps it ships; Kafka orders nothing across topics) waits for them, bounded, and is decided again in place:
the foreign process that caused it is in its own evidence, in the store and in what the sinks got, under the
same alert id and incident."""
from __future__ import annotations

import json

from stepwatch.wire.catalog import headers
from stepwatch.wire.encode import encode_arrow
from stepwatch.devtools.simulate import Simulation
from stepwatch.devtools.eval import Record
from stepwatch.storage.views import connect
from stepwatch.kafkaio import KafkaSettings
from stepwatch.stream.processor import Processor

import pytest
pytestmark = pytest.mark.unit

T0 = 1_767_225_600_000_000_000


def _feed(p: Processor, sim: Simulation, chunk: int, steps: int, host: bool = True) -> None:
    """Steps of ``chunk`` steps per message, each followed by the host samples of the same steps."""
    off = {"steps": 0, "host": 0}

    def send(kind, t):
        if t.num_rows:
            p.process_message(Record(p.kafka.topic(kind), 0, off[kind], sim.job.encode(), encode_arrow(t),
                             headers(kind)))
            off[kind] += 1
    p.process_message(Record(p.kafka.topic("topology"), 0, 0, sim.job.encode(), encode_arrow(sim.topology()),
                     headers("topology")))
    for s in range(0, steps, chunk):
        g = sim.generate(s, min(s + chunk, steps))
        send("steps", g["steps"])
        if host:
            send("host", g["host"])


def test_the_foreign_process_read_after_the_alert_is_in_its_evidence(tmp_path):
    sim = Simulation(job="hw", ranks=64, steps=100, seed=5, faults=["cpu-contention:rank=21,pct=25,start=60"],
                     t0_ns=T0)
    seen = []
    p = Processor(KafkaSettings(), tmp_path, on_alert=seen.append, profiling=None)
    _feed(p, sim, chunk=10, steps=100)
    p.close()
    mine = [a for a in seen if a.kind in ("slow_rank", "slow_node") and a.status == "firing"]
    assert mine, [a.line() for a in seen]
    first, last = mine[0], mine[-1]
    # sent at once (its delay is the steps'), then again, the same alert, once the host samples came
    assert len(mine) == 2 and first is last and len({a.alert_id for a in mine}) == 1
    ev = last.evidence
    assert ev["host_wait"]["covered"] is True
    foreign = ev["host"]["foreign"]
    assert foreign and foreign[0]["name"] == "monitor-plugin" and foreign[0]["pid"] > 0, ev["host"]
    assert last.cause == "cpu" and "monitor-plugin" in ev["cause_reason"]
    assert ev["incident"]["cause"] == "cpu" and ev["incident"]["alerts"] == 1
    con = connect(tmp_path)
    rows = con.execute("SELECT status, cause, evidence, incident_id FROM alerts WHERE alert_id = ?",
                       [last.alert_id]).fetchall()
    firing = [r for r in rows if r[0] == "firing"]
    assert len(firing) == 1                         # one row per alert and status: the final evidence
    stored = json.loads(firing[0][2])
    assert firing[0][1] == "cpu" and stored["host"]["foreign"][0]["name"] == "monitor-plugin"
    assert firing[0][3] == last.incident_id


def test_without_host_samples_the_row_waits_only_its_bound(tmp_path):
    """A producer that sends no host samples: the alert goes out at once and its row is stored when the
    wait ends (host source read to its end + 3 s, here: the processor closes), unchanged, sent once."""
    sim = Simulation(job="hw0", ranks=64, steps=100, seed=5, faults=["slow-rank:rank=21,pct=20,start=60"],
                     t0_ns=T0)
    seen = []
    p = Processor(KafkaSettings(), tmp_path, on_alert=seen.append, profiling=None)
    _feed(p, sim, chunk=10, steps=100, host=False)
    p.close()
    fired = [a for a in seen if a.kind == "slow_rank" and a.status == "firing"]
    assert len(fired) == 1 and fired[0].evidence["host_wait"]["covered"] is False
    assert fired[0].cause == "computation" and "host" not in fired[0].evidence
    con = connect(tmp_path)
    assert con.execute("SELECT count(*) FROM alerts WHERE alert_id = ? AND status = 'firing'",
                       [fired[0].alert_id]).fetchone()[0] == 1

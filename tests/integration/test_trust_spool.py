"""Issue 16, spool and disk: a full disk or a damaged spool file loses nothing silently. The real agent
(real probe, real ``agent.sock``) spools to a real small filesystem (a tmpfs mounted for the test) while
Kafka is away, the disk fills up, Kafka comes back (a real broker started on the port the agent was
given): every step reaches Kafka, once, in order. A damaged spool file found by a restarted agent is
counted and logged once; the rest is delivered in order."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
import zlib

import pytest

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import decode
from stepwatch.agents.agent import Agent
from stepwatch.agents.probe import Probe
from stepwatch.agents.shipper import Shipper, Spool
from stepwatch.devtools.broker import EmbeddedBroker
from testkit import free_port
from stepwatch.kafkaio import KafkaSettings, make_consumer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def small_disk():
    d = tempfile.mkdtemp(prefix="sw-disk-", dir="/tmp")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a small tmpfs here (needs CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", d], check=False)
    shutil.rmtree(d, ignore_errors=True)


def fill(d: str) -> str:
    """Fill the filesystem of ``d`` to the last byte."""
    p = os.path.join(d, "filler")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    fd = os.open(os.path.join(d, "probe-write"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError):
            os.write(fd, b"x" * 4096)
    finally:
        os.close(fd)
    return p


def consume_steps(kafka: KafkaSettings, job: str, want: int, timeout=60.0) -> list[int]:
    c = make_consumer(kafka, f"g-{time.time_ns()}")
    c.subscribe([kafka.topic("steps")])
    steps: list[int] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(steps) < want:
            for _, msgs in c.poll(timeout_ms=300).items():
                for m in msgs:
                    h = dict(m.headers)
                    d = decode(m.value, h["content-type"], h["schema"])
                    t = d.table
                    if t.num_rows and t.column("job")[0].as_py() == job:
                        steps += t.column("step").to_pylist()
        time.sleep(0.5)
        for _, msgs in c.poll(timeout_ms=500).items():          # nothing more than wanted
            for m in msgs:
                h = dict(m.headers)
                t = decode(m.value, h["content-type"], h["schema"]).table
                if t.num_rows and t.column("job")[0].as_py() == job:
                    steps += t.column("step").to_pylist()
    finally:
        c.close()
    return steps


def test_kafka_back_and_disk_full_loses_nothing_and_keeps_the_order(small_disk, socket_dir, tmp_path, caplog):
    """Today, with spooled files waiting and the disk full, every tick raises writing the spool: the
    tick's rows are lost, nothing is counted, and the spool is never replayed again."""
    port = free_port()
    kafka = KafkaSettings(bootstrap=f"127.0.0.1:{port}", prefix="full.", partitions=1)
    agent = Agent(kafka, socket_dir=socket_dir, node="n1", interval_s=0.2, spool_dir=os.path.join(small_disk, "spool"),
                  plugins=[], send_timeout_s=1.0, retry_s=0.2).start()
    probe = Probe().init(job="disk", rank=0, world_size=1, socket_dir=socket_dir, auto=False, flush_ms=0)
    broker = None
    n = 0

    def steps_and_tick(k):
        nonlocal n
        for _ in range(k):
            probe.begin_step()
            probe.end_step()
            n += 1
        time.sleep(0.1)
        agent.tick()

    try:
        for _ in range(3):                                   # Kafka away: the agent spools
            steps_and_tick(5)
        assert len(agent.spool) >= 3 and agent.metrics.value(agent.metrics.records_spooled, "steps") == 15
        fill(small_disk)                                     # then the disk fills up
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stepwatch.agent.ship"):
            for _ in range(5):
                steps_and_tick(5)                            # must not raise; rows held in memory, in order
        assert agent.shipper.held and agent.metrics.value(agent.metrics.dropped) == 0
        assert len([r for r in caplog.records if "cannot write the spool" in r.getMessage()]) == 1   # logged once
        broker = EmbeddedBroker(port=port, log_path=tmp_path / "broker.log").start()   # Kafka is back
        deadline = time.monotonic() + 60
        while (len(agent.spool) or agent.shipper.held) and time.monotonic() < deadline:
            steps_and_tick(1)
        assert not len(agent.spool) and not agent.shipper.held, "the spool and the held tables went out"
        steps_and_tick(3)
        got = consume_steps(kafka, "disk", n)
        assert got == list(range(n)), got                    # every step, once, in the order it was made
        assert agent.metrics.value(agent.metrics.dropped) == 0
    finally:
        probe.shutdown()
        agent.close()
        if broker is not None:
            broker.stop()


def test_disk_full_for_too_long_drops_the_oldest_held_counted_and_logged_once(small_disk, caplog):
    """Memory is bounded too: past ``held_max_bytes`` the oldest held table goes, counted."""
    from stepwatch.agents.agent import AgentMetrics
    m = AgentMetrics()
    spool = Spool(os.path.join(small_disk, "spool"), metrics=m)
    port = free_port()
    sh = Shipper(KafkaSettings(bootstrap=f"127.0.0.1:{port}", prefix="x."), spool, m, send_timeout_s=0.5,
                 retry_s=60, held_max_bytes=64 << 10)
    fill(small_disk)
    import pyarrow as pa
    t = pa.Table.from_pylist([{"job": "j", "node": "n", "rank": 0, "step": i, "t_end": i, "step_ms": 1.0}
                              for i in range(200)], schema=wire.STEPS)
    with caplog.at_level(logging.WARNING, logger="stepwatch.agent.ship"):
        for _ in range(40):
            sh.ship([("steps", "j", t)])
    assert sh.held_bytes <= 64 << 10 and sh.held
    dropped = m.value(m.dropped, "disk_full")
    assert dropped == (40 - len(sh.held)) * 200 > 0
    assert len([r for r in caplog.records if "(disk_full)" in r.getMessage()]) == 1      # logged once a minute


def test_a_damaged_spool_file_is_counted_logged_once_and_the_rest_delivered_in_order(kafka, tmp_path, caplog):
    """Today a damaged spool file is either sent as it is (a flipped bit inside a buffer reads back as
    other values) or dropped without its rows being known; torn temporary files vanish uncounted."""
    from stepwatch.agents.agent import AgentMetrics
    import pyarrow as pa
    d = tmp_path / "spool"
    away = Shipper(KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}", prefix=kafka.prefix),
                   Spool(d), None, send_timeout_s=0.5, retry_s=60)
    for k in range(6):                                       # six tables spooled while Kafka was away
        away.ship([("steps", "dmg", pa.Table.from_pylist(
            [{"job": "dmg", "node": "n", "rank": 0, "step": 10 * k + i, "t_end": 1, "step_ms": 1.0} for i in range(10)],
            schema=wire.STEPS))])
    files = sorted(p for p in os.listdir(d) if p.endswith(".arrows"))
    assert len(files) == 6
    victim = d / files[2]
    b = bytearray(victim.read_bytes())
    b[len(b) // 2] ^= 0x40                                   # one flipped bit in the middle of the file
    victim.write_bytes(bytes(b))
    (d / ".tmp-0000000000000099-steps-7-00000000.arrow").write_bytes(b"torn")   # a crash mid-write
    m = AgentMetrics()
    with caplog.at_level(logging.WARNING, logger="stepwatch.agent.ship"):
        sh = Shipper(kafka, Spool(d, metrics=m), m, send_timeout_s=5.0)     # the agent restarted, Kafka is up
        while len(sh.spool):
            assert sh.replay() or len(sh.spool) == 0
    assert m.value(m.dropped, "spool_unreadable") == 10 and m.value(m.dropped, "spool_incomplete") == 7
    got = consume_steps(kafka, "dmg", 50)
    assert got == [s for s in range(60) if not 20 <= s < 30], got      # all but the damaged file, in order
    msgs = [r.getMessage() for r in caplog.records]
    assert len([x for x in msgs if "(spool_unreadable)" in x]) == 1 and len([x for x in msgs if "incomplete" in
                                                                              x or "(spool_incomplete)" in x]) == 1
    assert zlib.crc32(b"") == 0                              # (the CRC used to detect the damage)


def test_spool_writes_are_fsynced(tmp_path):
    """Each spooled file is fsynced before its rename, and the directory after (strace shows the calls)."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    code = ("import pyarrow as pa; from stepwatch.wire import tables as w; from stepwatch.agents.shipper import Spool; "
            f"s = Spool({str(tmp_path / 'sp')!r}); "
            "s.put('steps', 'j', pa.Table.from_pylist([{'job': 'j', 'node': 'n', 'rank': 0, 'step': 1, 't_end': 1, "
            "'step_ms': 1.0}], schema=w.STEPS))")
    import sys
    r = subprocess.run(["strace", "-f", "-e", "trace=fsync,rename,renameat,renameat2", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=120)
    calls = [line for line in r.stderr.splitlines() if "fsync(" in line or "rename" in line]
    kinds = ["fsync" if "fsync(" in c else "rename" for c in calls]
    assert kinds[-3:] == ["fsync", "rename", "fsync"], calls

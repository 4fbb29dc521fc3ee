"""Bus-bandwidth rows for every job whose collectives are timed (issue 27, item 4).

On an H200 (torch 2.11, NCCL) 1- and 2-rank jobs whose all-reduces were timed by device events got no
``comm_bw`` rows at all, and the gloo job of tests/test_efficiency_dist.py got none now and then on a
loaded machine. Both are the same: Kafka orders nothing across topics, and the processor handles a
poll's ``steps`` before its ``comm``; a fast job (or a lagging processor) has its steps closed, and every
analysis window of the ``comm_bw`` detector come due, before the comm rows of those steps are in the
job's window. The window was then skipped for good. Here the rows are built as on the device: real probes
whose collectives on an accelerator tensor are timed by (stand-in) device events, their datagrams decoded
by the agent's columnar decoder, fed to the real processor's message entry point in the order a poll
hands them over (steps first)."""
from __future__ import annotations

import os

import pyarrow as pa
import pytest

from stepwatch.wire import tables as wire
from stepwatch.wire.catalog import headers
from stepwatch.wire.encode import encode_arrow
from stepwatch.wire import columns
from stepwatch.agents.agent import identity_from_hello
from stepwatch.agents.probe import Probe, decode
from stepwatch.wire import datagram
from stepwatch.devtools.eval import Record, _NullProducer
from stepwatch.kafkaio import KafkaSettings
from stepwatch.storage.views import connect
from stepwatch.stream.processor import Processor

from probe_helpers import Rx  # noqa: E402 - tests/probe_helpers.py

pytestmark = [pytest.mark.unit, pytest.mark.slow]


CALL_BYTES = 43 * 2**20 // 3           # 43 MiB of gradients a step, in 3 all_reduces
DEV_MS = 2.5                           # each call's time on the device (its events)


class _DevTensor:
    is_cpu = False
    nbytes = CALL_BYTES

    class device:
        type = "fakedev"


class _Event:
    """``torch.cuda.Event``'s methods the probe uses: recorded around the call, read at the replay."""

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return DEV_MS


def _device_job(sockdir: str, job: str, ranks: int, steps: int) -> dict[str, pa.Table]:
    """``topology``, ``steps`` and ``comm`` tables of a job of ``ranks`` probes (one after the other) whose
    all_reduces run on an accelerator and are timed by its events, as the agent ships them."""
    class Dist:
        @staticmethod
        def get_world_size(group=None):
            return ranks

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    datagrams = []
    for rank in range(ranks):
        rx = Rx(sockdir, listen=False)                  # (read after the probe's shutdown sent it all)
        p = Probe()
        try:
            p.init(job=job, rank=rank, world_size=ranks, socket_dir=sockdir, auto=False, flush_ms=60_000)
            p.timing.mods["fakedev"] = type("FakeDevModule", (), {"Event": _Event})
            p._log.dev_on = 1                           # what a CUDA context turns on
            ar = p.hooks._wrap_collective(Dist, "all_reduce", all_reduce)
            for _ in range(steps):
                p.begin_step()
                for _ in range(3):
                    ar(_DevTensor())
                p.end_step()
            p.flush()
            assert p.stats()["dev_timed"] == 3 * steps
        finally:
            p.shutdown()
        while True:
            try:
                datagrams.append(rx.sock.recv(1 << 17))
            except BlockingIOError:
                break
        rx.close()
        os.unlink(os.path.join(sockdir, datagram.SOCKET_NAME))
    idents, bc, topo = {}, columns.BatchColumns(), []
    for d in datagrams:
        typ, inst, frames = datagram.scan(d)
        if typ == datagram.T_HELLO:
            idents[inst] = identity_from_hello(decode(d)[0][3], "gpu-node", None)
            topo.append(idents[inst].topology_row())
            continue
        if typ == datagram.T_BATCH:
            bc.add(idents[inst], d, frames)
    (_, [(st, cm, _)]), = bc.take().items()          # (one message's worth per kind)
    return {"topology": pa.Table.from_pylist(topo, schema=wire.TOPOLOGY), "steps": pa.table(st), "comm": pa.table(cm)}


class _Processor:
    """The real processor fed through its message entry point (``process_message``), one poll at a time in
    the order ``poll_once`` hands a poll over (topology, steps, then the rest)."""

    def __init__(self, tmp_path):
        self.kafka, self.dir = KafkaSettings(prefix="cbw."), tmp_path
        self.p = Processor(self.kafka, tmp_path, flush_interval_s=1e9, create_topics=False)
        self.p.producer = _NullProducer()
        self.off: dict[str, int] = {}

    def send(self, job: str, kind: str, t: pa.Table) -> None:
        o = self.off[kind] = self.off.get(kind, -1) + 1
        self.p.process_message(Record(self.kafka.topic(kind), 0, o, job.encode(), encode_arrow(t),
                                      headers(kind)))

    def poll(self, job: str, tabs: dict[str, pa.Table]) -> None:
        for kind in ("topology", "steps", "comm"):
            self.send(job, kind, tabs[kind])

    def goodbyes(self, job: str, tabs: dict[str, pa.Table]) -> None:
        """Every rank's goodbye (exit status 0) after its last step, as the agent ships it."""
        st = tabs["steps"]
        t_end = max(st.column("t_end").cast(pa.int64()).to_pylist())
        self.send(job, "inflight", pa.Table.from_pylist(
            [{"job": job, "node": "gpu-node", "rank": r, "t": t_end + 1000, "source": "probe", "state": "exited",
              "exit_code": 0} for r in sorted(set(st.column("rank").to_pylist()))], schema=wire.INFLIGHT))

    def rows(self, job: str) -> list[tuple]:
        """The job's stored ``comm_bw`` rows (after a checkpoint)."""
        self.p._flush()
        return connect(self.dir).execute(
            """SELECT step_lo, step_hi, op, group_size, calls_per_step, bytes_per_call, algbw_gbps, busbw_gbps,
                      link FROM comm_bw WHERE job = ? ORDER BY step_hi""", [job]).fetchall()

    def close(self):
        self.p.close()


def test_device_timed_all_reduces_of_a_2_rank_job_get_bus_bandwidth_rows(tmp_path, socket_dir):
    """40 steps of 2 ranks, 3 device-timed all_reduces of 14 MiB a step each, all in one poll: each
    analysis window's rows, bus bandwidth by the nccl-tests factor 2(n-1)/n from the device time."""
    proc = _Processor(tmp_path)
    try:
        proc.poll("dev2", _device_job(socket_dir, "dev2", 2, 40))
        rows = proc.rows("dev2")
    finally:
        proc.close()
    alg = CALL_BYTES / (DEV_MS * 1e6)                     # GB/s: one call's payload in its device time
    for lo, hi, op, gs, cps, bpc, algbw, busbw, link in rows:
        assert (op, gs, cps, bpc, link) == ("all_reduce", 2, 3.0, CALL_BYTES, "loopback")
        assert algbw == pytest.approx(alg) and busbw == pytest.approx(alg * 2 * (2 - 1) / 2)
    assert [r[1] for r in rows] == [8, 18, 28], rows                 # windows due at steps 10, 20, 30


def test_a_1_rank_device_job_gets_rows_and_a_short_job_its_last_window_at_its_end(tmp_path, socket_dir):
    """A 1-rank job (bus factor 0: an all_reduce of one rank moves nothing between ranks) still has its
    rows (algorithm bandwidth); a job of 6 steps, shorter than an analysis window, gets its rows when
    its ranks have said goodbye."""
    proc = _Processor(tmp_path)
    try:
        proc.poll("dev1", _device_job(socket_dir, "dev1", 1, 40))
        rows = proc.rows("dev1")
        assert [r[1] for r in rows] == [8, 18, 28], rows
        assert all(r[3] == 1 and r[7] == 0.0 and r[6] == pytest.approx(CALL_BYTES / (DEV_MS * 1e6))
                   for r in rows), rows
        short = _device_job(socket_dir, "short", 2, 6)
        proc.poll("short", short)
        assert proc.rows("short") == []                             # (still running: nothing to say yet)
        proc.goodbyes("short", short)
        rows = proc.rows("short")
    finally:
        proc.close()
    assert [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows] == [(-14, 5, "all_reduce", 2, 3.0, CALL_BYTES)], rows

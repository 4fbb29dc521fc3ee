"""The processor's Kafka boundary (issue 16): no message can stop, stall or poison the pipeline.

Each test sends the defect through the real broker to a real processor and checks what DuckDB
sees: the good rows stored once under their own job, one deadletter record per bad message, the
processor still running.

The tests of the default limits share one processor (``shared``: starting and stopping one took
3-5 s a test); each has its own job ids, and judges only its own messages (the deadletter records
whose source is one of them) and what its messages changed (counters read as the change since it
began sending). A test sends while the processor is held between two polls, in one producer batch
per partition, so its messages are read as one poll reads them, as a processor started after them
would. The tests that need other limits start their own (``run``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import resource
import threading
import time
import tomllib

import numpy as np
import pyarrow as pa
import pytest

from stepwatch.devtools import hostile as H
from stepwatch.wire import tables as wire
from stepwatch.wire.decode import WireError, _read_arrow, conform
from stepwatch.storage.views import connect
from stepwatch.kafkaio import KafkaSettings, ensure_topics, make_producer
from stepwatch.stream.processor import Processor
from testkit import ROOT

pytestmark = pytest.mark.integration

NOW = time.time_ns()


def run(kafka, data, until, timeout=90, **kw):
    """An in-process processor until ``until(proc)``; fails if its thread dies or time runs out."""
    kw.setdefault("flush_interval_s", 0.3)
    proc = Processor(kafka, data, group=f"g-{kafka.prefix}", on_alert=lambda a: None, **kw)
    stop = threading.Event()
    err = []

    def target():
        try:
            proc.run(stop_event=stop)
        except BaseException as e:  # noqa: BLE001 - reported below
            err.append(e)
            raise
    th = threading.Thread(target=target, daemon=True)
    th.start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            assert th.is_alive(), f"processor died: {err[0]!r}" if err else "processor died"
            if until(proc):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"processor did not finish in {timeout}s: {proc.stats()}")
        time.sleep(0.7)
        assert th.is_alive(), f"processor died: {err[0]!r}" if err else "processor died"
    finally:
        stop.set()
        th.join(30)
    return proc


def stored(proc, table="steps"):
    return proc.metrics.value(proc.metrics.records_out, table)


class Shared:
    """One in-process processor (default limits) for the module, in its own thread. ``held()``: the
    processor waits between two polls while the test sends; ``wait(until)``: as :func:`run`, then one
    more flush, the processor still running; ``delta(counter, label)``: the counter's change since the
    test's ``held()`` began."""

    def __init__(self, kafka, data):
        self.kafka, self.data = kafka, data
        self.proc = Processor(kafka, data, group=f"g-{kafka.prefix}", on_alert=lambda a: None, flush_interval_s=0.3)
        self.go, self.parked, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.go.set()
        self.err = []
        self.base = {}
        self.th = threading.Thread(target=self._target, daemon=True)
        self.th.start()

    def _target(self):
        try:
            self.proc.run(stop_event=self.stop, on_tick=self._tick)
        except BaseException as e:  # noqa: BLE001 - reported by alive()
            self.err.append(e)
            raise

    def _tick(self, proc):
        if not self.go.is_set():
            self.parked.set()
            self.go.wait()
            self.parked.clear()

    def alive(self):
        assert self.th.is_alive(), f"processor died: {self.err[0]!r}" if self.err else "processor died"

    @contextlib.contextmanager
    def held(self):
        self.parked.clear()                 # (set again only by a tick that finds go cleared)
        self.go.clear()
        try:
            deadline = time.monotonic() + 30
            while not self.parked.wait(0.2):
                self.alive()
                assert time.monotonic() < deadline, "processor not between polls in 30 s"
            m = self.proc.metrics
            self.base = {(id(c), lab): m.value(c, lab) for c, lab in self._counters()}
            yield
        finally:
            self.go.set()

    def _counters(self):
        m = self.proc.metrics
        return [(m.records_out, "steps"), (m.records_out, "deadletter"), (m.undecodable, None),
                (m.columns_dropped, None), (m.step_axis, "reanchor"), (m.steps_closed, None)]

    def delta(self, counter, label=None):
        return self.proc.metrics.value(counter, label) - self.base[(id(counter), label)]

    def stored(self, table="steps"):
        return self.delta(self.proc.metrics.records_out, table)

    def wait(self, until, timeout=90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.alive()
            if until(self.proc):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"processor did not finish in {timeout}s: {self.proc.stats()}")
        flushed = self.proc.last_flush        # one more flush after the test's rows: still running
        while self.proc.last_flush == flushed and time.monotonic() < deadline + 5:
            self.alive()
            time.sleep(0.05)
        self.alive()
        return self.proc

    def close(self):
        self.stop.set()
        self.go.set()
        self.th.join(30)
        assert not self.err, self.err


@pytest.fixture(scope="module")
def shared(broker, tmp_path_factory):
    kafka = KafkaSettings(bootstrap=broker.bootstrap, prefix=f"ingress{os.getpid()}.", partitions=2)
    ensure_topics(kafka)
    sh = Shared(kafka, tmp_path_factory.mktemp("ingress-shared"))
    yield sh
    sh.close()


def send(kafka, items, codec=None, one_batch=False):
    """``one_batch``: every message of a partition in one producer batch (appended at once)."""
    prod = make_producer(kafka, compression_type=codec, **({"linger_ms": 60_000} if one_batch else {}))
    futs = [prod.send(kafka.topic(it.kind), it.value, key=it.key, headers=it.headers) for it in items]
    prod.flush(30)
    where = [(m.topic, m.partition, m.offset) for m in (f.get(30) for f in futs)]
    prod.close()
    return where


def good(job, step0=0, steps=3, ranks=4, t0=NOW - 60 * 10**9):
    """One message per step, all ranks."""
    out = []
    for s in range(step0, step0 + steps):
        t = H.steps_table(job, np.arange(ranks), np.full(ranks, s), t0 + s * 10**9)
        out.append(H.Item("steps", H._arrow(t), H._hdr(), job.encode(), rows=H._keys(t)))
    return out


def topo(job, ranks, world_size=None):
    t = pa.table({"job": [job] * ranks, "rank": pa.array(np.arange(ranks, dtype=np.int32)),
                  "node": [f"n{r}" for r in range(ranks)],
                  "world_size": pa.array(np.full(ranks, world_size or ranks, np.int32))})
    return H.Item("topology", H._arrow(t), H._hdr("topology"), job.encode())


def n_steps(con, job):
    return con.execute("SELECT count(*) FROM steps WHERE job = ?", [job]).fetchone()[0]


def deadletters(con, sources=None):
    """The deadletter records (with ``sources``: of those (topic, partition, offset) only)."""
    rows = con.execute("SELECT source_topic, source_partition, source_offset, reason, row FROM deadletter "
                       "ORDER BY source_offset").fetchall()
    return rows if sources is None else [r for r in rows if tuple(r[:3]) in set(map(tuple, sources))]


# ------------------------------------------------------------------------------ codecs
def test_every_kafka_codec_is_a_declared_dependency():
    # kafka-python comes with the [agent] extra (which [processor] and [grafana] build on): its codecs with it
    deps = " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
                    ["agent"]).lower()
    assert "kafka-python" in deps
    for pkg in ("lz4", "python-snappy", "zstandard"):
        assert pkg in deps, f"{pkg} (kafka-python's codec) is not a dependency"
    import kafka.codec as c
    assert c.has_gzip() and c.has_snappy() and c.has_lz4() and c.has_zstd()


CODECS = ("gzip", "snappy", "lz4", "zstd")


def test_producer_with_each_codec_is_stored(shared):
    """One job per codec, each sent by its own producer with that codec (so each batch the processor reads
    is compressed with it), through one processor run: every job stored, none deadlettered."""
    where = []
    with shared.held():
        for codec in CODECS:
            job = f"codec-{codec}"
            where += send(shared.kafka, [topo(job, 4)] + good(job, steps=5), codec=codec, one_batch=True)
    proc = shared.wait(lambda p: shared.stored() >= 20 * len(CODECS))
    con = connect(shared.data)
    assert {c: n_steps(con, f"codec-{c}") for c in CODECS} == {c: 20 for c in CODECS}
    assert not deadletters(con, where)
    assert {c: proc.jobs[f"codec-{c}"].state.max_step for c in CODECS} == {c: 4 for c in CODECS}


def test_batch_the_client_cannot_decode_is_deadlettered_and_skipped(shared):
    job = "corrupt"
    kafka = shared.kafka
    with shared.held():
        where = send(kafka, [topo(job, 4)] + good(job, 0, 2), one_batch=True)
        _, bad = H.send_items([], kafka, corrupt_batches=3)
        where += send(kafka, good(job, 2, 2), one_batch=True)
    proc = shared.wait(lambda p: shared.stored() >= 16 and shared.stored("deadletter") >= 3)
    con = connect(shared.data)
    assert n_steps(con, job) == 16
    dl = deadletters(con, where + bad["corrupt batch"])
    assert [(t, p, o) for t, p, o, _, _ in dl] == sorted(bad["corrupt batch"], key=lambda w: w[2])
    assert all("cannot decode" in r for _, _, _, r, _ in dl), dl
    assert shared.delta(proc.metrics.undecodable) == 3


# ------------------------------------------------------------------------------ columns and sizes
def test_extra_columns_parquet_cannot_store_or_whose_type_changes_do_not_poison(shared):
    job = "extras"
    base = good(job, 0, 4)
    rows = [H.steps_table(job, np.arange(4), np.full(4, s), NOW - 10**10 + s * 10**9) for s in range(4)]
    u = pa.UnionArray.from_sparse(pa.array([0] * 4, pa.int8()), [pa.array(np.arange(4)), pa.array(["x"] * 4)])
    iv = pa.array([(1, 2, 3)] * 4, pa.month_day_nano_interval())
    msgs = [rows[0].append_column("u", u), rows[1].append_column("iv", iv),
            rows[2].append_column("note", pa.array(np.arange(4))),
            rows[3].append_column("note", pa.array(["text"] * 4))]
    items = [H.Item("steps", H._arrow(t), H._hdr(), job.encode(), rows=b.rows) for t, b in zip(msgs, base)]
    items += good(job, 4, 2)
    with shared.held():
        where = send(shared.kafka, items, one_batch=True)
    proc = shared.wait(lambda p: shared.stored() >= 24)
    con = connect(shared.data)
    assert n_steps(con, job) == 24
    assert not deadletters(con, where)
    # the int 'note' was kept (first type seen); the string one could not be cast and was dropped
    notes = con.execute("SELECT note FROM steps WHERE job = ? AND note IS NOT NULL", [job]).fetchall()
    assert len(notes) == 4
    dropped = shared.delta(proc.metrics.columns_dropped)
    assert dropped == 3, dropped   # union, interval, conflicting string


def test_a_message_that_breaks_the_flush_is_isolated_to_the_deadletter(kafka, tmp_path):
    """With extra_column_types='any' (trusted producers) an unstorable column reaches the flush: the
    flush is bisected by source message, the one message goes to the deadletter, the rest is stored."""
    from stepwatch.stream.ingress_limits import IngressLimits
    job = "isolate"
    items = good(job, 0, 6)
    t = H.steps_table(job, np.arange(4), np.full(4, 6), NOW - 10**9)
    u = pa.UnionArray.from_sparse(pa.array([0] * 4, pa.int8()), [pa.array(np.arange(4)), pa.array(["x"] * 4)])
    bad = H.Item("steps", H._arrow(t.append_column("u", u)), H._hdr(), job.encode())
    where = send(kafka, items[:3] + [bad] + items[3:])
    proc = run(kafka, tmp_path, lambda p: stored(p) >= 24 and stored(p, "deadletter") >= 1,
               limits=IngressLimits(extra_column_types="any"))
    con = connect(tmp_path)
    assert n_steps(con, job) == 24
    dl = deadletters(con)
    assert [(t, p, o) for t, p, o, _, _ in dl] == [where[3]], dl
    assert "could not be stored" in dl[0][3]
    time.sleep(0.1)
    assert proc.metrics.value(proc.metrics.flush_isolations) >= 1


def test_decompression_bomb_is_refused_before_it_is_inflated(shared):
    bomb = H.decompression_bomb()
    assert len(bomb) < 64 << 10
    with shared.held():
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        where = send(shared.kafka, [H.Item("steps", bomb, H._hdr(), b"bomb")] + good("after-bomb", 0, 2),
                     one_batch=True)
    shared.wait(lambda p: shared.stored() >= 8 and shared.stored("deadletter") >= 1)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    con = connect(shared.data)
    dl = deadletters(con, where)
    assert [(t, p, o) for t, p, o, _, _ in dl] == [where[0]]
    assert "max_decoded_bytes" in dl[0][3]
    assert n_steps(con, "bomb") == 0 and n_steps(con, "after-bomb") == 8
    assert rss1 - rss0 < 200 << 20, f"peak RSS grew by {(rss1 - rss0) >> 20} MiB"


# ------------------------------------------------------------------------------ ranks, steps, times
def test_memory_does_not_follow_a_declared_world_size(shared):
    """A topology row declaring 100,000 ranks, sent by rank 0 alone, allocates one rank of state."""
    job = "declared"
    with shared.held():
        send(shared.kafka, [topo(job, 1, world_size=100_000)] + good(job, 0, 2, ranks=1), one_batch=True)
    proc = shared.wait(lambda p: shared.stored() >= 2)
    st = proc.jobs[job].state
    assert st.planes["step_ms"].shape[1] == 1, st.planes["step_ms"].shape
    assert st.expected == 100_000


def test_world_size_above_max_ranks_is_rejected(shared):
    """(Not run on main: there a 10 M-rank topology row allocates 64 GiB.)"""
    job = "huge-world"
    with shared.held():
        where = send(shared.kafka, [topo(job, 1, world_size=10_000_000)] + good(job, 0, 2, ranks=1), one_batch=True)
    proc = shared.wait(lambda p: shared.stored() >= 2 and shared.stored("deadletter") >= 1)
    dl = deadletters(connect(shared.data), where)
    assert [(t, p, o) for t, p, o, _, _ in dl] == [where[0]] and "max_ranks" in dl[0][3]
    assert proc.jobs[job].state.planes["step_ms"].shape[1] == 1


def test_step_jumps_do_not_spin_the_alignment(shared):
    job = "jumps"
    t = H.steps_table(job, [0, 1, 2], [0, 4_000_000, 10**12], NOW - 10**9)
    items = [H.Item("steps", H._arrow(t), H._hdr(), job.encode())] + good(job, 1, 3, ranks=3)
    with shared.held():
        where = send(shared.kafka, items, one_batch=True)
        t0 = time.monotonic()
    proc = shared.wait(lambda p: shared.stored() >= 10 and shared.stored("deadletter") >= 1, timeout=40)
    assert time.monotonic() - t0 < 30
    con = connect(shared.data)
    assert con.execute("SELECT list(step ORDER BY step) FROM steps WHERE job = ? AND rank = 0",
                       [job]).fetchone()[0] == [0, 1, 2, 3]
    dl = deadletters(con, where)
    assert [(t, p, o) for t, p, o, _, _ in dl] == [where[0]] and "max_step_jump" in dl[0][3]
    assert proc.jobs[job].state.max_step == 3


def test_far_future_t_end_does_not_break_the_jobs_alignment(shared):
    job = "future"
    far = H.steps_table(job, [1], [1], 4_102_444_800 * 10**9)          # 2100-01-01
    items = [topo(job, 2)] + good(job, 0, 1, ranks=2)
    items.append(H.Item("steps", H._arrow(far), H._hdr(), job.encode()))
    items += good(job, 1, 3, ranks=2)
    with shared.held():
        where = send(shared.kafka, items, one_batch=True)
    proc = shared.wait(lambda p: shared.stored() >= 8 and shared.stored("deadletter") >= 1)
    dl = deadletters(connect(shared.data), where)
    assert len(dl) == 1 and "max_future_skew_s" in dl[0][3]
    st = proc.jobs[job].state
    assert st.max_t_end < time.time_ns() + 300 * 10**9


def test_a_jobs_first_message_cannot_place_its_step_axis(shared):
    """A job's first message claims step 10^9 for rank 0; its ranks then report steps 0..9. The bad
    row is deadlettered (one record, naming the field and the value), every good row is stored once
    and aligned: the job's position is where its ranks are. (On the code before the step axis the
    first row placed the window at 10^9 and every good row was 'old'.)"""
    job = "first-far"
    far = H.steps_table(job, [0], [10**9], NOW - 61 * 10**9)
    items = [H.Item("steps", H._arrow(far), H._hdr(), job.encode())] + [topo(job, 4)] + good(job, 0, 10)
    with shared.held():
        where = send(shared.kafka, items, one_batch=True)
    proc = shared.wait(lambda p: shared.stored() >= 40 and shared.stored("deadletter") >= 1)
    con = connect(shared.data)
    assert con.execute("SELECT count(*), count(DISTINCT (rank, step)), max(step) FROM steps WHERE job = ?",
                       [job]).fetchone() == (40, 40, 9)
    dl = deadletters(con, where)
    assert [(t, p, o) for t, p, o, _, _ in dl] == [where[0]], dl
    assert "field 'step'" in dl[0][3] and "1,000,000,000" in dl[0][3], dl[0][3]
    st = proc.jobs[job].state
    assert st.max_step == 9 and st.next_close == 10, (st.max_step, st.next_close)
    assert shared.delta(proc.metrics.steps_closed) >= 10
    assert shared.delta(proc.metrics.step_axis, "reanchor") == 1


def test_a_first_message_stored_before_its_job_began_cannot_hold_the_axis(shared):
    """The bad first message is flushed long before the job's ranks report: it stays stored (counted),
    but the window follows the ranks and a processor restarted on the store rebuilds the job at its
    ranks' position, not at the bad row's."""
    job = "first-early"
    far = H.steps_table(job, [0], [10**9], NOW - 61 * 10**9)
    kafka = shared.kafka
    with shared.held():
        send(kafka, [H.Item("steps", H._arrow(far), H._hdr(), job.encode())])
    sent = []

    def until(p):
        if not sent and shared.stored() >= 1:
            sent.append(send(kafka, [topo(job, 4)] + good(job, 0, 10)))
        return sent and shared.stored() >= 41
    proc = shared.wait(until)
    st = proc.jobs[job].state
    assert st.max_step == 9 and st.next_close == 10, (st.max_step, st.next_close)
    assert shared.delta(proc.metrics.step_axis, "reanchor") == 1
    again = Processor(kafka, shared.data, group="rebuild", on_alert=lambda a: None)
    assert again._job(job).state.max_step == 9


def test_one_rank_cannot_walk_the_step_axis(shared):
    """Rank 3 claims step 900,005 (inside max_step_jump: stored, not aligned), then 1,800,005 (beyond
    it from where the ranks are: deadlettered, naming the value). The job's window stays with its
    ranks and their steps are aligned as they come. (Before: the window followed the newest row, the
    second row was within max_step_jump of the first, and every real step after them was 'old'.)"""
    job = "walk"
    bad = [H.Item("steps", H._arrow(H.steps_table(job, [3], [5 + k * 900_000], NOW - 30 * 10**9)), H._hdr(),
                  job.encode()) for k in (1, 2)]
    with shared.held():
        where = send(shared.kafka, [topo(job, 4)] + good(job, 0, 5) + bad + good(job, 5, 5), one_batch=True)
    proc = shared.wait(lambda p: shared.stored() >= 41 and shared.stored("deadletter") >= 1)
    con = connect(shared.data)
    assert n_steps(con, job) == 41
    dl = deadletters(con, where)
    assert [(t, p, o) for t, p, o, _, _ in dl] == [where[7]], dl
    assert "value 1,800,005" in dl[0][3], dl[0][3]
    st = proc.jobs[job].state
    assert st.max_step == 9 and st.next_close == 10, (st.max_step, st.next_close)
    assert int(st.last_step[3]) == 9


def test_rows_arriving_out_of_order_do_not_move_the_step_axis_back(shared):
    """Steps 100-150 of every rank, then 0-99 (another producer, a spool replayed after an outage): a
    rank's report is its newest row in time, so the late rows are stored and the window stays (no
    re-anchor)."""
    job = "late"
    with shared.held():
        where = send(shared.kafka, [topo(job, 4)] + good(job, 100, 51) + good(job, 0, 100), one_batch=True)
    proc = shared.wait(lambda p: shared.stored() >= 604)
    assert n_steps(connect(shared.data), job) == 604 and not deadletters(connect(shared.data), where), where[:1]
    assert proc.jobs[job].state.max_step == 150
    assert shared.delta(proc.metrics.step_axis, "reanchor") == 0


def test_a_simulation_ahead_of_real_time_is_taken_but_one_far_future_row_is_not(shared):
    """A job replayed 30 minutes ahead of real time (10 s steps, 4 steps a message) is stored whole:
    its own time moves. One row 20 minutes ahead of the job's own time is deadlettered naming the value.
    (Before: the window was one hour ahead of the receive time, whatever the job.)"""
    job = "replay"
    t0 = time.time_ns()
    items = [topo(job, 4)]
    for s in range(0, 180, 4):
        t = pa.concat_tables([H.steps_table(job, np.arange(4), np.full(4, k), t0 + k * 10 * 10**9)
                              for k in range(s, s + 4)])
        items.append(H.Item("steps", H._arrow(t), H._hdr(), job.encode()))
    far = H.steps_table(job, [1], [180], t0 + 180 * 10 * 10**9 + 1200 * 10**9)
    items.append(H.Item("steps", H._arrow(far), H._hdr(), job.encode()))
    with shared.held():
        where = send(shared.kafka, items, one_batch=True)
    proc = shared.wait(lambda p: shared.stored() >= 720 and shared.stored("deadletter") >= 1)
    con = connect(shared.data)
    assert n_steps(con, job) == 720
    dl = deadletters(con, where)
    assert [(t, p, o) for t, p, o, _, _ in dl] == [where[-1]], dl
    assert "field 't_end'" in dl[0][3] and "max_future_skew_s=300" in dl[0][3], dl[0][3]
    assert proc.jobs[job].state.max_step == 179


def test_t_end_before_1970_is_rejected_not_filed_under_another_job(shared):
    a, b = "alpha", "beta"
    ta = H.steps_table(a, [0, 1], [0, 0], NOW - 10**9)
    tb = H.steps_table(b, [0, 1], [0, 0], [-86_400 * 10**9, NOW - 10**9])
    with shared.held():
        where = send(shared.kafka, [H.Item("steps", H._arrow(pa.concat_tables([ta, tb])), H._hdr(), a.encode())],
                     one_batch=True)
    shared.wait(lambda p: shared.stored() >= 3 and shared.stored("deadletter") >= 1)
    con = connect(shared.data)
    assert con.execute("SELECT job, rank, epoch_ns(t_end) >= 0 FROM steps WHERE job IN ('alpha', 'beta') "
                       "ORDER BY job, rank").fetchall() == [("alpha", 0, True), ("alpha", 1, True), ("beta", 1, True)]
    dl = deadletters(con, where)
    assert len(dl) == 1 and "1970" in dl[0][3]
    # the store is shared: the date partitions whose files hold these jobs' rows (each file read as it is)
    lake = shared.data / "lake" / "main" / "steps"
    dates = sorted(p.name for p in lake.glob("date=*")
                   if con.execute("SELECT count(*) FROM read_parquet(?) WHERE job IN ('alpha', 'beta')",
                                  [f"{p}/*.parquet"]).fetchone()[0])
    assert dates == ["date=" + time.strftime("%Y-%m-%d", time.gmtime((NOW - 10**9) / 1e9))]
    assert all(p.name >= "date=1970-01-01" for p in lake.glob("date=*"))


# ------------------------------------------------------------------------------ deadletter volume, logs
def test_one_deadletter_record_per_message_headers_stripped_log_rate_limited(kafka, tmp_path, caplog):
    job = "manybad"
    n = 7000
    t = H.steps_table(job, np.arange(n) % 64, np.arange(n) // 64, NOW - 10**9)
    t = t.set_column(t.schema.get_field_index("step_ms"), "step_ms", pa.array(np.full(n, -1.0)))
    hdr = H._hdr() + [("secret", b"s3cr3t" * 100)]
    items = [H.Item("steps", H._arrow(t), hdr, job.encode()) for _ in range(30)] + good("fine", 0, 2)
    send(kafka, items)
    caplog.set_level(logging.WARNING, logger="stepwatch")
    from stepwatch.stream.ingress_limits import IngressLimits
    proc = run(kafka, tmp_path, lambda p: stored(p, "deadletter") >= 30 and stored(p) >= 8,
               limits=IngressLimits(log_per_s=0.1))
    con = connect(tmp_path)
    dl = deadletters(con)
    assert len(dl) == 30
    assert all(r.startswith(f"{n} of {n} row(s) rejected") for _, _, _, r, _ in dl), dl[0]
    assert con.execute("SELECT max(octet_length(payload)) FROM deadletter").fetchone()[0] < 1 << 20
    # the deadletter topic: one message per source message, none of the producer's headers
    from stepwatch.kafkaio import make_consumer
    c = make_consumer(kafka, "g-dl-read")
    c.subscribe([kafka.topic("deadletter")])
    got, deadline = [], time.monotonic() + 20
    while len(got) < 30 and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=500).values():
            got += recs
    c.close()
    assert len(got) == 30
    assert all({k for k, _ in m.headers} == {"error", "source"} for m in got), got[0].headers
    lines = [r for r in caplog.records if "deadletter" in r.getMessage()]
    assert len(lines) <= 12, len(lines)
    assert proc.stats()["deadletter"] == 30


# ------------------------------------------------------------------------------ jobs in memory
def test_idle_jobs_are_evicted(kafka, tmp_path):
    from stepwatch.stream.ingress_limits import IngressLimits
    send(kafka, good("idle-a", 0, 2) + good("idle-b", 0, 2))
    proc = run(kafka, tmp_path, lambda p: stored(p) >= 16 and not p.jobs, timeout=30,
               limits=IngressLimits(job_idle_evict_s=1.0))
    assert proc.metrics.value(proc.metrics.jobs_evicted) == 2


def test_a_burst_of_new_job_ids_does_not_stall_ingest(kafka, tmp_path):
    """1,000 made-up job ids (one row each) plus a real job: jobs without stored history cost no
    store rebuild, memory holds at most max_jobs of them, every row is stored under its own job.
    The flushes stay bounded too: one data file per table per flush, not one per job (a lake
    partitioned by job took ~95 ms per new job and flush)."""
    from stepwatch.stream.ingress_limits import IngressLimits
    items = []
    for i in range(1000):
        t = H.steps_table(f"burst-{i}", [0], [0], NOW - 10**9)
        items.append(H.Item("steps", H._arrow(t), H._hdr(), f"burst-{i}".encode()))
    items += good("steady", 0, 5)
    send(kafka, items)
    t0 = time.monotonic()
    proc = run(kafka, tmp_path, lambda p: stored(p) >= 1020, timeout=150,
               limits=IngressLimits(max_jobs=300))
    took = time.monotonic() - t0
    flush_s = sum(s.value for m in proc.metrics.flush_seconds.collect() for s in m.samples if s.name.endswith("_sum"))
    con = connect(tmp_path)
    assert con.execute("SELECT count(*), count(DISTINCT job) FROM steps WHERE job LIKE 'burst-%'").fetchone() == \
        (1000, 1000)
    assert n_steps(con, "steady") == 20
    assert len(proc.jobs) <= 300
    assert proc.metrics.value(proc.metrics.rebuilds, "store") == 0
    assert proc.metrics.value(proc.metrics.rebuilds, "none") >= 1001
    assert took - flush_s < 30, (took, flush_s)
    assert flush_s < 30, flush_s


def test_rows_at_high_ranks_of_made_up_jobs_cannot_push_a_real_job_out_of_memory(kafka, tmp_path):
    """One row at rank 16,383 of a made-up job used to widen its ring to 16,384 ranks (~106 MiB); four
    of them, after a real job's steps, in one poll, pushed the real job out (then: the budget held as
    each ring widens, sparse rings first). Since issue 26 such a row gets no column at all (stored, not
    aligned: stream.align.JobState.place), so the made-up jobs hold no ring and the real job keeps its
    state, aligned to its last step."""
    from stepwatch.stream.ingress_limits import IngressLimits
    job = "dense"
    items = [topo(job, 8)] + good(job, 0, 10, ranks=8)
    for i in range(4):
        t = H.steps_table(f"sparse-{i}", [16_383], [0], NOW - 10**9)
        items.append(H.Item("steps", H._arrow(t), H._hdr(), f"sparse-{i}".encode()))
    send(kafka, items)
    budget = 200 << 20
    peak = [0]

    def until(p):
        peak[0] = max(peak[0], sum(rt.state.state_bytes() for rt in list(p.jobs.values())))
        return stored(p) >= 84
    proc = run(kafka, tmp_path, until, limits=IngressLimits(max_state_bytes=budget))
    assert job in proc.jobs, sorted(proc.jobs)
    st = proc.jobs[job].state
    assert st.max_step == 9 and st.next_close == 10, (st.max_step, st.next_close)
    assert all(rt.state.world_size == 0 for j, rt in proc.jobs.items() if j.startswith("sparse-"))
    assert proc.metrics.value(proc.metrics.step_axis, "rank_unplaced") == 4
    assert sum(rt.state.state_bytes() for rt in proc.jobs.values()) <= budget
    con = connect(tmp_path)
    assert n_steps(con, job) == 80
    assert con.execute("SELECT count(*) FROM steps WHERE job LIKE 'sparse-%'").fetchone()[0] == 4


# ------------------------------------------------------------------------------ the same bounds, below the broker
def test_alignment_walks_only_the_step_ranges_that_hold_rows():
    """Behind the ingress bound (max_step_jump), the alignment itself must not spin either."""
    from stepwatch.stream.align import JobState
    st = JobState("j", capacity=128)
    t = conform(H.steps_table("j", [0, 0, 0], [0, 4_000_000, 10**12], NOW), wire.STEPS)
    t0 = time.perf_counter()
    res, _ = st.ingest(t)
    assert time.perf_counter() - t0 < 1.0
    assert st.max_step == 10**12 and res.keep.sum() == 3


def test_expansion_bombs_are_refused_from_metadata_and_encodings():
    from stepwatch.stream.ingress_limits import IngressLimits
    from stepwatch.stream.ingress_sizes import check_arrow_sizes, check_expansion
    lim = IngressLimits()
    with pytest.raises(WireError, match="max_decoded_bytes"):
        check_arrow_sizes(H.decompression_bomb(), lim)
    with pytest.raises(WireError, match="max_rows_per_message"):
        check_arrow_sizes(H.rows_bomb(), lim)
    t = _read_arrow(H.dictionary_bomb())
    with pytest.raises(WireError, match="expands"):
        check_expansion(t, lim)
    v = pa.array(["x" * 1000] * 4).cast(pa.string_view())
    big = pa.table({"v": pa.chunked_array([v] * 100_000)})
    with pytest.raises(WireError, match="expands"):
        check_expansion(big, IngressLimits(max_decoded_bytes=100 << 20))
    check_arrow_sizes(H._arrow(H.steps_table("ok", np.arange(4096), np.zeros(4096), NOW)), lim)


def test_the_amplifying_type_check_is_remembered_per_type_and_bounded():
    """Whether a column type holds a dictionary/run-end/view encoding (however deep) is walked once per
    type and remembered (a message repeats the previous one's types); a sender's endless made-up types
    never grow that memory past its bound."""
    from stepwatch.stream import ingress_sizes as sz
    cases = {pa.int64(): False, pa.list_(pa.struct([("a", pa.string())])): False,
             pa.dictionary(pa.int32(), pa.string()): True, pa.string_view(): True,
             pa.struct([("x", pa.list_(pa.dictionary(pa.int8(), pa.string())))]): True,
             pa.list_view(pa.int32()): True, pa.run_end_encoded(pa.int32(), pa.float64()): True}
    for t, want in cases.items():
        assert sz._has_amplifying(t) is want and sz._has_amplifying(t) is want, t
        assert sz._AMPLIFYING[t] is want
    for i in range(sz._AMPLIFYING_MAX + 100):
        sz._has_amplifying(pa.struct([(f"f{i}", pa.int32())]))
        assert len(sz._AMPLIFYING) <= sz._AMPLIFYING_MAX

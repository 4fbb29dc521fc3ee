"""Compaction and retention: fewer files, same rows, safe under concurrent queries, writes and a
second compaction."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import date, datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.storage import compact
from stepwatch.storage.lake import Lake
from stepwatch.storage.store import LakeStore
from stepwatch.storage.views import connect, query

pytestmark = pytest.mark.integration

RANKS = 64


def steps(job, step0, n, day: date | None = None):
    s = np.repeat(np.arange(step0, step0 + n), RANKS)
    r = np.tile(np.arange(RANKS), n)
    base = int(datetime.combine(day or datetime.now(timezone.utc).date(), datetime.min.time(),
                                tzinfo=timezone.utc).timestamp() * 1e9) + 3600 * 10**9
    t = pa.table({"job": [job] * len(s), "node": [f"n{x // 8}" for x in r], "rank": r.astype("int32"),
                  "step": s, "t_end": pa.array(base + s * 10**9).cast(wire.TS),
                  "step_ms": np.full(len(s), 100.0), "comm_wait_ms": (r % 7).astype(float)})
    return conform(t, wire.STEPS)


def files(lake, table="steps"):
    con = connect(lake)
    return [r[0] for r in con.execute(f"SELECT data_file FROM ducklake_list_files('lake', '{table}')").fetchall()]


def test_compaction_merges_small_files_and_keeps_every_row(tmp_path):
    st = LakeStore(tmp_path).init()
    for k in range(40):
        st.write_flush({"steps": [steps("j", k * 5, 5)]}, {})
    assert len(files(tmp_path)) == 40
    con = connect(tmp_path)
    before = con.execute("SELECT count(*), sum(step), sum(comm_wait_ms) FROM steps").fetchall()
    res = compact.run(tmp_path, grace_s=0)
    # steps and the derived rank_minutes and step_summary tables: 40 files each -> 1 each
    assert res.partitions == 3 and res.files_in == 120 and res.files_out == 3, res
    assert len(files(tmp_path)) == 1
    con = connect(tmp_path)
    assert con.execute("SELECT count(*), sum(step), sum(comm_wait_ms) FROM steps").fetchall() == before
    assert con.execute("SELECT count(*) = count(DISTINCT (rank, step)) FROM steps").fetchall() == [(True,)]
    # the merged file is sorted by (step, rank): row groups prune on step
    t = pq.read_table(files(tmp_path)[0])
    assert t.column("step").to_pylist() == sorted(t.column("step").to_pylist())
    # the replaced files are gone from disk after the grace period (0 here); a second pass has nothing to do
    assert len(list((tmp_path / "lake" / "main" / "steps").rglob("*.parquet"))) == 1
    assert compact.run(tmp_path, grace_s=0).partitions == 0


def _compactor(lake, out):
    """``stepwatch compact --every 0.2`` in its own process (as the CronJob and a manual run would be)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if isinstance(lake, Lake) and lake.kind == "postgres":
        env.update(STEPWATCH_LAKE_CATALOG=lake.catalog, STEPWATCH_LAKE_DATA_PATH=lake.data_path)
        data_dir = out.parent
    else:
        data_dir = lake
    # grace: how long a replaced snapshot stays readable. A query must read its snapshot's file list
    # within it (production: 300 s); 30 s covers this test's slowest query on a loaded machine.
    return subprocess.Popen([sys.executable, "-m", "stepwatch.cli", "compact", "--data-dir", str(data_dir),
                             "--every", "0.2", "--grace", "30"], env=env, stdout=open(out, "w"),
                            stderr=subprocess.STDOUT)


def _race(lake, work, compactions: int, seconds: float = 5.0):
    """A writer flushing, a reader counting, ``compactions`` compaction processes at once, for at least
    ``seconds`` and until the reader has read 3 times and each compaction merged twice on average (up to
    120 s on a loaded machine). Returns (errors, observations, merges)."""
    st = LakeStore(lake).init()
    per_flush = 5 * RANKS
    for k in range(20):
        st.write_flush({"steps": [steps("j", k * 5, 5)]}, {})
    written = [20]     # flushes committed
    started = [20]     # flushes begun (a reader may already see the one being committed)
    stop = threading.Event()
    errors, observed = [], []

    def writer():
        k = 20
        while not stop.is_set() and k < 400:
            started[0] = k + 1
            st.write_flush({"steps": [steps("j", k * 5, 5)]}, {})
            k += 1
            written[0] = k
            time.sleep(0.05)     # (a processor flushes once a second)

    def reader():
        try:
            con = connect(lake)
        except Exception as e:  # noqa: BLE001
            errors.append(f"connect: {e!r}")
            return
        while not stop.is_set():
            lo = written[0]
            try:
                _, rows = query(con, "SELECT count(*), count(DISTINCT (rank, step)) FROM steps")
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                continue
            hi = started[0]
            n, uniq = rows[0]
            observed.append(n)
            if n != uniq or n % per_flush or not (lo * per_flush <= n <= hi * per_flush):
                errors.append(f"inconsistent read: {n} rows, {uniq} distinct, flushes written {lo}..{hi}")

    logs = [work / f"compact{i}.log" for i in range(compactions)]
    procs = [_compactor(lake, log) for log in logs]
    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()

    def merges() -> int:
        return sum(int(m) for log in logs for m in re.findall(r"^compacted (\d+) partitions", log.read_text(), re.M))
    deadline, cap = time.monotonic() + seconds, time.monotonic() + max(6 * seconds, 120.0)
    while threads[0].is_alive() and time.monotonic() < cap and (
            time.monotonic() < deadline or len(observed) < 3 or merges() < 2 * compactions):
        time.sleep(0.1)          # (on a loaded machine the first reads and merges may need longer)
    stop.set()
    for t in threads:
        t.join(60)
    for p in procs:
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    for log in logs:
        text = log.read_text()
        if "Traceback" in text:
            errors.append(f"compaction: {text[-2000:]}")
    con = connect(lake)
    n, uniq = con.execute("SELECT count(*), count(DISTINCT (rank, step)) FROM steps").fetchall()[0]
    if not n == uniq == written[0] * per_flush:
        errors.append(f"final: {n} rows, {uniq} distinct, {written[0]} flushes")
    return errors, observed, merges()


def test_queries_during_compaction_and_writes_see_each_row_exactly_once(tmp_path):
    errors, observed, merges = _race(tmp_path, tmp_path, compactions=1)
    assert not errors, errors[:5]
    assert merges >= 2 and len(observed) >= 3      # (2 tables per pass that merged: steps, rank_minutes)


@pytest.mark.parametrize("catalog", ["sqlite", "postgres"])
def test_two_compactions_at_once_during_writes_and_queries_see_each_row_exactly_once(tmp_path, catalog, request):
    """Two ``stepwatch compact`` processes (a manual run during the CronJob's) while a processor
    writes and a reader queries: every query sees each row once, and so does the lake after."""
    lake = request.getfixturevalue("pg_lake") if catalog == "postgres" else tmp_path
    errors, observed, merges = _race(lake, tmp_path, compactions=2)
    assert not errors, errors[:5]
    assert merges >= 4 and len(observed) >= 3


def test_retention_removes_only_partitions_wholly_outside_the_window(tmp_path):
    st = LakeStore(tmp_path).init()
    today = date(2026, 11, 21)
    ages = [0, 1, 4, 5, 6, 30]
    for i, age in enumerate(ages):
        st.write_flush({"steps": [steps("j", i * 10, 3, day=today - timedelta(days=age))]}, {})
    removed = compact.expire(tmp_path, retention_days=5, today=today)
    assert sorted(removed) == sorted(f"{t}/job=j/date={today - timedelta(days=a)}"
                                     for a in (6, 30) for t in ("steps", "rank_minutes", "step_summary"))
    con = connect(tmp_path)
    kept = [str(r[0]) for r in con.execute("SELECT DISTINCT date FROM steps ORDER BY 1").fetchall()]
    assert kept == sorted(str(today - timedelta(days=a)) for a in (0, 1, 4, 5))
    # whole files left the snapshot (no delete files); writing into an expired date works again
    assert con.execute("SELECT count(*) FROM ducklake_list_files('lake', 'steps') WHERE delete_file IS NOT NULL"
                       ).fetchone() == (0,)
    st.write_flush({"steps": [steps("j", 999, 1, day=today - timedelta(days=30))]}, {})
    assert connect(tmp_path).execute("SELECT count(*) FROM steps WHERE step = 999").fetchall() == [(RANKS,)]


def test_a_snapshot_expires_only_grace_after_a_newer_one_replaced_it(tmp_path):
    """In a lake idle for longer than the grace period the newest snapshot is old; a query may have
    started on it just before the next write. It must outlive that write by the grace period."""
    st = LakeStore(tmp_path).init()
    st.write_flush({"steps": [steps("j", 0, 1)]}, {})
    con = Lake.from_dir(tmp_path).connect()
    idle = con.execute("SELECT max(snapshot_id) FROM lake.snapshots()").fetchone()[0]
    time.sleep(4.0)                                    # idle: the newest snapshot ages past the grace below
    st.write_flush({"steps": [steps("j", 1, 1)]}, {})
    assert idle not in compact.expirable(con, grace_s=3.0)
    assert idle - 1 in compact.expirable(con, grace_s=3.0)     # (replaced by `idle` 4 s ago)
    time.sleep(3.5)
    assert idle in compact.expirable(con, grace_s=3.0)

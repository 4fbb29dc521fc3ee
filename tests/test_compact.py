"""Compaction and retention: fewer files, same rows, safe under concurrent queries and writes."""
from __future__ import annotations

import threading
import time
from datetime import date, datetime, timedelta, timezone

import numpy as np
import pyarrow as pa

from stepwatch import schema as wire
from stepwatch.storage import compact
from stepwatch.storage.store import ParquetStore
from stepwatch.storage.views import connect, query

RANKS = 64


def steps(job, step0, n, day: date | None = None):
    s = np.repeat(np.arange(step0, step0 + n), RANKS)
    r = np.tile(np.arange(RANKS), n)
    base = int(datetime.combine(day or datetime.now(timezone.utc).date(), datetime.min.time(),
                                tzinfo=timezone.utc).timestamp() * 1e9) + 3600 * 10**9
    t = pa.table({"job": [job] * len(s), "node": [f"n{x // 8}" for x in r], "rank": r.astype("int32"),
                  "step": s, "t_end": pa.array(base + s * 10**9).cast(wire.TS),
                  "step_ms": np.full(len(s), 100.0), "comm_wait_ms": (r % 7).astype(float)})
    return wire.conform(t, wire.STEPS)


def files(root, job="j"):
    return sorted((root / "steps" / f"job={job}").glob("*/*.parquet"))


def test_compaction_merges_small_files_and_keeps_every_row(tmp_path):
    st = ParquetStore(tmp_path, fsync=False).init()
    for k in range(40):
        st.write_flush({"steps": [steps("j", k * 5, 5)]}, {})
    assert len(files(tmp_path)) == 40
    con = connect(tmp_path)
    before = con.execute("SELECT count(*), sum(step), sum(comm_wait_ms) FROM steps").fetchall()
    res = compact.run(tmp_path, min_age_s=0, grace_s=0)
    # steps and the derived rank_minutes summary: 40 files each -> 1 each
    assert res.partitions == 2 and res.files_in == 80 and res.files_out == 2
    assert len(files(tmp_path)) == 1
    con = connect(tmp_path)
    assert con.execute("SELECT count(*), sum(step), sum(comm_wait_ms) FROM steps").fetchall() == before
    assert con.execute("SELECT count(*) = count(DISTINCT (rank, step)) FROM steps").fetchall() == [(True,)]
    # the compacted file is sorted by (step, rank): row groups prune on step
    import pyarrow.parquet as pq
    t = pq.read_table(files(tmp_path)[0])
    assert t.column("step").to_pylist() == sorted(t.column("step").to_pylist())
    # a second pass has nothing to do
    assert compact.run(tmp_path, min_age_s=0).partitions == 0


def test_queries_during_compaction_and_writes_see_each_row_exactly_once(tmp_path):
    st = ParquetStore(tmp_path, fsync=False).init()
    per_flush = 5 * RANKS
    for k in range(20):
        st.write_flush({"steps": [steps("j", k * 5, 5)]}, {})
    written = [20]     # flushes finished
    started = [20]     # flushes begun (a reader may already see the one being renamed in)
    stop = threading.Event()
    errors, observed = [], []

    def writer():
        k = 20
        while not stop.is_set() and k < 400:
            started[0] = k + 1
            st.write_flush({"steps": [steps("j", k * 5, 5)]}, {})
            k += 1
            written[0] = k
            time.sleep(0.005)

    def reader():
        try:
            con = connect(tmp_path)          # binds the views while compaction swaps files
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

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    swaps = 0
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and threads[0].is_alive():
        # back-to-back passes (a real deployment runs one every few minutes); a fence stands 0.1 s,
        # the next pass comes 0.4 s later: a query's retries (0.05, 0.1, 0.2 s ...) get past it
        swaps += compact.run(tmp_path, min_age_s=0, grace_s=0, fence_s=0.1).partitions
        time.sleep(0.4)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors[:5]
    assert swaps >= 3 and len(observed) >= 10
    con = connect(tmp_path)
    n, uniq = con.execute("SELECT count(*), count(DISTINCT (rank, step)) FROM steps").fetchall()[0]
    assert n == uniq == written[0] * per_flush


def test_a_listing_taken_before_the_swap_finds_every_old_name_and_fails_instead_of_reading_too_few(tmp_path):
    """DuckDB lists a folder through its handle, then stats each name by path and silently skips a
    missing one: a listing straddling the swap would read too few rows without an error. While the
    fences stand, every old name still resolves to a file and reading one fails (and is retried)."""
    import duckdb
    import pytest
    st = ParquetStore(tmp_path, fsync=False).init()
    for k in range(6):
        st.write_flush({"steps": [steps("j", k * 5, 5)]}, {})
    part = files(tmp_path)[0].parent
    old_names = sorted(f.name for f in part.glob("*.parquet"))
    fences: list = []
    assert compact.compact_partition(tmp_path, "steps", part, min_age_s=0, fences=fences)
    assert sorted(f.name for f in fences) == old_names
    for name in old_names:                                  # what a straddling listing stats next
        assert (part / name).is_file() and (part / name).stat().st_size == 0
    glob = str(tmp_path / "steps" / "*" / "*" / "*.parquet")
    with pytest.raises(duckdb.InvalidInputException, match="too small to be a Parquet file"):
        duckdb.connect().execute(f"SELECT count(*) FROM read_parquet('{glob}')").fetchall()
    # connect() and query() wait and retry: the fences come down 0.2 s later, then every row is read once
    threading.Timer(0.2, compact.remove_fences, [fences]).start()
    con = connect(tmp_path)
    _, rows = query(con, "SELECT count(*), count(DISTINCT (rank, step)) FROM steps")
    assert rows == [(6 * 5 * RANKS, 6 * 5 * RANKS)]
    assert [f.name for f in part.glob("*.parquet")] == [f.name for f in files(tmp_path)] and len(files(tmp_path)) == 1


def test_a_pass_removes_fences_a_crashed_pass_left(tmp_path):
    st = ParquetStore(tmp_path, fsync=False).init()
    for k in range(3):
        st.write_flush({"steps": [steps("j", k * 5, 5)]}, {})
    part = files(tmp_path)[0].parent
    fences: list = []
    assert compact.compact_partition(tmp_path, "steps", part, min_age_s=0, fences=fences)   # ... and crashed
    old = time.time() - 60
    for f in fences:
        import os
        os.utime(f, (old, old))
    compact.run(tmp_path, min_age_s=3600)
    assert not any(f.exists() for f in fences)
    assert connect(tmp_path).execute("SELECT count(*) FROM steps").fetchall() == [(3 * 5 * RANKS,)]


def test_retention_removes_only_partitions_wholly_outside_the_window(tmp_path):
    st = ParquetStore(tmp_path, fsync=False).init()
    today = date(2026, 11, 21)
    ages = [0, 1, 4, 5, 6, 30]
    for i, age in enumerate(ages):
        st.write_flush({"steps": [steps("j", i * 10, 3, day=today - timedelta(days=age))]}, {})
    removed = compact.expire(tmp_path, retention_days=5, today=today)
    kept = sorted(p.parent.name for p in files(tmp_path))
    assert sorted(removed) == sorted(f"{t}/job=j/date={today - timedelta(days=a)}"
                                     for a in (6, 30) for t in ("steps", "rank_minutes"))
    assert kept == sorted(f"date={today - timedelta(days=a)}" for a in (0, 1, 4, 5))
    # the seed partition is untouched; writing into an expired date works again
    assert (tmp_path / "steps" / "job=_seed").exists()
    st.write_flush({"steps": [steps("j", 999, 1, day=today - timedelta(days=30))]}, {})
    assert connect(tmp_path).execute("SELECT count(*) FROM steps WHERE step = 999").fetchall() == [(RANKS,)]

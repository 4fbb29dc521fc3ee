import json
import os
import subprocess
import sys
import threading

import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pytest

from stepwatch.storage.store import Fenced, LakeStore, Marker, ranges
from stepwatch.storage.views import connect
from testkit import ROOT, TESTS, tool
from testkit import store_steps as steps

pytestmark = pytest.mark.integration


def test_flush_writes_rows_and_offsets_in_one_snapshot(tmp_path):
    st = LakeStore(tmp_path).init()
    st.cluster = "c1"
    con = connect(tmp_path)
    snap0 = con.execute("SELECT max(snapshot_id) FROM lake.snapshots()").fetchone()[0]
    assert st.write_flush({"steps": [steps("a", 0, 3), steps("b", 0, 2)]}, {("t.steps", 0): Marker(42)}) >= 20
    assert st.load_marker("t.steps", 0) == Marker(42, [])
    con = connect(tmp_path)
    assert con.execute("SELECT job, count(*) FROM steps GROUP BY job ORDER BY job").fetchall() == [("a", 12), ("b", 8)]
    # the per-rank minute summary is derived from the same rows in the same flush
    assert con.execute("SELECT sum(steps) FROM rank_minutes").fetchone() == (20,)
    assert con.execute("SELECT count(*) FROM alerts").fetchone() == (0,)
    # one commit = one snapshot, holding the rows of both tables and the offsets
    snaps = con.execute("SELECT snapshot_id, changes FROM lake.snapshots() WHERE snapshot_id > ?", [snap0]).fetchall()
    assert len(snaps) == 1, snaps
    # partitioned by date only: one data file for both jobs, rows sorted by job, then step and rank;
    # times stored as TIMESTAMPTZ, the date column from t_end (UTC)
    files = [r[0] for r in con.execute("SELECT data_file FROM ducklake_list_files('lake', 'steps')").fetchall()]
    assert [f.split("/steps/")[1].rsplit("/", 1)[0] for f in files] == ["date=2026-11-18"]
    assert con.execute(f"SELECT list(job || ':' || step || ':' || rank) FROM read_parquet('{files[0]}')").fetchone()[0] \
        == [f"{j}:{s}:{r}" for j, n in (("a", 3), ("b", 2)) for s in range(n) for r in range(4)]
    # the jobs table names both (has_history reads it)
    assert sorted(r[0] for r in con.execute("SELECT job FROM jobs").fetchall()) == ["a", "b"]
    assert st.has_history("a") and st.has_history("b") and not st.has_history("c")
    assert con.execute("SELECT any_value(typeof(t_end)), min(date)::VARCHAR FROM steps").fetchone() == (
        "TIMESTAMP WITH TIME ZONE", "2026-11-18")


def test_a_writer_killed_before_commit_leaves_nothing_visible(tmp_path):
    """Killed after writing its Parquet files, before the catalog commit: neither rows nor offsets
    are visible; the next flush of the same messages stores them once."""
    code = f"""
import sys; sys.path.insert(0, {str(TESTS)!r})
from testkit import store_steps as steps
from stepwatch.storage.store import LakeStore, Marker
st = LakeStore({str(tmp_path)!r}).init(); st.cluster = "c1"
st.write_flush({{"steps": [steps("a", 0, 5)]}}, {{("t.steps", 1): Marker(7)}})
"""
    env = dict(os.environ, STEPWATCH_FAILPOINT="before-commit")
    rc = subprocess.run([sys.executable, "-c", code], env=env).returncode
    assert rc == 137
    st = LakeStore(tmp_path).init()
    st.cluster = "c1"
    assert st.load_marker("t.steps", 1) is None
    assert connect(tmp_path).execute("SELECT count(*) FROM steps").fetchone() == (0,)
    assert st.recover() == 0
    st.write_flush({"steps": [steps("a", 0, 5)]}, {("t.steps", 1): Marker(7)})
    con = connect(tmp_path)
    assert con.execute("SELECT count(*), count(DISTINCT (rank, step)) FROM steps").fetchone() == (20, 20)
    assert st.load_marker("t.steps", 1).next == 7


def test_marker_done_ranges():
    m = Marker(10, ranges([12, 13, 14, 20]))
    assert m.done == [[12, 14], [20, 20]]
    assert m.is_done(9) and not m.is_done(10) and m.is_done(13) and not m.is_done(15) and m.is_done(20)
    assert json.loads(json.dumps(m.to_json())) == {"next": 10, "done": [[12, 14], [20, 20]]}


@pytest.mark.parametrize("catalog", ["sqlite", "postgres"])
def test_a_commit_from_an_older_generation_is_rejected(tmp_path, catalog, request):
    """Fencing, directly: a processor whose partition went to a newer generation cannot commit
    (nor claim it back); nothing of its flush is stored."""
    lake = request.getfixturevalue("pg_lake") if catalog == "postgres" else tmp_path
    a, b = LakeStore(lake).init(), LakeStore(lake).init()
    a.cluster = b.cluster = "c1"
    assert a.claim([("t.steps", 0), ("t.steps", 1)], generation=5) == {("t.steps", 0): None, ("t.steps", 1): None}
    a.write_flush({"steps": [steps("j", 0, 1)]}, {("t.steps", 0): Marker(10), ("t.steps", 1): Marker(3)}, generation=5)
    # a rebalance: generation 6 gives partition 0 to b
    assert b.claim([("t.steps", 0)], generation=6) == {("t.steps", 0): Marker(10, [])}
    with pytest.raises(Fenced) as e:                     # a still thinks it owns both
        a.write_flush({"steps": [steps("j", 1, 1)]}, {("t.steps", 0): Marker(11), ("t.steps", 1): Marker(4)},
                      generation=5)
    assert e.value.partitions == {("t.steps", 0): 6}
    with pytest.raises(Fenced):                          # nor can it claim the partition back
        a.claim([("t.steps", 0)], generation=5)
    con = connect(lake)
    assert con.execute("SELECT count(*), max(step) FROM steps").fetchone() == (4, 0)     # nothing of the fenced flush
    assert a.load_marker("t.steps", 1).next == 3
    b.write_flush({"steps": [steps("j", 1, 1)]}, {("t.steps", 0): Marker(11)}, generation=6)
    a.write_flush({}, {("t.steps", 1): Marker(4)}, generation=6)    # a rejoined in generation 6, owns partition 1
    assert connect(lake).execute(
        "SELECT topic, \"partition\", next, generation FROM kafka_offsets WHERE cluster = 'c1' ORDER BY 2").fetchall() == [
        ("t.steps", 0, 11, 6), ("t.steps", 1, 4, 6)]


@pytest.mark.parametrize("catalog", ["sqlite", "postgres"])
def test_a_claim_racing_an_old_owners_commits_sees_every_commit_that_landed(tmp_path, catalog, request):
    """The old owner (generation 1) commits flush after flush while the new owner claims the
    partition (generation 2). Whatever interleaving, the claim's position counts exactly the
    flushes stored, and every commit after the claim is rejected."""
    lake = tmp_path
    if catalog == "postgres":
        lake = request.getfixturevalue("pg_lake")
    old, new = LakeStore(lake).init(), LakeStore(lake).init()
    old.claim([("t.steps", 0)], generation=1)
    claimed = threading.Event()
    fenced, committed = [], [0]

    def old_owner():
        k = 0
        while k < 400:
            try:
                old.write_flush({"steps": [steps("j", k, 1)]}, {("t.steps", 0): Marker(k + 1)}, generation=1)
            except Fenced:
                fenced.append(k)
                if claimed.is_set():
                    return
                continue
            committed[0] = k = k + 1
    th = threading.Thread(target=old_owner)
    th.start()
    while committed[0] < 5:
        threading.Event().wait(0.01)
    m = new.claim([("t.steps", 0)], generation=2)[("t.steps", 0)]
    claimed.set()
    th.join(60)
    assert fenced, "the old owner was never fenced"
    n = connect(lake).execute("SELECT count(*), count(DISTINCT step), max(step) FROM steps").fetchone()
    assert n == (m.next * 4, m.next, m.next - 1)


def test_docs_tables_md_matches_the_code():
    doc = ROOT / "docs" / "tables.md"
    assert doc.read_text() == tool("tablesdoc").tables_markdown(), \
        "docs/tables.md is stale: python tools/tablesdoc.py > docs/tables.md"


def test_step_summary_adds_up_to_the_step_rows_across_flushes(tmp_path):
    """A step whose ranks arrive in two flushes has two summary rows; aggregated they equal the rows."""
    st = LakeStore(tmp_path).init()
    a, b = steps("s", 0, 4, ranks=8), steps("s", 2, 3, ranks=8)
    st.write_flush({"steps": [a.filter(pa.compute.less(a.column("rank"), 5))]}, {})
    st.write_flush({"steps": [a.filter(pa.compute.greater_equal(a.column("rank"), 5)), b]}, {})
    con = connect(tmp_path)
    want = con.execute("SELECT step, count(*), max(t_end), max(step_ms), sum(step_ms) FROM steps GROUP BY step "
                       "ORDER BY step").fetchall()
    got = con.execute("SELECT step, sum(ranks), max(t_end), max(step_ms_max), sum(step_ms_sum) FROM step_summary "
                      "GROUP BY step ORDER BY step").fetchall()
    assert got == want and len(want) == 5
    assert con.execute("SELECT count(*) FROM step_summary WHERE step = 1").fetchone() == (2,)


def test_postgres_password_from_a_file_is_used_and_never_printed(postgres, tmp_path):
    """The chart mounts the catalog's password Secret as a file: STEPWATCH_LAKE_PASSWORD_FILE. A
    role that needs a password (scram) connects with it; neither a good nor a bad password shows in
    what the process prints."""
    import os
    import subprocess
    import sys
    psql = [str(postgres.bin / "psql"), "-h", "127.0.0.1", "-p", str(postgres.port), "-U", postgres.user,
            "-d", "postgres", "-v", "ON_ERROR_STOP=1"]
    subprocess.run(psql + ["-c", "CREATE ROLE pwuser LOGIN PASSWORD 'S3kr3t-pw'"], check=True, capture_output=True)
    subprocess.run(psql + ["-c", "CREATE DATABASE pwlake OWNER pwuser"], check=True, capture_output=True)
    hba = postgres.base / "data" / "pg_hba.conf"
    hba.write_text("host all pwuser 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    subprocess.run(psql + ["-c", "SELECT pg_reload_conf()"], check=True, capture_output=True)
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); from testkit import store_steps as steps\n"
            "from stepwatch.storage.lake import Lake; from stepwatch.storage.store import LakeStore\n"
            "lake = Lake.from_dir(sys.argv[1]); print(lake.describe())\n"
            "st = LakeStore(lake).init(); st.write_flush({'steps': [steps('j', 0, 1)]}, {}); print('stored')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(STEPWATCH_LAKE_CATALOG=f"postgres:host=127.0.0.1 port={postgres.port} user=pwuser dbname=pwlake",
               STEPWATCH_LAKE_DATA_PATH=str(tmp_path / "data"))
    for pw, ok in (("wrong-pw-123", False), ("S3kr3t-pw", True)):
        (tmp_path / "pw").write_text(pw + "\n")
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                           env=dict(env, STEPWATCH_LAKE_PASSWORD_FILE=str(tmp_path / "pw")))
        assert (r.returncode == 0 and "stored" in r.stdout) == ok, (r.stdout[-2000:], r.stderr[-2000:])
        assert pw not in r.stdout + r.stderr
        if not ok:
            assert "password authentication failed" in r.stderr


def test_interleaved_sorted_messages_are_ordered_by_their_chunks_not_copied(tmp_path):
    """A flush holds the messages of several partitions interleaved, each message a sorted run: the
    store orders the runs (no row copied) and the file is sorted as SORT_COLUMNS says; runs whose
    key ranges overlap are sorted row by row."""
    from stepwatch.storage.store import _sort_order
    a, b, c = steps("j", 0, 2), steps("j", 2, 2), steps("j", 4, 2)
    t = pa.concat_tables([c, a, b])                     # partitions read in another order
    cols = ["job", "step", "rank"]
    out = _sort_order(t, cols)
    assert isinstance(out, pa.Table)
    assert out.column("step").to_pylist() == sorted(t.column("step").to_pylist())
    # the same buffers, reordered: nothing copied
    assert [ch.buffers()[1].address for ch in out.column("step").chunks] == \
        [ch.buffers()[1].address for ch in (a, b, c) for ch in [ch.column("step").chunks[0]]]
    overlap = pa.concat_tables([steps("j", 1, 2), steps("j", 0, 2)])      # steps 1-2 and 0-1
    assert not isinstance(_sort_order(overlap, cols), pa.Table)
    st = LakeStore(tmp_path).init()
    st.write_flush({"steps": [c, a, b, overlap]}, {})
    con = connect(tmp_path)
    for f, in con.execute("SELECT data_file FROM ducklake_list_files('lake', 'steps')").fetchall():
        got = con.execute(f"SELECT list([step, rank]) FROM read_parquet('{f}')").fetchone()[0]
        assert got == sorted(got)


def test_a_schema_column_no_row_has_is_not_scanned_and_reads_null(tmp_path):
    """cpu_ms null in every row of a batch: the batch handed to DuckDB leaves it out (INSERT BY NAME
    stores NULL), a column some row has is kept, and both read back as sent."""
    st = LakeStore(tmp_path).init()
    t = steps("n", 0, 2)
    t = t.set_column(t.schema.get_field_index("gc_ms"), "gc_ms", pa.array([None, 1.5] + [None] * 6, pa.float64()))
    prepared = st._prepare("steps", t, 0)
    assert "cpu_ms" not in prepared.column_names and "phases" not in prepared.column_names
    assert "gc_ms" in prepared.column_names and "date" in prepared.column_names
    st.write_flush({"steps": [t]}, {})
    con = connect(tmp_path)
    assert con.execute("SELECT count(*), count(cpu_ms), count(phases), sum(gc_ms) FROM steps").fetchone() == (8, 0, 0, 1.5)


def test_steps_files_the_store_writes_span_days_keep_every_column_and_orphans_go(tmp_path, monkeypatch):
    """The store writes the steps files itself (DIRECT_TABLES) and adds them in the flush's commit:
    one file per day the batch spans, in DuckLake's date folder, no dictionary tried on the float
    columns; every column reads back (a map, a producer's extra column, the date from the folder).
    A fenced flush's file is committed nowhere: an orphan that compaction deletes."""
    import pyarrow.parquet as pq
    from stepwatch.storage import compact
    t = steps("d", 0, 4)                                   # t_end 1,795,000,000 s + step: 2026-11-18
    midnight = 1_795_046_400 * 10**9                          # 2026-11-19 00:00 UTC
    t = t.set_column(t.schema.get_field_index("t_end"), "t_end",
                     pa.array([midnight - 10**9 + 2 * 10**9 * (s >= 2) for s in t.column("step").to_pylist()],
                              pa.int64()).cast(t.schema.field("t_end").type))
    t = t.set_column(t.schema.get_field_index("data_ms"), "data_ms",
                     pa.array([float(i % 3) for i in range(t.num_rows)]))
    phases = pa.array([[("fwd", 1.5)]] + [None] * (t.num_rows - 1), t.schema.field("phases").type)
    t = t.set_column(t.schema.get_field_index("phases"), "phases", phases).append_column("extra_ms", pa.array(
        [0.25] * t.num_rows))
    st = LakeStore(tmp_path).init()
    st.write_flush({"steps": [t]}, {("t.steps", 0): Marker(1)}, generation=2)
    con = connect(tmp_path)
    assert con.execute("SELECT date::VARCHAR, count(*), min(step), max(step), count(phases), sum(extra_ms), "
                       "bool_and(date = t_end::DATE) FROM steps GROUP BY date ORDER BY date").fetchall() == [
        ("2026-11-18", 8, 0, 1, 1, 2.0, True), ("2026-11-19", 8, 2, 3, 0, 2.0, True)]
    assert con.execute("SELECT phases['fwd'] FROM steps WHERE phases IS NOT NULL").fetchall() == [(1.5,)]
    files = sorted(r[0] for r in con.execute("SELECT data_file FROM ducklake_list_files('lake', 'steps')").fetchall())
    assert [f.split("/steps/")[1].rsplit("/", 1)[0] for f in files] == ["date=2026-11-18", "date=2026-11-19"]
    meta = pq.ParquetFile(files[0]).metadata
    enc = {meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i).encodings
           for i in range(meta.num_columns)}
    assert "date" not in enc and not any("DICTIONARY" in e for e in enc["data_ms"]), enc
    # the store's own writer (Arrow's): floats byte-stream-split, integers and times delta-encoded
    assert "BYTE_STREAM_SPLIT" in enc["data_ms"] and "DELTA_BINARY_PACKED" in enc["step"], enc
    assert "DELTA_BINARY_PACKED" in enc["t_end"] and any("DICTIONARY" in e for e in enc["job"]), enc
    # an older generation is fenced: nothing committed, its file an orphan until compaction
    on_disk = {str(p) for p in (tmp_path / "lake").rglob("*.parquet")}
    with pytest.raises(Fenced):
        st.write_flush({"steps": [steps("d", 9, 1)]}, {("t.steps", 0): Marker(2)}, generation=1)
    orphans = {str(p) for p in (tmp_path / "lake").rglob("*.parquet")} - on_disk
    assert len(orphans) == 1 and con.execute("SELECT count(*) FROM steps WHERE step = 9").fetchone() == (0,)
    monkeypatch.setattr(compact, "ORPHAN_AGE_S", 0.0)
    compact.run(tmp_path, grace_s=0.0)
    assert not any(os.path.exists(p) for p in orphans)
    assert connect(tmp_path).execute("SELECT count(*), sum(extra_ms) FROM steps").fetchone() == (16, 4.0)


def test_a_reader_open_before_a_table_gained_a_column_still_reads_it(tmp_path):
    """The views live in one DuckDB instance per lake and process (a Grafana backend, `stepwatch sql`'s
    session, a report): a writer that adds a column (a producer's extra column) changes the table under
    a view bound to the old columns, and DuckDB refuses it ('Contents of view were altered'). A new
    connection and a query on an open one both see the table as it is now, the new column included."""
    from stepwatch.storage.views import query
    st = LakeStore(tmp_path).init()
    st.write_flush({"steps": [steps("n", 0, 2)]}, {})
    old = connect(tmp_path)
    n0 = old.execute("SELECT count(*) FROM steps").fetchone()[0]
    t = steps("n", 2, 4)
    t = t.append_column("vendor_counter", pa.array(range(len(t)), pa.int64()))
    st.write_flush({"steps": [t]}, {})
    con = connect(tmp_path)
    n = len(t)
    assert con.execute("SELECT count(*), count(vendor_counter) FROM steps").fetchone() == (n0 + n, n)
    assert query(old, "SELECT count(*), sum(vendor_counter) FROM steps")[1] == [(n0 + n, n * (n - 1) // 2)]


def test_host_samples_read_back_with_their_lists(tmp_path):
    """``host`` samples' nested lists of processes and accelerators read back through the views as
    they were sent (what the node dashboard's accelerator panel unnests), nulls included."""
    from stepwatch.wire import tables as wire
    t0 = 1_795_000_000 * 10**9
    rows = [{"job": "h", "node": f"n{i % 2}", "t": t0 + i * 10**9, "cpu_util": 50.0 + i, "mem_used": 10**9 + i,
             "top_procs": [{"pid": 100 + i, "name": "python", "cpu_pct": 99.5}] if i % 3 else None,
             "accel": [{"index": k, "util": 60.0 + k, "mem_used": 2**30, "temp_c": 55.0, "power_w": 400.0 + i,
                        "clock_mhz": 1980.0} for k in range(i % 3)]} for i in range(6)]
    host = pa.Table.from_pylist(rows, schema=wire.SCHEMAS["host"])
    st = LakeStore(tmp_path).init()
    st.write_flush({"host": [host]}, {("t.host", 0): Marker(1)}, generation=1)
    con = connect(tmp_path)
    files = [r[0] for r in con.execute("SELECT data_file FROM ducklake_list_files('lake', 'host')").fetchall()]
    assert len(files) == 1 and "/host/date=" in files[0]
    got = con.execute("SELECT node, epoch_ns(t) - ?, cpu_util, mem_used, top_procs, len(accel) FROM host "
                      "ORDER BY t", [t0]).fetchall()
    assert [(r[0], r[1], r[2], r[3], r[5]) for r in got] == [
        (f"n{i % 2}", i * 10**9, 50.0 + i, 10**9 + i, i % 3) for i in range(6)]
    assert got[1][4] == [{"pid": 101, "name": "python", "cpu_pct": 99.5}] and got[0][4] is None
    assert con.execute("SELECT a.index, a.util, a.power_w FROM (SELECT unnest(accel) AS a FROM host "
                       "WHERE epoch_ns(t) = ?) ORDER BY 1", [t0 + 5 * 10**9]).fetchall() == [
        (0, 60.0, 405.0), (1, 61.0, 405.0)]

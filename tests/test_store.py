import json
import os
import subprocess
import sys

import pyarrow as pa

from stepwatch import schema as wire
from stepwatch.storage.store import Marker, ParquetStore, ranges
from stepwatch.storage.views import connect


def steps(job, step0, n, ranks=4):
    import numpy as np
    s = np.repeat(np.arange(step0, step0 + n), ranks)
    r = np.tile(np.arange(ranks), n)
    t = pa.table({"job": [job] * len(s), "node": ["n0"] * len(s), "rank": r.astype("int32"), "step": s,
                  "t_end": pa.array(1_795_000_000_000_000_000 + s * 10**9).cast(wire.TS),
                  "step_ms": np.full(len(s), 100.0)})
    return wire.conform(t, wire.STEPS)


def test_flush_writes_partitions_markers_and_views(tmp_path):
    st = ParquetStore(tmp_path).init()
    st.cluster = "c1"
    files = st.write_flush({"steps": [steps("a", 0, 3), steps("b", 0, 2)]}, {("t.steps", 0): Marker(42)})
    steps_files = [f for f in files if f.parts[-4] == "steps"]
    assert len(steps_files) == 2 and all(f.exists() for f in files)
    assert {f.parent.parent.name for f in steps_files} == {"job=a", "job=b"}
    # the per-rank minute summary is derived from the same rows in the same flush
    assert {f.parts[-4] for f in files} == {"steps", "rank_minutes"}
    assert st.load_marker("t.steps", 0).next == 42
    con = connect(tmp_path)
    assert con.execute("SELECT job, count(*) FROM steps GROUP BY job ORDER BY job").fetchall() == [("a", 12), ("b", 8)]
    assert con.execute("SELECT count(*) FROM alerts").fetchone() == (0,)       # seed keeps empty tables readable
    assert not list(tmp_path.rglob("*.tmp"))


def test_crash_after_intent_is_rolled_forward(tmp_path):
    """A writer killed between its intent and the renames: recovery completes the flush."""
    code = f"""
import sys; sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from test_store import steps
from stepwatch.storage.store import ParquetStore, Marker
st = ParquetStore({str(tmp_path)!r}).init(); st.cluster = "c1"
st.write_flush({{"steps": [steps("a", 0, 5)]}}, {{("t.steps", 1): Marker(7)}})
"""
    env = dict(os.environ, STEPWATCH_FAILPOINT="after-intent")
    rc = subprocess.run([sys.executable, "-c", code], env=env).returncode
    assert rc == 137
    st = ParquetStore(tmp_path)
    st.cluster = "c1"
    assert st.load_marker("t.steps", 1) is None                    # nothing visible yet
    assert len(list((tmp_path / "steps").rglob(".part-*.tmp"))) == 1
    assert st.recover() == 1
    assert st.load_marker("t.steps", 1).next == 7
    con = connect(tmp_path)
    assert con.execute("SELECT count(*) FROM steps").fetchone() == (20,)
    assert con.execute("SELECT sum(steps) FROM rank_minutes").fetchone() == (20,)
    assert not list((tmp_path / "_state" / "intents").iterdir())


def test_marker_done_ranges():
    m = Marker(10, ranges([12, 13, 14, 20]))
    assert m.done == [[12, 14], [20, 20]]
    assert m.is_done(9) and not m.is_done(10) and m.is_done(13) and not m.is_done(15) and m.is_done(20)
    assert json.loads(json.dumps(m.to_json())) == {"next": 10, "done": [[12, 14], [20, 20]]}


def test_docs_tables_md_matches_the_code():
    from pathlib import Path

    from stepwatch.storage.docs import tables_markdown
    doc = Path(__file__).resolve().parents[1] / "docs" / "tables.md"
    assert doc.read_text() == tables_markdown(), \
        "docs/tables.md is stale: python -m stepwatch.storage.docs > docs/tables.md"

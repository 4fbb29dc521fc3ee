"""The lake stores steps' durations as FLOAT (storage.store.STORED_TYPES) and the views read them as DOUBLE."""
import glob
import os

import pyarrow.parquet as pq
import pytest

from stepwatch.devtools.simulate import Simulation
from stepwatch.storage.store import LakeStore, Marker
from stepwatch.storage.views import connect

pytestmark = pytest.mark.integration


def test_step_durations_are_stored_as_float_read_as_double_and_take_under_25_bytes_a_row(tmp_path):
    sim = Simulation(job="types", ranks=4096, steps=8, seed=3)
    steps = sim.generate(0, 8)["steps"]
    LakeStore(tmp_path, threads=1).init().write_flush({"steps": [steps]}, {("t", 0): Marker(1, [])}, generation=1)
    files = glob.glob(str(tmp_path / "lake" / "**" / "steps" / "**" / "*.parquet"), recursive=True)
    size = sum(os.path.getsize(f) for f in files)
    assert size / steps.num_rows <= 25, f"{size / steps.num_rows:.1f} B a step row"
    schema = pq.read_schema(files[0])
    assert str(schema.field("comm_wait_ms").type) == "float" and str(schema.field("step_ms").type) == "float"
    con = connect(tmp_path)
    assert dict(con.execute("SELECT column_name, data_type FROM duckdb_columns() WHERE database_name = 'lake' "
                            "AND table_name = 'steps'").fetchall())["data_ms"] == "FLOAT"
    types = dict((r[0], r[1]) for r in con.execute("DESCRIBE steps").fetchall())
    assert types["data_ms"] == types["step_ms"] == "DOUBLE"
    got = con.execute("SELECT data_ms FROM steps ORDER BY step, rank").fetch_arrow_table().column(0).to_pylist()
    want = steps.sort_by([("step", "ascending"), ("rank", "ascending")]).column("data_ms").to_pylist()
    assert got == pytest.approx(want, rel=1e-7) and got != want       # float32: 7 significant digits
    # SQL computes in float64 (a FLOAT's round(x, 1) would read back as 123.4000015...)
    assert con.execute("SELECT round(max(data_ms), 1) FROM steps").fetchone()[0] == round(max(got), 1)


def test_a_lake_made_with_double_durations_keeps_them(tmp_path, monkeypatch):
    from stepwatch.storage import store
    steps = Simulation(job="old", ranks=64, steps=2, seed=4).generate(0, 2)["steps"]
    with monkeypatch.context() as m:            # the lake as the store made it before STORED_TYPES
        m.setattr(store, "STORED_TYPES", {})
        LakeStore(tmp_path, threads=1).init().write_flush({"steps": [steps]}, {})
    LakeStore(tmp_path, threads=1).init().write_flush({"steps": [steps]}, {})   # a store of today: no error
    con = connect(tmp_path)
    assert dict(con.execute("SELECT column_name, data_type FROM duckdb_columns() WHERE database_name = 'lake' "
                            "AND table_name = 'steps'").fetchall())["data_ms"] == "DOUBLE"
    got = con.execute("SELECT data_ms FROM steps").fetch_arrow_table().column(0).to_pylist()
    assert sorted(got) == sorted(steps.column("data_ms").to_pylist() * 2)      # exact: still float64

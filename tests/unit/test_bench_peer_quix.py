"""``tools/bench_peer_quix.py`` (the quixstreams peer of ``stepwatch bench ingest``): its messages are the bench
job's step rows, one valid JSON object each with every column of the ``steps`` table. The consumer half needs
quixstreams (a separate venv, not a dependency) and is not run here."""
import json

import pyarrow as pa
import pytest

from stepwatch.devtools.simulate import Simulation
from stepwatch.wire.tables import STEPS
from testkit import tool

peer = tool("bench_peer_quix")      # tools/bench_peer_quix.py
pytestmark = pytest.mark.unit


def test_messages_are_the_step_rows_as_json_with_every_steps_column():
    t = Simulation(job="bench-tput", ranks=16, steps=3, seed=1).generate(0, 3)["steps"]
    t = t.set_column(t.schema.get_field_index("phases"), "phases",      # a map value, as the probe sends them
                     pa.array([[("fwd", 1.5), ("bwd", 2.0)]] + [None] * (t.num_rows - 1),
                              STEPS.field("phases").type))
    msgs = peer.step_messages(t)
    assert len(msgs) == t.num_rows == 48
    rows = [json.loads(v) for _, v in msgs]          # strict JSON: no NaN/Infinity tokens
    assert all(list(r) == STEPS.names for r in rows)
    assert {k for k, _ in msgs} == {b"bench-tput"}
    first = t.slice(0, 1).to_pylist()[0]
    assert rows[0]["t_end"] == t.column("t_end").cast("int64")[0].as_py() and isinstance(rows[0]["t_end"], int)
    assert rows[0]["step_ms"] == first["step_ms"] and rows[0]["rank"] == first["rank"]
    assert rows[0]["phases"] == {"fwd": 1.5, "bwd": 2.0} and rows[1]["phases"] is None
    assert [(r["rank"], r["step"]) for r in rows] == list(zip(t.column("rank").to_pylist(), t.column("step").to_pylist()))


def test_a_nan_duration_is_refused_not_sent_as_invalid_json():
    t = Simulation(job="bench-tput", ranks=2, steps=1, seed=1).generate(0, 1)["steps"]
    t = t.set_column(t.schema.get_field_index("data_ms"), "data_ms", pa.array([float("nan"), 1.0]))
    with pytest.raises(ValueError, match="not JSON compliant"):
        peer.step_messages(t)

import math

import pyarrow as pa
import pytest

from stepwatch.wire import catalog
from stepwatch.wire import tables as wire
from stepwatch.wire.catalog import NATURAL_KEYS, TELEMETRY
from stepwatch.wire.decode import WireError, decode
from stepwatch.wire.encode import encode_arrow, encode_json

pytestmark = pytest.mark.unit

TS = wire.TS


def steps_table(n=4, **over):
    cols = {
        "job": ["j1"] * n, "node": [f"n{i // 2}" for i in range(n)], "rank": list(range(n)),
        "step": [7] * n, "t_start": pa.array([1_000] * n, pa.int64()).cast(TS),
        "t_end": pa.array([2_000] * n, pa.int64()).cast(TS), "step_ms": [100.0] * n,
        "comm_wait_ms": [5.0] * n,
    }
    cols.update(over)
    return pa.table(cols)


def test_arrow_roundtrip_conforms_and_keeps_extra_columns():
    t = steps_table().append_column("my_extra", pa.array([1, 2, 3, 4]))
    d = decode(encode_arrow(t), catalog.ARROW_CT, "steps/1")
    assert d.kind == "steps" and d.rejected == []
    assert d.table.num_rows == 4
    # every v1 column present with its v1 type, extras kept at the end
    for f in wire.STEPS:
        assert d.table.schema.field(f.name).type == f.type
    assert d.table.column_names[-1] == "my_extra"
    assert d.table.column("data_ms").null_count == 4      # missing nullable -> null
    assert d.table.column("rank").type == pa.int32()       # int64 in, int32 out


def test_bad_rows_are_rejected_with_field_and_value_good_rows_kept():
    t = steps_table(step_ms=[100.0, float("nan"), -3.0, 90.0],
                    job=["j1", "j1", "j1", "../etc"])
    d = decode(encode_arrow(t), catalog.ARROW_CT, "steps/1")
    assert d.table.num_rows == 1 and d.table.column("rank").to_pylist() == [0]
    reasons = dict(d.rejected)
    assert "step_ms" in reasons[1] and "nan" in reasons[1]
    assert "step_ms" in reasons[2] and "-3.0" in reasons[2]
    assert "job" in reasons[3] and "../etc" in reasons[3]
    assert d.rejected_rows.num_rows == 3


def test_missing_required_column_and_bad_type_name_the_field():
    t = steps_table().drop_columns(["step_ms"])
    with pytest.raises(WireError, match="'step_ms'"):
        decode(encode_arrow(t), catalog.ARROW_CT, "steps/1")
    t = steps_table(rank=["a", "b", "c", "d"])
    with pytest.raises(WireError, match="'rank'"):
        decode(encode_arrow(t), catalog.ARROW_CT, "steps/1")


@pytest.mark.parametrize("payload,ct,hdr,match", [
    (b"\x00garbage\xff", catalog.ARROW_CT, "steps/1", "undecodable Arrow"),
    (b"{not json", catalog.JSON_CT, "steps/1", "undecodable JSON"),
    (b"[]", catalog.JSON_CT, "nonsense/1", "unknown schema"),
    (b"[]", catalog.JSON_CT, "steps/9", "unsupported schema version"),
    (b"[]", "text/csv", "steps/1", "unsupported content-type"),
    (b"[]", catalog.JSON_CT, None, "missing 'schema' header"),
    (b"[1, 2]", catalog.JSON_CT, "steps/1", "array of row objects"),
])
def test_whole_message_errors(payload, ct, hdr, match):
    with pytest.raises(WireError, match=match):
        decode(payload, ct, hdr)


def test_json_rows_with_int_and_iso_times():
    rows = [
        {"job": "j", "node": "n", "rank": 0, "step": 1, "t_end": 1_700_000_000_000_000_000, "step_ms": 10},
        {"job": "j", "node": "n", "rank": 1, "step": 1, "t_end": "2026-01-01T00:00:00.5Z", "step_ms": 11.5,
         "phases": {"forward": 3.0, "backward": 6.0}},
        {"job": "j", "node": "n", "rank": 2, "step": 1, "t_end": "2026-01-01T00:00:00Z", "step_ms": "NaN"},
    ]
    d = decode(encode_json(rows), catalog.JSON_CT, "steps/1")
    assert d.table.num_rows == 2
    assert d.rejected[0][0] == 2 and "step_ms" in d.rejected[0][1]
    t_end = d.table.column("t_end").cast(pa.int64()).to_pylist()
    assert t_end[1] == 1_767_225_600_500_000_000
    assert d.table.column("phases")[1].as_py() == [("forward", 3.0), ("backward", 6.0)]


def test_json_type_error_names_field():
    rows = [{"job": "j", "node": "n", "rank": 0, "step": 1, "t_end": 5, "step_ms": "slow"}]
    with pytest.raises(WireError, match="'step_ms'.*'slow'"):
        decode(encode_json(rows), catalog.JSON_CT, "steps/1")


def test_topology_rank_must_be_below_world_size():
    t = pa.table({"job": ["j", "j"], "rank": [0, 8], "node": ["a", "b"], "world_size": [8, 8]})
    d = decode(encode_arrow(t), catalog.ARROW_CT, "topology/1")
    assert d.table.num_rows == 1
    assert "world_size 8" in d.rejected[0][1]


def test_every_kind_has_schema_and_natural_key():
    for k in TELEMETRY:
        assert k in wire.SCHEMAS and k in NATURAL_KEYS
        assert set(NATURAL_KEYS[k]) <= set(wire.SCHEMAS[k].names)
    assert not math.isnan(0.0)

"""The encodings the store gives the files it writes itself with adaptive encodings (``host``): each
Parquet leaf's, nested ones by their paths, from the values of the file (storage/store.py)."""
from __future__ import annotations

import io
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stepwatch.storage.store import DICTIONARY_PAGE_LIMIT, _adaptive_encodings, _dictionary_pays, _leaves

pytestmark = pytest.mark.unit


def test_leaf_paths_are_the_ones_arrows_writer_gives_and_their_values_those_written():
    item = pa.struct([("pid", pa.int64()), ("cpu", pa.float64())])
    lists = pa.array([[{"pid": 1, "cpu": 0.5}], None, [{"pid": 2, "cpu": 1.5}, {"pid": 3, "cpu": 2.5}], []],
                     pa.list_(item))
    maps = pa.array([[("a", 1.0)], None, [("b", 2.0), ("c", 3.0)], []], pa.map_(pa.string(), pa.float32()))
    pair = pa.array([{"x": 1, "y": "u"}, {"x": 2, "y": "v"}, None, {"x": 4, "y": "w"}],
                    pa.struct([("x", pa.int32()), ("y", pa.string())]))
    t = pa.table({"l": pa.chunked_array([lists.slice(2), lists.slice(0, 2)]),        # chunks cut mid-array
                  "m": pa.chunked_array([maps.slice(2), maps.slice(0, 2)]), "s": pa.chunked_array([pair.slice(2),
                                                                                    pair.slice(0, 2)])})
    leaves = [(p, v.to_pylist()) for name, col in zip(t.column_names, t.columns) for p, v in _leaves(col, name)]
    buf = io.BytesIO()
    pq.write_table(t, buf)
    written = pq.ParquetFile(io.BytesIO(buf.getvalue())).metadata.schema
    assert [p for p, _ in leaves] == [written.column(i).path for i in range(len(written))] == [
        "l.list.element.pid", "l.list.element.cpu", "m.key_value.key", "m.key_value.value", "s.x", "s.y"]
    got = dict(leaves)
    assert got["l.list.element.pid"] == [2, 3, 1] and got["m.key_value.key"] == ["b", "c", "a"]
    assert got["s.x"][1:] == [4, 1, 2]             # (a null struct's child slot is whatever it holds)


def test_a_dictionary_is_chosen_where_it_and_its_indices_are_smaller_than_the_other_encoding():
    rng = random.Random(7)
    # floats (byte-stream-split keeps every byte): 64 values, d distinct of 8 B each with 6-bit indices:
    # 8·d + 48 < 512 up to d = 57
    def floats(d):
        return pa.array([float(i % d) * 1.1 for i in range(64)])
    assert _dictionary_pays(floats(57), 8) and not _dictionary_pays(floats(58), 8)
    assert _dictionary_pays(floats(3), 8) and not _dictionary_pays(pa.array([rng.random() for _ in range(64)]), 8)
    # integers: against what delta packs, the span of successive differences. Ranks in runs (a step's
    # 16 ranks, 4 times) differ by 0 or 1: a bit a value, less than a dictionary's 16 values + 4-bit
    # indices; the same 16 values spread over 2^34 and shuffled: a dictionary.
    runs = pa.array([i // 4 for i in range(64)], pa.int64())
    spread = pa.array([rng.choice(range(16)) * 2**30 + 7 for _ in range(64)], pa.int64())
    assert not _dictionary_pays(runs, 8, delta=True) and _dictionary_pays(runs, 8)
    assert _dictionary_pays(spread, 8, delta=True)
    # nothing but nulls: no dictionary; a dictionary past Arrow's page limit: none either
    assert not _dictionary_pays(pa.array([None, None], pa.float64()), 8)
    big = DICTIONARY_PAGE_LIMIT // 8 + 1
    assert not _dictionary_pays(pa.chunked_array([pa.array(range(big), pa.int64())] * 8), 8)


def test_host_like_leaves_get_dictionary_delta_or_byte_stream_split_by_their_values():
    rng = random.Random(3)
    n = 512
    accel = pa.list_(pa.struct([("util", pa.float64()), ("mem_used", pa.int64())]))
    t = pa.table({"node": [f"n{i % 8}" for i in range(n)],
                  "cpu_util": [float(rng.randrange(5) * 10) for _ in range(n)],          # few values
                  "mem_used": [10**9 + rng.randrange(10**8) for _ in range(n)],          # all distinct
                  "net_rx_bps": [rng.random() * 1e9 for _ in range(n)],
                  "up": [i % 2 == 0 for i in range(n)],
                  "accel": pa.array([[{"util": float(rng.randrange(4)), "mem_used": 2**30 + rng.randrange(2**40)}
                                      for _ in range(2)] for _ in range(n)], accel)})
    dictionary, encoding = _adaptive_encodings(t)
    assert sorted(dictionary) == ["accel.list.element.util", "cpu_util", "node"]
    assert encoding == {"mem_used": "DELTA_BINARY_PACKED", "net_rx_bps": "BYTE_STREAM_SPLIT",
                        "accel.list.element.mem_used": "DELTA_BINARY_PACKED"}
    buf = io.BytesIO()
    pq.write_table(t, buf, use_dictionary=dictionary, column_encoding=encoding)
    rg = pq.ParquetFile(io.BytesIO(buf.getvalue())).metadata.row_group(0)
    enc = {rg.column(i).path_in_schema: rg.column(i).encodings for i in range(rg.num_columns)}
    assert "RLE_DICTIONARY" in enc["accel.list.element.util"] and "DELTA_BINARY_PACKED" in enc[
        "accel.list.element.mem_used"] and "BYTE_STREAM_SPLIT" in enc["net_rx_bps"], enc

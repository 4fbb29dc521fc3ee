"""The table catalog (stepwatch/wire/catalog.py) is the one list of tables and topics: every table has exactly
one Arrow schema, its key/time/sort columns exist in it, and the parts that used to keep their own lists
read the catalog's."""
import pyarrow as pa

from stepwatch.wire import catalog
from stepwatch.wire import tables as wire
from stepwatch.wire.catalog import NATURAL_KEYS, TELEMETRY
from stepwatch.wire.decode import parse_schema_header
from stepwatch.agents import agent
from stepwatch.storage import store
from stepwatch import kafkaio
from stepwatch.stream import ingress, processor

import pytest
pytestmark = pytest.mark.unit


def test_every_table_has_one_schema_with_its_columns():
    assert set(catalog.BY_NAME) == set(wire.SCHEMAS) | {"control"}
    assert len(catalog.BY_NAME) == len(catalog.CATALOG)
    for t in catalog.CATALOG:
        sch = wire.CONTROL if t.name == "control" else wire.SCHEMAS[t.name]
        cols = set(sch.names)
        assert set(t.key) <= cols, t.name
        assert set(t.sort) <= cols, t.name
        if t.stored and t.time != "_received":     # _received: the store partitions by arrival time
            assert t.time in cols and pa.types.is_timestamp(sch.field(t.time).type), t.name


def test_derived_lists():
    assert catalog.INPUT_TOPICS == ("topology", "steps", "host", "gc", "comm", "profiles", "inflight")
    assert set(catalog.TELEMETRY) == {"steps", "topology", "host", "gc", "comm", "inflight"}
    assert set(catalog.TOPICS) == set(catalog.INPUT_TOPICS) | {"control", "alerts", "deadletter"}
    assert set(catalog.RANKED) == set(catalog.INPUT_TOPICS) - {"host"}
    assert "control" not in catalog.TABLES and "rank_minutes" in catalog.TABLES
    for k in catalog.INPUT_TOPICS:                  # the processor can decode everything it subscribes to
        assert parse_schema_header(f"{k}/1") == (k, 1)


def test_parts_read_the_catalog():
    assert processor.INPUT_TOPICS is catalog.INPUT_TOPICS
    assert kafkaio.TOPIC_NAMES is catalog.TOPICS
    assert store.TABLES is catalog.TABLES and store.SORT_COLUMNS is catalog.SORT_COLUMNS
    assert store.TIME_COLUMN is catalog.TIME_COLUMN
    assert ingress._RANKED is catalog.RANKED
    assert agent.KINDS is catalog.INPUT_TOPICS
    assert NATURAL_KEYS is catalog.NATURAL_KEYS and TELEMETRY is catalog.TELEMETRY

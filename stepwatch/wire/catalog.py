"""The one catalog of stepwatch's tables: name, natural key, time column, sort columns, Kafka topic, and
who writes each. Every part reads its lists from here (the processor's input topics, the topics created,
the store's tables and sort order, the ingress bounds, the agent's and simulator's kinds).

The Arrow schema of each table is :data:`stepwatch.wire.tables.SCHEMAS` ``[name]`` (the decoder,
:mod:`stepwatch.wire.decode`, conforms rows to it); ``tests/unit/test_catalog.py`` checks that every table here
has exactly one schema there and that its key, time and sort columns are columns of it. This module imports
only the standard library (an import-linter contract), so that every layer of the wire package (and the
probe, if it ever needs a table name) can read it.
"""
from __future__ import annotations

from dataclasses import dataclass

#: The message's content types and the wire contract's version (the ``schema`` header ``<kind>/<VERSION>``);
#: here, in the standard library's layer, so that the node agent's writer (:mod:`stepwatch.wire.lite`, no
#: pyarrow) and :mod:`stepwatch.wire.tables` share them.
ARROW_CT = "application/vnd.apache.arrow.stream"
JSON_CT = "application/json"
VERSION = 1


def headers(kind: str, content_type: str = ARROW_CT) -> list[tuple[str, bytes]]:
    """A message's Kafka headers: its content type and ``schema`` (``<kind>/<VERSION>``)."""
    return [("content-type", content_type.encode()), ("schema", f"{kind}/{VERSION}".encode())]


@dataclass(frozen=True)
class Table:
    name: str
    key: tuple[str, ...]             # natural key: rows with the same key are the same fact (deduplicated)
    time: str | None                 # event-time column: the store's date partition ("_received": the time
                                     # the store received the batch; None: not stored)
    sort: tuple[str, ...]            # sort order of the rows within a stored file
    topic: str | None                # "in": producers send it, the processor reads it; "out": the processor
                                     # publishes it; "control": commands to the agents; None: no topic
    writer: str                      # "probe" (per rank) | "agent" (per node) | "processor" | "cli"
    per_rank: bool = False           # rows carry a ``rank`` bounded by the ingress' max_ranks
    stored: bool = True              # a table of the store


#: In the store's order (docs/tables.md lists them so).
CATALOG: tuple[Table, ...] = (
    Table("steps", ("job", "rank", "step"), "t_end", ("step", "rank"), "in", "probe", per_rank=True),
    Table("topology", ("job", "rank"), "_received", ("rank",), "in", "probe", per_rank=True),
    Table("host", ("job", "node", "t"), "t", ("node", "t"), "in", "agent"),
    Table("gc", ("job", "rank", "t"), "t", ("t",), "in", "probe", per_rank=True),
    Table("comm", ("job", "rank", "step", "op", "group"), "_received", ("step", "rank"), "in", "probe",
          per_rank=True),
    Table("alerts", ("alert_id", "status"), "t_detected", ("t_detected",), "out", "processor"),
    Table("deadletter", (), "t_received", ("t_received",), "out", "processor"),
    Table("rank_minutes", (), "minute", ("minute", "rank"), None, "processor"),
    Table("step_summary", (), "t_end", ("step",), None, "processor"),
    Table("efficiency", ("job", "step"), "t_end", ("step",), None, "processor"),
    Table("comm_bw", ("job", "step_hi", "op", "group"), "t_end", ("step_hi", "op", "group"), None, "processor"),
    Table("profiles", ("cmd_id", "rank", "status"), "_received", ("cmd_id", "rank"), "in", "agent",
          per_rank=True),
    Table("profile_diffs", ("cmd_id", "name"), "t", ("cmd_id", "position"), None, "processor"),
    Table("inflight", ("job", "rank", "t", "source"), "t", ("t", "rank"), "in", "probe", per_rank=True),
    Table("control", (), None, (), "control", "cli", stored=False),
)
BY_NAME: dict[str, Table] = {t.name: t for t in CATALOG}

#: Tables of the store.
TABLES: tuple[str, ...] = tuple(t.name for t in CATALOG if t.stored)
#: Every Kafka topic (by kind; ``KafkaSettings.topic`` adds the prefix).
TOPICS: tuple[str, ...] = tuple(t.name for t in CATALOG if t.topic)
#: Topics the processor consumes (topology first: what a job is comes before its rows).
INPUT_TOPICS: tuple[str, ...] = tuple(sorted((t.name for t in CATALOG if t.topic == "in"), key=lambda n: n != "topology"))
#: Kinds the ranks' probes send (through the node agent); ``profiles`` and ``host`` come from the agent.
TELEMETRY: tuple[str, ...] = tuple(t.name for t in CATALOG if t.topic == "in" and t.name != "profiles")
#: Input kinds whose rows carry a per-rank ``rank``.
RANKED: tuple[str, ...] = tuple(t.name for t in CATALOG if t.topic == "in" and t.per_rank)
#: Natural key per table (tables without one are append-only).
NATURAL_KEYS: dict[str, tuple[str, ...]] = {t.name: t.key for t in CATALOG if t.key}
#: The event-time column that gives each stored table's date partition.
TIME_COLUMN: dict[str, str] = {t.name: t.time for t in CATALOG if t.stored}
#: Sort order within a stored file: the job first (a lake file holds every job of a flush; a job's rows
#: are then contiguous), then the table's own order.
SORT_COLUMNS: dict[str, list[str]] = {t.name: ["job", *t.sort] for t in CATALOG if t.stored}

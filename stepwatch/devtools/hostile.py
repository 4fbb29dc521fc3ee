"""Malformed and hostile Kafka messages, interleaved with good data, with what the processor must
make of each (``stepwatch bench hostile``, ``tests/test_ingress.py``).

Every generated :class:`Item` says which step rows it must leave in the store (``rows``: job, rank,
step) and whether it must leave exactly one deadletter record (``dead``). The checker
(:func:`verify`) then asks DuckDB: every good row stored exactly once and under its own job, every
bad message in the deadletter table once, nothing else.
"""
from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from stepwatch.wire import catalog
from stepwatch.wire import tables as wire
from stepwatch.wire.catalog import headers
from stepwatch.wire.encode import encode_arrow

GiB = 1 << 30


@dataclass
class Item:
    kind: str                        # topic kind
    value: bytes | None
    headers: list
    key: bytes | None
    rows: pa.Table | None = None     # (job, rank, step) that must be stored in 'steps'
    dead: bool = False               # exactly one deadletter record expected
    label: str = ""
    codec: str | None = None         # producer to send it with (None: uncompressed)
    meta: dict = field(default_factory=dict)


def steps_table(job: str, ranks, steps, t_end_ns, node: str = "node-0") -> pa.Table:
    """Step rows for the given (rank, step) pairs (broadcast), all columns valid."""
    ranks = np.asarray(ranks, dtype=np.int64)
    steps = np.asarray(steps, dtype=np.int64)
    t_end = np.broadcast_to(np.asarray(t_end_ns, dtype=np.int64), ranks.shape)
    n = len(ranks)
    step_ms = np.full(n, 100.0)
    cols = {
        "job": pa.array([job] * n, pa.string()), "node": pa.array([node] * n, pa.string()),
        "rank": pa.array(ranks.astype(np.int32)), "step": pa.array(steps),
        "t_start": pa.array(t_end - 100_000_000).cast(wire.TS), "t_end": pa.array(t_end).cast(wire.TS),
        "step_ms": pa.array(step_ms), "data_ms": pa.array(step_ms * 0.1), "compute_ms": pa.array(step_ms * 0.6),
        "comm_ms": pa.array(step_ms * 0.3), "comm_wait_ms": pa.array(step_ms * 0.05), "gc_ms": pa.array(np.zeros(n)),
    }
    return pa.table(cols)


def _keys(t: pa.Table) -> pa.Table:
    return t.select(["job", "rank", "step"]).cast(pa.schema([("job", pa.string()), ("rank", pa.int32()),
                                                             ("step", pa.int64())]))


def _hdr(kind="steps", ct=catalog.ARROW_CT):
    return headers(kind, ct)


def _arrow(t, compression="zstd") -> bytes:
    return encode_arrow(t, compression=compression)


# ------------------------------------------------------------------------------ bombs (built once)
_BOMBS: dict = {}


def decompression_bomb(decoded: int = 520 << 20) -> bytes:
    """One step row with an extra binary column of ``decoded`` zero bytes, zstd: ~8-20 KiB on the
    wire. The zeros come from a lazily zeroed buffer, so building it touches no memory."""
    if decoded not in _BOMBS:
        data = pa.py_buffer(bytearray(decoded))
        offs = pa.py_buffer(np.array([0, decoded], dtype=np.int32).tobytes())
        pad = pa.Array.from_buffers(pa.binary(), 1, [None, offs, data])
        t = steps_table("bomb", [0], [0], time.time_ns()).append_column("pad", pad)
        _BOMBS[decoded] = _arrow(t, "zstd")
    return _BOMBS[decoded]


def rows_bomb(rows: int = 2_000_000) -> bytes:
    if ("rows", rows) not in _BOMBS:
        t = steps_table("rowsbomb", np.zeros(rows, np.int64), np.zeros(rows, np.int64), time.time_ns())
        _BOMBS[("rows", rows)] = _arrow(t, "zstd")
    return _BOMBS[("rows", rows)]


def dictionary_bomb(rows: int = 300_000, value_bytes: int = 1 << 20) -> bytes:
    """``node`` dictionary-encoded: one 1 MiB value referenced by every row (300 GB once cast)."""
    if ("dict", rows) not in _BOMBS:
        t = steps_table("dictbomb", np.arange(rows) % 8, np.zeros(rows, np.int64), time.time_ns())
        node = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array(["n" * value_bytes]))
        t = t.set_column(t.schema.get_field_index("node"), "node", node)
        _BOMBS[("dict", rows)] = _arrow(t, "zstd")
    return _BOMBS[("dict", rows)]


# ------------------------------------------------------------------------------ the stream
CODECS = ("gzip", "snappy", "lz4", "zstd", None)


KINDS = 29     # hostile message kinds of build_stream: message i is of kind i % KINDS


def build_stream(n_bad: int, prefix: str = "h", good_jobs: int = 8, ranks: int = 64, seed: int = 1,
                 now_ns: int | None = None, bombs: bool = True) -> list[Item]:
    """``n_bad`` hostile messages of every kind, interleaved with good step data of ``good_jobs``
    jobs x ``ranks`` ranks (each job sent by a producer with one of the Kafka codecs)."""
    rng = np.random.default_rng(seed)
    now = now_ns or time.time_ns()
    jobs = [f"{prefix}-good-{j}" for j in range(good_jobs)]
    items: list[Item] = []
    # topology of the good jobs first
    for j, job in enumerate(jobs):
        topo = pa.table({"job": [job] * ranks, "rank": pa.array(np.arange(ranks, dtype=np.int32)),
                         "node": [f"node-{r // 8}" for r in range(ranks)],
                         "world_size": pa.array(np.full(ranks, ranks, np.int32))})
        items.append(Item("topology", _arrow(topo), _hdr("topology"), job.encode(), label="good-topology",
                          codec=CODECS[j % len(CODECS)]))
    step_of = {job: 0 for job in jobs}
    conflict_flip = [0]

    def good(j: int) -> Item:
        job = jobs[j]
        s = step_of[job]
        step_of[job] += 1
        t = steps_table(job, np.arange(ranks), np.full(ranks, s), now - 600_000_000_000 + s * 1_000_000_000)
        return Item("steps", _arrow(t, "lz4"), _hdr(), job.encode(), rows=_keys(t), label="good",
                    codec=CODECS[j % len(CODECS)])

    def partial(job: str, bad: pa.Table, label: str) -> Item:
        """A message of good rows of ``job`` (a fresh step) plus the bad rows."""
        s = step_of[job]
        step_of[job] += 1
        g = steps_table(job, np.arange(ranks), np.full(ranks, s), now - 600_000_000_000 + s * 1_000_000_000)
        t = pa.concat_tables([g, bad.cast(g.schema)])
        return Item("steps", _arrow(t), _hdr(), job.encode(), rows=_keys(g), dead=True, label=label)

    def extra(job: str, name: str, arr: pa.Array, label: str) -> Item:
        s = step_of[job]
        step_of[job] += 1
        g = steps_table(job, np.arange(ranks), np.full(ranks, s), now - 600_000_000_000 + s * 1_000_000_000)
        return Item("steps", _arrow(g.append_column(name, arr)), _hdr(), job.encode(), rows=_keys(g),
                    label=label)

    def bad_whole(value, headers, label, kind="steps", key=b"h-bad") -> Item:
        return Item(kind, value, headers, key, dead=True, label=label)

    t_now = now - 1_000_000_000

    def hostile(i: int) -> Item:
        job = jobs[int(rng.integers(len(jobs)))]
        k = i % KINDS
        one = lambda **kw: steps_table(job, [kw.get("rank", 0)], [kw.get("step", step_of[job])],
                                       kw.get("t_end", t_now))
        if k == 0:
            return bad_whole(bytes(rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8)), _hdr(), "garbage")
        if k == 1:
            return bad_whole(None, _hdr(), "empty value")
        if k == 2:
            return bad_whole(_arrow(one()), [("content-type", catalog.ARROW_CT.encode())], "no schema header")
        if k == 3:
            return bad_whole(_arrow(one()), [("schema", b"steps/9")], "schema version")
        if k == 4:
            return bad_whole(b'{"job": [1, 2', _hdr(ct=catalog.JSON_CT), "bad json")
        if k == 5:
            return bad_whole(b'[{"job": "x", "rank": 1e400, "step": 1}]', _hdr(ct=catalog.JSON_CT), "json inf rank")
        if k == 6:
            return bad_whole(_arrow(one())[:-40], _hdr(), "truncated arrow")
        if k == 7:
            b = one(rank=1)
            b = b.set_column(b.schema.get_field_index("step_ms"), "step_ms", pa.array([float("nan")]))
            return partial(job, b, "nan step_ms")
        if k == 8:
            b = one(rank=2).set_column(0, "job", pa.array(["../../etc/passwd"]))
            return partial(job, b, "unsafe job id")
        if k == 9:
            return partial(job, one(rank=2**31 - 1), "rank int32 max")
        if k == 10:
            t = pa.table({"job": [job], "rank": pa.array([2**31], pa.int64()), "node": ["n"], "step": [1],
                          "t_end": pa.array([t_now]).cast(wire.TS), "step_ms": [1.0]})
            return bad_whole(_arrow(t), _hdr(), "rank 2^31", key=job.encode())
        if k == 11:
            topo = pa.table({"job": [f"{prefix}-huge-{i}"], "rank": pa.array([0], pa.int32()), "node": ["n"],
                             "world_size": pa.array([10_000_000], pa.int32())})
            return bad_whole(_arrow(topo), _hdr("topology"), "world_size 10M", kind="topology")
        if k == 12:
            return partial(job, one(rank=3, step=10**12), "step 10^12")
        if k == 13:
            return partial(job, one(rank=3, step=step_of[job] + 4_000_000), "step +4M")
        if k == 14:
            return partial(job, one(rank=4, t_end=4_102_444_800 * 10**9), "t_end year 2100")
        if k == 15:
            return partial(job, one(rank=5, t_end=-86_400 * 10**9), "t_end 1969")
        if k == 16:
            u = pa.UnionArray.from_sparse(pa.array([0] * ranks, pa.int8()),
                                          [pa.array(np.arange(ranks)), pa.array(["x"] * ranks)])
            return extra(job, "u", u, "union column")
        if k == 17:
            iv = pa.array([pa.scalar((1, 2, 3), pa.month_day_nano_interval()).as_py()] * ranks,
                          pa.month_day_nano_interval())
            return extra(job, "iv", iv, "interval column")
        if k == 18:
            conflict_flip[0] += 1
            arr = pa.array(np.arange(ranks)) if conflict_flip[0] % 2 else pa.array(["s"] * ranks)
            return extra(job, "note", arr, "conflicting extra type")
        if k == 19:
            nested = pa.array([[[[[[1]]]]]] * ranks)
            return extra(job, "deep", nested, "deeply nested column")
        if k == 20:
            return bad_whole(decompression_bomb() if bombs else _arrow(one())[:10], _hdr(), "decompression bomb")
        # the 2M-row message is 11 MB on the wire, the dictionary bomb 1 MB: 20 of each are sent, then
        # small decompression bombs in their place (370 of each in 10,000 would hold 4 GB in the
        # embedded broker's memory, which is not what is being tested)
        if k == 21:
            if i // KINDS >= 20:
                return bad_whole(decompression_bomb() if bombs else b"x", _hdr(), "decompression bomb")
            return bad_whole(rows_bomb() if bombs else b"x", _hdr(), "2M-row message")
        if k == 22:
            if i // KINDS >= 20:
                return bad_whole(decompression_bomb() if bombs else b"x", _hdr(), "decompression bomb")
            return bad_whole(dictionary_bomb() if bombs else b"x", _hdr(), "dictionary bomb")
        if k == 23:
            fresh = f"{prefix}-new-{i}"
            t = steps_table(fresh, [0], [0], t_now)
            return Item("steps", _arrow(t), _hdr(), fresh.encode(), rows=_keys(t), label="made-up job id")
        if k == 24:     # a string where a number belongs: the column cannot be cast
            t = one(rank=7)
            t = t.set_column(t.schema.get_field_index("step_ms"), "step_ms", pa.array(["fast"]))
            return bad_whole(_arrow(t), _hdr(), "string step_ms", key=job.encode())
        if k == 25:
            h = pa.table({"job": [job], "node": ["n"], "t": pa.array([4_102_444_800 * 10**9]).cast(wire.TS)})
            return bad_whole(_arrow(h), _hdr("host"), "host t year 2100", kind="host", key=job.encode())
        if k == 26:
            t = one(rank=6)
            dup = pa.Table.from_arrays(t.columns + [t.column("step_ms")], names=t.column_names + ["step_ms"])
            s = step_of[job]
            step_of[job] += 1
            g = steps_table(job, np.arange(ranks), np.full(ranks, s), now - 600_000_000_000 + s * 1_000_000_000)
            g2 = pa.Table.from_arrays(g.columns + [g.column("step_ms")], names=g.column_names + ["step_ms"])
            return Item("steps", _arrow(g2), _hdr(), job.encode(), rows=_keys(g), label="duplicate column name")
        if k == 27:     # a regex '$' matches before a final newline: the id pattern must refuse 'job\n'
            return partial(job, one(rank=2).set_column(0, "job", pa.array([job + "\n"])), "job id ending in a newline")
        if k == 28:     # one topology row claiming rank 99,999 of 100,000 for a real 64-rank job
            topo = pa.table({"job": [job], "rank": pa.array([99_999], pa.int32()), "node": ["intruder"],
                             "world_size": pa.array([100_000], pa.int32())})
            return Item("topology", _arrow(topo), _hdr("topology"), job.encode(), label="rank 99,999 of 100,000")
        raise AssertionError(k)

    # interleave: about one good message per hostile one
    bad_i = 0
    while bad_i < n_bad:
        items.append(good(int(rng.integers(len(jobs)))))
        items.append(hostile(bad_i))
        bad_i += 1
    return items


def send_items(items: list[Item], settings, corrupt_batches: int = 0) -> tuple[list, dict]:
    """Send every item with a producer of its codec; ``corrupt_batches`` more records go out in
    gzip batches whose compressed bytes are garbage (the client cannot decode them). Returns
    (per item (topic, partition, offset), {label: [(topic, partition, offset)]} for the corrupt ones)."""
    from stepwatch.kafkaio import make_producer
    prods = {c: make_producer(settings, compression_type=c, linger_ms=5) for c in CODECS}
    futs = []
    for it in items:
        futs.append(prods[it.codec].send(settings.topic(it.kind), it.value, key=it.key, headers=it.headers))
    for p in prods.values():
        p.flush(60)
    where = []
    for f in futs:
        md = f.get(60)
        where.append((md.topic, md.partition, md.offset))
    for p in prods.values():
        p.close(10)
    corrupt = []
    if corrupt_batches:
        import kafka.record.default_records as dr
        orig = dr.gzip_encode
        dr.gzip_encode = lambda data: b"\x1f\x8b\x08\x00garbage"   # shorter than the data: it is sent
        try:
            p = make_producer(settings, compression_type="gzip", linger_ms=50)
            fs = [p.send(settings.topic("steps"), b"x" * 200, key=b"h-corrupt",
                         headers=_hdr()) for _ in range(corrupt_batches)]
            p.flush(60)
            corrupt = [(m.topic, m.partition, m.offset) for m in (f.get(60) for f in fs)]
            p.close(10)
        finally:
            dr.gzip_encode = orig
    return where, {"corrupt batch": corrupt}


def verify(con, items: list[Item], where: list, extra_dead: list, job_like: str) -> dict:
    """Compare the store with what the items promise. Returns figures; raises AssertionError."""
    exp = [it.rows for it in items if it.rows is not None and it.rows.num_rows]
    expected = pa.concat_tables(exp) if exp else None
    con.register("expected_rows", expected)
    n_exp = expected.num_rows
    n, uniq = con.execute(f"SELECT count(*), count(DISTINCT (job, rank, step)) FROM steps "
                          f"WHERE job LIKE '{job_like}'").fetchone()
    missing = con.execute(f"SELECT count(*) FROM expected_rows e ANTI JOIN (SELECT job, rank, step FROM steps "
                          f"WHERE job LIKE '{job_like}') s USING (job, rank, step)").fetchone()[0]
    assert missing == 0, f"{missing} good rows not stored under their job"
    assert n == uniq == n_exp, f"stored {n} rows ({uniq} distinct), expected {n_exp}"
    dead_expected = {w for it, w in zip(items, where) if it.dead} | set(extra_dead)
    got = con.execute("SELECT source_topic, source_partition, source_offset, count(*) FROM deadletter "
                      "WHERE source_topic IS NOT NULL GROUP BY ALL").fetchall()
    twice = [g for g in got if g[3] != 1]
    assert not twice, f"messages with more than one deadletter record: {twice[:5]}"
    got_set = {(t, p, o) for t, p, o, _ in got}
    topics = {w[0] for w in where}
    got_set = {g for g in got_set if g[0] in topics}
    missing_dl = dead_expected - got_set
    # records of messages the bench did not send (the agent's leg ships what it accepted from hostile
    # datagrams: the processor deadletters what breaks its bounds) are counted, not expected
    unexpected = (got_set & (set(where) | set(extra_dead))) - dead_expected
    others = len(got_set - set(where) - set(extra_dead))
    labels = {w: it.label for it, w in zip(items, where)}
    assert not missing_dl, f"bad messages without a deadletter record: {[labels.get(m, m) for m in list(missing_dl)[:10]]}"
    assert not unexpected, f"unexpected deadletter records: {[labels.get(m, m) for m in list(unexpected)[:10]]}"
    return {"good_rows": n_exp, "deadletter": len(dead_expected), "messages": len(items) + len(extra_dead),
            "other_deadletter": others}


def peak_rss_bytes(pid: int) -> int:
    """VmHWM (peak resident set) of a running process, bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _print_log_tail(path, n: int = 40) -> None:
    lines = path.read_text(errors="replace").splitlines()[-n:] if path.exists() else ["(no log)"]
    print(f"the processor's log (last {n} lines):\n  " + "\n  ".join(lines))


def run_hostile_bench(a) -> int:
    """``stepwatch bench hostile``: ``--messages`` hostile messages of every kind interleaved with
    good data (producers with each Kafka codec) through the embedded broker into ``stepwatch
    process`` (a child process); then DuckDB is asked whether every good row is stored once under
    its own job and every bad message has one deadletter record. Prints the processor's peak RSS."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from stepwatch.storage.views import connect
    from stepwatch.devtools.broker import EmbeddedBroker
    from stepwatch.kafkaio import KafkaSettings, ensure_topics

    base = Path(a.data_dir or tempfile.mkdtemp(prefix="stepwatch-hostile-"))
    base.mkdir(parents=True, exist_ok=True)
    n = a.messages
    t = time.perf_counter()
    items = build_stream(n, prefix="h")
    print(f"stepwatch bench hostile: {n:,} hostile messages ({len({i.label for i in items if i.label not in ('good', 'good-topology')})} kinds) "
          f"+ {sum(1 for i in items if i.label == 'good'):,} good ones, built in {time.perf_counter() - t:.1f}s; data in {base}")
    with EmbeddedBroker(log_path=base / "broker.log") as broker:
        s = KafkaSettings(bootstrap=broker.bootstrap, prefix="hostile.", partitions=4)
        ensure_topics(s)
        t = time.perf_counter()
        where, extra = send_items(items, s, corrupt_batches=max(3, n // 500))
        print(f"sent {len(items):,} messages + {len(extra['corrupt batch'])} records in corrupt gzip batches "
              f"in {time.perf_counter() - t:.1f}s (codecs: gzip, snappy, lz4, zstd, none)")
        cmd = [sys.executable, "-m", "stepwatch.cli", "process", "--bootstrap", broker.bootstrap, "--topic-prefix",
               s.prefix, "--data-dir", str(base), "--group", "hostile",
               "--idle-exit", str(getattr(a, "idle_exit", None) or 30),
               "--stats-json", str(base / "_stats.json")]
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(base / "_processor.log", "wb"))
        # the node agent's leg, at the same time: a real agent serving a real probe while another process
        # floods agent.sock and unverifiable commands arrive on the control topic
        import threading
        rss: dict = {}
        leg: dict = {}
        n_dg, n_ctl, n_steps = max(1000, n), max(60, n // 20), 300
        th = threading.Thread(target=lambda: leg.update(run_agent_leg(broker.bootstrap, s.prefix, base, n_dg,
                                                                      n_ctl, n_steps, rss)), daemon=True)
        th.start()
        peak, limit_s, stuck = 0, 600.0, False
        while p.poll() is None:
            try:
                peak = max(peak, peak_rss_bytes(p.pid))
            except OSError:
                pass
            if time.perf_counter() - t > limit_s:     # it exits once idle and read to the end: it is stuck
                stuck = True
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                break
            time.sleep(0.2)
        th.join(300)
        took = time.perf_counter() - t
        print(f"processor exited {p.returncode} after {took:.1f}s{' (stopped: still running after %.0f s)' % limit_s if stuck else ''}; "
              f"peak RSS {peak / 2**20:,.0f} MiB")
        print(f"agent: {leg.get('datagrams_sent', 0):,} hostile datagrams and {n_ctl:,} unverifiable commands "
              f"(+{leg.get('control_sent', n_ctl) - n_ctl} warm-up) while its probe ran {n_steps} steps; alive at the end: {leg.get('alive')} (rc {leg.get('rc')} "
              f"after SIGTERM); peak RSS {rss.get('agent', 0) / 2**20:,.0f} MiB; bad datagrams "
              f"{leg.get('bad_datagrams', 0):,.0f}; rows dropped by reason {leg.get('dropped')}; "
              f"commands refused {leg.get('control_rejected')}")
        con = connect(base)
        try:
            r = verify(con, items, where, extra["corrupt batch"], "h-%")
            got = [x[0] for x in con.execute("SELECT step FROM steps WHERE job = 'agent-h' ORDER BY step").fetchall()]
            assert got == list(range(n_steps)), f"agent-h steps stored: {len(got)} (distinct {len(set(got))}), " \
                                                f"expected 0..{n_steps - 1} once each"
            assert leg.get("alive"), f"the agent died: {leg}"
            refused = sum(v for k, v in (leg.get("control_rejected") or {}).items() if "internal_error" not in k)
            assert refused >= leg.get("control_expected", n_ctl) and not any("internal_error" in k for k in leg.get("control_rejected") or {}), \
                f"the agent's control thread did not refuse every command: {leg.get('control_rejected')}"
        except AssertionError as e:
            print(f"FAILED: {e}")
            _print_log_tail(base / "_processor.log")
            return 1
        if stuck:
            print(f"FAILED: the processor did not exit within {limit_s:.0f} s")
            _print_log_tail(base / "_processor.log")
            return 1
        print(f"OK: {r['good_rows']:,} good rows stored exactly once under their own job; "
              f"{r['deadletter']:,} bad messages each in the deadletter table once (+{r['other_deadletter']:,} records of "
              f"the agent's messages); processor alive until idle exit "
              f"(rc {p.returncode}); the agent's {n_steps} good steps stored once; agent alive, every command refused")
        st = json.loads((base / "_stats.json").read_text())
        print(f"stats: {st}")
    return 0 if p.returncode == 0 else 1


# ------------------------------------------------------------------------------ the node agent's leg
def hostile_datagrams(n: int, good_inst: int, seed: int = 16) -> list[bytes]:
    """``n`` hostile datagrams for ``agent.sock``: out-of-range hellos, deeply nested JSON, frames for
    unknown instances and for the good probe's instance (from another process), random bytes, and
    byte-level mutations of valid datagrams (:func:`stepwatch.devtools.fuzz_targets.mutate`)."""
    import json as _json
    import random

    from stepwatch.devtools.fuzz_targets import mutate
    from stepwatch.wire.datagram import HDR, HDR_STEP, MAGIC, T_BATCH, T_HELLO, VERSION

    def hello(inst, **f):
        return HDR.pack(MAGIC, VERSION, T_HELLO, inst, 0, 0, 0, 0, 0) + _json.dumps(f).encode()

    def frame(inst, rank, step):
        t = time.time_ns()
        return HDR_STEP.pack(MAGIC, VERSION, T_BATCH, inst, rank, 1, 0, 0, 0, step, t - 10_000_000, t, 10e6, 0.0,
                             10e6, 0.0, 0.0, 0.0, 0, -1, -1, -1, 0, -1.0, -1.0, -1.0, -1.0)
    fixed = [hello(1001, job="evil", rank=2**31, world_size=2**31 + 1), frame(1001, 0, 1),
             hello(1002, job="evil", rank=0, world_size=4, dp=2**40), hello(1003, job="evil", rank=5, world_size=4),
             hello(1004, job="x" * 5000, rank=0, world_size=1), hello(1005, job="evil", rank=0, world_size=4,
                                                                        node="../../etc"),
             hello(1006, job="evil", rank=0, world_size=4, names={"1": {"nested": 1}}),
             HDR.pack(MAGIC, VERSION, T_HELLO, 1007, 0, 0, 0, 0, 0) + b"[" * 60000,
             hello(good_inst, job="agent-h", rank=0, world_size=1),            # the good instance, another process
             frame(good_inst, 0, 10**12)]
    corpus = [(hello(2000 + i, job=f"agent-x{i}", rank=i, world_size=8), None) for i in range(8)] + \
             [(frame(2000 + i, i, i), None) for i in range(8)]     # (input, extra), as fuzz_targets keeps it
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = i % 20
        if k < len(fixed):
            out.append(fixed[k])
        elif k == 10:
            out.append(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 300))))
        else:
            out.append(mutate(rng.choice(corpus)[0], rng, corpus))
    return out


def bad_control_messages(n: int, seed: int = 16) -> list[bytes]:
    """``n`` control-topic messages no agent may act on: unsigned JSON (one with a non-integer rank),
    random bytes, envelopes with a zero or flipped signature, one sealed by a key nobody trusts, too large."""
    import random

    from stepwatch.agents import profiling
    from stepwatch.agents.profiling import protocol
    other = profiling.load_private_key(env={protocol.ENV_PRIVATE: protocol.keygen()[0].decode()})
    rng = random.Random(seed)
    kinds = [lambda: b'[{"cmd_id": "p", "node": "hnode", "job": "agent-h", "ranks": ["x"], "signature": "00"}]',
             lambda: b'{"node": "hnode", "ranks": [1.5], "signature": "ab"}',
             lambda: bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 400))),
             lambda: protocol.MAGIC + bytes(200),
             lambda: profiling.seal(protocol.new_command("agent-h", "hnode", [0], 2, "py-spy", "t"), other),
             lambda: protocol.MAGIC + bytes(64 << 10)]
    return [kinds[i % len(kinds)]() for i in range(n)]


def _send_datagrams_from_child(path: str, payloads: list[bytes], pace_s: float) -> "object":
    """A child process (another pid: the agent binds probe instances to processes) sends the datagrams."""
    import subprocess
    import sys
    import tempfile
    f = tempfile.NamedTemporaryFile(prefix="sw-hostile-dgrams-", delete=False)
    for p in payloads:
        f.write(struct.pack("<I", len(p)) + p)
    f.close()
    code = ("import socket, struct, sys, time\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            "d = open(sys.argv[1], 'rb').read(); i = n = 0\n"
            "while i < len(d):\n"
            "    (k,) = struct.unpack_from('<I', d, i); i += 4\n"
            "    try: s.sendto(d[i:i + k], sys.argv[2]); n += 1\n"
            "    except OSError: pass\n"
            "    i += k; time.sleep(float(sys.argv[3]))\n"
            "print(n)\n")
    return subprocess.Popen([sys.executable, "-c", code, f.name, path, str(pace_s)], stdout=subprocess.PIPE,
                            text=True)


def run_agent_leg(bootstrap: str, prefix: str, base, n_datagrams: int, n_control: int, steps: int,
                  rss: dict) -> dict:
    """A real ``stepwatch agent`` (child process, signed-command verification on) serves a real probe of
    job ``agent-h`` (``steps`` steps) while another process floods ``agent.sock`` with ``n_datagrams``
    hostile datagrams and ``n_control`` unverifiable commands go to the control topic. Returns what
    the agent counted and whether it was alive at the end; ``rss["agent"]`` gets its peak RSS."""
    import socket as _socket
    import subprocess
    import sys

    from stepwatch.agents.profiling import protocol
    sock_dir = str(base / "agent-sock")
    os.makedirs(sock_dir, exist_ok=True)
    _, pub = protocol.keygen()
    s = _socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, **{protocol.ENV_PUBLIC: pub})
    cmd = [sys.executable, "-m", "stepwatch.cli", "agent", "--bootstrap", bootstrap, "--topic-prefix", prefix,
           "--socket-dir", sock_dir, "--node", "hnode", "--interval", "0.2", "--plugins", "cpu",
           "--metrics-port", str(port), "--metrics-addr", "127.0.0.1", "--no-create-topics"]
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(base / "_agent.log", "wb"))
    try:
        return _agent_leg(agent, path_of=os.path.join(sock_dir, "agent.sock"), sock_dir=sock_dir, port=port,
                          bootstrap=bootstrap, prefix=prefix, n_datagrams=n_datagrams, n_control=n_control,
                          steps=steps, rss=rss)
    finally:
        if agent.poll() is None:          # a failure above must not leave the agent running
            agent.kill()
            agent.wait(10)


def _agent_leg(agent, path_of: str, sock_dir: str, port: int, bootstrap: str, prefix: str, n_datagrams: int,
               n_control: int, steps: int, rss: dict) -> dict:
    import subprocess
    import urllib.request

    from stepwatch.agents.probe import Probe
    from stepwatch.kafkaio import KafkaSettings, make_producer
    path = path_of
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    probe = Probe().init(job="agent-h", rank=0, world_size=1, socket_dir=sock_dir, auto=False, flush_ms=0)
    probe.begin_step()          # its hello goes out before anyone else can claim its (random) instance id
    probe.end_step()
    time.sleep(0.5)
    sender = _send_datagrams_from_child(path, hostile_datagrams(n_datagrams, probe.instance),
                                        pace_s=max(0.0, 8.0 / max(n_datagrams, 1)))
    ks = KafkaSettings(bootstrap=bootstrap, prefix=prefix)
    prod = make_producer(ks)

    def metrics() -> dict:
        try:
            txt = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            return {}
        out: dict = {}
        for line in txt.splitlines():
            if line.startswith("stepwatch_agent_") and not line.startswith("#"):
                name, _, v = line.rpartition(" ")
                out[name] = out.get(name, 0.0) + float(v)
        return out
    def refused() -> float:
        return sum(v for k, v in metrics().items() if k.startswith("stepwatch_agent_profile_commands_rejected_total"))
    # the agent's control consumer reads from the end of the topic: wait until it hears one
    warm, deadline = 0, time.monotonic() + 60
    while refused() < 1 and time.monotonic() < deadline:
        prod.send(ks.topic("control"), b"warm-up: not a command", partition=0)
        prod.flush(10)
        warm += 1
        time.sleep(0.5)
    base_refused = refused()
    for m in bad_control_messages(n_control):     # one partition: the one the consumer is known to read
        prod.send(ks.topic("control"), m, partition=0)
    prod.flush(30)
    prod.close()
    for _ in range(steps - 1):
        probe.begin_step()
        time.sleep(0.02)
        probe.end_step()
        rss["agent"] = max(rss.get("agent", 0), _rss(agent.pid))
    sent = int((sender.communicate(timeout=120)[0] or "0").strip() or 0)
    deadline = time.monotonic() + 30
    m: dict = {}
    while time.monotonic() < deadline:
        m = metrics()
        rejected = sum(v for k, v in m.items() if k.startswith("stepwatch_agent_profile_commands_rejected_total"))
        out = sum(v for k, v in m.items() if k.startswith('stepwatch_agent_records_out_total{kind="steps"'))
        if rejected >= base_refused + n_control and out >= steps:
            break
        rss["agent"] = max(rss.get("agent", 0), _rss(agent.pid))
        time.sleep(0.5)
    probe.shutdown()
    alive = agent.poll() is None
    agent.terminate()
    try:
        rc = agent.wait(30)
    except subprocess.TimeoutExpired:
        agent.kill()
        rc = agent.wait(10)
    pick = lambda pre: {k[len(pre):] or "total": v for k, v in m.items() if k.startswith(pre)}
    return {"alive": alive, "rc": rc, "datagrams_sent": sent, "control_sent": n_control + warm, "steps": steps,
            "control_expected": base_refused + n_control,
            "bad_datagrams": pick("stepwatch_agent_bad_datagrams_total").get("total", 0),
            "dropped": pick("stepwatch_agent_records_dropped_total"),
            "control_rejected": pick("stepwatch_agent_profile_commands_rejected_total"),
            "steps_out": sum(v for k, v in m.items() if k.startswith('stepwatch_agent_records_out_total{kind="steps"'))}


def _rss(pid: int) -> int:
    try:
        return peak_rss_bytes(pid)
    except OSError:
        return 0

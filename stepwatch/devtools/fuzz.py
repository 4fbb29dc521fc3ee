"""Fuzzing the boundaries with ``hypothesis`` (structured inputs): ``stepwatch bench fuzz``.

:data:`BOUNDARIES` maps a boundary's name to ``function(n, seed) -> result dict`` with at least
``tried`` (inputs run), ``crashes`` (an exception escaped, or the boundary reported an internal
error), ``hangs`` (an input took longer than ``HANG_S``) and ``examples`` (a few failing inputs,
described). Another boundary is one line: ``BOUNDARIES["agent-datagram"] = fuzz_datagram``.

``kafka-message``: Kafka records as a producer could send them — any telemetry kind, rows drawn
from hostile values (huge, negative, NaN/inf numbers, times before 1970 or in 2262, odd job ids),
unknown extra columns of every Arrow type (unions, intervals, dictionaries, nesting), Arrow with
each IPC compression or JSON, mutated bytes (truncated, flipped), odd headers — driven through the
processor's own per-message entry point (:meth:`Processor.process_message`: decode, bounds, route,
align, detectors) and flushed to a real store every ``FLUSH_EVERY`` inputs.
"""
from __future__ import annotations

import logging
import signal
import tempfile
import time
from types import SimpleNamespace

import pyarrow as pa

from stepwatch.wire import catalog
from stepwatch.wire import tables as wire
from stepwatch.wire.catalog import TELEMETRY
from stepwatch.wire.encode import encode_arrow, encode_json

HANG_S = 5.0
FLUSH_EVERY = 1000


class _Hang(Exception):
    pass


def _alarm(_sig, _frm):
    raise _Hang()


# ------------------------------------------------------------------------------ strategies
def _strategies():
    from hypothesis import strategies as st

    ints = st.one_of(st.integers(-3, 3), st.integers(0, 200), st.sampled_from(
        [2**31 - 1, 2**31, -2**31, 2**53, 10**12, 4_000_000, 2**63 - 1, -2**63, 131_072, 10_000_000]))
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 100.0, -1.0]))
    now = time.time_ns()
    times = st.one_of(st.integers(now - 10**12, now + 10**12), st.sampled_from(
        [0, -1, -86_400 * 10**9, 4_102_444_800 * 10**9, 2**63 - 1, -2**63 + 1, now]))
    jobs = st.one_of(st.sampled_from(["fz-a", "fz-b", "fz-c", "", "../x", "a" * 200, "fz-ü"]),
                     st.text(min_size=0, max_size=8))
    strs = st.one_of(st.sampled_from(["n0", "n1", ""]), st.text(max_size=12))

    def value_for(f: pa.Field):
        t = f.type
        if f.name == "job":
            return jobs
        if pa.types.is_timestamp(t):
            return times
        if pa.types.is_integer(t):
            return ints
        if pa.types.is_floating(t):
            return floats
        if pa.types.is_string(t):
            return strs
        return st.none()

    extra_types = st.sampled_from([
        pa.int64(), pa.string(), pa.float16(), pa.bool_(), pa.binary(), pa.date32(), pa.duration("s"),
        pa.month_day_nano_interval(), pa.null(), pa.list_(pa.int32()), pa.struct([("a", pa.int8())]),
        pa.dictionary(pa.int8(), pa.string()), pa.decimal128(10, 2), pa.decimal256(60, 2),
        pa.map_(pa.string(), pa.int64()), pa.large_string(), pa.string_view(), pa.timestamp("s"),
        "union", "run_end",
    ])

    def good_value(f: pa.Field, i: int):
        t = f.type
        if f.name == "job":
            return "fz-a"
        if pa.types.is_timestamp(t):
            return now - 60 * 10**9 + i * 10**9
        if f.name == "world_size":
            return 8
        if pa.types.is_integer(t):
            return i % 8
        if pa.types.is_floating(t):
            return 1.0 + i
        if pa.types.is_string(t):
            return f"n{i % 2}"
        return None

    @st.composite
    def table(draw, kind):
        """Rows of valid values, with (per column) a hostile value on one row or on every row."""
        schema = wire.SCHEMAS[kind]
        n = draw(st.integers(0, 6))
        cols, names = [], []
        for f in schema:
            mode = draw(st.integers(0, 149))
            if mode == 0:                           # missing
                continue
            vals = [good_value(f, i) for i in range(n)]
            if mode <= 6 and n:                     # one row hostile
                vals[draw(st.integers(0, n - 1))] = draw(value_for(f))
            elif mode == 7:                         # every row hostile
                v = draw(value_for(f))
                vals = [v] * n
            if mode == 8:                           # another type
                arr = pa.array([str(v) for v in vals], pa.string())
            else:
                try:
                    arr = pa.array(vals, type=pa.int64() if pa.types.is_integer(f.type) or
                                   pa.types.is_timestamp(f.type) else f.type)
                    if pa.types.is_timestamp(f.type):
                        arr = arr.cast(wire.TS)
                except (pa.ArrowInvalid, OverflowError, TypeError, pa.ArrowTypeError):
                    arr = pa.nulls(n, pa.int64())
            cols.append(arr)
            names.append(f.name)
        for k in range(draw(st.integers(0, 3))):
            t = draw(extra_types)
            name = draw(st.sampled_from(["note", "x", "date", "_received", "step_ms", "job", "9bad", "k"]))
            if t == "union":
                arr = pa.UnionArray.from_sparse(pa.array([0] * n, pa.int8()), [pa.array(range(n)), pa.array(["u"] * n)])
            elif t == "run_end":
                arr = pa.RunEndEncodedArray.from_arrays(pa.array([n] if n else [], pa.int32()),
                                                        pa.array(["r" * 10] if n else [], pa.string()))
            else:
                try:
                    arr = pa.array([None] * n, type=pa.int64()).cast(t) if pa.types.is_dictionary(t) is False and \
                        not pa.types.is_timestamp(t) else pa.nulls(n, t)
                    if pa.types.is_integer(t) or t in (pa.string(), pa.large_string()):
                        arr = pa.array([draw(ints) if pa.types.is_integer(t) else draw(strs) for _ in range(n)],
                                       pa.int64() if pa.types.is_integer(t) else pa.string()).cast(t)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OverflowError):
                    arr = pa.nulls(n, t)
            cols.append(arr)
            names.append(name)
        return pa.Table.from_arrays(cols, names=names) if cols else pa.table({})

    @st.composite
    def message(draw):
        kind = draw(st.sampled_from(list(TELEMETRY)))
        t = draw(table(kind))
        enc = draw(st.sampled_from(["lz4", "zstd", None, "json"]))
        ct = catalog.JSON_CT if enc == "json" else catalog.ARROW_CT
        try:
            if enc == "json":
                value = encode_json([{k: (v if not isinstance(v, (bytes, bytearray)) else v.hex())
                                           for k, v in r.items()} for r in t.to_pylist()])
            else:
                value = encode_arrow(t, compression=enc) if t.num_columns else b""
        except Exception:  # noqa: BLE001 - unencodable draws become bytes
            value = draw(st.binary(max_size=64))
        mut = draw(st.integers(0, 11))
        if mut == 1 and value:
            value = value[:draw(st.integers(0, len(value)))]
        elif mut == 2 and value:
            i = draw(st.integers(0, len(value) - 1))
            value = value[:i] + bytes([value[i] ^ draw(st.integers(1, 255))]) + value[i + 1:]
        elif mut == 3:
            value = draw(st.binary(max_size=256))
        hsel = draw(st.integers(0, 19))
        hkind = {1: "alerts", 2: "nope"}.get(hsel, kind)
        ver = "2" if hsel == 3 else "1"
        ctv = {4: "text/plain", 5: "\udcff"}.get(hsel, ct)
        headers = [("content-type", ctv.encode("utf-8", "surrogateescape")), ("schema", f"{hkind}/{ver}".encode())]
        if hsel == 6:
            headers = headers[:draw(st.integers(0, 1))]
        key = draw(st.one_of(st.none(), st.sampled_from([b"fz-a", b"fz-b", b"\xff\xfe", b"x" * 300])))
        if draw(st.integers(0, 30)) == 0:
            value = None
        return kind, value, headers, key

    return message()


# ------------------------------------------------------------------------------ kafka-message
def fuzz_kafka_message(n: int, seed: int = 0, hang_s: float = HANG_S, progress=None) -> dict:
    """``n`` hypothesis-drawn Kafka records through decode + bounds + route + flush."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from stepwatch.stream.ingress_limits import IngressLimits
    from stepwatch.kafkaio import KafkaSettings
    from stepwatch.stream.processor import Processor

    quiet = logging.getLogger("stepwatch")              # the code under test logs its refusals; the level
    level = quiet.level                                 # is put back after (a caller in the same process,
    quiet.setLevel(logging.CRITICAL)                    # a test suite, lost every stepwatch warning after)
    data = tempfile.mkdtemp(prefix="stepwatch-fuzz-")
    proc = Processor(KafkaSettings(prefix="fz."), data, create_topics=False, profiling=None,
                     on_alert=lambda a: None,
                     limits=IngressLimits(max_rows_per_message=10_000, max_decoded_bytes=16 << 20, max_jobs=200))
    proc.store.fsync = False
    from stepwatch.stream.processor import _build_detectors
    _build_detectors(None)                 # import the detectors' libraries before the clock runs
    topics = {k: proc.kafka.topic(k) for k in TELEMETRY}
    res = {"boundary": "kafka-message", "tried": 0, "crashes": 0, "hangs": 0, "deadletter": 0, "stored_rows": 0,
           "flushes": 0, "examples": [], "reasons": {}, "kinds": {}, "slowest_s": 0.0}
    internal = ("internal error",)

    def note(kind: str, what: str) -> None:
        if len(res["examples"]) < 5:
            res["examples"].append(f"{kind}: {what[:300]}")
            if progress:
                print(f"\n    crash: {kind}: {what[:300]}", flush=True)

    def flush():
        try:
            proc._flush()
            res["flushes"] += 1
        except Exception as e:  # noqa: BLE001
            res["crashes"] += 1
            note("flush", repr(e))
            proc.lake.drop()

    old = signal.signal(signal.SIGALRM, _alarm)
    off = [0]

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(_strategies())
    def one(m):
        kind, value, headers, key = m
        off[0] += 1
        msg = SimpleNamespace(topic=topics[kind], partition=0, offset=off[0], key=key, value=value,
                              headers=headers, timestamp=0)
        before_dl = len(proc.lake.buffers.get("deadletter", ()))
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, hang_s)
        try:
            proc.process_message(msg)
        except _Hang:
            res["hangs"] += 1
            note("hang", f"{kind} {len(value or b'')} bytes")
        except Exception as e:  # noqa: BLE001 - process_message must never raise
            res["crashes"] += 1
            note("raised", repr(e))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        dt = time.perf_counter() - t0
        res["slowest_s"] = max(res["slowest_s"], dt)
        res["tried"] += 1
        res["kinds"][kind] = res["kinds"].get(kind, 0) + 1
        dls = proc.lake.buffers.get("deadletter", [])[before_dl:]
        if len(dls) > 1:
            res["crashes"] += 1
            note("two deadletter records", str([d.column("reason")[0] for d in dls]))
        for d in dls:
            res["deadletter"] += 1
            r = d.column("reason")[0].as_py()
            why = r.split(":")[0][:40]
            res["reasons"][why] = res["reasons"].get(why, 0) + 1
            if r.startswith(internal):
                res["crashes"] += 1
                note("internal error", r)
        if res["tried"] % FLUSH_EVERY == 0:
            res["stored_rows"] += sum(t.num_rows for t in proc.lake.buffers.get("steps", []))
            flush()
            if progress:
                progress(res)

    t_start = time.perf_counter()
    try:
        one()
        res["stored_rows"] += sum(t.num_rows for t in proc.lake.buffers.get("steps", []))
        flush()
    finally:
        signal.signal(signal.SIGALRM, old)
        quiet.setLevel(level)
        import shutil
        shutil.rmtree(data, ignore_errors=True)
    res["seconds"] = time.perf_counter() - t_start
    res["columns_dropped"] = proc.metrics.value(proc.metrics.columns_dropped)
    res["rows_rejected"] = proc.metrics.value(proc.metrics.rows_rejected)
    return res


#: boundary name -> function(n, seed) -> {"tried", "crashes", "hangs", "examples", ...}
BOUNDARIES = {
    "kafka-message": fuzz_kafka_message,
}
try:        # the node's boundaries (agent datagram decode, control verify): stepwatch.devtools.fuzz_targets
    from stepwatch.devtools.fuzz_targets import fuzz_control, fuzz_datagram
    BOUNDARIES["agent-datagram"] = fuzz_datagram
    BOUNDARIES["control-verify"] = fuzz_control
except ImportError:  # pragma: no cover - an older agents package
    pass
from stepwatch.devtools.fuzz_config import fuzz_config  # noqa: E402 - the processor's configuration loader

BOUNDARIES["config-file"] = fuzz_config


def run_fuzz(a) -> int:
    """``stepwatch bench fuzz``: every boundary (or ``--boundary``), ``--inputs`` each."""
    names = [a.boundary] if getattr(a, "boundary", None) else list(BOUNDARIES)
    n = a.inputs
    print(f"stepwatch bench fuzz: {n:,} inputs per boundary, seed {a.seed}, hang = over {HANG_S:g} s per input")
    bad = 0
    for name in names:
        t = time.perf_counter()

        def progress(r, name=name, t=t):
            print(f"\r  {name}: {r['tried']:,} tried, {r['crashes']} crashes, {r['hangs']} hangs "
                  f"({time.perf_counter() - t:.0f}s)", end="", flush=True)
        r = BOUNDARIES[name](n, a.seed, progress=progress) if name == "kafka-message" else BOUNDARIES[name](n, a.seed)
        print("\r", end="")
        extra = {k: v for k, v in r.items() if k not in ("boundary", "tried", "crashes", "hangs", "examples")}
        print(f"  {name}: tried {r['tried']:,}  crashes {r['crashes']}  hangs {r['hangs']}  "
              f"({time.perf_counter() - t:.0f}s) {extra}")
        for ex in r.get("examples", []):
            print(f"    e.g. {ex}")
        bad += r["crashes"] + r["hangs"]
    return 1 if bad else 0

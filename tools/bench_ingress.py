"""CPU cost of the processor's per-message path (ingress, alignment, detectors) apart from the store.

``python tools/bench_ingress.py`` (a tool of the repository, not part of the package; run by another
checkout's interpreter, it compares two versions on the same machine): the ``stepwatch bench ingest`` throughput job
(``--ranks`` x ``--steps``, 4,096-row Arrow messages, as :func:`stepwatch.devtools.simsend.send_simulation`
encodes them) is encoded in memory, then fed to one :class:`Processor` through
``process_message`` (the entry point ``poll_once`` calls for each Kafka record), flushing to a fresh
local store every ``--flush-rows`` buffered rows. Process CPU (user+sys, all threads) is measured
separately for the messages and for the flushes, so a slower store cannot hide or fake a change of
the ingress; on a shared machine CPU seconds are the figure to compare, not wall time.

Prints one JSON line: cpu_msg_s, cpu_flush_s, rows, and CPU seconds per million step rows.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from types import SimpleNamespace


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def encode_job(ranks: int, steps: int, rows_per_message: int = 4096, chunk: int = 4) -> list:
    """The records ``send_simulation`` would produce, in order, as consumer-record look-alikes."""
    try:
        from stepwatch.devtools.simsend import send_simulation
        from stepwatch.devtools.simulate import Simulation
    except ImportError:                      # a checkout from before stepwatch.devtools (run to compare)
        from stepwatch.agents.simsend import send_simulation
        from stepwatch.agents.simulate import Simulation
    from stepwatch.kafkaio import KafkaSettings

    out: list = []
    offsets: dict[str, int] = {}

    class _Fut:                 # a delivered send (what send_simulation checks of kafka-python's futures)
        is_done, exception = True, None

        def get(self, timeout=None):
            return None

        def failed(self):
            return False

    class _Producer:
        def send(self, topic, value, key=None, headers=None):
            off = offsets.get(topic, 0)
            offsets[topic] = off + 1
            out.append(SimpleNamespace(topic=topic, partition=0, offset=off, key=key, value=value,
                                       headers=list(headers or []), timestamp=0))
            return _Fut()

        def flush(self, timeout=None):
            pass

    s = KafkaSettings(bootstrap="127.0.0.1:1", prefix="tput.", partitions=4)
    sim = Simulation(job="bench-tput", ranks=ranks, steps=steps, seed=1)
    send_simulation(sim, _Producer(), s, chunk=chunk, rows_per_message=rows_per_message)
    return out


#: what ``--parts`` times (module or class attribute, in CPU seconds; absent ones are skipped)
PARTS = ("stepwatch.wire.decode:decode", "stepwatch.wire.decode:_read_arrow", "stepwatch.wire.decode:validate",
         "stepwatch.stream.ingress_sizes:check_arrow_sizes", "stepwatch.stream.ingress:row_bounds",
         "stepwatch.stream.stepaxis:time_base", "stepwatch.stream.stepaxis:StepAxisGate.admit",
         "stepwatch.stream.align:JobState.ingest", "stepwatch.stream.processor:Processor._detect",
         "stepwatch.stream.processor:Processor._tick", "stepwatch.stream.processor:Processor._context",
         "stepwatch.stream.processor:Processor._buffer", "stepwatch.stream.emitter:AlertEmitter.settle",
         "stepwatch.stream.intake:Intake.prepare")


def _wrap_parts(spent: dict) -> None:
    import importlib
    for name in PARTS:
        mod, attr = name.split(":")
        try:
            obj = importlib.import_module(mod)
        except ImportError:                    # an older checkout without the module
            continue
        *owner, fn = attr.split(".")
        for o in owner:
            obj = getattr(obj, o)
        f = getattr(obj, fn, None)
        if f is None:
            continue
        spent[name] = 0.0

        def timed(*args, _f=f, _k=name, **kw):
            c = _cpu()
            try:
                return _f(*args, **kw)
            finally:
                spent[_k] += _cpu() - c
        setattr(obj, fn, timed)


def run(a) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from stepwatch.kafkaio import KafkaSettings
    from stepwatch.stream.processor import Processor, _build_detectors

    spent: dict = {}
    if a.parts:
        _wrap_parts(spent)
    msgs = encode_job(a.ranks, a.steps, a.rows_per_message)
    topo = [m for m in msgs if m.topic.endswith("topology")]
    rest = [m for m in msgs if not m.topic.endswith("topology")]
    d = tempfile.mkdtemp(prefix="stepwatch-bench-ingress-")
    p = Processor(KafkaSettings(bootstrap="127.0.0.1:1", prefix="tput."), d, group="bench", profiling=None)
    _build_detectors(p.detector_settings)    # as Processor.start(): detector libraries imported up front
    prof = None
    if a.profile:
        import cProfile
        prof = cProfile.Profile(time.process_time)
    cpu_msg = cpu_flush = 0.0
    wall0 = time.perf_counter()
    for m in topo + rest:
        c = _cpu()
        if prof:
            prof.enable()
        p.process_message(m)
        if prof:
            prof.disable()
        cpu_msg += _cpu() - c
        if p.lake.rows >= a.flush_rows:
            c = _cpu()
            p._flush()
            cpu_flush += _cpu() - c
    c = _cpu()
    p._flush()
    cpu_flush += _cpu() - c
    wall = time.perf_counter() - wall0
    rows = p.metrics.value(p.metrics.records_out, "steps")
    res = {"python": sys.executable, "rows_steps": rows, "rows_all": p.metrics.value(p.metrics.records_out),
           "messages": len(msgs), "cpu_msg_s": round(cpu_msg, 3), "cpu_flush_s": round(cpu_flush, 3),
           "cpu_msg_s_per_M": round(cpu_msg / rows * 1e6, 3), "cpu_flush_s_per_M": round(cpu_flush / rows * 1e6, 3),
           "cpu_total_s_per_M": round((cpu_msg + cpu_flush) / rows * 1e6, 3), "wall_s": round(wall, 2),
           "rows_per_cpu_s": round(rows / (cpu_msg + cpu_flush)), "deadletter": p.metrics.value(p.metrics.dropped, "deadletter")}
    if spent:
        res["parts_s_per_M"] = {k.split(":")[1]: round(v / rows * 1e6, 3) for k, v in spent.items()}
    if prof:
        import pstats
        prof.dump_stats(a.profile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rows-per-message", type=int, default=4096)
    ap.add_argument("--flush-rows", type=int, default=250_000,
                    help="flush when this many rows are buffered (the bench's 1 s flush at ~250k rows/s)")
    ap.add_argument("--profile", default=None, help="write a cProfile of the message path here")
    ap.add_argument("--parts", action="store_true", help="CPU seconds per million step rows of each part (PARTS)")
    a = ap.parse_args(argv)
    print(json.dumps(run(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

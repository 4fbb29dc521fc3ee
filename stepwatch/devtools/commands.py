"""``stepwatch demo``, ``stepwatch broker`` and ``stepwatch simulate``: the development tools' commands as
plug-ins of the ``stepwatch`` command.

Each ``register_*`` adds one command to the CLI's subparsers; pyproject.toml declares them, with
:func:`stepwatch.devtools.evalcli.register` (``eval``) and :func:`stepwatch.devtools.benchcli.register`
(``bench``), in the entry-point group ``stepwatch.commands`` (one entry point per command, named by it).
``stepwatch.cli`` finds them there and loads one only for its own command or for ``stepwatch --help``:
the product never imports this package (the import-linter contract "Product vs tools" has no exception).
"""
from __future__ import annotations

import signal
import sys
import threading
import time


# ---------------------------------------------------------------------------- broker
def cmd_broker(a) -> int:
    from stepwatch.devtools.broker import EmbeddedBroker
    b = EmbeddedBroker(port=a.port, cluster_id=a.cluster_id, log_path=a.log).start()
    print(f"broker ready: bootstrap {b.bootstrap} (cluster id {b.cluster_id}, pid {b.proc.pid}); Ctrl-C stops it",
          flush=True)
    stop = threading.Event()
    # Ctrl-C and SIGTERM stop it even where the parent left SIGINT ignored or blocked (a shell's background
    # job, a supervisor, a test runner): a handler of its own overrides an inherited SIG_IGN
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.is_set() and b.alive():
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        b.stop()
    print("broker stopped", flush=True)
    return 0


def register_broker(sub) -> None:
    b = sub.add_parser("broker", help="run the embedded Kafka-protocol broker (Tansu) on 127.0.0.1")
    b.add_argument("--port", type=int, default=None, help="default: a free port")
    b.add_argument("--cluster-id", default=None)
    b.add_argument("--log", default=None, help="write the broker's output to this file")
    b.set_defaults(func=cmd_broker)


# ---------------------------------------------------------------------------- simulate
def cmd_simulate(a) -> int:
    from stepwatch.devtools.simsend import send_simulation
    from stepwatch.devtools.simulate import Simulation
    from stepwatch.kafkaio import ensure_topics, make_producer, settings_from_args
    s = settings_from_args(a)
    try:
        sim = Simulation(job=a.job, ranks=a.ranks, ranks_per_node=a.ranks_per_node, steps=a.steps,
                         step_ms=a.step_ms, faults=a.fault or (), seed=a.seed, pp=a.pp)
    except ValueError as e:
        print(f"stepwatch simulate: {e}", file=sys.stderr)
        return 2
    ensure_topics(s)
    if a.labels:
        sim.write_labels(a.labels)
        print(f"labels written to {a.labels}")
    prod = make_producer(s)
    t0 = time.monotonic()

    def progress(step, sent):
        print(f"\rstep {step}/{sim.steps}  rows sent {sent['steps']:,}  "
              f"({sent['steps'] / max(time.monotonic() - t0, 1e-9):,.0f} rows/s)", end="", file=sys.stderr)
    sent = send_simulation(sim, prod, s, pace=a.pace, rows_per_message=a.rows_per_message, on_chunk=progress)
    prod.close()
    print(f"\nsent {sent} to {s.bootstrap} in {time.monotonic() - t0:.1f}s")
    return 0


def register_simulate(sub) -> None:
    from stepwatch.kafkaio import add_kafka_args
    s = sub.add_parser("simulate", help="send a simulated cluster's telemetry to Kafka")
    add_kafka_args(s)
    s.add_argument("--job", default="sim")
    s.add_argument("--ranks", type=int, default=1024)
    s.add_argument("--ranks-per-node", type=int, default=8)
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--step-ms", type=float, default=1000.0)
    s.add_argument("--pp", type=int, default=1, help="pipeline stages")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--fault", action="append", metavar="SPEC",
                   help="e.g. slow-rank:rank=17,pct=30,start=100[,every=3] | regression:start=200,pct=20,cause=io | "
                        "gc-storm:rank=3,start=50 | gc-jitter:start=50 | data-stall:start=50 | "
                        "cpu-contention:rank=9,start=40 | comm-slow:rank=9,start=40 | rank-hang:rank=5,start=80 | "
                        "job-hang:start=80 | clean (repeatable)")
    s.add_argument("--labels", help="write the ground truth (JSON) here")
    s.add_argument("--pace", action="store_true", help="send each step at its t_end (live), not as fast as possible")
    s.add_argument("--rows-per-message", type=int, default=4096)
    s.set_defaults(func=cmd_simulate)


# ---------------------------------------------------------------------------- demo
def cmd_demo(a) -> int:
    if a.real:
        from stepwatch.devtools.demo import run_real_demo
        return run_real_demo(ranks=a.ranks or 4, steps=a.steps or 200, slow_rank=2 if a.slow_rank is None else a.slow_rank,
                             gc_rank=1 if a.gc_rank is None else a.gc_rank,
                             data_dir=a.data_dir or "./stepwatch-data/demo-real")
    if a.gc_rank is not None:
        raise SystemExit("stepwatch demo: --gc-rank needs --real (the simulated job injects a slow rank and a regression)")
    from stepwatch.devtools.demo import run_demo
    return run_demo(ranks=a.ranks or 1024, steps=a.steps or 300, data_dir=a.data_dir or "./stepwatch-data/demo",
                    slow_rank=613 if a.slow_rank is None else a.slow_rank, regression_step=a.regression_step,
                    seed=a.seed)


def register_demo(sub) -> None:
    d = sub.add_parser("demo", help="broker + simulated job + processor on this machine, then a post-mortem")
    d.add_argument("--real", action="store_true",
                   help="real PyTorch training instead of the simulation: gloo ranks on CPU under `stepwatch wrap`, "
                        "a node agent, the broker and the processor (needs torch)")
    d.add_argument("--ranks", type=int, default=None, help="default 1024 simulated, 4 real")
    d.add_argument("--steps", type=int, default=None, help="default 300 simulated, 200 real (~50 ms each)")
    d.add_argument("--slow-rank", type=int, default=None,
                   help="rank made slow (simulated: from step 80, default 613; real: 20 ms more per step, default 2; "
                        "-1: none)")
    d.add_argument("--gc-rank", type=int, default=None,
                   help="real: rank that collects a large heap every step, in a second run (default 1; -1: no such run)")
    d.add_argument("--regression-step", type=int, default=200, help="simulated: step where the job-wide regression starts")
    d.add_argument("--seed", type=int, default=7)
    d.add_argument("--data-dir", default=None, help="default ./stepwatch-data/demo (or demo-real)")
    d.set_defaults(func=cmd_demo)

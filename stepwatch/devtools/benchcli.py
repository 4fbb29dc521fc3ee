"""``stepwatch bench <name>``: one subcommand per benchmark, each with its own options only.

A benchmark's module loads only when it runs; the parser imports only
:mod:`stepwatch.devtools.bench_overhead` and :mod:`stepwatch.devtools.bench_profiling`, whose options
are defined beside their benchmarks. An option that is not the chosen benchmark's is refused by that
benchmark's parser, which says which benchmarks take it (:func:`refuse`: ``stepwatch.cli.main`` calls the
namespace's ``on_unrecognized``). :func:`register` is the ``bench`` entry point of the group
``stepwatch.commands`` (pyproject.toml)."""
from __future__ import annotations

import argparse
import importlib


def _opt(p: argparse.ArgumentParser, *names: str, help: str, **kw) -> argparse.Action:
    """An option whose help ends with its default (none for flags and for options without one)."""
    d = kw.get("default")
    if d is not None and d is not False and kw.get("action") != "store_true":
        help += " (default %(default)s)"
    return p.add_argument(*names, help=help, **kw)


def _call(module: str, fn: str):
    def run(a) -> int:
        return getattr(importlib.import_module(module), fn)(a)
    return run


def _hostile(a) -> int:
    from stepwatch.devtools.hostile import run_hostile_bench
    from stepwatch.devtools.hostile_jobs import run_jobs_bench
    return (run_jobs_bench if a.kind == "jobs" else run_hostile_bench)(a)


def _fuzz(a) -> int:
    from stepwatch.devtools.fuzz import BOUNDARIES, run_fuzz
    if a.boundary is not None and a.boundary not in BOUNDARIES:
        raise SystemExit(f"stepwatch bench fuzz: --boundary {a.boundary!r} is not a boundary; "
                         f"one of: {', '.join(BOUNDARIES)}")
    return run_fuzz(a)


def _data_dir(p: argparse.ArgumentParser) -> None:
    _opt(p, "--data-dir", default=None, help="where the bench writes its broker log and store (default: a "
                                             "temporary folder)")


#: name -> (one line for ``stepwatch bench --help``, the paragraph a bench's ``--help`` opens with)
BENCHES = {
    "ingest": ("step rows/s into the store, end-to-end lag, a burst",
               "A simulated job pre-produced to the embedded broker, then consumed by one `stepwatch process` "
               "pinned to one core (step rows/s); a job sent live at 1 step/s (step end -> queryable in "
               "DuckDB, p50/p95/max); one flush holding --burst-jobs new jobs."),
    "query": ("every canned query timed over an hour of a big job",
              "Writes --seconds steps (1 step/s) of a --ranks job into a DuckLake store (reused when there), "
              "then times every canned query cold, warm and in a new process; prints bytes per step row."),
    "scale": ("one big job live through one processor: kept up?",
              "Sends a --ranks job live for --seconds through the embedded broker to one `stepwatch process` "
              "pinned to one core; reports step end -> queryable, consumer lag, the processor's RSS and CPU, "
              "and whether it kept up."),
    "detectors": ("every detector's ms per step on one core",
                  "All registered detectors fed a simulated job (a straggler and a regression, comm rows) in "
                  "blocks of 1 and 4 steps on one core; mean, p99 and max ms per step per detector. Exits 1 "
                  "when the mean of all detectors is over 50 ms per step."),
    "changepoint": ("change-point finders' F1 on labelled series",
                    "find() with its defaults and variants, ruptures' binseg and PELT, on --series series of "
                    "each family (steptime, trend, seasonal, ar1, smooth): F1 with a 5-point margin, cover."),
    "overhead": ("probe µs per step; the node agent's CPU %% and RSS",
                 "The probe's cost per training step (real PyTorch loops, interleaved blocks) and the node "
                 "agent's CPU and RSS serving --agent-ranks probes (needs torch for the probe part)."),
    "profiling": ("targeted profiling: alert -> trace latency",
                  "Real gloo ranks of tests/profile_train.py under a node agent, a processor with profiling "
                  "on: latency from the alert to the trace and the diff, step times before, during, after."),
    "gpu": ("GPU check: MFU FLOPs, wrap overhead, spooled jobs",
            "GPT-2-124M-shaped runs plain/wrapped/plain/wrapped (overhead, FLOPs counted vs 6N + 12LHQT) and "
            "three ddp_train jobs under wrap, one node agent spooling (a GPU machine has no broker): the spool "
            "comes back as <out>/spool.tgz for `stepwatch eval --real --spool`. Without CUDA: tiny shapes on "
            "the CPU, nothing judged."),
    "fuzz": ("fuzzed inputs per boundary: crashes and hangs",
             "Every boundary (or --boundary) fed --inputs generated inputs; any crash or hang is a failure."),
    "hostile": ("hostile Kafka messages; many job ids at the cap",
                "--kind messages: --messages hostile messages of every kind among good data, through the "
                "embedded broker into `stepwatch process`; every good row stored once, every bad one "
                "dead-lettered. --kind jobs: the ingest rate with --jobs job ids (past max_jobs) vs "
                "--baseline-jobs."),
}


def _add(sub, name: str, func, options: dict) -> argparse.ArgumentParser:
    line, desc = BENCHES[name]
    p = sub.add_parser(name, help=line, description=desc)
    p.set_defaults(func=func, bench_parser=p, bench_options=options, on_unrecognized=refuse)
    return p


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``stepwatch bench`` and its benchmarks to the CLI's subparsers (the entry point ``bench`` of the group
    ``stepwatch.commands``)."""
    be = subparsers.add_parser("bench", help="benchmarks that print figures (stepwatch bench --help lists them)",
                               description="Benchmarks that print figures; each has its own options "
                                           "(stepwatch bench NAME --help).")
    sub = be.add_subparsers(dest="benchmark", title="benchmarks")
    be.set_defaults(func=lambda a: (be.print_help(), 2)[1], bench_parser=be, on_unrecognized=refuse)
    owners: dict[str, set[str]] = {}        # bench -> its option strings (for the error on another's option)

    p = _add(sub, "ingest", _call("stepwatch.devtools.bench", "run_bench"), owners)
    _opt(p, "--ranks", type=int, default=16384, help="ranks of the simulated job")
    _opt(p, "--steps", type=int, default=60, help="steps pre-produced for the throughput run")
    _opt(p, "--lag-seconds", type=int, default=30, help="length of the live (1 step/s) lag run")
    _opt(p, "--rows-per-message", type=int, default=4096, help="step rows per Kafka message")
    _opt(p, "--burst-jobs", type=int, default=1000, help="new jobs in the one-flush burst")
    _data_dir(p)

    p = _add(sub, "query", _call("stepwatch.devtools.bench", "run_query_bench"), owners)
    _opt(p, "--ranks", type=int, default=16384, help="ranks of the stored job")
    _opt(p, "--seconds", type=int, default=3600, help="steps (1 step/s) to generate")
    _data_dir(p)

    p = _add(sub, "scale", _call("stepwatch.devtools.bench_scale", "run_scale_bench"), owners)
    _opt(p, "--ranks", type=int, default=16384, help="ranks of the live job")
    _opt(p, "--seconds", type=int, default=300, help="seconds of the live job (one step each)")
    _opt(p, "--drain", type=float, default=60.0,
         help="seconds to wait, after the last step was sent, for every step to be queryable")
    _opt(p, "--rows-per-message", type=int, default=4096, help="rows per Kafka message")
    _opt(p, "--json", default=None, help="also write the figures here (JSON)")
    _data_dir(p)

    p = _add(sub, "detectors", _call("stepwatch.devtools.eval", "run_detector_bench"), owners)
    _opt(p, "--ranks", type=int, default=16384, help="ranks of the simulated job")
    _opt(p, "--steps", dest="bench_steps", type=int, default=200, help="steps of the simulated job")

    p = _add(sub, "changepoint", _call("stepwatch.devtools.bench", "run_changepoint_bench"), owners)
    _opt(p, "--series", dest="cp_series", type=int, default=48, help="generated series per family (>= 2)")
    _opt(p, "--seed", dest="cp_seed", type=int, default=2024, help="seed of the generated series")

    from stepwatch.devtools.bench_overhead import add_overhead_args
    p = _add(sub, "overhead", _call("stepwatch.devtools.bench_overhead", "run_overhead_bench"), owners)
    add_overhead_args(p)

    from stepwatch.devtools.bench_profiling import add_profiling_args
    p = _add(sub, "profiling", _call("stepwatch.devtools.bench_profiling", "run_profiling_bench"), owners)
    add_profiling_args(p)
    _data_dir(p)

    from stepwatch.devtools.bench_gpu import add_gpu_args
    p = _add(sub, "gpu", _call("stepwatch.devtools.bench_gpu", "run_gpu_bench"), owners)
    add_gpu_args(p)

    p = _add(sub, "fuzz", _fuzz, owners)
    _opt(p, "--inputs", type=int, default=100_000, help="inputs per boundary")
    _opt(p, "--seed", type=int, default=0, help="hypothesis seed")
    _opt(p, "--boundary", default=None,
         help="only this boundary (stepwatch.devtools.fuzz.BOUNDARIES; default: every one)")

    p = _add(sub, "hostile", _hostile, owners)
    _opt(p, "--kind", choices=["messages", "jobs"], default="messages",
         help="malformed messages, or many job ids (ingest rate at max_jobs vs below it)")
    _opt(p, "--messages", type=int, default=10_000, help="--kind messages: malformed/hostile messages to send")
    _opt(p, "--idle-exit", type=float, default=30.0,
         help="the processor exits after this long without a new message (s)")
    _opt(p, "--jobs", type=int, default=20_000, help="--kind jobs: job ids of the run at the cap")
    _opt(p, "--baseline-jobs", type=int, default=1000, help="--kind jobs: job ids of the baseline run")
    _opt(p, "--job-rounds", type=int, default=3,
         help="--kind jobs: messages per job id of --jobs (both runs send this many in all)")
    _opt(p, "--max-jobs", type=int, default=None,
         help="--kind jobs: the processor's max_jobs (default: its default, 10,000)")
    _data_dir(p)
    for name, bp in sub.choices.items():
        owners[name] = options_of(bp)
    return be


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for act in parser._actions for s in act.option_strings}


def refuse(a: argparse.Namespace, extra: list[str]) -> None:
    """Arguments the chosen bench does not take: its own parser's error (exits 2), saying :func:`unknown`."""
    a.bench_parser.error(unknown(a, extra))


def unknown(a: argparse.Namespace, extra: list[str]) -> str:
    """The error for arguments a bench does not take: names them, and which benchmarks take each."""
    msg = f"unrecognized arguments: {' '.join(extra)}"
    owners = getattr(a, "bench_options", None) or {}
    what = getattr(a, "benchmark", None)
    hints = []
    for word in extra:
        name = word.split("=", 1)[0]
        takes = [b for b, opts in owners.items() if name.startswith("-") and name in opts]
        if what in takes:                   # `stepwatch bench --ranks 5 ingest`: given before the name
            hints.append(f"{name} goes after the benchmark's name: stepwatch bench {what} {name} ...")
        elif takes:
            hints.append(f"{name} is an option of {', '.join('bench ' + b for b in takes)}")
    return (msg + (f" ({'; '.join(hints)})" if hints else "")
            + (f"; `stepwatch bench {what} --help` lists its own options" if what else ""))

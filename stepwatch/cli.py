"""``stepwatch`` — one console command with subcommands.

    stepwatch demo                     broker + simulated 1,024-rank job + processor, alerts, post-mortem
    stepwatch broker                   run the embedded Kafka-protocol broker (Tansu) on loopback
    stepwatch simulate                 send a simulated cluster's telemetry to Kafka (faults + labels)
    stepwatch process                  the stream processor (consumer group -> Parquet, alerts)
    stepwatch sql "SELECT …"           DuckDB over the Parquet store
    stepwatch bench NAME               benchmarks, one subcommand each with its own options (stepwatch bench --help):
                                       ingest, query, scale, detectors, changepoint, overhead, profiling, fuzz, hostile
    stepwatch eval                     the labelled scenario suite through the processor: recall, precision, delay
    stepwatch report --job J           HTML post-mortem; stepwatch compact: compaction and retention
    stepwatch grafana provision|export dashboards, DuckDB datasource, alert rules (idempotent)
    stepwatch agent                    node agent: probes' records + host metrics -> Kafka (spools offline)
    stepwatch wrap -- CMD …            run a training command with every rank instrumented (zero-code)
    stepwatch act serve|undo|log       opt-in Alertmanager webhook: drain/cordon a node that keeps failing
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from stepwatch import __version__
from stepwatch.storage import DEFAULT_DATA      # the store's default root (also `stepwatch profile`'s)


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("kafka").setLevel(max(level, logging.ERROR))


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


# ---------------------------------------------------------------------------- process
def cmd_process(a) -> int:
    from stepwatch.kafkaio import settings_from_args
    from stepwatch.stream.processor import Processor
    from stepwatch.dashboards.grafana_cmd import annotation_sink_from_args
    from stepwatch.dashboards.grafana import GrafanaError
    from stepwatch import config as swconfig
    from stepwatch.configfile import ConfigError
    from stepwatch.dashboards.alertmanager import AlertmanagerError, sink_from_args as am_sink_from_args
    from stepwatch.stream.alertfanout import attach
    from stepwatch.stream.jobmetrics import configure_from_args
    s = settings_from_args(a)
    from stepwatch.stream.ingress import limits_from_pairs
    try:
        limits = limits_from_pairs(a.limit)
    except ValueError as e:
        print(f"stepwatch process: {e}", file=sys.stderr)
        return 2
    cfg_path = a.config or os.environ.get("STEPWATCH_CONFIG") or None
    try:
        cfg = swconfig.load(cfg_path) if cfg_path else None
    except ConfigError as e:
        print(f"stepwatch process: {e}", file=sys.stderr)
        return 2
    from stepwatch.stream.profiling import settings_from_env
    p = Processor(s, a.data_dir, group=a.group, detector_settings=cfg, limits=limits,
                  profiling=cfg.profiling_settings(settings_from_env()) if cfg else "env",
                  **swconfig.processor_kwargs(cfg, a))
    configure_from_args(p.job_metrics, a)
    try:
        sink = annotation_sink_from_args(a, registry=p.metrics.registry)   # None without --grafana-url
        am = am_sink_from_args(a, registry=p.metrics.registry)             # None without --alertmanager
    except (GrafanaError, AlertmanagerError) as e:
        print(f"stepwatch process: {e}", file=sys.stderr)
        return 2
    # every alert to the console, Grafana and Alertmanager (sinks never block; they retry in the background)
    attach(p, [sink, am], echo=lambda al: print(al.line(), flush=True))
    if a.metrics_port:
        p.metrics.serve(a.metrics_port, a.metrics_addr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    last = [0.0]
    hup = threading.Event()
    watch = swconfig.FileWatch(cfg_path) if cfg_path else None
    if cfg_path:                      # SIGHUP or a changed file: reload between messages (stepwatch.config)
        signal.signal(signal.SIGHUP, lambda *_: hup.set())

    def tick(proc):
        if hup.is_set() or (watch is not None and watch.changed()):
            hup.clear()
            swconfig.reload(proc, cfg_path)
        if a.quiet or time.monotonic() - last[0] < 5:
            return
        last[0] = time.monotonic()
        st = proc.stats()
        print(f"rows in {st['rows_in']:,.0f} stored {st['rows_out']:,.0f} deadletter {st['deadletter']:,.0f} "
              f"duplicates {st['duplicates']:,.0f} alerts {st['alerts']} lag {st['lag']}", file=sys.stderr, flush=True)
    print(f"processing {s.bootstrap} -> {os.path.abspath(a.data_dir)} (group {a.group}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    try:
        p.run(stop, idle_exit_s=a.idle_exit, on_tick=tick)
    finally:
        if sink:
            sink.close(10)
        if am:
            am.close(10)
    st = p.stats()
    if a.stats_json:
        import json
        with open(a.stats_json, "w", encoding="utf-8") as f:
            json.dump(st, f)
    print(f"stopped: {st}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- sql
def cmd_sql(a) -> int:
    import duckdb

    from stepwatch.storage.store import LakeStore
    from stepwatch.storage.views import connect, query, view_sql
    if a.print_views:
        print(view_sql(a.data_dir))
        return 0
    if a.list:
        from stepwatch.storage.queries import QUERIES
        for q in QUERIES.values():
            params = " ".join(f"--{p.replace('t_', '')}" for p in q.params if p != "job")
            print(f"{q.name:<18} --job J {params}\n    {q.description}\n")
        return 0
    if a.run:
        from stepwatch.storage import queries
        LakeStore(a.data_dir).init()
        if not a.job:
            print("stepwatch sql --run: give --job", file=sys.stderr)
            return 2
        try:
            cols, rows = queries.run(connect(a.data_dir), a.run, job=a.job, t_from=a.t_from, t_to=a.t_to,
                                     step=a.step, window=a.window, minutes=a.minutes)
        except (ValueError, duckdb.Error) as e:
            print(f"stepwatch sql: {e}", file=sys.stderr)
            return 1 if isinstance(e, duckdb.Error) else 2
        _print_rows(a.format, cols, rows)
        return 0
    if not a.query:
        print("stepwatch sql: give a query, e.g. stepwatch sql \"SELECT * FROM job_steps LIMIT 5\"",
              file=sys.stderr)
        return 2
    LakeStore(a.data_dir).init()
    try:
        cols, rows = query(connect(a.data_dir), a.query)      # (retried across a compaction swap)
    except duckdb.Error as e:
        print(f"stepwatch sql: {e}", file=sys.stderr)
        return 1
    _print_rows(a.format, cols, rows)
    return 0


def _print_rows(fmt: str, cols, rows) -> None:
    if fmt == "csv":
        import csv
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(rows)
    elif fmt == "json":
        import json
        print(json.dumps([dict(zip(cols, r)) for r in rows], default=str, indent=1))
    else:
        from stepwatch.storage.queries import format_table
        print(format_table(cols, rows))
        print(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")


# ---------------------------------------------------------------------------- report
def cmd_report(a) -> int:
    from stepwatch.report import build
    t = time.monotonic()
    try:
        r = build(a.data_dir, a.job, a.t_from, a.t_to)
    except ValueError as e:
        print(f"stepwatch report: {e}", file=sys.stderr)
        return 2
    out = a.out or f"stepwatch-report-{a.job}.html"
    with open(out, "w", encoding="utf-8") as f:
        f.write(r.html)
    print(r.summary)
    print(f"\nreport: {os.path.abspath(out)} ({len(r.html) / 1e6:.1f} MB, {time.monotonic() - t:.1f}s)")
    return 0


# ---------------------------------------------------------------------------- compact
def cmd_compact(a) -> int:
    from stepwatch.storage import compact
    from stepwatch.storage.store import LakeStore
    LakeStore(a.data_dir).recover()
    while True:
        t = time.monotonic()
        r = compact.run(a.data_dir, target_mb=a.target_mb, min_age_s=a.min_age, retention_days=a.retention_days,
                        grace_s=a.grace)
        print(f"compacted {r.partitions} partitions: {r.files_in} files ({r.bytes_in / 1e6:.1f} MB) -> "
              f"{r.files_out} ({r.bytes_out / 1e6:.1f} MB), {r.rows:,} rows; expired {len(r.expired)} partitions"
              f" in {time.monotonic() - t:.1f}s", flush=True)
        for x in r.expired:
            print(f"  expired {x}")
        for x in r.skipped:
            print(f"  skipped {x}")
        if not a.every:
            return 0
        time.sleep(a.every)


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


# ---------------------------------------------------------------------------- parser
#: commands served by stepwatch.devtools (the development tools): their modules load only for these
DEVTOOLS = ("demo", "broker", "simulate", "bench", "eval")


#: the node agent: it runs beside the job on every training node, so its command line is the agents' own
#: (agents/commands.py), not the whole one, which loads every command's modules -- the processor's DuckDB lake,
#: the Grafana client, ``pyarrow.compute`` through the wire decoder: ~55 MB of the agent's RSS
#: (docs/agents.md, agent cost; tests/test_agent_footprint.py)
AGENT_CMDS = ("agent",)


def _top_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    p = argparse.ArgumentParser(prog="stepwatch", description="Streaming telemetry for large training clusters.")
    p.add_argument("--version", action="version", version=f"stepwatch {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    return p, p.add_subparsers(dest="cmd", metavar="COMMAND")


def build_agent_parser() -> argparse.ArgumentParser:
    """The command line of ``stepwatch agent``: the same options as in :func:`build_parser`, and the
    agent's subcommand only (agents/commands.py ``register``: not ``act``, ``wrap``, ``slurm``, whose modules
    the agent does not need)."""
    from stepwatch.agents.commands import prepare_agent_process, register
    prepare_agent_process()
    p, sub = _top_parser()
    register(sub, AGENT_CMDS)
    return p


def build_parser(devtools: bool = True) -> argparse.ArgumentParser:
    """``devtools=False``: leave out the arguments that stepwatch.devtools defines (a product command)."""
    from stepwatch.kafkaio import add_kafka_args
    p, sub = _top_parser()

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

    b = sub.add_parser("broker", help="run the embedded Kafka-protocol broker (Tansu) on 127.0.0.1")
    b.add_argument("--port", type=int, default=None, help="default: a free port")
    b.add_argument("--cluster-id", default=None)
    b.add_argument("--log", default=None, help="write the broker's output to this file")
    b.set_defaults(func=cmd_broker)

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

    pr = sub.add_parser("process", help="run the stream processor")
    add_kafka_args(pr)
    pr.add_argument("--data-dir", default=DEFAULT_DATA)
    pr.add_argument("--group", default="stepwatch-processor")
    from stepwatch.stream.processor_settings import PROCESSOR as proc_settings     # stdlib only: the declarations
    ps = {st.name: st for st in proc_settings}
    for flag, name in (("--flush-interval", "flush_interval_s"), ("--lateness", "lateness_s")):
        pr.add_argument(flag, type=float, default=None, help=f"{ps[name].meaning} ({ps[name].default:g}; "
                        f"wins over [processor] {name})")
    pr.add_argument("--config", default=None, help="configuration file (TOML; default $STEPWATCH_CONFIG): detector "
                    "settings, limits, profiling policy; reloaded on SIGHUP (docs/configuration.md)")
    pr.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    pr.add_argument("--metrics-addr", default="127.0.0.1")
    pr.add_argument("--idle-exit", type=float, default=None,
                    help="exit after this many seconds without a message, once every assigned partition is read to its end")
    pr.add_argument("-q", "--quiet", action="store_true")
    pr.add_argument("--stats-json", default=None, help="write final counters here on exit")
    pr.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                    help="an ingress bound, repeatable, e.g. max_ranks=262144 (docs/limits.md lists them)")
    from stepwatch.dashboards.grafana_cmd import add_annotation_args, register as register_grafana
    add_annotation_args(pr)
    from stepwatch.dashboards.alertmanager import add_args as add_alertmanager_args
    from stepwatch.stream.jobmetrics import add_args as add_job_metrics_args
    add_alertmanager_args(pr)
    add_job_metrics_args(pr)
    register_grafana(sub)
    from stepwatch.agents.commands import register as register_agents
    register_agents(sub)
    if devtools:
        from stepwatch.devtools.evalcli import register as register_eval
        register_eval(sub)
    from stepwatch.stream.profiling_cli import register as register_profile
    register_profile(sub)
    from stepwatch.config import register as register_config
    register_config(sub)
    pr.set_defaults(func=cmd_process)

    q = sub.add_parser("sql", help="run SQL over the Parquet store (DuckDB views)")
    q.add_argument("query", nargs="?")
    q.add_argument("--data-dir", default=DEFAULT_DATA)
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.add_argument("--print-views", action="store_true", help="print the view definitions (Grafana initSql)")
    q.add_argument("--list", action="store_true", help="list the canned post-mortem queries")
    q.add_argument("--run", metavar="NAME", help="run a canned query (see --list)")
    q.add_argument("--job")
    q.add_argument("--from", dest="t_from", help="start time, e.g. '2026-11-21 10:00:00+00'")
    q.add_argument("--to", dest="t_to")
    q.add_argument("--step", type=int, help="before_after: the step to compare around")
    q.add_argument("--window", type=int, default=None, help="before_after: steps on each side (30)")
    q.add_argument("--minutes", type=int, default=None, help="host_contention: minutes around each alert (5)")

    rp = sub.add_parser("report", help="self-contained HTML post-mortem of a job + a terminal summary")
    rp.add_argument("--job", required=True)
    rp.add_argument("--data-dir", default=DEFAULT_DATA)
    rp.add_argument("--from", dest="t_from")
    rp.add_argument("--to", dest="t_to")
    rp.add_argument("--out", help="HTML file (default stepwatch-report-<job>.html)")
    rp.set_defaults(func=cmd_report)

    c = sub.add_parser("compact", help="merge small Parquet files, expire old partitions")
    c.add_argument("--data-dir", default=DEFAULT_DATA)
    c.add_argument("--target-mb", type=float, default=256, help="size of a compacted file")
    c.add_argument("--min-age", type=float, default=30, help="only merge files older than this (s)")
    c.add_argument("--retention-days", type=float, default=None, help="remove date partitions older than this")
    c.add_argument("--grace", type=float, default=300, help="keep replaced files this long for running queries (s)")
    c.add_argument("--every", type=float, default=None, help="repeat every N seconds (a maintenance loop)")
    c.set_defaults(func=cmd_compact)
    q.set_defaults(func=cmd_sql)

    if devtools:
        from stepwatch.devtools.benchcli import register as register_bench
        register_bench(sub)          # `stepwatch bench NAME`: one subcommand per benchmark, its own options
    return p


def main(argv: list[str] | None = None) -> int:
    from stepwatch import extras             # (a command whose extra is not installed: say which one)
    args = sys.argv[1:] if argv is None else list(argv)
    cmd = next((x for x in args if not x.startswith("-")), None)
    words = [x for x in args if not x.startswith("-")]
    if words[:2] == ["bench", "gpu"]:        # a GPU machine's image: torch and the agent's packages, no DuckDB
        from stepwatch.devtools.bench_gpu import main as gpu_main
        return gpu_main(args[args.index("gpu") + 1:])
    try:
        if cmd in AGENT_CMDS:
            p = build_agent_parser()
        else:
            p = build_parser(devtools=cmd is None or cmd in DEVTOOLS)   # a product command loads no devtools module
    except ModuleNotFoundError as e:
        if not extras.is_missing_extra(e):
            raise
        return extras.without_parser(e, argv)
    a, extra = p.parse_known_args(argv)
    if extra:                                # as parse_args, but said by the bench's own parser
        bench = getattr(a, "bench_parser", None)
        if bench is None:
            p.error(f"unrecognized arguments: {' '.join(extra)}")
        from stepwatch.devtools.benchcli import unknown
        bench.error(unknown(a, extra))
    _setup_logging(a.verbose)
    if not getattr(a, "func", None):
        p.print_help()
        return 2
    try:
        return a.func(a) or 0
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as e:
        if not extras.is_missing_extra(e):
            raise
        print(extras.message(a.cmd, e), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

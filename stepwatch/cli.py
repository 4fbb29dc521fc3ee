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

demo, broker, simulate, bench and eval are the development tools' (stepwatch.devtools): plug-ins found through
the entry-point group ``stepwatch.commands`` (:data:`PLUGIN_GROUP`), loaded only for their own command.
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
    from stepwatch.stream.ingress_limits import limits_from_pairs
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


# ---------------------------------------------------------------------------- parser
#: the entry-point group of the command plug-ins. One entry point per command, named by it, whose object is
#: ``register(subparsers)``: it adds the command (its options, ``set_defaults(func=...)``; optionally
#: ``on_unrecognized=f``, called as ``f(namespace, extra)`` with the arguments the command's parser did not
#: take). pyproject.toml declares the development tools' (stepwatch.devtools: demo, broker, simulate, eval,
#: bench); this module imports none of them, so no product command can load one.
PLUGIN_GROUP = "stepwatch.commands"


def command_plugins() -> dict:
    """The installed command plug-ins, command name -> ``importlib.metadata.EntryPoint`` (metadata only:
    nothing is imported until :func:`register_plugins` loads one)."""
    from importlib.metadata import entry_points
    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}


class PluginMissing(Exception):
    """A plug-in's entry point is declared but its module is not installed."""

    def __init__(self, command: str, module: str):
        super().__init__(command, module)
        self.command, self.module = command, module


def register_plugins(sub, eps) -> None:
    """Load each entry point of ``eps`` and let it add its command to ``sub``."""
    for ep in eps:
        try:
            register = ep.load()
        except ModuleNotFoundError as e:
            if e.name and (ep.module == e.name or ep.module.startswith(e.name + ".")):
                raise PluginMissing(ep.name, ep.module) from e
            raise
        register(sub)


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


def build_plugin_parser(eps) -> argparse.ArgumentParser:
    """The command line of a plug-in's command (``eps``: its entry point): that command only, so it loads
    none of the product commands' modules (``stepwatch bench gpu`` runs on a GPU machine's training image,
    which has torch and the agent's packages but no DuckDB)."""
    p, sub = _top_parser()
    register_plugins(sub, eps)
    return p


def build_parser(plugins=None) -> argparse.ArgumentParser:
    """Every product command, and the plug-ins' (:data:`PLUGIN_GROUP`) of ``plugins`` (entry points; None:
    every installed one; empty: none, as for a product command, which so loads no plug-in's module)."""
    p, sub = _product_parser()
    register_plugins(sub, command_plugins().values() if plugins is None else plugins)   # (listed after the product's)
    return p


def _product_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    from stepwatch.kafkaio import add_kafka_args
    p, sub = _top_parser()

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
    return p, sub


def main(argv: list[str] | None = None) -> int:
    from stepwatch import extras             # (a command whose extra is not installed: say which one)
    args = sys.argv[1:] if argv is None else list(argv)
    cmd = next((x for x in args if not x.startswith("-")), None)
    try:
        if cmd in AGENT_CMDS:
            p = build_agent_parser()
        else:
            found = command_plugins()
            if cmd in found:
                p = build_plugin_parser([found[cmd]])
            elif cmd in extras.PLUGIN_COMMANDS:
                print(extras.missing_plugin(cmd), file=sys.stderr)
                return 1
            else:                            # a product command loads no plug-in's module
                p, sub = _product_parser()
                if cmd is None or cmd not in sub.choices:   # --help, or no such command: list the plug-ins' too
                    register_plugins(sub, found.values())
    except PluginMissing as e:
        print(extras.missing_plugin(e.command, e.module), file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        if not extras.is_missing_extra(e):
            raise
        return extras.without_parser(e, argv)
    a, extra = p.parse_known_args(argv)
    if extra:                                # as parse_args, or as the command's own parser says it
        getattr(a, "on_unrecognized", lambda *_: None)(a, extra)
        p.error(f"unrecognized arguments: {' '.join(extra)}")
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

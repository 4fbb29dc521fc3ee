"""Subcommands of the agents package: ``stepwatch agent``, ``stepwatch wrap`` and ``stepwatch slurm``.

``stepwatch/cli.py`` adds them with ``register(sub)`` (``sub`` = its ``add_subparsers()`` object).
``python -m stepwatch.agents.commands agent|wrap …`` runs them on their own.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading


def systemd_unit(name: str, exe: str | None = None) -> str:
    """The hardened systemd unit ``stepwatch-<name>.service`` shipped in the package (agents/deploy), its
    ``ExecStart`` pointing at ``exe`` (default: this installation's ``stepwatch``)."""
    from importlib.resources import files
    if name not in ("agent", "processor"):
        raise ValueError(f"--print-systemd-unit: {name!r} is not agent or processor")
    text = files("stepwatch.agents").joinpath("deploy", f"stepwatch-{name}.service").read_text()
    import shutil
    here = os.path.join(os.path.dirname(sys.executable), "stepwatch")       # this environment's, else PATH's
    exe = exe or (here if os.access(here, os.X_OK) else shutil.which("stepwatch")) or "/usr/local/bin/stepwatch"
    return text.replace("/usr/local/bin/stepwatch", exe)


def prepare_agent_process() -> None:
    """Called in the agent's process before numpy loads (the variable is read once, as the library
    loads; an operator's own setting is kept):

    - ``OPENBLAS_NUM_THREADS=1``: numpy's OpenBLAS starts a thread per core as numpy loads (up to 64 on a
      training node); the agent multiplies no matrices.

    The agent loads no pyarrow (its Arrow writer is nanoarrow, :mod:`stepwatch.wire.lite`), so Arrow's
    memory pools and CPU thread pool are not its concern."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


#: compression codecs that kafka-python (``kafka.codec``) and prometheus_client (``exposition``, for pushes
#: to a Pushgateway) import at load when they are installed
OPTIONAL_CODECS = ("snappy", "zstandard", "lz4")


def skip_unused_codecs(a) -> list[str]:
    """Leave out the optional compression codecs where this agent uses none, before the libraries load;
    returns the modules left out.

    The agent's producer compresses its record batches with LZ4 (``lz4``: its Arrow IPC buffers are not
    compressed, nanoarrow's writer does not), it pushes no metrics, and it reads from Kafka only with
    profiling on (its control channel: the codec of that topic's batches is not the agent's to choose).
    So without profiling (``--no-kafka``, ``--no-profiling``, or no ``STEPWATCH_PROFILING_PUBLIC_KEY[_FILE]``)
    ``snappy`` (cramjam) and ``zstandard`` are marked absent, and ``lz4`` too with ``--no-kafka``
    (``sys.modules[name] = None``, which makes their import raise ``ImportError``; both libraries then
    treat the codec as not installed): ~1.4 MB of the agent's resident set (docs/agents.md, agent cost).
    A module already loaded is kept."""
    from stepwatch.agents.profiling.protocol import ENV_PUBLIC, ENV_PUBLIC_FILE
    profiling = (not a.no_kafka and not a.no_profiling
                 and bool(os.environ.get(ENV_PUBLIC) or os.environ.get(ENV_PUBLIC_FILE)))
    if profiling:
        return []
    skipped = [m for m in OPTIONAL_CODECS if m not in sys.modules and (m != "lz4" or a.no_kafka)]
    for m in skipped:
        sys.modules[m] = None
    return skipped


def cmd_agent(a) -> int:
    if a.print_systemd_unit:
        try:
            print(systemd_unit(a.print_systemd_unit), end="")
        except ValueError as e:
            print(f"stepwatch agent: {e}", file=sys.stderr)
            return 2
        return 0
    skip_unused_codecs(a)
    from stepwatch.agents.agent import Agent
    from stepwatch.kafkaio import settings_from_args
    s = None if a.no_kafka else settings_from_args(a)
    from stepwatch.agents.socket_trust import IngressLimits
    try:
        mode = int(a.socket_mode, 8)
    except ValueError:
        print(f"stepwatch agent: --socket-mode {a.socket_mode!r} is not an octal mode", file=sys.stderr)
        return 2
    limits = IngressLimits(max_world_size=a.max_world_size, max_queue_bytes=int(a.max_queue_mb * (1 << 20)),
                           allow_uids=frozenset(a.allow_uid) if a.allow_uid else None,
                           allow_gids=frozenset(a.allow_gid) if a.allow_gid else None,
                           job_binding=a.job_binding)
    agent = Agent(s, socket_dir=a.socket_dir, node=a.node, job=a.job, interval_s=a.interval,
                  spool_dir=a.spool_dir, spool_max_bytes=int(a.spool_max_mb * (1 << 20)),
                  plugins=[p for p in a.plugins.split(",") if p] if a.plugins else None,
                  create_topics=not a.no_create_topics, socket_mode=mode, socket_group=a.socket_group,
                  limits=limits)
    from stepwatch.agents.profiling import load_public_keys
    from stepwatch.agents.profiling.protocol import KeyError_
    try:
        keys = None if a.no_kafka or a.no_profiling else load_public_keys()
    except KeyError_ as e:
        print(f"stepwatch agent: {e}", file=sys.stderr)
        return 1
    if keys is not None:     # signed profiling commands for this node (docs/profiling.md)
        agent.enable_profiling(keys, a.profile_dir, cooldown_s=a.profile_cooldown, max_steps=a.profile_max_steps,
                               keep_mb=a.profile_keep_mb)
    try:
        agent.start()
    except (RuntimeError, OSError) as e:
        print(f"stepwatch agent: {e}", file=sys.stderr)
        return 1
    if a.metrics_port:
        agent.metrics.serve(a.metrics_port, a.metrics_addr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"agent serving {agent.path} (node {agent.node}) -> "
          f"{s.bootstrap if s else 'nowhere (--no-kafka: rows are counted, not kept)'}; Ctrl-C stops", file=sys.stderr, flush=True)
    agent.run(stop)
    print(f"agent stopped: {agent.stats()}", file=sys.stderr)
    return 0


def cmd_wrap(a) -> int:
    from stepwatch.agents.wrap import run_wrap
    return run_wrap(a)


def add_agent_args(p: argparse.ArgumentParser) -> None:
    from stepwatch.kafkaio import add_kafka_args
    add_kafka_args(p)
    p.add_argument("--socket-dir", default=None,
                   help="where to create agent.sock (env STEPWATCH_SOCKET_DIR; default /run/stepwatch when it "
                        "exists, else /tmp/stepwatch)")
    p.add_argument("--node", default=None, help="node name on every row (env STEPWATCH_NODE or NODE_NAME; "
                                                "default: host name)")
    p.add_argument("--job", default=os.environ.get("STEPWATCH_JOB"),
                   help="job of ranks that name none, and of host rows while no rank is connected")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between host samples and batches")
    p.add_argument("--spool-dir", default=os.environ.get("STEPWATCH_SPOOL_DIR"),
                   help="where batches wait while Kafka is unreachable (default <socket-dir>/spool)")
    p.add_argument("--spool-max-mb", type=float, default=256.0, help="spool bound; the oldest files go first")
    p.add_argument("--plugins", default=None,
                   help="comma-separated host plug-ins (default all: cpu,load,mem,disk,net,procs,rdma,npu,nvidia)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-addr", default="127.0.0.1")
    p.add_argument("--no-create-topics", action="store_true", help="do not create missing Kafka topics")
    p.add_argument("--no-kafka", action="store_true", help="receive, decode and count only; send nothing (tests, benchmarks)")
    p.add_argument("--print-systemd-unit", metavar="agent|processor", default=None,
                   help="print the hardened systemd unit of the agent or the processor (docs/baremetal.md) and exit")
    t = p.add_argument_group("who may send (docs/limits.md)")
    t.add_argument("--socket-mode", default=os.environ.get("STEPWATCH_SOCKET_MODE", "0660"),
                   help="mode of agent.sock (octal; default 0660: the agent's user and group)")
    t.add_argument("--socket-group", default=os.environ.get("STEPWATCH_SOCKET_GROUP"),
                   help="group (name or gid) of agent.sock and of the ctl directory; default the agent's group")
    t.add_argument("--allow-uid", type=int, action="append", help="only these sender uids (repeat; root always)")
    t.add_argument("--allow-gid", type=int, action="append", help="only these sender gids (repeat; root always)")
    t.add_argument("--job-binding", choices=("cgroup", "uid", "none"),
                   default=os.environ.get("STEPWATCH_JOB_BINDING", "cgroup"),
                   help="who owns a job on this node once its first hello is served: cgroup (default: the sender's "
                        "uid and pod, Slurm job or cgroup), uid, none; a job token (STEPWATCH_JOB_TOKEN in the "
                        "training pods) overrides it")
    t.add_argument("--max-world-size", type=int, default=1 << 20, help="largest world size a hello may declare")
    t.add_argument("--max-queue-mb", type=float, default=64.0,
                   help="received datagrams waiting to be decoded, at most (beyond: dropped, counted)")
    g = p.add_argument_group("targeted profiling (on when STEPWATCH_PROFILING_PUBLIC_KEY[_FILE] holds the public key)")
    g.add_argument("--profile-dir", default=os.environ.get("STEPWATCH_PROFILE_DIR"),
                   help="the trace directory the probes are configured with (their STEPWATCH_PROFILE_DIR), kept "
                        "within --profile-keep-mb; default <socket-dir>/profiles")
    g.add_argument("--profile-cooldown", type=float, default=60.0,
                   help="seconds after an accepted command during which this node refuses new ones")
    g.add_argument("--profile-max-steps", type=int, default=200, help="longest profile accepted, in steps")
    g.add_argument("--profile-keep-mb", type=float, default=0.0,
                   help="delete the oldest traces in --profile-dir beyond this many MiB (checked at start and "
                        "after each profile; for a per-node directory); 0 keeps everything")
    g.add_argument("--no-profiling", action="store_true", help="ignore profiling commands even with a key")


#: the agents' subcommands, in the order ``stepwatch --help`` lists them
COMMANDS = ("agent", "wrap", "slurm", "act")


def register(sub, commands: tuple[str, ...] = COMMANDS) -> None:
    """Add ``commands`` (default all: ``agent``, ``wrap``, ``slurm`` and ``act``) to a ``stepwatch``
    subparsers object. Each command's own module is imported only when it is added: ``stepwatch agent``
    adds the agent alone, so the node agent does not load ``act`` (sqlite3, the webhook's HTTP server),
    ``wrap`` or ``slurm`` (~1.1 MB of its RSS, docs/agents.md, agent cost)."""
    for name in commands:
        if name not in COMMANDS:
            raise ValueError(f"register: command {name!r} is not one of {', '.join(COMMANDS)}")
    if "agent" in commands:
        ag = sub.add_parser("agent", help="node agent: receive the probes' records, sample the host, batch to Kafka")
        add_agent_args(ag)
        ag.set_defaults(func=cmd_agent)
    if "wrap" in commands:
        from stepwatch.agents.wrap import add_wrap_args
        w = sub.add_parser("wrap", help="run a command with its Python processes instrumented (zero-code probe)")
        add_wrap_args(w)
        w.set_defaults(func=cmd_wrap)
    if "slurm" in commands:
        from stepwatch.agents.slurm import add_slurm_args, cmd_slurm
        sl = sub.add_parser("slurm", help="Slurm prolog/epilog: tell this node's agent a job started or ended")
        add_slurm_args(sl)
        sl.set_defaults(func=cmd_slurm)
    if "act" in commands:
        from stepwatch.agents.act import add_act_args
        ac = sub.add_parser("act", help="opt-in: drain (Slurm) or cordon (k8s) a node that keeps failing, from "
                            "Alertmanager's webhook (dry run unless --execute)")
        add_act_args(ac)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if next((x for x in args if not x.startswith("-")), None) == "agent":
        prepare_agent_process()
    p = argparse.ArgumentParser(prog="stepwatch")
    p.add_argument("-v", "--verbose", action="count", default=0)
    cmd = next((x for x in args if not x.startswith("-")), None)
    register(p.add_subparsers(dest="cmd", metavar="COMMAND"), ("agent",) if cmd == "agent" else COMMANDS)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * a.verbose,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    if not getattr(a, "func", None):
        p.print_help()
        return 2
    return a.func(a) or 0


if __name__ == "__main__":
    sys.exit(main())

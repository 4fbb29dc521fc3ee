"""The node agent (``stepwatch agent``): one per training node.

Lifecycle: :meth:`Agent.start` binds ``<socket_dir>/agent.sock`` (``AF_UNIX``, ``SOCK_DGRAM``; a stale
file left by a dead agent is replaced, a live agent is refused) and starts a receiver thread that only
moves datagrams into a bounded in-memory queue. Every ``interval_s`` (1 s) :meth:`Agent.tick` decodes
the queued datagrams (:mod:`stepwatch.wire.columns`, :func:`stepwatch.wire.datagram.decode`; a bad one is counted and skipped, never
fatal), samples the host through the plug-ins of :mod:`stepwatch.agents.hostmetrics`, and hands one
Arrow table per (kind, job) to the :class:`~stepwatch.agents.shipper.Shipper`: ``topology`` first,
then ``steps``, ``gc``, ``comm`` and ``host``, each keyed by job with the ``schema`` headers of
``stepwatch.wire.encode``. When Kafka is unreachable the shipper spools to a bounded directory and replays
in order when it returns. :meth:`Agent.close` does a last tick and removes the socket file.

Identity. A probe introduces itself with a *hello* datagram (job, rank, world size, device, the table of
interned op/group/phase names) and repeats it every 10-20 s, so a restarted agent learns its ranks again.
Records of a probe instance the agent has not heard a hello from yet are held (bounded, 30 s) and
then dropped and counted. The socket is 0660 in the agent's group; each datagram carries its sender's
pid/uid/gid (``SO_PASSCRED``), a hello is range-checked and binds its instance to that process, and
another process cannot speak for it; a job belongs on this node to the first sender (uid and pod, Slurm job or
cgroup; or a job token) whose hello names it, and others' hellos for it are refused while it is live
(:mod:`stepwatch.agents.socket_trust`, docs/limits.md). Rows carry the node name the probe gave (``STEPWATCH_NODE``), else the
agent's ``--node`` (in Kubernetes: the node name from the downward API), and the job the probe gave,
else the agent's ``--job``, else ``default``.

Self-metrics (Prometheus, ``--metrics-port`` on 127.0.0.1): records in/out/spooled by kind, dropped by
reason (``bad_datagram``, ``no_identity``, ``queue_full``, ``spool_full`` ...), send latency, spool size,
Kafka up, ranks served, datagrams the probes themselves dropped, per-plug-in runs and timings.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stepwatch import __version__
from stepwatch.wire import catalog
from stepwatch.wire import datagram
from stepwatch.wire import columns
from stepwatch.wire import lite    # the Arrow writer: nanoarrow, no pyarrow nor its ~42 MB (docs/agents.md)
from stepwatch.wire.lite import Batch
from stepwatch.agents.hostmetrics import PluginRunner, build_runners, sample
from stepwatch.agents.inflight import Liveness, RateBound, row_from_probe
from stepwatch.agents.profiling.protocol import safe_job   # one copy: the probe and the control channel use it too
from stepwatch.agents.socket_trust import (IngressLimits, Peer, ScopeCache, check_hello, describe_owner, enable_passcred,
                                      owner_of, pid_alive, recv_with_peer, resolve_group)
from stepwatch.agents.shipper import Shipper, Spool
from stepwatch.metrics import Metrics

log = logging.getLogger("stepwatch.agent")

_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
KINDS = catalog.INPUT_TOPICS
ACTIVE_S = 60.0          # a probe heard from within this many seconds is a served rank
PENDING_S = 30.0         # records of an unknown probe instance wait this long for its hello
PENDING_MAX = 256        # ... and at most this many datagrams per instance


class AgentMetrics(Metrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.datagrams = Counter("stepwatch_agent_datagrams_in", "Datagrams received from probes", registry=r)
        self.records_in = Counter("stepwatch_agent_records_in", "Rows received from probes or sampled", ["kind"],
                                  registry=r)
        self.records_out = Counter("stepwatch_agent_records_out", "Rows acknowledged by Kafka", ["kind"], registry=r)
        self.records_spooled = Counter("stepwatch_agent_records_spooled", "Rows written to the local spool",
                                       ["kind"], registry=r)
        self.dropped = Counter("stepwatch_agent_records_dropped", "Rows or datagrams dropped", ["reason"],
                               registry=r)
        self.bad_datagrams = Counter("stepwatch_agent_bad_datagrams", "Datagrams that could not be decoded",
                                     registry=r)
        self.send_seconds = Histogram("stepwatch_agent_send_seconds", "Send + acknowledgement time per batch",
                                      buckets=_FAST, registry=r)
        self.tick_seconds = Histogram("stepwatch_agent_tick_seconds", "Work per tick (decode, sample, ship)",
                                      buckets=_FAST, registry=r)
        self.spool_bytes = Gauge("stepwatch_agent_spool_bytes", "Bytes in the local spool", registry=r)
        self.spool_files = Gauge("stepwatch_agent_spool_files", "Files in the local spool", registry=r)
        self.kafka_up = Gauge("stepwatch_agent_kafka_up", "1 when the last send reached Kafka", registry=r)
        self.ranks = Gauge("stepwatch_agent_ranks", "Probes heard from in the last minute", registry=r)
        self.probe_dropped = Gauge("stepwatch_agent_probe_dropped_datagrams",
                                   "Datagrams the served probes report they dropped (sum of their counters)",
                                   registry=r)
        self.plugin_runs = Counter("stepwatch_agent_plugin_runs", "Host plug-in runs by result", ["plugin", "result"],
                                   registry=r)
        self.plugin_seconds = Histogram("stepwatch_agent_plugin_seconds", "Host plug-in gather time", ["plugin"],
                                        buckets=_FAST, registry=r)


@dataclass
class Identity:
    """What a probe's hello said, plus when the agent last heard from that probe."""

    job: str
    rank: int
    world_size: int
    node: str
    names: dict[int, str]
    hello: dict
    t_seen: float = 0.0
    dropped: int = 0                  # the probe's own drop counter, from its last step record
    peer: Peer | None = None          # the process whose hello this is (SCM_CREDENTIALS)
    owner: str | None = None          # who owns the job through this instance (ingress.owner_of)
    token: str | None = None          # the hello's job token (only compared; never stored in rows nor logged)

    def topology_row(self) -> dict:
        h = self.hello
        row = {"job": self.job, "rank": self.rank, "node": self.node, "world_size": self.world_size,
               "framework": h.get("framework"), "agent_version": f"stepwatch-{__version__}"}
        for k in ("device", "device_type", "dtype", "flops_source"):
            if isinstance(h.get(k), str):
                row[k] = h[k]
        for k in ("dp", "tp", "pp", "ep", "cp", "slurm_job", "slurm_step"):
            if isinstance(h.get(k), int) and not isinstance(h.get(k), bool):
                row[k] = h[k]
        for k in ("model_flops_per_token", "model_flops_per_sample"):
            if isinstance(h.get(k), (int, float)) and not isinstance(h.get(k), bool):
                row[k] = float(h[k])
        if isinstance(h.get("model_params"), int) and not isinstance(h.get("model_params"), bool):
            row["model_params"] = h["model_params"]
        return row

    def topo_key(self) -> tuple:
        r = self.topology_row()
        r.pop("agent_version", None)
        return tuple(sorted(r.items()))


def identity_from_hello(hello: dict, node: str, default_job: str | None,
                        limits: IngressLimits | None = None) -> Identity:
    """Validate a hello (:func:`stepwatch.agents.socket_trust.check_hello`); raises ValueError naming the bad
    field."""
    hello = check_hello(hello, limits or IngressLimits())
    token = hello.pop("_token", None)
    rank, ws = hello["rank"], hello["world_size"]
    names = hello["names"]
    nd = hello.get("node") if isinstance(hello.get("node"), str) and hello.get("node") else node
    return Identity(job=safe_job(hello.get("job") if isinstance(hello.get("job"), str) else None,
                                 default_job or "default"),
                    rank=rank, world_size=ws, node=nd,
                    names={int(k): str(v) for k, v in names.items() if str(k).isdigit()}, hello=hello,
                    token=token)


def _opt(v: int) -> int | None:
    return None if v < 0 else v


def rows_from_batch(ident: Identity, body) -> tuple[dict | None, list[dict], list[dict]]:
    """(steps row or None, comm rows, gc rows) of one decoded batch datagram, in the wire's columns and
    units (the datagram carries durations in ns; rows carry ms). The agent itself decodes into columns
    (stepwatch/wire/columns.py); this row form is the reference tests/unit/test_wirecols.py holds it to."""
    step, phases, comm, gcs = body
    base = {"job": ident.job, "node": ident.node, "rank": ident.rank}
    names = ident.names
    srow = None
    if step is not None:
        if len(step) < 18:                        # an older record: no CPU (v1) / comm total, exposed (v2) fields
            step = tuple(step) + (-1.0,) * (18 - len(step))
        (n, t0, t1, step_ns, data_ns, compute_ns, comm_ns, wait_ns, gc_ns, gc_count, data_queue, samples, tokens,
         dropped, cpu_ns, cpu_wait_ns, total_ns, exposed_ns) = step
        ident.dropped = dropped
        srow = dict(base, step=n, t_start=t0, t_end=t1, step_ms=step_ns / 1e6, data_ms=data_ns / 1e6,
                    compute_ms=compute_ns / 1e6, comm_ms=comm_ns / 1e6, comm_wait_ms=wait_ns / 1e6,
                    gc_ms=gc_ns / 1e6, gc_count=gc_count,
                    samples=_opt(samples), tokens=_opt(tokens), data_queue=_opt(data_queue),
                    phases=[(names.get(i, f"#{i}"), ns / 1e6) for i, ns in phases] or None,
                    cpu_ms=cpu_ns / 1e6 if cpu_ns >= 0 else None,
                    cpu_wait_ms=cpu_wait_ns / 1e6 if cpu_wait_ns >= 0 else None,
                    comm_total_ms=total_ns / 1e6 if total_ns >= 0 else None,
                    comm_exposed_ms=exposed_ns / 1e6 if exposed_ns >= 0 else None)
    crows = []
    if comm and step is not None:
        sizes = ident.hello.get("group_sizes") if isinstance(ident.hello.get("group_sizes"), dict) else {}
        for op, grp, cnt, nbytes, t_ns, w_ns in comm:
            gname = names.get(grp, f"#{grp}")
            gs = sizes.get(gname)
            row = dict(base, step=step[0], op=names.get(op, f"#{op}"), group=gname,
                       count=cnt, bytes=nbytes, time_ms=t_ns / 1e6, wait_ms=w_ns / 1e6)
            if isinstance(gs, int) and not isinstance(gs, bool) and gs > 0:
                row["group_size"] = gs          # from the hello's group_sizes (bus-bandwidth factor)
            crows.append(row)
    grows = [dict(base, t=t, generation=gen, duration_ms=d / 1e6, collected=c, uncollectable=u)
             for t, d, gen, c, u in gcs]
    return srow, crows, grows


class Agent:
    def __init__(self, kafka=None, socket_dir: str | None = None, node: str | None = None, job: str | None = None,
                 interval_s: float = 1.0, spool_dir: str | Path | None = None, spool_max_bytes: int = 256 << 20,
                 plugins: list[str] | None = None, host_plugins: dict | None = None,
                 metrics: AgentMetrics | None = None, create_topics: bool = True, socket_mode: int = 0o660,
                 send_timeout_s: float = 5.0, retry_s: float = 2.0, max_queue: int = 100_000,
                 socket_group=None, limits: IngressLimits | None = None):
        self.socket_dir = socket_dir or datagram.default_socket_dir()
        self.path = os.path.join(self.socket_dir, datagram.SOCKET_NAME)
        self.node = node or os.environ.get("STEPWATCH_NODE") or os.environ.get("NODE_NAME") or socket.gethostname()
        self.job = job
        self.interval_s = interval_s
        self.metrics = metrics or AgentMetrics()
        self.runners: list[PluginRunner] = build_runners(plugins, self.metrics, host_plugins)
        self.spool = Spool(spool_dir or os.path.join(self.socket_dir, "spool"), spool_max_bytes, self.metrics)
        self.shipper = Shipper(kafka, self.spool, self.metrics, send_timeout_s=send_timeout_s, retry_s=retry_s,
                               create_topics=create_topics, background_connect=True) if kafka is not None else None
        self.socket_mode = socket_mode
        self.socket_group = socket_group
        self.limits = limits or IngressLimits()
        self.max_queue = max_queue
        self._q_in = self._q_out = 0          # bytes queued by the receiver / taken by drain (one writer each)
        self._pending_bytes = 0
        self._n_refused = 0
        self.sock: socket.socket | None = None
        self.queue: collections.deque = collections.deque()
        self.idents: dict[int, Identity] = {}
        self.pending: dict[int, collections.deque] = {}
        self._topo_sent: dict[tuple[str, int], tuple] = {}
        self.rows: dict[str, dict[str, list]] = {k: collections.defaultdict(list) for k in KINDS}
        self.batches = columns.BatchColumns()      # the probes' step/comm/gc frames, decoded into columns per tick
        self.stop_event = threading.Event()
        self._rx: threading.Thread | None = None
        self._t_host = -1e18
        self.ticks = 0
        self._closing = False               # the last tick (close): the receiver stopped, the queue was read
        self.bad = 0
        self.control = None                 # targeted profiling (stepwatch.agents.control), see enable_profiling
        self.liveness = Liveness()          # stopped / gone / silent ranks (agents.inflight)
        self._inflight_rate = RateBound()   # in-flight rows per probe instance (agents.inflight)
        self._byes: dict[int, int] = {}     # goodbyes per probe instance (an exit, then an abort in teardown)
        self._scopes = ScopeCache()          # senders' cgroup scopes, read as their hellos arrive (job ownership)

    # ------------------------------------------------------------------ socket
    def start(self) -> "Agent":
        os.makedirs(self.socket_dir, exist_ok=True)
        if os.path.exists(self.path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                probe.connect(self.path)
                raise RuntimeError(f"another agent is serving {self.path}")
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(self.path)         # stale socket of a dead agent
            finally:
                probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        except OSError:
            pass
        s.bind(self.path)
        os.chmod(self.path, self.socket_mode)
        gid = resolve_group(self.socket_group)
        if gid is not None:
            os.chown(self.path, -1, gid)
        if not enable_passcred(s):
            log.warning("SO_PASSCRED unavailable: senders cannot be told apart by process")
        _ensure_ctl_dir(self.socket_dir, gid)
        s.settimeout(0.25)
        self.sock = s
        self._rx = threading.Thread(target=self._receive, name="stepwatch-agent-rx", daemon=True)
        self._rx.start()
        if self.shipper is not None:
            self.shipper.connect_soon()
        sample(self.runners, time.monotonic())       # baselines for rates and CPU shares
        if self.control is not None:
            self.control.start()
        self._t_host = time.monotonic()
        qlen = _max_dgram_qlen()
        if qlen is not None and qlen < 64:
            log.info("net.unix.max_dgram_qlen is %d: a node with many ranks may see probes drop datagrams in "
                     "bursts (raise it to 512 with sysctl in the agent's network namespace)", qlen)
        log.info("agent on %s serving %s (node %s)", self.path, "Kafka " + self.shipper.settings.bootstrap
                 if self.shipper else "no Kafka", self.node)
        return self

    def _receive(self) -> None:
        sock, q, m = self.sock, self.queue, self.metrics
        cap = self.limits.max_queue_bytes
        while not self.stop_event.is_set():
            try:
                data, peer = recv_with_peer(sock, 65536)
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                if self.stop_event.is_set():
                    return
                time.sleep(0.05)
                continue
            if len(q) >= self.max_queue or self._q_in - self._q_out + len(data) > cap:
                m.dropped.labels("queue_full").inc()
                continue
            if (peer is not None and len(data) > 3 and data[3] == datagram.T_HELLO
                    and self.limits.job_binding == "cgroup"):
                peer = dataclasses.replace(peer, scope=self._scopes.get(peer.pid))   # now: it may exit before the tick
            self._q_in += len(data)
            q.append((data, peer))

    # ------------------------------------------------------------------ decode
    def handle(self, data: bytes, now: float | None = None, peer: Peer | None = None) -> None:
        """Decode one datagram into rows; a bad one is counted and skipped, whatever it holds."""
        try:
            self._handle(data, time.monotonic() if now is None else now, peer)
        except Exception as e:  # noqa: BLE001 - one sender's datagram never stops the others
            self._bad(e)

    def _refused(self, reason: str, what: str) -> None:
        self.metrics.dropped.labels(reason).inc()
        self._n_refused += 1
        if self._n_refused <= 5 or self._n_refused % 1000 == 0:
            log.warning("datagram refused (%s, #%d): %s", reason, self._n_refused, what)

    def _handle(self, data: bytes, now: float, peer: Peer | None) -> None:
        m = self.metrics
        m.datagrams.inc()
        if not self.limits.allowed(peer):
            self._refused("peer_not_allowed", f"uid {peer.uid} gid {peer.gid} is not allowed")
            return
        try:
            typ, inst, frames = datagram.scan(data)   # batch frames: headers only, records read at the tick
            if typ != datagram.T_BATCH:
                frames = datagram.decode(data)
                typ, inst, _, body = frames[0]
            if typ == datagram.T_HELLO:
                self._hello(inst, body, now, peer)
                return
            if typ == datagram.T_SCHED:
                self._sched(body, peer)
                return
        except (datagram.BadDatagram, ValueError, TypeError) as e:
            self._bad(e)
            return
        ident = self.idents.get(inst)
        if ident is not None and peer is not None and ident.peer is not None and peer != ident.peer:
            self._refused("peer_mismatch", f"process {peer.pid} (uid {peer.uid}) sent frames of probe instance "
                                           f"{inst}, which belongs to process {ident.peer.pid}")
            return
        if typ == datagram.T_PROFILE:
            if self.control is not None:
                self.control.on_result(ident, body)
            return
        if ident is None or any(f[1] != inst for f in frames):
            if ident is not None:
                self._bad(datagram.BadDatagram("frames of several probe instances in one datagram"))
                return
            pend = self.pending.get(inst)
            if pend is None:
                if len(self.pending) >= self.limits.max_instances:
                    m.dropped.labels("no_identity").inc()
                    return
                pend = self.pending[inst] = collections.deque()
            while pend and (len(pend) >= PENDING_MAX
                            or self._pending_bytes + len(data) > self.limits.max_pending_bytes):
                self._pending_bytes -= len(pend.popleft()[1])
                m.dropped.labels("no_identity").inc()
            if self._pending_bytes + len(data) > self.limits.max_pending_bytes:
                m.dropped.labels("no_identity").inc()
                return
            pend.append((now, data, peer))
            self._pending_bytes += len(data)
            return
        ident.t_seen = now
        if typ == datagram.T_INFLIGHT:                  # a probe's watchdog: an overlong step (agents.inflight)
            bye = body.get("state") == "exited"      # ... or its goodbye (probe.exitwatch): at most 2, never cut
            if bye and inst in self._byes and self._byes[inst] >= 2 or \
                    not bye and not self._inflight_rate.allow(inst, now):
                m.dropped.labels("inflight_rate").inc()
                return
            try:
                row = row_from_probe(ident, body, time.time_ns())
                if bye:
                    self._byes[inst] = self._byes.get(inst, 0) + 1
                    self.liveness.said_goodbye(inst)
                self.rows["inflight"][ident.job].append(row)
                m.records_in.labels("inflight").inc()
            except ValueError as e:
                self._bad(e)
            return
        n_s, n_c, n_g = self.batches.add(ident, data, frames)   # columns at the tick (stepwatch/wire/columns.py)
        if n_s:
            m.records_in.labels("steps").inc(n_s)
        if n_c:
            m.records_in.labels("comm").inc(n_c)
        if n_g:
            m.records_in.labels("gc").inc(n_g)

    def _sched(self, body: dict, peer: Peer | None) -> None:
        """A scheduler's word on a job (``stepwatch slurm prolog|epilog``, :mod:`stepwatch.agents.slurm`): an
        ``inflight`` row with source ``slurm`` (rank 0 stands for the job; ``error`` holds the Slurm state).
        Only root (slurmd runs the prolog and epilog as root) or the agent's own user may send it."""
        if peer is None or peer.uid not in (0, os.getuid()):
            self._refused("sched_not_root", f"scheduler event from uid {peer.uid if peer else '?'}: only root "
                                            "or the agent's user may say a job started or ended")
            return
        from stepwatch.agents.slurm import check_sched
        ev = check_sched(body)
        t = ev["t"] or time.time_ns()
        row = {"job": ev["job"], "node": self.node, "rank": 0, "t": t, "source": "slurm",
               "state": "sched_" + ev["event"], "exit_code": ev["exit_code"], "signal": ev["signal"],
               "error": ev["state"], "pid": peer.pid or None}
        self.rows["inflight"][ev["job"]].append(row)
        self.metrics.records_in.labels("inflight").inc()

    def _bad(self, e: Exception) -> None:
        self.bad += 1
        self.metrics.bad_datagrams.inc()
        self.metrics.dropped.labels("bad_datagram").inc()
        if self.bad <= 5 or self.bad % 1000 == 0:
            log.warning("bad datagram #%d skipped: %s", self.bad, e)

    def _hello(self, inst: int, hello: dict, now: float, peer: Peer | None = None) -> None:
        ident = identity_from_hello(hello, self.node, self.job, self.limits)
        ident.peer = peer
        old = self.idents.get(inst)
        if old is not None and peer is not None and old.peer is not None and old.peer != peer:
            self._refused("peer_mismatch", f"process {peer.pid} sent a hello for probe instance {inst} of "
                                           f"process {old.peer.pid}")
            return
        if old is not None and old.owner is not None and old.token == ident.token and old.job == ident.job:
            ident.owner = old.owner          # the same process again: its cgroup is not read every 10-20 s
        else:
            ident.owner = owner_of(peer, ident.token, self.limits.job_binding)
        for oi, o in self.idents.items():
            if oi == inst or o.job != ident.job or now - o.t_seen > ACTIVE_S:
                continue
            if (ident.owner is not None and o.owner is not None and o.owner != ident.owner
                    and (o.peer is None or pid_alive(o.peer.pid))):
                self._refused("job_not_owned", f"a hello of process {peer.pid if peer else '?'} (uid "
                                               f"{peer.uid if peer else '?'}) for rank {ident.rank} of job "
                                               f"{ident.job!r}: the job belongs on this node to "
                                               f"{describe_owner(o.owner)} (process {o.peer.pid if o.peer else '?'})")
                return
            if (o.rank == ident.rank and peer is not None and o.peer is not None and o.peer.pid != peer.pid
                    and pid_alive(o.peer.pid)):
                self._refused("identity_conflict", f"process {peer.pid} claims rank {ident.rank} of job {ident.job}, "
                                                   f"held by live process {o.peer.pid}")
                return
        if old is None and len(self.idents) >= self.limits.max_instances:
            quiet = [k for k, i in self.idents.items() if now - i.t_seen > ACTIVE_S]
            if not quiet:
                self._refused("too_many_instances", f"{len(self.idents)} probe instances served already")
                return
            del self.idents[min(quiet, key=lambda k: self.idents[k].t_seen)]
        if old is not None:
            ident.dropped = old.dropped
        ident.t_seen = now
        self.idents[inst] = ident
        key = (ident.job, ident.rank)
        tk = ident.topo_key()
        if self._topo_sent.get(key) != tk:
            self._topo_sent[key] = tk
            self.rows["topology"][ident.job].append(ident.topology_row())
            self.metrics.records_in.labels("topology").inc()
            if old is None:
                log.info("serving rank %d of job %s (pid %s, %s)", ident.rank, ident.job, hello.get("pid"),
                         hello.get("device", "?"))
        waiting = self.pending.pop(inst, None)
        if waiting:
            for _, data, p in waiting:
                self._pending_bytes -= len(data)
                if p == peer:
                    self.handle(data, now, p)
                else:
                    self._refused("peer_mismatch", f"frames of probe instance {inst} from another process")

    def _expire_pending(self, now: float) -> None:
        for inst in list(self.pending):
            pend = self.pending[inst]
            while pend and now - pend[0][0] > PENDING_S:
                self._pending_bytes -= len(pend.popleft()[1])
                self.metrics.dropped.labels("no_identity").inc()
            if not pend:
                del self.pending[inst]

    def drain(self) -> int:
        n = 0
        q = self.queue
        while q:
            data, peer = q.popleft()
            self._q_out += len(data)
            self.handle(data, None, peer)
            n += 1
        return n

    # ------------------------------------------------------------------ tick
    def active_jobs(self, now: float) -> list[str]:
        jobs = sorted({i.job for i in self.idents.values() if now - i.t_seen <= ACTIVE_S})
        if not jobs and self.job:
            jobs = [safe_job(self.job)]
        return jobs

    def host_rows(self, now: float, t_ns: int) -> list[dict]:
        fields = sample(self.runners, now)
        if not fields:
            return []
        return [dict(fields, job=job, node=self.node, t=t_ns) for job in self.active_jobs(now)]

    def tick(self) -> list[tuple[str, str, Batch]]:
        """Decode what arrived, sample the host, ship one table per (kind, job). Returns the items."""
        t0 = time.perf_counter()
        now = time.monotonic()
        self.drain()
        self._expire_pending(now)
        m = self.metrics
        active = [i for i in self.idents.values() if now - i.t_seen <= ACTIVE_S]
        m.ranks.set(len(active))
        m.probe_dropped.set(sum(i.dropped for i in active))
        for inst in [k for k, i in self.idents.items() if now - i.t_seen > 10 * ACTIVE_S]:
            del self.idents[inst]
        if len(self._byes) > self.limits.max_instances:
            self._byes = {k: v for k, v in self._byes.items() if k in self.idents}
        if len(self._topo_sent) > 2 * self.limits.max_instances:     # bounded under a stream of made-up ranks
            live = {(i.job, i.rank) for i in self.idents.values()}
            self._topo_sent = {k: v for k, v in self._topo_sent.items() if k in live}
        if now - self._t_host >= self.interval_s * 0.5:
            self._t_host = now
            hrows = self.host_rows(now, time.time_ns())
            for r in hrows:
                self.rows["host"][r["job"]].append(r)
            if hrows:
                m.records_in.labels("host").inc(len(hrows))
        for r in self.liveness.rows(self.idents, self.node, now, time.time_ns(), final=self._closing):
            self.rows["inflight"][r["job"]].append(r)
        if self.control is not None:
            for r in self.control.take_rows():
                self.rows["profiles"][r["job"]].append(r)
        items = []
        cols = self.batches.take()                  # job -> [(steps, comm, gc)] tables of the probes' frames
        for kind in KINDS:
            per_job, self.rows[kind] = self.rows[kind], collections.defaultdict(list)
            for job, rows in per_job.items():
                for i in range(0, len(rows), lite.MAX_ROWS):
                    t = self._table(kind, job, rows[i:i + lite.MAX_ROWS])
                    if t is not None:
                        items.append((kind, job, t))
            if kind in columns.KINDS:
                k = columns.KINDS.index(kind)
                items += [(kind, job, t[k]) for job, ts in cols.items() for t in ts if t[k] is not None]
        if self.shipper is not None:
            self.shipper.ship(items)
        self.ticks += 1
        m.tick_seconds.observe(time.perf_counter() - t0)
        return items

    def _table(self, kind: str, job: str, rows: list[dict]) -> Batch | None:
        """The Arrow record batch of one (kind, job); rows that cannot be encoded are found one by one
        (only then), counted as ``unencodable`` and dropped: one bad row never holds back the others."""
        if not rows:
            return None
        try:
            return lite.from_rows(kind, rows)
        except Exception:  # noqa: BLE001 - ValueError (naming the field), TypeError, OverflowError ...
            pass
        good = []
        for r in rows:
            try:
                lite.from_rows(kind, [r])
                good.append(r)
            except Exception as e:  # noqa: BLE001
                self._refused("unencodable", f"{kind} row of job {job} dropped: {e!r}"[:300])
        return lite.from_rows(kind, good) if good else None

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Serve until ``stop_event`` (or :attr:`stop_event`) is set; then a last tick and close."""
        stop = stop_event or self.stop_event
        if self.sock is None:
            self.start()
        nxt = time.monotonic() + self.interval_s
        try:
            while not stop.is_set():
                stop.wait(max(0.0, nxt - time.monotonic()))
                nxt += self.interval_s
                if nxt < time.monotonic():
                    nxt = time.monotonic() + self.interval_s
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - the agent never dies of one bad tick
                    log.exception("agent tick failed")
                trim()
        finally:
            self.close()

    def enable_profiling(self, public_keys: dict, profile_dir: str | None = None, **kw) -> "Agent":
        """Accept signed profiling commands for this node (before :meth:`start`); ``public_keys`` from
        :func:`stepwatch.agents.profiling.load_public_keys`; ``kw`` goes to
        :class:`~stepwatch.agents.control.AgentControl` (``cooldown_s``, ``max_steps``, ``state_dir`` ...)."""
        from stepwatch.agents.control import AgentControl
        d = profile_dir or os.environ.get("STEPWATCH_PROFILE_DIR") or os.path.join(self.socket_dir, "profiles")
        self.control = AgentControl(self, self.shipper.settings if self.shipper else None, public_keys, d, **kw)
        return self

    def close(self) -> None:
        self.stop_event.set()
        if self.control is not None:
            self.control.close()
        if self._rx is not None:
            self._rx.join(2)
            self._rx = None
        self._closing = True
        if self.shipper is not None:
            self.shipper.wait_connect(self.shipper.send_timeout_s)
        try:
            self.tick()
        except Exception:  # noqa: BLE001
            log.exception("last tick failed")
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self.shipper is not None:
            self.shipper.close()

    def stats(self) -> dict:
        m = self.metrics
        return {"datagrams": m.value(m.datagrams), "records_in": m.value(m.records_in),
                "records_out": m.value(m.records_out), "spooled": m.value(m.records_spooled),
                "dropped": m.value(m.dropped), "bad_datagrams": m.value(m.bad_datagrams),
                "spool_files": len(self.spool), "ranks": len(self.idents),
                "kafka_up": bool(self.shipper and self.shipper.online)}


def _ensure_ctl_dir(socket_dir: str, gid: int | None = None) -> None:
    """``<socket_dir>/ctl``, where probes bind their control sockets: setgid and sticky, writable by the
    socket's group (3770), so probes of other uids in that group can bind there and not remove each
    other's sockets. Left as it is when it exists (the chart's init container sets it up)."""
    d = os.path.join(socket_dir, "ctl")
    if os.path.isdir(d):
        return
    try:
        os.mkdir(d)
        if gid is not None:
            os.chown(d, -1, gid)
        os.chmod(d, 0o3770)
    except OSError as e:
        log.info("cannot create %s (%s): probes bind their control sockets in %s", d, e.strerror, socket_dir)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library)."""
    import ctypes
    try:
        f = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    f.argtypes, f.restype = [ctypes.c_size_t], ctypes.c_int
    return f


def trim() -> None:
    """Give the C heap's free pages back to the OS, once per tick of :meth:`Agent.run`: each tick's
    datagrams, columns, Arrow tables and IPC buffers are freed by its end, and glibc keeps what they
    left free in its arenas (~3 MB of the agent's resident set serving 8 ranks). ~0.1 ms a call."""
    f = _malloc_trim()
    if f is not None:
        f(0)


def _max_dgram_qlen() -> int | None:
    try:
        with open("/proc/sys/net/unix/max_dgram_qlen") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None

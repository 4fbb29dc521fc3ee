"""The node agent's side of targeted profiling (DESIGN §9): ``control`` in, ``profiles`` out.

Lifecycle: :meth:`AgentControl.start` opens a Kafka consumer with no group that is ``assign()``-ed only
the partition of the ``control`` topic this node's key hashes to (kafka-python's default murmur2
partitioner, the one producers use), positioned at its end: commands older than the agent are
expired anyway. A thread polls it and handles each command at once (:meth:`handle_command`):

1. rows for other nodes (sharing the partition) are skipped;
2. the HMAC-SHA256 signature is checked (``unsigned``, ``bad_signature`` -> ``rejected``);
3. ``expires_at`` (``expired``), then the command id against the ids seen until their expiry
   (``replay`` -> ``rejected``), the sanity limits (``steps`` at most ``max_steps``, a lifetime of at
   most ``max_ttl_s``, not issued in the future) and the node's cooldown since the last accepted
   command (``cooldown`` -> ``rejected``);
4. each addressed rank: not served here -> ``failed``; already profiling -> ``busy``; else the command
   goes to that probe's control socket (``ctl`` in its hello) with the trace directory and deadline.

Every outcome is a ``profiles`` row (one per addressed rank; ``rank`` null when the command named
none), published by the agent's normal shipping at its next tick, keyed by job. Probes answer with
``T_PROFILE`` datagrams that :meth:`on_result` turns into the final rows (``ok`` with ``uri``,
``bytes``, ``summary``; or ``failed``/``expired``/``busy``). A forwarded profile the probe never
answers is reported ``expired`` a grace period after its deadline. Rejections of unsigned or forged
commands are rate-limited (``reject_rows_per_min``) so a flood cannot turn into a flood of rows;
they are always counted in the metrics.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time

import pyarrow as pa
from prometheus_client import Counter

from stepwatch import schema as wire
from stepwatch.agents import profiling

log = logging.getLogger("stepwatch.agent.control")

GRACE_S = 30.0                 # a forwarded profile with no answer this long after its deadline: expired
TRACE_SUFFIXES = (".json.gz", ".pyspy.txt")   # the names profiling.trace_name gives


def prune_traces(directory: str, keep_bytes: int, protect=frozenset()) -> tuple[int, int]:
    """Delete the oldest trace files of ``directory`` (by mtime) until those left take at most
    ``keep_bytes``; returns (files deleted, bytes freed). Only trace names (``*.json.gz``,
    ``*.pyspy.txt``, not in sub-directories) are counted or touched; names in ``protect`` (traces of
    profiles still running) are counted but never deleted. A missing directory is not an error."""
    files = []
    try:
        with os.scandir(directory) as it:
            for e in it:
                if e.name.endswith(TRACE_SUFFIXES) and e.is_file(follow_symlinks=False):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    files.append((st.st_mtime_ns, e.name, st.st_size))
    except OSError:
        return 0, 0
    total = sum(f[2] for f in files)
    n = freed = 0
    for _, name, size in sorted(files):
        if total <= keep_bytes:
            break
        if name in protect:
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except OSError as e:
            log.warning("could not delete old trace %s: %s", name, e.strerror)
            continue
        total -= size
        n += 1
        freed += size
    return n, freed


def node_partition(node: str, partitions: int) -> int:
    """The partition kafka-python's default partitioner sends key ``node`` to."""
    from kafka.partitioner.default import murmur2
    return (murmur2(node.encode()) & 0x7FFFFFFF) % partitions


def decode_control(payload: bytes) -> list[dict]:
    """Rows of one ``control`` message (Arrow IPC stream or JSON array), times as int ns."""
    if payload[:1] in (b"[", b"{"):
        rows = json.loads(payload.decode("utf-8"))
        return rows if isinstance(rows, list) else [rows]
    with pa.ipc.open_stream(pa.BufferReader(payload)) as r:
        t = r.read_all()
    t = wire.conform(t, wire.CONTROL)
    cols = [c.cast(pa.int64()) if pa.types.is_timestamp(c.type) else c for c in t.columns]
    return pa.Table.from_arrays(cols, names=t.column_names).to_pylist()


def encode_control(cmd: dict) -> bytes:
    return wire.encode_arrow(pa.Table.from_pylist([{k: cmd.get(k) for k in wire.CONTROL.names}],
                                                  schema=wire.CONTROL))


def control_headers() -> list[tuple[str, bytes]]:
    return [("content-type", wire.ARROW_CT.encode()), ("schema", b"control/1")]


class ControlMetrics:
    """Counters registered on the agent's registry."""

    def __init__(self, registry):
        self.received = Counter("stepwatch_agent_profile_commands", "Profiling commands for this node received",
                                registry=registry)
        self.rejected = Counter("stepwatch_agent_profile_commands_rejected",
                                "Profiling commands or ranks refused, by reason", ["reason"], registry=registry)
        self.forwarded = Counter("stepwatch_agent_profile_forwarded", "Profiles handed to a probe", registry=registry)
        self.done = Counter("stepwatch_agent_profiles_done", "Profile outcomes reported by probes, by status",
                            ["status"], registry=registry)
        self.pruned = Counter("stepwatch_agent_profile_traces_deleted", "Old traces deleted to keep the trace "
                              "directory within --profile-keep-mb", registry=registry)


class AgentControl:
    def __init__(self, agent, kafka, key: bytes, profile_dir: str, cooldown_s: float = 60.0,
                 max_steps: int = 200, max_ttl_s: float = 3600.0, skew_s: float = 60.0,
                 reject_rows_per_min: int = 30, consume: bool = True, keep_mb: float = 0.0):
        self.agent = agent
        self.kafka = kafka
        self._key = key
        self.profile_dir = profile_dir
        self.cooldown_s = cooldown_s
        self.max_steps = max_steps
        self.max_ttl_s = max_ttl_s
        self.skew_s = skew_s
        self.reject_rows_per_min = reject_rows_per_min
        self.consume = consume
        self.keep_bytes = int(keep_mb * (1 << 20))      # trace budget of profile_dir; 0: keep everything
        self._prune_due = self.keep_bytes > 0           # at start, then after each trace written
        self.metrics = ControlMetrics(agent.metrics.registry)
        self.lock = threading.Lock()
        self.seen: dict[str, int] = {}                  # cmd_id -> expires_at (ns): replay protection
        self.active: dict[tuple[str, int], dict] = {}   # (job, rank) -> forwarded command (+ deadline)
        self.last_accept = -1e18                        # monotonic time of the last accepted command
        self.rows: list[dict] = []
        self._rej_window: collections.deque = collections.deque()
        self.t_start_ns = time.time_ns()
        self.stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self.consumer = None
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)

    # ------------------------------------------------------------------ kafka
    def start(self) -> "AgentControl":
        if self.consume and self.kafka is not None:
            self._thread = threading.Thread(target=self._run, name="stepwatch-agent-control", daemon=True)
            self._thread.start()
        return self

    def _open(self):
        from kafka import KafkaConsumer, TopicPartition
        topic = self.kafka.topic("control")
        c = KafkaConsumer(**self.kafka.client_config(), group_id=None, enable_auto_commit=False,
                          auto_offset_reset="latest", fetch_max_wait_ms=200)
        parts = None
        deadline = time.monotonic() + 30
        while not parts and time.monotonic() < deadline and not self.stop_event.is_set():
            parts = c.partitions_for_topic(topic)
            if not parts:
                time.sleep(0.5)
        if not parts:
            c.close()
            raise RuntimeError(f"topic {topic} not found")
        tp = TopicPartition(topic, node_partition(self.agent.node, len(parts)))
        c.assign([tp])
        c.seek_to_end(tp)
        c.position(tp)
        log.info("profiling commands for node %s: %s partition %d", self.agent.node, topic, tp.partition)
        return c

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                if self.consumer is None:
                    self.consumer = self._open()
                recs = self.consumer.poll(timeout_ms=250)
            except Exception as e:  # noqa: BLE001 - Kafka away: try again
                log.warning("control consumer: %s", e)
                if self.consumer is not None:
                    try:
                        self.consumer.close()
                    except Exception:  # noqa: BLE001
                        pass
                    self.consumer = None
                self.stop_event.wait(2.0)
                continue
            for msgs in recs.values():
                for m in msgs:
                    self.handle_message(m.value, m.key)

    def close(self) -> None:
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.consumer is not None:
            try:
                self.consumer.close()
            except Exception:  # noqa: BLE001
                pass
        self._out.close()

    # ------------------------------------------------------------------ commands
    def handle_message(self, value: bytes, key: bytes | None = None) -> list[dict]:
        if key is not None and key.decode("utf-8", "replace") != self.agent.node:
            return []
        try:
            cmds = decode_control(value)
        except Exception as e:  # noqa: BLE001
            self.metrics.rejected.labels("undecodable").inc()
            log.warning("undecodable control message: %s", e)
            return []
        out = []
        for c in cmds:
            out += self.handle_command(c)
        return out

    def handle_command(self, cmd: dict, now_ns: int | None = None) -> list[dict]:
        """Check one command and forward it; returns the outcome rows it produced (also queued)."""
        if not isinstance(cmd, dict) or cmd.get("node") != self.agent.node:
            return []
        now = time.time_ns() if now_ns is None else now_ns
        self.metrics.received.inc()
        with self.lock:
            rows = self._check_and_forward(cmd, now)
            self.rows += rows
        return rows

    def _row(self, cmd: dict, rank, status: str, detail: str, now: int, **kw) -> dict:
        ref = set(int(r) for r in (cmd.get("reference") or []))
        r = {"cmd_id": str(cmd.get("cmd_id") or "?")[:64], "job": _safe_job(cmd.get("job")), "node": self.agent.node,
             "rank": rank, "status": status, "kind": cmd.get("kind"), "reason": cmd.get("reason") or "",
             "role": None if rank is None else ("reference" if rank in ref else "suspect"), "detail": detail,
             "steps": cmd.get("steps"), "t": now}
        r.update(kw)
        return r

    def _refuse(self, cmd: dict, status: str, reason: str, detail: str, now: int, limited: bool) -> list[dict]:
        self.metrics.rejected.labels(reason).inc()
        log.warning("profiling command %s refused: %s (%s)", cmd.get("cmd_id"), reason, detail)
        if limited:
            w = self._rej_window
            while w and now - w[0] > 60_000_000_000:
                w.popleft()
            if len(w) >= self.reject_rows_per_min:
                return []
            w.append(now)
        ranks = [int(r) for r in (cmd.get("ranks") or [])] or [None]
        return [self._row(cmd, r, status, f"{reason}: {detail}" if detail else reason, now) for r in ranks]

    def _check_and_forward(self, cmd: dict, now: int) -> list[dict]:
        why = profiling.verify(cmd, self._key)
        if why is not None:
            return self._refuse(cmd, "rejected", why, "unsigned command" if why == "unsigned"
                                else "signature does not match (wrong key or altered command)", now, True)
        cmd_id = str(cmd.get("cmd_id"))
        exp = int(cmd.get("expires_at") or 0)
        issued = int(cmd.get("issued_at") or 0)
        for k in [k for k, e in self.seen.items() if e < now]:
            del self.seen[k]
        if exp <= now:
            if exp < self.t_start_ns:           # older than this agent: a backlog, not news
                self.metrics.rejected.labels("stale").inc()
                return []
            return self._refuse(cmd, "expired", "expired", f"expired {(now - exp) / 1e9:.1f}s ago", now, False)
        if cmd_id in self.seen:
            return self._refuse(cmd, "rejected", "replay", f"command {cmd_id} was already received", now, True)
        self.seen[cmd_id] = exp
        if issued > now + self.skew_s * 1e9:
            return self._refuse(cmd, "rejected", "future", "issued_at is in the future", now, False)
        if exp - issued > self.max_ttl_s * 1e9:
            return self._refuse(cmd, "rejected", "ttl", f"lifetime over {self.max_ttl_s:.0f}s", now, False)
        steps = int(cmd.get("steps") or 0)
        if not 1 <= steps <= self.max_steps:
            return self._refuse(cmd, "rejected", "steps", f"steps must be 1..{self.max_steps}", now, False)
        if cmd.get("kind") not in profiling.PROFILER_KINDS:
            return self._refuse(cmd, "rejected", "kind", f"unknown kind {cmd.get('kind')!r}", now, False)
        mono = time.monotonic()
        if mono - self.last_accept < self.cooldown_s:
            return self._refuse(cmd, "rejected", "cooldown",
                                f"node cooldown: last command {mono - self.last_accept:.0f}s ago "
                                f"(cooldown {self.cooldown_s:.0f}s)", now, False)
        job = _safe_job(cmd.get("job"))
        served = {(i.job, i.rank): i for i in list(self.agent.idents.values())}
        for k in [k for k, a in self.active.items() if a["deadline"] + GRACE_S * 1e9 < now]:
            a = self.active.pop(k)
            self.rows.append(self._row(a["cmd"], k[1], "expired", "no answer from the probe", now))
        out = []
        accepted = False
        for rank in sorted(int(r) for r in (cmd.get("ranks") or [])):
            ident = served.get((job, rank))
            path = ident.hello.get("ctl") if ident is not None else None
            if ident is None:
                self.metrics.rejected.labels("unknown_rank").inc()
                out.append(self._row(cmd, rank, "failed", "rank not served by this agent", now))
                continue
            if not isinstance(path, str) or not os.path.basename(path).startswith(profiling.CTL_PREFIX):
                self.metrics.rejected.labels("no_control").inc()
                out.append(self._row(cmd, rank, "failed", "the probe of this rank takes no commands "
                                                          "(old version or STEPWATCH_PROFILING=0)", now))
                continue
            if (job, rank) in self.active:
                self.metrics.rejected.labels("busy").inc()
                out.append(self._row(cmd, rank, "busy", f"rank is profiling for command "
                                                        f"{self.active[(job, rank)]['cmd']['cmd_id']}", now))
                continue
            ref = set(int(r) for r in (cmd.get("reference") or []))
            msg = {"cmd_id": cmd_id, "job": job, "rank": rank, "kind": cmd.get("kind"), "steps": steps,
                   "deadline_ns": exp, "dir": self.profile_dir, "reason": cmd.get("reason") or "",
                   "role": "reference" if rank in ref else "suspect"}
            try:
                self._out.sendto(json.dumps(msg).encode(), path)
            except OSError as e:
                self.metrics.rejected.labels("unreachable").inc()
                out.append(self._row(cmd, rank, "failed", f"probe control socket unreachable: {e.strerror}", now))
                continue
            self.active[(job, rank)] = {"cmd": cmd, "deadline": exp, "t": now}
            self.metrics.forwarded.inc()
            accepted = True
        if accepted:
            self.last_accept = mono
        return out

    # ------------------------------------------------------------------ results from probes
    def on_result(self, ident, body: dict, now_ns: int | None = None) -> dict | None:
        """A ``T_PROFILE`` datagram of a served probe -> the final ``profiles`` row."""
        if ident is None:
            return None
        now = time.time_ns() if now_ns is None else now_ns
        status = body.get("status") if body.get("status") in profiling.STATUSES else "failed"
        self.metrics.done.labels(status).inc()
        summ = body.get("summary")
        with self.lock:
            a = self.active.get((ident.job, ident.rank))
            if a is not None and a["cmd"].get("cmd_id") == body.get("cmd_id"):
                del self.active[(ident.job, ident.rank)]
            if status == "ok" and self.keep_bytes > 0:
                self._prune_due = True                   # pruned at the next tick, not on the receive thread
            row = {"cmd_id": str(body.get("cmd_id"))[:64], "job": ident.job, "node": ident.node, "rank": ident.rank,
                   "status": status, "uri": body.get("uri"), "bytes": body.get("bytes"),
                   "summary": json.dumps(summ, sort_keys=True) if summ is not None else None,
                   "started_at": body.get("started_at"), "finished_at": body.get("finished_at"),
                   "kind": body.get("kind"), "role": body.get("role"), "reason": body.get("reason") or "",
                   "detail": body.get("detail") or "", "steps": body.get("steps"), "t": now}
            self.rows.append(row)
        log.info("profile %s of rank %d (%s): %s %s", row["cmd_id"], ident.rank, row["kind"], status, row["uri"] or
                 row["detail"])
        return row

    def take_rows(self) -> list[dict]:
        with self.lock:
            now = time.time_ns()
            for k in [k for k, a in self.active.items() if a["deadline"] + GRACE_S * 1e9 < now]:
                a = self.active.pop(k)
                self.rows.append(self._row(a["cmd"], k[1], "expired", "no answer from the probe", now))
            rows, self.rows = self.rows, []
            prune, self._prune_due = self._prune_due, False
            protect = {profiling.trace_name(j, r, str(a["cmd"].get("cmd_id")), str(a["cmd"].get("kind")))
                       for (j, r), a in self.active.items()}
        if prune:
            self.prune(protect)
        return rows

    def prune(self, protect=frozenset()) -> int:
        """Keep ``profile_dir`` within ``keep_mb`` (oldest traces first); returns the files deleted.
        Meant for a per-node directory: on a volume shared by several nodes each agent would count
        the others' traces too, so leave ``keep_mb`` at 0 there and expire traces by other means."""
        if self.keep_bytes <= 0:
            return 0
        n, freed = prune_traces(self.profile_dir, self.keep_bytes, protect)
        if n:
            self.metrics.pruned.inc(n)
            log.info("deleted %d old trace(s), %.1f MiB, to keep %s within %.0f MiB", n, freed / (1 << 20),
                     self.profile_dir, self.keep_bytes / (1 << 20))
        return n


def _safe_job(job) -> str:
    from stepwatch.agents.agent import safe_job
    return safe_job(job if isinstance(job, str) else None)

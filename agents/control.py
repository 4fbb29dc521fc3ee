"""The node agent's side of targeted profiling (docs/profiling.md): ``control`` in, ``profiles`` out.

Lifecycle: :meth:`AgentControl.start` opens a Kafka consumer with no group that is ``assign()``-ed only
the partition of the ``control`` topic this node's key hashes to (kafka-python's default murmur2
partitioner, the one producers use), positioned at its end: commands older than the agent are
expired anyway. A thread polls it and handles each message at once (:meth:`handle_message`); nothing a
message holds can stop that thread (every message is handled inside its own ``try``):

1. messages keyed for other nodes are skipped;
2. the envelope is opened (:func:`stepwatch.agents.profiling.open_envelope`): size, magic, key id and
   the Ed25519 signature are checked with this node's *public* keys **before** any of the body is
   decoded (``too_large``, ``bad_envelope``, ``unknown_key``, ``bad_signature`` -> ``rejected``), then
   every field of the body is checked (``bad_command``); commands for other nodes are skipped;
3. ``expires_at`` (``expired``), then the command id against the ids accepted until their expiry,
   kept in ``<state_dir>/control-seen.log`` (fsynced before the command is forwarded, read again at
   start: a replay is refused after an agent restart too) (``replay`` -> ``rejected``), the sanity limits
   (``steps`` at most ``max_steps``, a lifetime of at most ``max_ttl_s``, not issued in the future) and
   the node's cooldown since the last accepted command (``cooldown`` -> ``rejected``);
4. each addressed rank: not served here -> ``failed``; already profiling -> ``busy``; else the sealed
   envelope itself, unchanged, goes to that probe's control socket (``ctl`` in its hello, which must lie
   in the socket directory or its ``ctl`` sub-directory). The probe verifies it again with its own keys.

Every outcome is a ``profiles`` row (one per addressed rank; ``rank`` null when the command named
none), published by the agent's normal shipping at its next tick, keyed by job. Probes answer with
``T_PROFILE`` datagrams that :meth:`on_result` turns into the final rows (``ok`` with ``uri``,
``bytes``, ``summary``; or ``failed``/``expired``/``busy``/``rejected``). A forwarded profile the probe
never answers is reported ``expired`` a grace period after its deadline. Rejections of unverifiable
commands are rate-limited (``reject_rows_per_min``) so a flood cannot turn into a flood of rows or log
lines; they are always counted in the metrics.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import socket
import threading
import time

from prometheus_client import Counter

from stepwatch.agents import profiling
from stepwatch.agents.profiling import protocol, summary
from stepwatch.agents.shipper import fsync_dir

log = logging.getLogger("stepwatch.agent.control")

GRACE_S = 30.0                 # a forwarded profile with no answer this long after its deadline: expired
TRACE_SUFFIXES = (".json.gz", ".pyspy.txt")   # the names summary.trace_name gives


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



def _per_minute_ok(window: collections.deque, now: int, limit: int) -> bool:
    """A sliding one-minute window of event times (ns): True, and ``now`` recorded, while fewer than
    ``limit`` events fell in the last minute."""
    while window and now - window[0] > 60_000_000_000:
        window.popleft()
    if len(window) >= limit:
        return False
    window.append(now)
    return True

class SeenStore:
    """Command ids accepted, each until it expires, in memory and in an append-only file (one
    ``<cmd_id> <expires_at>`` line each, fsynced) that is read back at start and compacted there and
    whenever it grows past ``2 * max(1000, len)`` lines. :meth:`add` raises OSError when the id could
    not be made durable (the caller then refuses the command: fail closed)."""

    def __init__(self, path: str, now_ns: int | None = None):
        self.path = path
        self.ids: dict[str, int] = {}
        self.bad_lines = 0
        now = time.time_ns() if now_ns is None else now_ns
        try:
            with open(path, "rb") as f:
                for line in f.read(64 << 20).splitlines():
                    parts = line.split()
                    try:
                        cid, exp = parts[0].decode("ascii"), int(parts[1])
                    except (IndexError, ValueError, UnicodeDecodeError):
                        self.bad_lines += 1              # a torn last line after a crash
                        continue
                    if exp > now and protocol.CMD_ID_RE.fullmatch(cid):
                        self.ids[cid] = max(exp, self.ids.get(cid, 0))
        except FileNotFoundError:
            pass
        self._lines = len(self.ids)
        self._f = None
        self._compact()

    def _compact(self) -> None:
        tmp = self.path + ".tmp"
        d = os.path.dirname(self.path) or "."
        os.makedirs(d, exist_ok=True)
        with open(tmp, "w") as f:
            f.writelines(f"{k} {v}\n" for k, v in self.ids.items())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(d)
        if self._f is not None:
            self._f.close()
        self._f = open(self.path, "a")
        self._lines = len(self.ids)

    def __contains__(self, cmd_id: str) -> bool:
        return cmd_id in self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def expire(self, now_ns: int) -> None:
        for k in [k for k, e in self.ids.items() if e <= now_ns]:
            del self.ids[k]

    def add(self, cmd_id: str, expires_at: int) -> None:
        self.ids[cmd_id] = expires_at
        try:
            self._f.write(f"{cmd_id} {expires_at}\n")
            self._f.flush()
            os.fsync(self._f.fileno())
            self._lines += 1
            if self._lines > 2 * max(1000, len(self.ids)):
                self._compact()
        except (OSError, ValueError):
            del self.ids[cmd_id]
            raise

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


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
    def __init__(self, agent, kafka, public_keys: dict, profile_dir: str, cooldown_s: float = 60.0,
                 max_steps: int = 200, max_ttl_s: float = 3600.0, skew_s: float = 60.0,
                 reject_rows_per_min: int = 30, consume: bool = True, keep_mb: float = 0.0,
                 state_dir: str | None = None):
        if not public_keys or not isinstance(public_keys, dict):
            raise ValueError("profiling needs the public key(s) that verify commands (a dict from load_public_keys)")
        self.agent = agent
        self.kafka = kafka
        self._keys = public_keys
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
        sd = state_dir or str(agent.spool.dir)
        self.seen = SeenStore(os.path.join(sd, "control-seen.log"))    # replay protection across restarts
        self.active: dict[tuple[str, int], dict] = {}   # (job, rank) -> forwarded command (+ deadline)
        self.last_accept = -1e18                        # monotonic time of the last accepted command
        self.rows: list[dict] = []
        self._rej_window: collections.deque = collections.deque()
        self._unsolicited: collections.deque = collections.deque()
        self._n_logged = 0
        self.t_start_ns = time.time_ns()
        self.stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self.consumer = None
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)
        sd_real = os.path.realpath(agent.socket_dir)
        self._ctl_dirs = {sd_real, os.path.join(sd_real, protocol.CTL_DIR)}

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
                          auto_offset_reset="latest", fetch_max_wait_ms=200,
                          max_partition_fetch_bytes=1 << 20)
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
                self._close_consumer()
                self.stop_event.wait(2.0)
                continue
            for msgs in recs.values():
                for m in msgs:
                    try:
                        self.handle_message(m.value, m.key)
                    except Exception:  # noqa: BLE001 - no message may stop this thread
                        self.metrics.rejected.labels("internal_error").inc()
                        if self._log_ok():
                            log.exception("control message at offset %s not handled", m.offset)

    def _close_consumer(self) -> None:
        if self.consumer is not None:
            try:
                self.consumer.close()
            except Exception:  # noqa: BLE001 - a consumer that lost its broker may fail to close
                pass
            self.consumer = None

    def _log_ok(self) -> bool:
        self._n_logged += 1
        return self._n_logged <= 5 or self._n_logged % 1000 == 0

    def close(self) -> None:
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(5)
        self._close_consumer()
        self._out.close()
        self.seen.close()

    # ------------------------------------------------------------------ commands
    def handle_message(self, value, key: bytes | None = None, now_ns: int | None = None) -> list[dict]:
        """One ``control`` message: verified before anything of its body is decoded, then handled."""
        if key is not None and bytes(key).decode("utf-8", "replace") != self.agent.node:
            return []
        now = time.time_ns() if now_ns is None else now_ns
        try:
            cmd = profiling.open_envelope(value, self._keys)
        except protocol.BadCommand as e:
            with self.lock:
                rows = self._refuse_unverified(e, value, now)
                self.rows += rows
            return rows
        if cmd["node"] != self.agent.node:
            self.metrics.rejected.labels("other_node").inc()
            return []
        return self.handle_command(cmd, bytes(value), now)

    def handle_command(self, cmd: dict, envelope: bytes, now_ns: int | None = None) -> list[dict]:
        """Check one verified command and forward its envelope; returns the outcome rows (also queued)."""
        now = time.time_ns() if now_ns is None else now_ns
        self.metrics.received.inc()
        with self.lock:
            rows = self._check_and_forward(cmd, envelope, now)
            self.rows += rows
        return rows

    def _job(self) -> str:
        return _safe_job(self.agent.job)

    def _refuse_unverified(self, e: "protocol.BadCommand", value, now: int) -> list[dict]:
        """A message that is not a verified command: nothing of it is trusted, so the row carries only
        a digest of the message (as ``cmd_id``) and the reason; rate-limited like every refusal."""
        self.metrics.rejected.labels(e.reason).inc()
        if self._log_ok():
            log.warning("control message refused: %s", e)
        if not self._window_ok(now):
            return []
        digest = hashlib.sha256(bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else b"").hexdigest()
        return [{"cmd_id": "sha256:" + digest[:16], "job": self._job(), "node": self.agent.node, "rank": None,
                 "status": "rejected", "kind": None, "reason": "", "role": None, "detail": f"{e.reason}: {e.detail}",
                 "steps": None, "t": now}]

    def _unsolicited_ok(self, now: int) -> bool:
        """At most ``reject_rows_per_min`` rows a minute for probe answers to commands this agent did
        not forward (a probe refusing an envelope sent to it directly, or a flood)."""
        return _per_minute_ok(self._unsolicited, now, self.reject_rows_per_min)

    def _window_ok(self, now: int) -> bool:
        """At most ``reject_rows_per_min`` rows a minute for refused commands."""
        return _per_minute_ok(self._rej_window, now, self.reject_rows_per_min)

    def _row(self, cmd: dict, rank, status: str, detail: str, now: int, **kw) -> dict:
        r = {"cmd_id": cmd["cmd_id"], "job": _safe_job(cmd["job"]), "node": self.agent.node,
             "rank": rank, "status": status, "kind": cmd["kind"], "reason": cmd["reason"],
             "role": None if rank is None else ("reference" if rank in cmd["reference"] else "suspect"),
             "detail": detail, "steps": min(cmd["steps"], 2**31 - 1), "t": now}
        r.update(kw)
        return r

    def _refuse(self, cmd: dict, status: str, reason: str, detail: str, now: int, limited: bool) -> list[dict]:
        self.metrics.rejected.labels(reason).inc()
        if self._log_ok():
            log.warning("profiling command %s refused: %s (%s)", cmd["cmd_id"], reason, detail)
        if limited and not self._window_ok(now):
            return []
        ranks = cmd["ranks"] or [None]
        return [self._row(cmd, r, status, f"{reason}: {detail}" if detail else reason, now) for r in ranks]

    def _ctl_ok(self, path) -> bool:
        """A probe's control socket must be a ``probe-*.sock`` in the socket directory or its ``ctl``
        sub-directory: a hello cannot point the agent at any other socket."""
        if not isinstance(path, str) or len(path) > 512:
            return False
        base = os.path.basename(path)
        if not (base.startswith(protocol.CTL_PREFIX) and base.endswith(".sock")):
            return False
        return os.path.realpath(os.path.dirname(path)) in self._ctl_dirs

    def _check_and_forward(self, cmd: dict, envelope: bytes, now: int) -> list[dict]:
        cmd_id = cmd["cmd_id"]
        exp, issued = cmd["expires_at"], cmd["issued_at"]
        steps = cmd["steps"]
        self.seen.expire(now)
        if exp <= now:
            if exp < self.t_start_ns:           # older than this agent: a backlog, not news
                self.metrics.rejected.labels("stale").inc()
                return []
            return self._refuse(cmd, "expired", "expired", f"expired {(now - exp) / 1e9:.1f}s ago", now, False)
        if cmd_id in self.seen:
            return self._refuse(cmd, "rejected", "replay", f"command {cmd_id} was already received", now, True)
        if issued > now + self.skew_s * 1e9:
            return self._refuse(cmd, "rejected", "future", "issued_at is in the future", now, False)
        if exp - issued > self.max_ttl_s * 1e9:
            return self._refuse(cmd, "rejected", "ttl", f"lifetime over {self.max_ttl_s:.0f}s", now, False)
        if not 1 <= steps <= self.max_steps:
            return self._refuse(cmd, "rejected", "steps", f"steps must be 1..{self.max_steps}", now, False)
        try:
            self.seen.add(cmd_id, exp)           # durable before anything is forwarded (fail closed)
        except (OSError, ValueError) as e:
            return self._refuse(cmd, "rejected", "state", f"cannot record the command id ({e}); refusing it "
                                                          f"since a replay could not be detected", now, False)
        mono = time.monotonic()
        if mono - self.last_accept < self.cooldown_s:
            return self._refuse(cmd, "rejected", "cooldown",
                                f"node cooldown: last command {mono - self.last_accept:.0f}s ago "
                                f"(cooldown {self.cooldown_s:.0f}s)", now, False)
        job = _safe_job(cmd["job"])
        served = {(i.job, i.rank): i for i in list(self.agent.idents.values())}
        for k in [k for k, a in self.active.items() if a["deadline"] + GRACE_S * 1e9 < now]:
            a = self.active.pop(k)
            self.rows.append(self._row(a["cmd"], k[1], "expired", "no answer from the probe", now))
        out = []
        accepted = False
        digest = hashlib.sha256(envelope).hexdigest()[:16]
        for rank in cmd["ranks"]:
            ident = served.get((job, rank))
            path = ident.hello.get("ctl") if ident is not None else None
            if ident is None:
                self.metrics.rejected.labels("unknown_rank").inc()
                out.append(self._row(cmd, rank, "failed", "rank not served by this agent", now))
                continue
            if not self._ctl_ok(path):
                self.metrics.rejected.labels("no_control").inc()
                out.append(self._row(cmd, rank, "failed", "the probe of this rank takes no commands "
                                                          "(old version, STEPWATCH_PROFILING=0, or its control "
                                                          "socket is outside the socket directory)", now))
                continue
            if (job, rank) in self.active:
                self.metrics.rejected.labels("busy").inc()
                out.append(self._row(cmd, rank, "busy", f"rank is profiling for command "
                                                        f"{self.active[(job, rank)]['cmd']['cmd_id']}", now))
                continue
            try:
                self._out.sendto(envelope, path)
            except OSError as e:
                self.metrics.rejected.labels("unreachable").inc()
                out.append(self._row(cmd, rank, "failed", f"probe control socket unreachable: {e.strerror}", now))
                continue
            self.active[(job, rank)] = {"cmd": cmd, "deadline": exp, "t": now, "digest": digest}
            self.metrics.forwarded.inc()
            accepted = True
        if accepted:
            self.last_accept = mono
        return out

    # ------------------------------------------------------------------ results from probes
    def on_result(self, ident, body: dict, now_ns: int | None = None) -> dict | None:
        """A ``T_PROFILE`` datagram of a served probe -> the final ``profiles`` row (every field
        type- and size-checked: the probe is a local sender, not a trusted one)."""
        if ident is None or not isinstance(body, dict):
            return None
        now = time.time_ns() if now_ns is None else now_ns
        status = body.get("status") if body.get("status") in protocol.STATUSES else "failed"
        self.metrics.done.labels(status).inc()
        summ = body.get("summary")
        summ = json.dumps(summ, sort_keys=True, default=str) if summ is not None else None
        if summ is not None and len(summ) > 256 << 10:
            summ = None
        with self.lock:
            a = self.active.get((ident.job, ident.rank))
            cid = _s(body.get("cmd_id"), 64)
            if a is not None and (a["cmd"]["cmd_id"] == cid or (cid is None and a["digest"] == body.get("envelope"))):
                del self.active[(ident.job, ident.rank)]
                cid = a["cmd"]["cmd_id"]
            elif not self._unsolicited_ok(now):        # answers to nothing this agent forwarded: bounded
                self.metrics.rejected.labels("unsolicited_result").inc()
                return None
            if status == "ok" and self.keep_bytes > 0:
                self._prune_due = True                   # pruned at the next tick, not on the receive thread
            uri = _s(body.get("uri"), 4096)
            row = {"cmd_id": cid or "?", "job": ident.job, "node": ident.node, "rank": ident.rank,
                   "status": status, "uri": uri if uri and uri.startswith("file://") else None,
                   "bytes": _i(body.get("bytes"), 0, 2**63 - 1), "summary": summ,
                   "started_at": _i(body.get("started_at"), 0, 2**63 - 1),
                   "finished_at": _i(body.get("finished_at"), 0, 2**63 - 1),
                   "kind": body.get("kind") if body.get("kind") in protocol.PROFILER_KINDS else None,
                   "role": body.get("role") if body.get("role") in ("suspect", "reference") else None,
                   "reason": _s(body.get("reason"), 256) or "", "detail": _s(body.get("detail"), 1024) or "",
                   "steps": _i(body.get("steps"), 0, 2**31 - 1), "t": now}
            self.rows.append(row)
        if self._log_ok() or status == "ok":
            log.info("profile %s of rank %d (%s): %s %s", row["cmd_id"], ident.rank, row["kind"], status,
                     row["uri"] or row["detail"])
        return row

    def take_rows(self) -> list[dict]:
        with self.lock:
            now = time.time_ns()
            for k in [k for k, a in self.active.items() if a["deadline"] + GRACE_S * 1e9 < now]:
                a = self.active.pop(k)
                self.rows.append(self._row(a["cmd"], k[1], "expired", "no answer from the probe", now))
            rows, self.rows = self.rows, []
            prune, self._prune_due = self._prune_due, False
            protect = {summary.trace_name(j, r, a["cmd"]["cmd_id"], a["cmd"]["kind"])
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


def _s(v, n: int) -> str | None:
    return v[:n] if isinstance(v, str) else None


def _i(v, lo: int, hi: int) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi else None


def _safe_job(job) -> str:
    return protocol.safe_job(job if isinstance(job, str) else None)

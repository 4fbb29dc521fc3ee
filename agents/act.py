"""``stepwatch act``: an opt-in action on a node that keeps failing — an Alertmanager webhook receiver that
drains the node on Slurm (``scontrol update nodename=<node> state=drain reason="stepwatch: <kind> <incident>"``)
or cordons it on Kubernetes (``kubectl cordon <node>``), dry-run unless ``--execute``.

**Confirmation.** A firing alert whose ``alertname`` is one of ``kinds`` (``slow_node``, ``rank_crash``) and
whose ``nodes`` label (or ``node``) names exactly one node is a *sighting* of that node, keyed by its
``incident`` label (else its ``alert_id``, else its fingerprint). The node is *confirmed* when ``confirmations``
distinct incidents named it within the last ``window_s``: one fault re-sent, re-grouped or re-notified by
Alertmanager is one incident and counts once. Only a new sighting is decided on (Alertmanager's repeats of
what was already seen add nothing and store nothing).

**Gates**, in this order, each stored as a refusal with its reason: ``cooldown`` (this node was acted on
within ``cooldown_s``), ``rate_limit`` (``max_per_hour`` actions in the last hour, all nodes together),
``node_state`` (Slurm: the node is already drained or down — someone else's drain reason is never
overwritten, and an undo never resumes a node stepwatch did not drain — or ``scontrol`` does not know it).
A dry run counts for the gates as an action would (so it shows what the live receiver would do); the
gates of an ``--execute`` receiver count only executed actions (a failed command counts too: no retry
loop).

**Store**: one SQLite file, ``<state-dir>/actions.sqlite``. SQLite rather than JSONL (or the project's
DuckDB/Parquet, which is for telemetry): the receiver and an ``undo`` run by an operator write the same
log from two processes, and the gates are a read-then-append that must be atomic (``BEGIN IMMEDIATE``);
the log is small. Every decision is a row: id, time, node, action, outcome (``done``, ``failed``,
``dry_run``, ``refused``), reason, incident ids, alert kinds, the exact command, its result, and for an
undo the action it undoes.

**Webhook**: ``POST`` (any path) of Alertmanager's webhook payload (``version`` ``"4"``, ``status``,
``alerts[].status``, ``alerts[].labels``), at most ``max_body`` bytes with a ``Content-Length``, and an
``Authorization`` header matching the credentials file (a bearer token, or ``user:password`` for basic
auth: Alertmanager's ``http_config.authorization.credentials_file`` / ``basic_auth.password_file``);
anything else is refused (401, 400, 411, 413) before it is parsed. Listens on 127.0.0.1 unless told.
"""
from __future__ import annotations

import base64
import binascii
import hmac
import http.server
import json
import logging
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from stepwatch.metrics import Metrics

log = logging.getLogger("stepwatch.act")

KINDS = ("slow_node", "rank_crash")
#: a node name that is one host, never a Slurm host list (``n[1-64]``), a list, or a second argument
NODE_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?\Z")   # \Z: "$" lets a final newline in
ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}\Z")
MAX_ALERTS = 1000                 # alerts in one notification
MAX_LABEL = 1024                  # characters of one label value
REFUSALS = ("cooldown", "rate_limit", "node_state")
BACKENDS = {"slurm": ("drain", "resume"), "k8s": ("cordon", "uncordon")}


class ActError(Exception):
    pass


class PayloadError(ValueError):
    pass


# ---------------------------------------------------------------------------- the payload
def parse_payload(body: bytes) -> list[dict]:
    """Alertmanager's webhook payload (version 4) -> its alerts (each with ``status`` and string
    ``labels``). Raises :class:`PayloadError` naming the field and value."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"body is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise PayloadError(f"body: expected a JSON object, got {type(doc).__name__}")
    if doc.get("version") != "4":
        raise PayloadError(f"version: expected \"4\" (Alertmanager's webhook payload), got {_short(doc.get('version'))}")
    if doc.get("status") not in ("firing", "resolved"):
        raise PayloadError(f"status: expected firing or resolved, got {_short(doc.get('status'))}")
    alerts = doc.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError(f"alerts: expected a list, got {_short(alerts)}")
    if len(alerts) > MAX_ALERTS:
        raise PayloadError(f"alerts: {len(alerts)} alerts, at most {MAX_ALERTS}")
    for i, a in enumerate(alerts):
        if not isinstance(a, dict):
            raise PayloadError(f"alerts[{i}]: expected an object, got {_short(a)}")
        if a.get("status") not in ("firing", "resolved"):
            raise PayloadError(f"alerts[{i}].status: expected firing or resolved, got {_short(a.get('status'))}")
        labels = a.get("labels")
        if not isinstance(labels, dict):
            raise PayloadError(f"alerts[{i}].labels: expected an object, got {_short(labels)}")
        for k, v in labels.items():
            if not isinstance(v, str) or len(v) > MAX_LABEL:
                raise PayloadError(f"alerts[{i}].labels.{str(k)[:40]}: expected a string of at most {MAX_LABEL} "
                                   f"characters, got {_short(v)}")
        fp = a.get("fingerprint", "")
        if not isinstance(fp, str):
            raise PayloadError(f"alerts[{i}].fingerprint: expected a string, got {_short(fp)}")
    return alerts


def _short(v, n: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n - 1] + "…"


def sightings(alerts: list[dict], kinds, max_nodes: int = 1) -> tuple[list[dict], list[str]]:
    """The firing alerts of ``kinds`` that name a node: ``[{node, incident, kind, alert_id, job}]``, and
    why each other alert of those kinds was left out."""
    out, skipped = [], []
    for a in alerts:
        lab = a["labels"]
        kind = lab.get("alertname", "")
        if a["status"] != "firing" or kind not in kinds:
            continue
        nodes = [n for n in (lab.get("nodes") or lab.get("node") or "").split(",") if n]
        incident = lab.get("incident") or lab.get("alert_id") or a.get("fingerprint") or ""
        if not nodes:
            skipped.append(f"{kind}: no nodes label")
            continue
        if len(nodes) > max_nodes:
            skipped.append(f"{kind} {incident}: names {len(nodes)} nodes (at most {max_nodes}): not one node's fault")
            continue
        if not ID_RE.match(incident):
            skipped.append(f"{kind}: incident {_short(incident)} is not an id")
            continue
        bad = [n for n in nodes if not NODE_RE.match(n)]
        if bad:
            skipped.append(f"{kind} {incident}: node {_short(bad[0])} is not a host name")
            continue
        for n in nodes:
            out.append({"node": n, "incident": incident, "kind": kind, "alert_id": lab.get("alert_id", ""),
                        "job": lab.get("job", "")})
    return out, skipped


# ---------------------------------------------------------------------------- commands
def command(backend: str, action: str, node: str, reason: str = "", scontrol: str = "scontrol",
            kubectl: str = "kubectl") -> list[str]:
    """The argv of ``action`` on ``node`` (no shell: the node and the reason are single arguments)."""
    if not NODE_RE.match(node):
        raise ActError(f"node {node!r} is not a host name")
    if backend == "slurm":
        argv = [scontrol, "update", f"nodename={node}", f"state={action}"]
        return argv + [f"reason={reason}"] if action == "drain" else argv
    if backend == "k8s":
        return [kubectl, action, node]
    raise ActError(f"backend {backend!r}: slurm or k8s")


def run(argv: list[str], timeout_s: float = 30.0) -> tuple[int, str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]}: no answer in {timeout_s:.0f}s"
    return r.returncode, (r.stdout + r.stderr).strip()[-2000:]


def slurm_state(node: str, scontrol: str) -> tuple[str | None, str]:
    """(the node's ``State=`` in ``scontrol show node``, e.g. ``IDLE``, ``MIXED+DRAIN``; None if unknown, why)."""
    rc, out = run([scontrol, "show", "node", node], timeout_s=15)
    m = re.search(r"\bState=(\S+)", out) if rc == 0 else None
    return (m.group(1), out) if m else (None, out or f"rc {rc}")


# ---------------------------------------------------------------------------- the store
SCHEMA = """
CREATE TABLE IF NOT EXISTS sightings (node TEXT NOT NULL, incident TEXT NOT NULL, kind TEXT NOT NULL,
    alert_id TEXT, job TEXT, t REAL NOT NULL, PRIMARY KEY (node, incident));
CREATE TABLE IF NOT EXISTS actions (id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, node TEXT NOT NULL,
    backend TEXT NOT NULL, action TEXT NOT NULL, outcome TEXT NOT NULL, reason TEXT, incidents TEXT NOT NULL,
    kinds TEXT NOT NULL, command TEXT, result TEXT, undo_of INTEGER);
"""


class Store:
    """The action log (see the module docs). One connection per call: safe from any thread or process."""

    def __init__(self, state_dir: str):
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        self.path = os.path.join(state_dir, "actions.sqlite")
        with self._con() as c:
            c.executescript(SCHEMA)

    def _con(self) -> sqlite3.Connection:
        c = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        c.row_factory = sqlite3.Row
        return c

    def transaction(self):
        c = self._con()
        c.execute("BEGIN IMMEDIATE")
        return c

    def actions(self, node: str | None = None) -> list[dict]:
        c = self._con()
        try:
            q = "SELECT * FROM actions" + (" WHERE node = ?" if node else "") + " ORDER BY id"
            return [_row(r) for r in c.execute(q, [node] if node else [])]
        finally:
            c.close()

    def action(self, aid: int) -> dict | None:
        c = self._con()
        try:
            r = c.execute("SELECT * FROM actions WHERE id = ?", [aid]).fetchone()
            return _row(r) if r else None
        finally:
            c.close()

    def sightings(self) -> list[dict]:
        c = self._con()
        try:
            return [dict(r) for r in c.execute("SELECT * FROM sightings ORDER BY t")]
        finally:
            c.close()


def _row(r: sqlite3.Row) -> dict:
    d = dict(r)
    d["incidents"], d["kinds"] = json.loads(d["incidents"]), json.loads(d["kinds"])
    return d


def _insert(c: sqlite3.Connection, **row) -> int:
    row = {"incidents": [], "kinds": [], **row}
    row["incidents"], row["kinds"] = json.dumps(row["incidents"]), json.dumps(row["kinds"])
    cols = ", ".join(row)
    cur = c.execute(f"INSERT INTO actions ({cols}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
    return int(cur.lastrowid)


# ---------------------------------------------------------------------------- the decision
@dataclass
class Policy:
    backend: str = "slurm"
    execute: bool = False
    kinds: tuple = KINDS
    confirmations: int = 3
    window_s: float = 1800.0
    max_per_hour: int = 2
    cooldown_s: float = 4 * 3600.0
    max_nodes: int = 1
    scontrol: str = "scontrol"
    kubectl: str = "kubectl"
    counted: tuple = field(init=False)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ActError(f"backend {self.backend!r}: slurm or k8s")
        for name in ("confirmations", "max_per_hour", "max_nodes"):
            if int(getattr(self, name)) < 1:
                raise ActError(f"{name} {getattr(self, name)!r}: at least 1")
        for name in ("window_s", "cooldown_s"):
            if not float(getattr(self, name)) > 0:
                raise ActError(f"{name} {getattr(self, name)!r}: more than 0")
        self.counted = ("done", "failed") if self.execute else ("dry_run",)


class Actor:
    """Sightings in, decisions out (stored, counted, printed)."""

    def __init__(self, store: Store, policy: Policy, metrics: "ActMetrics | None" = None, out=None):
        self.store, self.p = store, policy
        self.metrics = metrics or ActMetrics()
        self.out = out or sys.stdout
        self.lock = threading.Lock()

    def handle(self, alerts: list[dict], now: float | None = None) -> list[dict]:
        """Record the sightings in ``alerts``; decide for every node a new sighting confirms. Returns the
        decisions (rows) taken."""
        now = time.time() if now is None else now
        seen, skipped = sightings(alerts, self.p.kinds, self.p.max_nodes)
        for why in skipped:
            log.info("ignored: %s", why)
            self.metrics.ignored.inc()
        decided = []
        with self.lock:
            for node in dict.fromkeys(s["node"] for s in seen):
                row = self._node(node, [s for s in seen if s["node"] == node], now)
                if row is not None:
                    decided.append(row)
        return decided

    def _node(self, node: str, seen: list[dict], now: float) -> dict | None:
        p = self.p
        c = self.store.transaction()
        try:
            new = 0
            for s in seen:
                new += c.execute("INSERT OR IGNORE INTO sightings VALUES (?, ?, ?, ?, ?, ?)",
                                 [node, s["incident"], s["kind"], s["alert_id"], s["job"], now]).rowcount
            if not new:
                c.execute("COMMIT")
                return None                                  # a repeat of what was seen: nothing to decide
            inc = c.execute("SELECT incident, kind FROM sightings WHERE node = ? AND t >= ? ORDER BY t, incident",
                            [node, now - p.window_s]).fetchall()
            incidents, kinds = [r[0] for r in inc], sorted({r[1] for r in inc})
            if len(incidents) < p.confirmations:
                c.execute("COMMIT")
                log.warning("node %s: %d of %d incident(s) within %.0f min (%s): not yet", node, len(incidents),
                            p.confirmations, p.window_s / 60, ", ".join(incidents))
                self.metrics.pending.inc()
                return None
            action, _ = BACKENDS[p.backend]
            last = seen[-1]
            reason_text = f"stepwatch: {last['kind']} {last['incident']}"
            argv = command(p.backend, action, node, reason_text, p.scontrol, p.kubectl)
            cmd = shlex.join(argv)
            base = dict(t=now, node=node, backend=p.backend, action=action, incidents=incidents, kinds=kinds,
                        command=cmd)
            q = ",".join("?" * len(p.counted))
            prev = c.execute(f"SELECT id, t FROM actions WHERE node = ? AND action = ? AND outcome IN ({q}) "
                             "AND t > ? ORDER BY t DESC LIMIT 1", [node, action, *p.counted, now - p.cooldown_s]
                             ).fetchone()
            refusal = None
            if prev is not None:
                refusal = ("cooldown", f"action {prev[0]} on {node} {now - prev[1]:.0f}s ago; cool-down "
                                       f"{p.cooldown_s:.0f}s")
            else:
                n_hour = c.execute(f"SELECT count(*) FROM actions WHERE action = ? AND outcome IN ({q}) AND t > ?",
                                   [action, *p.counted, now - 3600]).fetchone()[0]
                if n_hour >= p.max_per_hour:
                    refusal = ("rate_limit", f"{n_hour} action(s) in the last hour, at most {p.max_per_hour}")
                elif p.backend == "slurm" and (p.execute or shutil.which(p.scontrol)):
                    state, why = slurm_state(node, p.scontrol)
                    if state is None:
                        refusal = ("node_state", f"scontrol does not know node {node}: {why[-300:]}")
                    elif re.search(r"DRAIN|DOWN|FAIL", state):
                        refusal = ("node_state", f"node {node} is already {state}: left as it is")
            if refusal is not None:
                rid = _insert(c, **base, outcome="refused", reason=refusal[0], result=refusal[1])
                c.execute("COMMIT")
                log.warning("action %d: refused to %s %s (%s): %s", rid, action, node, refusal[0], refusal[1])
                print(f"stepwatch act: refused ({refusal[0]}) {cmd}: {refusal[1]}", file=self.out, flush=True)
                self.metrics.decisions.labels("refused", refusal[0]).inc()
                return self.store.action(rid)
            if not p.execute:
                rid = _insert(c, **base, outcome="dry_run", reason=None, result="dry run: not run")
                c.execute("COMMIT")
                print(f"stepwatch act: dry run (action {rid}), would run: {cmd}", file=self.out, flush=True)
                log.warning("action %d: dry run, would run: %s", rid, cmd)
                self.metrics.decisions.labels("dry_run", "confirmed").inc()
                return self.store.action(rid)
            rc, out = run(argv)                    # under the transaction: a second receiver waits for the result
            outcome = "done" if rc == 0 else "failed"
            rid = _insert(c, **base, outcome=outcome, reason=None if rc == 0 else f"exit {rc}",
                          result=f"rc {rc}" + (f": {out}" if out else ""))
            c.execute("COMMIT")
            print(f"stepwatch act: {outcome} (action {rid}): {cmd}" + (f" -> rc {rc}: {out}" if rc else ""),
                  file=self.out, flush=True)
            log.warning("action %d: %s: %s (rc %d)", rid, outcome, cmd, rc)
            self.metrics.decisions.labels(outcome, "confirmed" if rc == 0 else f"exit {rc}").inc()
            return self.store.action(rid)
        except BaseException:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise
        finally:
            c.close()


def undo(store: Store, action_id: int | None = None, node: str | None = None, dry_run: bool = False,
         scontrol: str = "scontrol", kubectl: str = "kubectl", out=None) -> dict:
    """Undo one action (by id, or the newest not-undone drain/cordon on ``node``): ``scontrol update
    nodename=<node> state=resume`` / ``kubectl uncordon <node>``. A dry-run action's undo is a dry run too.
    Raises :class:`ActError` when there is nothing to undo."""
    out = out or sys.stdout
    c = store.transaction()
    try:
        undone = {r[0] for r in c.execute("SELECT undo_of FROM actions WHERE undo_of IS NOT NULL "
                                          "AND outcome IN ('done', 'dry_run')")}
        if action_id is not None:
            r = c.execute("SELECT * FROM actions WHERE id = ?", [action_id]).fetchone()
            if r is None:
                raise ActError(f"action {action_id}: no such action in {store.path}")
        else:
            r = next((x for x in c.execute("SELECT * FROM actions WHERE node = ? AND undo_of IS NULL AND outcome IN "
                                           "('done', 'dry_run') ORDER BY id DESC", [node]) if x["id"] not in undone),
                     None)
            if r is None:
                raise ActError(f"node {node!r}: stepwatch has no action on it left to undo")
        if r["undo_of"] is not None or r["outcome"] not in ("done", "dry_run"):
            raise ActError(f"action {r['id']} ({r['action']} {r['node']}, {r['outcome']}): nothing to undo")
        if r["id"] in undone:
            raise ActError(f"action {r['id']} ({r['action']} {r['node']}): already undone")
        verb = BACKENDS[r["backend"]][1]
        argv = command(r["backend"], verb, r["node"], scontrol=scontrol, kubectl=kubectl)
        cmd = shlex.join(argv)
        base = dict(t=time.time(), node=r["node"], backend=r["backend"], action=verb, undo_of=r["id"],
                    incidents=json.loads(r["incidents"]), kinds=json.loads(r["kinds"]), command=cmd)
        if dry_run or r["outcome"] == "dry_run":
            rid = _insert(c, **base, outcome="dry_run", result="dry run: not run")
            print(f"stepwatch act: dry run (action {rid}), would run: {cmd}", file=out, flush=True)
        else:
            rc, text = run(argv)
            rid = _insert(c, **base, outcome="done" if rc == 0 else "failed", reason=None if rc == 0 else f"exit {rc}",
                          result=f"rc {rc}" + (f": {text}" if text else ""))
            print(f"stepwatch act: {'done' if rc == 0 else 'failed'} (action {rid}): {cmd}"
                  + (f" -> rc {rc}: {text}" if rc else ""), file=out, flush=True)
        c.execute("COMMIT")
    except BaseException:
        if c.in_transaction:
            c.execute("ROLLBACK")
        raise
    finally:
        c.close()
    return store.action(rid)


# ---------------------------------------------------------------------------- metrics
class ActMetrics(Metrics):
    def __init__(self, registry=None):
        self.registry = registry or CollectorRegistry()
        p = "stepwatch_act"
        self.decisions = Counter(f"{p}_decisions", "Decisions on a confirmed node, by outcome (done, failed, dry_run, "
                                 "refused) and reason (confirmed, cooldown, rate_limit, node_state, exit N)",
                                 ["outcome", "reason"], registry=self.registry)
        self.requests = Counter(f"{p}_requests", "Webhook requests by answer (accepted, unauthorized, bad_payload, "
                                "too_large, no_length, not_found)", ["result"], registry=self.registry)
        self.pending = Counter(f"{p}_sightings_pending", "New sightings that did not (yet) confirm their node",
                               registry=self.registry)
        self.ignored = Counter(f"{p}_alerts_ignored", "Alerts of the kinds acted on that name no single valid node",
                               registry=self.registry)


# ---------------------------------------------------------------------------- the webhook
def read_auth(path: str, kind: str) -> tuple[str, bytes]:
    """(kind, the secret) from a credentials file: a bearer token, or ``user:password`` for basic."""
    from stepwatch import secretfile
    try:
        with open(path, "rb") as f:
            text = f.read().strip()
    except OSError as e:
        raise ActError(f"--auth-file {path}: {e.strerror}") from None
    if not text:
        raise ActError(f"--auth-file {path}: empty")
    if kind == "basic" and b":" not in text:
        raise ActError(f"--auth-file {path}: basic auth needs user:password")
    if kind not in ("bearer", "basic"):
        raise ActError(f"--auth {kind!r}: bearer or basic")
    secretfile.check(path, "--auth-file")
    return kind, text


def authorized(header: str | None, auth: tuple[str, bytes]) -> bool:
    kind, secret = auth
    if not header:
        return False
    scheme, _, value = header.strip().partition(" ")
    value = value.strip().encode()
    if kind == "bearer":
        return scheme.lower() == "bearer" and hmac.compare_digest(value, secret)
    if scheme.lower() != "basic":
        return False
    try:
        got = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False
    return hmac.compare_digest(got, secret)


class Receiver:
    """The webhook server (a thread per request; decisions are serialised by the actor and the store)."""

    def __init__(self, actor: Actor, auth: tuple[str, bytes], host: str = "127.0.0.1", port: int = 0,
                 max_body: int = 1 << 20):
        self.actor, self.auth, self.max_body = actor, auth, int(max_body)
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            server_version = "stepwatch-act"
            sys_version = ""
            timeout = 10                      # a client that stalls mid-request loses its thread after 10 s

            def _answer(self, code: int, text: str, result: str, headers: dict | None = None):
                outer.actor.metrics.requests.labels(result).inc()
                body = (text + "\n").encode()
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                if self.path in ("/-/healthy", "/-/ready"):
                    return self._answer(200, "ok", "health")
                return self._answer(404, "POST Alertmanager's webhook payload here", "not_found")

            def do_POST(self):  # noqa: N802
                if not authorized(self.headers.get("Authorization"), outer.auth):
                    self.close_connection = True
                    return self._answer(401, "unauthorized", "unauthorized",
                                        {"WWW-Authenticate": 'Basic realm="stepwatch act"'
                                         if outer.auth[0] == "basic" else 'Bearer realm="stepwatch act"'})
                n = self.headers.get("Content-Length")
                if n is None or self.headers.get("Transfer-Encoding"):
                    self.close_connection = True
                    return self._answer(411, "a Content-Length is required", "no_length")
                try:
                    n = int(n)
                except ValueError:
                    self.close_connection = True
                    return self._answer(400, f"Content-Length {_short(n)} is not a number", "bad_payload")
                if n < 0 or n > outer.max_body:
                    self.close_connection = True
                    return self._answer(413, f"body of {n} bytes: at most {outer.max_body}", "too_large")
                try:
                    alerts = parse_payload(self.rfile.read(n))
                except PayloadError as e:
                    log.warning("refused a webhook payload from %s: %s", self.client_address[0], e)
                    return self._answer(400, str(e), "bad_payload")
                rows = outer.actor.handle(alerts)
                return self._answer(200, json.dumps([{k: r[k] for k in ("id", "node", "outcome", "reason")}
                                                     for r in rows]), "accepted")

            def log_message(self, fmt, *args):
                log.debug("%s " + fmt, self.client_address[0], *args)

        self.server = http.server.ThreadingHTTPServer((host, port), H)
        self.server.daemon_threads = True
        self.host, self.port = self.server.server_address[:2]

    def serve_forever(self):
        self.server.serve_forever(poll_interval=0.2)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------- the command
def add_act_args(p) -> None:
    sub = p.add_subparsers(dest="act_cmd", metavar="serve|undo|log", required=True)
    s = sub.add_parser("serve", help="the Alertmanager webhook receiver (dry run unless --execute)")
    s.add_argument("--state-dir", required=True, help="the action log (actions.sqlite) lives here")
    s.add_argument("--auth-file", required=True, help="the bearer token, or user:password with --auth basic, "
                   "that Alertmanager's http_config sends (a request without it is refused)")
    s.add_argument("--auth", choices=["bearer", "basic"], default="bearer")
    s.add_argument("--listen", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    s.add_argument("--port", type=int, default=9097, help="port (9097; 0: a free one, printed)")
    s.add_argument("--backend", choices=sorted(BACKENDS), default="slurm",
                   help="slurm: scontrol drain/resume; k8s: kubectl cordon/uncordon")
    s.add_argument("--execute", action="store_true", help="run the commands (default: a dry run that prints "
                   "and stores them)")
    s.add_argument("--kinds", default=",".join(KINDS), help="alert kinds that count (%(default)s)")
    s.add_argument("--confirmations", type=int, default=3, help="distinct incidents naming a node (3)")
    s.add_argument("--window", type=float, default=30.0, metavar="MIN", help="... within this many minutes (30)")
    s.add_argument("--max-per-hour", type=int, default=2, help="actions per hour, all nodes together (2)")
    s.add_argument("--cooldown", type=float, default=240.0, metavar="MIN",
                   help="minutes after an action on a node before another one on it (240)")
    s.add_argument("--max-body", type=int, default=1 << 20, help="largest webhook body in bytes (1 MiB)")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    s.add_argument("--metrics-addr", default="127.0.0.1")
    s.add_argument("--scontrol", default=shutil.which("scontrol") or "scontrol")
    s.add_argument("--kubectl", default=shutil.which("kubectl") or "kubectl")
    s.set_defaults(func=cmd_serve)
    u = sub.add_parser("undo", help="undo an action: scontrol ... state=resume / kubectl uncordon")
    u.add_argument("action_id", nargs="?", type=int, help="the action's id (stepwatch act log)")
    u.add_argument("--node", help="... or the newest action on this node not yet undone")
    u.add_argument("--state-dir", required=True)
    u.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    u.add_argument("--scontrol", default=shutil.which("scontrol") or "scontrol")
    u.add_argument("--kubectl", default=shutil.which("kubectl") or "kubectl")
    u.set_defaults(func=cmd_undo)
    lg = sub.add_parser("log", help="print the action log")
    lg.add_argument("--state-dir", required=True)
    lg.add_argument("--node")
    lg.add_argument("--json", action="store_true", help="one JSON object per line")
    lg.set_defaults(func=cmd_log)


def cmd_serve(a) -> int:
    import signal
    try:
        auth = read_auth(a.auth_file, a.auth)
        policy = Policy(backend=a.backend, execute=a.execute, kinds=tuple(k for k in a.kinds.split(",") if k),
                        confirmations=a.confirmations, window_s=a.window * 60, max_per_hour=a.max_per_hour,
                        cooldown_s=a.cooldown * 60, scontrol=a.scontrol, kubectl=a.kubectl)
        store = Store(a.state_dir)
        actor = Actor(store, policy)
        rec = Receiver(actor, auth, a.listen, a.port, a.max_body)
    except (ActError, OSError, sqlite3.Error) as e:
        print(f"stepwatch act: {e}", file=sys.stderr)
        return 2
    if a.metrics_port is not None:
        actor.metrics.serve(a.metrics_port, a.metrics_addr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    th = threading.Thread(target=rec.serve_forever, name="stepwatch-act", daemon=True)
    th.start()
    mode = "EXECUTE" if policy.execute else "dry run"
    print(f"stepwatch act: listening on {rec.host}:{rec.port} ({mode}, {policy.backend}; {policy.confirmations} "
          f"incidents in {policy.window_s / 60:g} min, at most {policy.max_per_hour}/h, cool-down "
          f"{policy.cooldown_s / 60:g} min; log {store.path})", flush=True)
    try:
        while not stop.is_set():
            stop.wait(0.5)
    finally:
        rec.close()
    return 0


def cmd_undo(a) -> int:
    if (a.action_id is None) == (a.node is None):
        print("stepwatch act undo: give an action id or --node (one of them)", file=sys.stderr)
        return 2
    try:
        row = undo(Store(a.state_dir), a.action_id, a.node, a.dry_run, a.scontrol, a.kubectl)
    except (ActError, sqlite3.Error) as e:
        print(f"stepwatch act undo: {e}", file=sys.stderr)
        return 1
    return 0 if row["outcome"] in ("done", "dry_run") else 1


def cmd_log(a) -> int:
    for r in Store(a.state_dir).actions(a.node):
        if a.json:
            print(json.dumps(r, sort_keys=True))
        else:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r["t"]))
            print(f"{r['id']:>5} {when} {r['node']} {r['action']} {r['outcome']}"
                  + (f" ({r['reason']})" if r["reason"] else "") + (f" undoes {r['undo_of']}" if r["undo_of"] else "")
                  + f" incidents={','.join(r['incidents'])}: {r['command']}")
    return 0

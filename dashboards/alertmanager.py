"""Alerts to Prometheus' Alertmanager (API v2), delivered without ever blocking the caller.

:class:`AlertmanagerSink` sits beside :class:`~stepwatch.dashboards.annotations.AnnotationSink` on the
processor's alert callback (see :mod:`stepwatch.stream.alertfanout`). :meth:`~AlertmanagerSink.submit`
puts the alert on one bounded in-memory queue per Alertmanager URL and returns at once; one background
thread per URL posts ``POST <url>/api/v2/alerts`` (a JSON list of ``postableAlert``), so a slow or dead
member of an HA pair never delays the other (Alertmanager's own recommendation: send to every member,
they deduplicate between themselves).

What is sent, per alert (:func:`postable_alert`):

* **labels** (they identify the alert; Alertmanager's fingerprint is a hash of them, so they never
  change between firing, re-sends and resolved, nor across processor restarts): ``alertname`` = the
  alert kind (``slow_rank``, ``regression``, ...), ``job`` (the training job), ``severity``, ``cause``,
  ``alert_id`` (the store's stable id: the same finding is the same Alertmanager alert), ``source`` =
  ``stepwatch``, ``incident`` (the alert's incident id, ``detectors/incidents.py``: a route with
  ``group_by: [incident]`` notifies once per fault — the straggler, the regression and jitter it caused,
  its re-fires), and ``ranks`` / ``nodes`` (comma-separated) when there are at most :data:`MAX_LABELLED`;
* **annotations** (the newest wins): ``summary`` (the alert's readable line), ``description``,
  ``suggestion``, ``evidence`` (JSON, cut to :data:`MAX_EVIDENCE` characters), ``cost`` (estimated
  throughput lost, %), ``ranks`` / ``nodes`` (the first 64), ``step_first``, ``step_detected``,
  ``dashboard`` (the Grafana Job dashboard of the job over the alert's time range, with
  ``grafana_url``), ``profile`` (a targeted profile's top operators, when one arrived);
* ``startsAt``: the first step of the finding (``evidence.t_first_ns``) or its detection time;
  ``endsAt``: for a firing alert ``now + resolve_after_s`` (``4 x resend_interval_s``, as Prometheus
  does), for a resolved one its resolution time, for a point alert (``regression``, ``recovery``,
  ``mfu_regression``: no ``resolved`` follows) ``startsAt + point_hold_s``; ``generatorURL``: the
  dashboard link.

While an alert fires, every worker **re-sends** it every ``resend_interval_s`` (Alertmanager resolves an
alert whose ``endsAt`` passes without a re-send). After a processor restart the processor hands the open
alerts it finds in the store to :meth:`~AlertmanagerSink.restore`, which resumes the re-sends: the
same labels, so Alertmanager sees the same alert — no second notification, no false resolution.

Delivery: each POST carries up to ``batch`` alerts; a connection error, a timeout, a 5xx, 408 or 429 is
retried with exponential backoff and jitter (``tenacity``: ``backoff_s`` doubling up to
``backoff_max_s``), until delivered (``max_attempts`` bounds it if set) or the sink closes; any other 4xx
is not retried and counts as *failed*. While an Alertmanager is away, alerts wait in its queue
(``maxsize``); when the queue is full new alerts are dropped and counted. The queues, threads, retries
and close are :mod:`stepwatch.dashboards.sink`'s, shared with the Grafana annotation sink. Credentials: HTTP basic
auth or a bearer token read from a file (:func:`credentials_file`: a file other users can read is warned
about; a replaced or rewritten file is read again before the next delivery, so a rotated Secret takes
effect without a restart).

Prometheus metrics (on the registry passed in, e.g. the processor's), label ``url``:
``stepwatch_alertmanager_alerts_sent_total``, ``…_failed_total``, ``…_dropped_total``,
``stepwatch_alertmanager_requests_retried_total``, gauges ``stepwatch_alertmanager_alerts_queued`` and
``stepwatch_alertmanager_alerts_firing`` (being re-sent); without label,
``stepwatch_alertmanager_alerts_restored_total`` (open alerts taken over from the store).
"""
from __future__ import annotations

import base64
import collections
import datetime as dt
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request

from prometheus_client import CollectorRegistry, Counter, Gauge

from stepwatch.detectors.base import Alert

from stepwatch.metrics import Metrics

from .sink import POLL_S, Lane, QueueSink, Retryable, SinkClosed

log = logging.getLogger("stepwatch.alertmanager")

MAX_LABELLED = 4          # ranks/nodes become labels only when there are at most this many
MAX_LISTED = 64           # ... and annotations list at most this many
MAX_EVIDENCE = 4000       # characters of the evidence JSON annotation
POINT_KINDS = frozenset({"regression", "recovery", "mfu_regression"})
RETRY_STATUS = frozenset({408, 429})
JOB_DASHBOARD_PATH = "/d/stepwatch-job/stepwatch-job"
LINK_MARGIN_S = 600       # the dashboard link shows this much before the finding and after its end


class AlertmanagerError(Exception):
    pass


def _rfc3339(t_ns: int | float) -> str:
    return dt.datetime.fromtimestamp(float(t_ns) / 1e9, tz=dt.timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def read_credentials(path: str, kind: str = "bearer") -> str:
    """The ``Authorization`` header value from a file: ``bearer`` — the file holds the token;
    ``basic`` — the file holds ``user:password`` (one line; surrounding whitespace is ignored). A file
    other users can read is warned about (:mod:`stepwatch.secretfile`)."""
    from stepwatch import secretfile
    secretfile.check(path, "--alertmanager-credentials-file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as e:
        raise AlertmanagerError(f"cannot read Alertmanager credentials file {path}: {e.strerror}") from e
    if not text:
        raise AlertmanagerError(f"Alertmanager credentials file {path} is empty")
    if kind == "bearer":
        return f"Bearer {text}"
    if kind == "basic":
        if ":" not in text:
            raise AlertmanagerError(f"Alertmanager credentials file {path} must hold user:password for basic auth")
        return "Basic " + base64.b64encode(text.encode()).decode()
    raise AlertmanagerError(f"unknown Alertmanager auth kind {kind!r} (basic or bearer)")


def credentials_file(path: str, kind: str = "bearer"):
    """The ``Authorization`` header of a credentials file as a callable (:class:`stepwatch.secretfile.Reread`):
    read at start (errors raise there) and again before a delivery whenever the file was replaced or
    rewritten, so a rotated Secret takes effect without a restart; a file found empty or gone mid-rewrite
    keeps the header in use."""
    from stepwatch.secretfile import Reread
    return Reread(path, lambda p: read_credentials(p, kind), "--alertmanager-credentials-file",
                  errors=(AlertmanagerError,))


def split_credentials(url: str) -> tuple[str, str | None]:
    """``http://user:pw@host:9093`` -> (``http://host:9093``, the ``Authorization: Basic`` value), so
    the password is sent as basic auth and never reaches a metric label or a log line (both show the
    URL without it). A URL without credentials comes back unchanged, with None."""
    u = urllib.parse.urlsplit(url)
    if u.username is None and u.password is None:
        return url, None
    host = u.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = u.port
    except ValueError:
        raise AlertmanagerError(f"Alertmanager URL {u.scheme}://***@{u.netloc.rpartition('@')[2]}: "
                                "bad port") from None
    clean = urllib.parse.urlunsplit((u.scheme, host + (f":{port}" if port else ""), u.path, u.query, u.fragment))
    if u.password is None:
        raise AlertmanagerError(f"Alertmanager URL {clean} names a user but no password: put user:password "
                                "in a credentials file instead (--alertmanager-credentials-file, "
                                "--alertmanager-auth basic)")
    userpass = f"{urllib.parse.unquote(u.username or '')}:{urllib.parse.unquote(u.password)}"
    return clean, "Basic " + base64.b64encode(userpass.encode()).decode()


def dashboard_link(grafana_url: str | None, alert: Alert, t_start_ns: int, t_end_ns: int) -> str:
    """The Grafana Job dashboard of the alert's job over its time range (with a margin), or ''."""
    if not grafana_url:
        return ""
    q = urllib.parse.urlencode({"var-job": alert.job, "from": int(t_start_ns // 1_000_000) - LINK_MARGIN_S * 1000,
                                "to": int(t_end_ns // 1_000_000) + LINK_MARGIN_S * 1000})
    return f"{grafana_url.rstrip('/')}{JOB_DASHBOARD_PATH}?{q}"


def _t_first(alert: Alert) -> int:
    tf = (alert.evidence or {}).get("t_first_ns")
    try:
        return min(int(tf), int(alert.t_detected)) if tf is not None else int(alert.t_detected)
    except (TypeError, ValueError):
        return int(alert.t_detected)


def postable_alert(alert: Alert, *, now_ns: int, resolve_after_s: float, point_hold_s: float,
                   grafana_url: str | None = None, starts_ns: int | None = None) -> dict:
    """One ``postableAlert`` of the v2 API for ``alert`` (see the module docs). ``starts_ns``: the
    firing's start when ``alert`` is the resolved row (else taken from the alert)."""
    starts = int(starts_ns) if starts_ns is not None else _t_first(alert)
    starts = min(starts, now_ns)
    if alert.status == "resolved":
        ends = max(starts, min(int(alert.t_detected), now_ns))
    elif alert.kind in POINT_KINDS:
        ends = starts + int(point_hold_s * 1e9)
    else:
        ends = now_ns + int(resolve_after_s * 1e9)
    ranks = [int(r) for r in alert.ranks]
    nodes = list(dict.fromkeys(str(n) for n in alert.nodes))
    labels = {"alertname": alert.kind, "job": alert.job, "severity": alert.severity or "warning",
              "cause": alert.cause or "unknown", "alert_id": alert.alert_id, "source": "stepwatch"}
    if getattr(alert, "incident_id", ""):          # fixed for the alert's life: route with group_by [incident]
        labels["incident"] = alert.incident_id
    if ranks and len(ranks) <= MAX_LABELLED:
        labels["ranks"] = ",".join(map(str, ranks))
    if nodes and len(nodes) <= MAX_LABELLED:
        labels["nodes"] = ",".join(nodes)
    ev = {k: v for k, v in (alert.evidence or {}).items() if k != "profile_diff"}
    evidence = json.dumps(ev, default=float, sort_keys=True)
    if len(evidence) > MAX_EVIDENCE:
        evidence = evidence[:MAX_EVIDENCE - 1] + "…"
    link = dashboard_link(grafana_url, alert, starts, max(ends if alert.status == "resolved" else alert.t_detected,
                                                           starts))
    ann = {"summary": alert.line(), "suggestion": alert.suggestion or "", "evidence": evidence,
           "cost": f"{float(alert.cost_pct):.1f}%", "step_first": str(int(alert.step_first)),
           "step_detected": str(int(alert.step_detected)),
           "description": (f"{alert.kind} in job {alert.job} from step {alert.step_first}"
                           + (f", rank(s) {','.join(map(str, ranks[:MAX_LISTED]))}" if ranks else "")
                           + (f" on {','.join(nodes[:MAX_LISTED])}" if nodes else "")
                           + f"; likely cause: {alert.cause}; estimated cost {float(alert.cost_pct):.1f}% of "
                           "throughput.")}
    if ranks:
        ann["ranks"] = ",".join(map(str, ranks[:MAX_LISTED])) + ("…" if len(ranks) > MAX_LISTED else "")
    if nodes:
        ann["nodes"] = ",".join(nodes[:MAX_LISTED]) + ("…" if len(nodes) > MAX_LISTED else "")
    if link:
        ann["dashboard"] = link
    diff = (alert.evidence or {}).get("profile_diff")
    if isinstance(diff, dict):
        from .annotations import profile_line
        ann["profile"] = profile_line(diff)
    body = {"labels": labels, "annotations": ann, "startsAt": _rfc3339(starts), "endsAt": _rfc3339(ends)}
    if link:
        body["generatorURL"] = link
    return body


class _Metrics(Metrics):
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        p = "stepwatch_alertmanager"
        self.sent = Counter(f"{p}_alerts_sent", "Alerts (firing, re-sent or resolved) Alertmanager accepted",
                            ["url"], registry=registry)
        self.failed = Counter(f"{p}_alerts_failed", "Alerts given up (non-retryable answer, attempts exhausted, "
                                                  "or undelivered at close)", ["url"], registry=registry)
        self.dropped = Counter(f"{p}_alerts_dropped", "Alerts dropped because the queue was full", ["url"],
                               registry=registry)
        self.retried = Counter(f"{p}_requests_retried", "Request retries after an error, 5xx, 408 or 429", ["url"],
                               registry=registry)
        self.queued = Gauge(f"{p}_alerts_queued", "Alerts waiting for delivery", ["url"], registry=registry)
        self.firing = Gauge(f"{p}_alerts_firing", "Firing alerts being re-sent", ["url"], registry=registry)
        self.restored = Counter(f"{p}_alerts_restored", "Open alerts taken over from the store after a (re)start",
                                registry=registry)


class _Worker(Lane):
    """Delivery to one Alertmanager: its lane (queue and thread) and its firing set."""

    def __init__(self, sink: "AlertmanagerSink", url: str, maxsize: int, authorization: str | None = None):
        self.url = url.rstrip("/")            # without credentials: it is a metric label and in logs
        self.authorization = authorization or sink.authorization
        m = sink.metrics
        super().__init__(sink, f"stepwatch-alertmanager-{self.url}", f"alertmanager {self.url}", maxsize,
                         queued=m.queued.labels(self.url), dropped=m.dropped.labels(self.url),
                         failed=m.failed.labels(self.url), batch=sink.batch)
        self.endpoint = self.url + "/api/v2/alerts"
        self.firing: collections.OrderedDict[str, Alert] = collections.OrderedDict()   # worker thread only
        self.starts: dict[str, int] = {}
        self.m_sent, self.m_retried = m.sent.labels(self.url), m.retried.labels(self.url)
        self.m_firing = m.firing.labels(self.url)
        self.next_resend = time.monotonic() + sink.resend_interval_s

    # ------------------------------------------------------------------ worker thread
    def wait_s(self) -> float:
        return max(0.0, min(POLL_S, self.next_resend - time.monotonic()))

    def tick(self) -> None:
        if time.monotonic() >= self.next_resend:
            self.next_resend = time.monotonic() + self.sink.resend_interval_s
            self._resend()

    def handle(self, batch: list[tuple[Alert, bool]]) -> None:
        now = time.time_ns()
        bodies = []
        for a, restored in batch:
            aid = a.alert_id
            if a.status == "resolved":
                starts = self.starts.pop(aid, None)
                self.firing.pop(aid, None)
                bodies.append(self._body(a, now, starts))
                continue
            if a.kind in POINT_KINDS:
                if restored and _t_first(a) + self.sink.point_hold_s * 1e9 < now:
                    continue                          # its hold is over: nothing to say any more
                bodies.append(self._body(a, now, None))
                continue
            self.starts.setdefault(aid, min(_t_first(a), now))
            self.firing[aid] = a
            self.firing.move_to_end(aid)
            while len(self.firing) > self.sink.max_firing:        # bounded: the oldest stop being re-sent
                old, _ = self.firing.popitem(last=False)
                self.starts.pop(old, None)
            bodies.append(self._body(a, now, self.starts[aid]))
        self.m_firing.set(len(self.firing))
        self._post_all(bodies)

    def _body(self, a: Alert, now: int, starts: int | None) -> dict:
        s = self.sink
        return postable_alert(a, now_ns=now, resolve_after_s=s.resolve_after_s, point_hold_s=s.point_hold_s,
                              grafana_url=s.grafana_url, starts_ns=starts)

    def _resend(self) -> None:
        if not self.firing:
            return
        now = time.time_ns()
        self._post_all([self._body(a, now, self.starts.get(aid)) for aid, a in self.firing.items()])

    def _post_all(self, bodies: list[dict]) -> None:
        for i in range(0, len(bodies), self.sink.batch):
            chunk = bodies[i:i + self.sink.batch]
            if self._post(chunk):
                self.m_sent.inc(len(chunk))
            else:
                self.m_failed.inc(len(chunk))

    def _post(self, bodies: list[dict]) -> bool:
        s = self.sink
        data = json.dumps(bodies).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "stepwatch"}
        auth = self.authorization() if callable(self.authorization) else self.authorization
        if auth:
            headers["Authorization"] = auth

        def once() -> None:
            req = urllib.request.Request(self.endpoint, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=s.timeout) as r:
                    r.read()
            except urllib.error.HTTPError as e:
                body = e.read()[:300].decode("utf-8", "replace")
                if e.code >= 500 or e.code in RETRY_STATUS:
                    raise Retryable(f"HTTP {e.code}: {body}") from e
                raise AlertmanagerError(f"HTTP {e.code}: {body}") from e
            except (urllib.error.URLError, OSError) as e:          # refused, reset, timeout, DNS
                raise Retryable(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from e

        try:
            s.retry(once, self.m_retried, self.label)
            return True
        except AlertmanagerError as e:
            log.error("alertmanager %s refused %d alert(s): %s", self.url, len(bodies), e)
        except (Retryable, SinkClosed) as e:
            log.error("alertmanager %s: giving up on %d alert(s): %s", self.url, len(bodies), e)
        return False


class AlertmanagerSink(QueueSink):
    """Non-blocking delivery of alerts to one or more Alertmanagers (see the module docs).

    ``urls``: Alertmanager base URLs (``http://host:9093``; every alert goes to each). ``authorization``: an
    ``Authorization`` header value, or a callable giving it before each POST (:func:`credentials_file`).
    ``grafana_url``: Grafana base URL for the dashboard link (None: no link). ``resend_interval_s``: re-send
    period of firing alerts; ``resolve_after_s``: their ``endsAt`` horizon (default 4 x the re-send period);
    ``point_hold_s``: how long a point alert stays up. ``maxsize``: queue bound per URL; ``batch``: alerts per
    POST; ``max_firing``: firing alerts re-sent at most (per URL); ``backoff_s``/``backoff_max_s``/
    ``max_attempts``: retries; ``timeout``: per-request seconds; ``registry``: where the counters live.
    """

    def __init__(self, urls, *, authorization=None, grafana_url: str | None = None,
                 resend_interval_s: float = 60.0, resolve_after_s: float | None = None,
                 point_hold_s: float = 900.0, maxsize: int = 10_000, batch: int = 500, max_firing: int = 10_000,
                 backoff_s: float = 0.5, backoff_max_s: float = 30.0, max_attempts: int | None = None,
                 timeout: float = 5.0, registry: CollectorRegistry | None = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("AlertmanagerSink needs at least one URL")
        auth: dict[str, str | None] = {}
        for raw in urls:
            u, creds = split_credentials(raw.rstrip("/"))
            if urllib.parse.urlsplit(u).scheme not in ("http", "https"):
                raise AlertmanagerError(f"Alertmanager URL {u!r} must be http(s)://host:port")
            if creds and authorization:
                raise AlertmanagerError(f"Alertmanager URL {u} carries a user:password and a credentials file is "
                                        "given too: use one of them")
            auth.setdefault(u, creds)
        if maxsize < 1 or batch < 1 or resend_interval_s <= 0 or max_firing < 1:
            raise ValueError("maxsize, batch, max_firing must be >= 1 and resend_interval_s > 0")
        super().__init__(backoff_s=backoff_s, backoff_max_s=backoff_max_s, max_attempts=max_attempts, log=log)
        self.authorization = authorization
        self.grafana_url = grafana_url or None
        self.resend_interval_s = float(resend_interval_s)
        self.resolve_after_s = float(resolve_after_s) if resolve_after_s else 4 * self.resend_interval_s
        self.point_hold_s = float(point_hold_s)
        self.batch, self.max_firing = int(batch), int(max_firing)
        self.timeout = float(timeout)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        self.workers = self.lanes = [_Worker(self, u, maxsize, a).start() for u, a in auth.items()]

    # ------------------------------------------------------------------ caller side
    def submit(self, alert: Alert) -> bool:
        """Queue ``alert`` for every Alertmanager; never blocks. False if some queue dropped it."""
        return self._put((alert, False))

    __call__ = submit

    def restore(self, alert: Alert) -> bool:
        """An alert still open in the store after a restart: resume re-sending it (same labels)."""
        self.metrics.restored.inc()
        return self._put((alert, True))

    def close(self, timeout: float = 10.0) -> bool:
        """Stop accepting alerts, wait up to ``timeout`` s for the queues to drain, stop the workers.
        Firing alerts are not resolved: Alertmanager resolves them at their ``endsAt`` unless another
        processor (or this one, restarted) goes on re-sending them."""
        return super().close(timeout)

    def stats(self) -> dict[str, float]:
        m = self.metrics
        return {"sent": m.value(m.sent), "failed": m.value(m.failed), "dropped": m.value(m.dropped),
                "retried": m.value(m.retried), "restored": m.value(m.restored),
                "queued": sum(w.q.qsize() for w in self.workers),
                "firing": max((len(w.firing) for w in self.workers), default=0)}


# ---------------------------------------------------------------------------- CLI wiring
def add_args(p) -> None:
    """``--alertmanager URL`` (repeatable) and friends, for ``stepwatch process``."""
    g = p.add_argument_group("Alertmanager (every alert, firing and resolved, to Alertmanager's API v2)")
    g.add_argument("--alertmanager", action="append", default=[], metavar="URL",
                   help="Alertmanager base URL, e.g. http://alertmanager:9093; repeat for an HA pair (sent to all)")
    g.add_argument("--alertmanager-credentials-file", default=None, metavar="FILE",
                   help="file holding a bearer token, or user:password with --alertmanager-auth basic")
    g.add_argument("--alertmanager-auth", choices=["bearer", "basic"], default="bearer")
    g.add_argument("--alertmanager-resend", type=float, default=60.0, metavar="S",
                   help="seconds between re-sends of firing alerts (endsAt = now + 4x this)")
    g.add_argument("--grafana-link-url", default=None, metavar="URL",
                   help="Grafana base URL for the dashboard link in alerts (default: --grafana-url)")


def sink_from_args(a, registry=None) -> AlertmanagerSink | None:
    """An :class:`AlertmanagerSink` from :func:`add_args` flags, or None without ``--alertmanager``.
    Raises :class:`AlertmanagerError` on a bad URL or credentials file."""
    urls = getattr(a, "alertmanager", None) or []
    if not urls:
        return None
    auth = credentials_file(a.alertmanager_credentials_file, a.alertmanager_auth) \
        if a.alertmanager_credentials_file else None
    grafana = a.grafana_link_url or getattr(a, "grafana_url", None)
    return AlertmanagerSink(urls, authorization=auth, grafana_url=grafana, resend_interval_s=a.alertmanager_resend,
                            registry=registry)

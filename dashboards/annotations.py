"""Alerts as Grafana annotations, delivered without ever blocking the caller.

:class:`AnnotationSink` is meant for the processor's ``on_alert`` callback. :meth:`~AnnotationSink.submit`
puts the alert on a bounded in-memory queue and returns at once (a few microseconds); one background
thread turns each alert into an annotation (``POST /api/annotations``) and delivers it:

* one annotation per alert row, firing **and** resolved: a *region* from the first step of the
  finding (``t_first_ns`` if the caller knows it, else ``alert.evidence["t_first_ns"]``, else the
  detection time) to the alert's ``t_detected`` (``time`` / ``timeEnd`` in epoch ms);
* tags ``stepwatch``, ``job:<job>``, ``kind:<kind>``, ``cause:<cause>``, ``status:<status>``,
  ``severity:<severity>``, ``rank:<r>`` and ``node:<n>`` (the first 8 of each), so dashboards filter
  them by tag (the stepwatch Job and Node dashboards do); text: the alert's readable line;
* a failed delivery — a connection error, a timeout, a 5xx, 408 or 429 — is retried with exponential
  backoff and jitter (``tenacity``: ``backoff_s * 2**n``, at most ``backoff_max_s``, plus up to
  ``backoff_s`` at random), for as long as it takes (``max_attempts`` bounds it if set), keeping alerts
  in order; other 4xx answers (a bad token, a bad request) are not retried and count as *failed*;
* while Grafana is away, alerts wait in the queue (``maxsize``); when it is full, new alerts are
  **dropped** and counted — the only way an alert is lost while the sink is open;
* **one annotation per incident** (``alert.incident_id``, see ``detectors/incidents.py``): the first alert
  of an incident posts it (tag ``incident:<id>``); its later alerts — consequences, re-fires, the
  resolution — PATCH it (a line more of text, the ``status:`` tag replaced, ``kind:`` tags added, the
  region stretched to the newest alert), so Grafana shows one thing per fault. Alerts without an
  incident id (and profile-diff re-sends) keep the rule below;
* **one annotation per (alert_id, status)**: the processor calls its callback again for an alert it
  already emitted, same id and status, when a targeted profile's diff arrives
  (``evidence.profile_diff``, see ``stream/emitter.py`` ``AlertEmitter.profile_results``). The sink remembers the
  annotation id Grafana returned for the last ``remember`` keys (an LRU, 10,000 by default) and, for
  such a re-send, **updates** that annotation (``PATCH /api/annotations/{id}``: the text gains a
  ``profile …`` line per diff, the tags ``profiled``) instead of posting a second one; a re-send
  with nothing new (the same diff, or none) is skipped and counted as a duplicate. A key the sink
  does not know (evicted, or its first post failed) is posted as a new annotation, diff included.
  The window is per sink, in memory: a restarted processor does not know the earlier ids.

:meth:`~AnnotationSink.close` stops accepting alerts and waits up to ``timeout`` seconds for the
queue to drain; what is still undelivered then is counted as failed (and logged). The queue, the
thread, the retries and close are :mod:`stepwatch.dashboards.sink`'s, shared with the Alertmanager sink.

Prometheus counters (on the registry passed in, e.g. the processor's):
``stepwatch_grafana_annotations_sent_total``, ``…_failed_total``, ``…_retried_total`` (retries),
``…_dropped_total`` (queue overflow), ``…_updated_total`` (annotations patched with a profile diff),
``…_duplicates_total`` (re-sends skipped), and the gauge ``stepwatch_grafana_annotations_queued``.
"""
from __future__ import annotations

import collections
import logging

from grafana_client.client import (GrafanaClientError, GrafanaException, GrafanaServerError,
                                   GrafanaTimeoutError)
from prometheus_client import CollectorRegistry, Counter, Gauge

from stepwatch.detectors.base import Alert
from stepwatch.metrics import Metrics

from .grafana import make_api
from .sink import Lane, QueueSink, Retryable, SinkClosed

log = logging.getLogger("stepwatch.grafana.annotations")

MAX_TAGGED = 8
RETRY_STATUS = {408, 429}
PROFILED_TAG = "profiled"


def profile_line(d: dict) -> str:
    """One readable line of an ``evidence.profile_diff`` section (the top 3 slower operators)."""
    slower = ", ".join(f"{x.get('name')} +{float(x.get('delta_ms') or 0):.2f} ms/step"
                       for x in (d.get("slower") or [])[:3]) or "no operator slower"
    return (f"profile {d.get('cmd_id')}: rank {d.get('suspect_rank')} vs reference rank "
            f"{d.get('reference_rank')}: {slower}")


def annotation_payload(alert: Alert, t_first_ns: int | None = None, dashboard_uid: str | None = None) -> dict:
    """The ``PostAnnotationsCmd`` body for one alert."""
    t_end_ms = int(alert.t_detected) // 1_000_000
    tf = t_first_ns if t_first_ns is not None else (alert.evidence or {}).get("t_first_ns")
    try:
        t_start_ms = int(tf) // 1_000_000 if tf is not None else t_end_ms
    except (TypeError, ValueError):
        t_start_ms = t_end_ms
    t_start_ms = min(t_start_ms, t_end_ms)
    tags = ["stepwatch", f"job:{alert.job}", f"kind:{alert.kind}", f"cause:{alert.cause}",
            f"status:{alert.status}", f"severity:{alert.severity}"]
    tags += [f"rank:{int(r)}" for r in list(alert.ranks)[:MAX_TAGGED]]
    tags += [f"node:{n}" for n in list(dict.fromkeys(alert.nodes))[:MAX_TAGGED]]
    if getattr(alert, "incident_id", ""):
        tags.append(f"incident:{alert.incident_id}")
    text = alert.line()
    diff = (alert.evidence or {}).get("profile_diff")
    if isinstance(diff, dict):
        tags.append(PROFILED_TAG)
        text += "\n" + profile_line(diff)
    body = {"time": t_start_ms, "timeEnd": t_end_ms, "tags": tags, "text": text}
    if dashboard_uid:
        body["dashboardUID"] = dashboard_uid
    return body


class _Metrics(Metrics):
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        p = "stepwatch_grafana_annotations"
        self.sent = Counter(f"{p}_sent", "Alert annotations Grafana accepted", registry=registry)
        self.failed = Counter(f"{p}_failed", "Alert annotations given up (non-retryable answer, attempts "
                                            "exhausted, or undelivered at close)", registry=registry)
        self.retried = Counter(f"{p}_retried", "Delivery retries after an error or 5xx", registry=registry)
        self.dropped = Counter(f"{p}_dropped", "Alerts dropped because the queue was full", registry=registry)
        self.updated = Counter(f"{p}_updated", "Annotations updated with a profile diff (PATCH)", registry=registry)
        self.duplicates = Counter(f"{p}_duplicates", "Re-sent alerts (same alert_id and status) with nothing new: "
                                                    "skipped", registry=registry)
        self.queued = Gauge(f"{p}_queued", "Alerts waiting for delivery", registry=registry)


class AnnotationSink(QueueSink):
    """Non-blocking delivery of alerts to Grafana as annotations (see the module docs).

    ``url``/``token``: Grafana and a service-account token (or pass a ready ``api``). ``maxsize``:
    queue bound. ``backoff_s``/``backoff_max_s``: retry backoff. ``max_attempts``: None = retry until
    delivered. ``timeout``: per-request timeout (seconds). ``registry``: where the counters live (a
    fresh one if None). ``dashboard_uid``: attach the annotations to one dashboard (default: none,
    i.e. organisation-wide annotations, found by tag). ``remember``: how many (alert_id, status)
    keys the sink remembers to keep one annotation per alert and status (see the module docs).
    """

    def __init__(self, url: str | None = None, token: str | None = None, *, maxsize: int = 10_000,
                 backoff_s: float = 0.5, backoff_max_s: float = 30.0, max_attempts: int | None = None,
                 timeout: float = 5.0, registry: CollectorRegistry | None = None,
                 dashboard_uid: str | None = None, api=None, remember: int = 10_000):
        if api is None:
            if not url or not token:
                raise ValueError("AnnotationSink needs url and token (or api)")
            api = make_api(url, token, timeout)
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        super().__init__(backoff_s=backoff_s, backoff_max_s=backoff_max_s, max_attempts=max_attempts, log=log)
        self.api = api
        self.dashboard_uid = dashboard_uid
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        self.remember = max(1, int(remember))
        # (alert_id, status) -> {"id": annotation id, "text", "tags", "cmds": diffs applied}; worker only
        self._posted: collections.OrderedDict = collections.OrderedDict()
        m = self.metrics
        self._lane = Lane(self, "stepwatch-annotations", "grafana annotations", maxsize, queued=m.queued,
                          dropped=m.dropped, failed=m.failed, handle=lambda items: self._handle(*items[0]))
        self.lanes.append(self._lane.start())

    # ------------------------------------------------------------------ caller side
    def submit(self, alert: Alert, t_first_ns: int | None = None) -> bool:
        """Queue ``alert`` for delivery; never blocks. Returns False if it was dropped (queue full or
        sink closed)."""
        return self._put((alert, t_first_ns))

    __call__ = submit   # usable directly as an on_alert callback

    def stats(self) -> dict[str, float]:
        m = self.metrics
        return {"sent": m.value(m.sent), "failed": m.value(m.failed), "retried": m.value(m.retried),
                "dropped": m.value(m.dropped), "updated": m.value(m.updated), "duplicates": m.value(m.duplicates),
                "queued": self._lane.q.qsize()}

    # ------------------------------------------------------------------ worker
    def _incident(self, alert: Alert, t_first: int | None) -> bool:
        """One annotation per incident: the first alert of an incident posts it, later ones (its
        consequences, re-fires, status changes) PATCH it: a line more of text, the status and kind tags,
        the region stretched to the newest alert. False when the caller should post instead."""
        key = ("incident", alert.incident_id)
        known = self._posted.get(key)
        if known is None:
            return False
        self._posted.move_to_end(key)
        line = alert.line()
        if line in known["text"].split("\n"):
            self.metrics.duplicates.inc()
            return True
        tags = [t for t in known["tags"] if not t.startswith("status:")] + [f"status:{alert.status}"]
        for t in (f"kind:{alert.kind}",):
            if t not in tags:
                tags.append(t)
        text = known["text"] + "\n" + line
        body = {"text": text, "tags": tags, "timeEnd": max(known["end"], int(alert.t_detected) // 1_000_000)}
        ok, status = self._deliver("PATCH", f"/annotations/{known['id']}", body, quiet={404})
        if ok:
            self.metrics.updated.inc()
            known.update(text=text, tags=tags, end=body["timeEnd"])
            return True
        del self._posted[key]
        return status != 404                                 # gone: post the incident again

    def _handle(self, alert: Alert, t_first: int | None) -> None:
        """Post the alert's annotation, or update the one already posted for its incident (or, without
        one, its (alert_id, status))."""
        diff = (alert.evidence or {}).get("profile_diff")
        inc = getattr(alert, "incident_id", "") or ""
        if inc and not isinstance(diff, dict):
            if not self._incident(alert, t_first):
                self._post(("incident", inc), alert, t_first, None)
            return
        key = (alert.alert_id, alert.status)
        known = self._posted.get(key)
        if known is not None:
            self._posted.move_to_end(key)
            cmd = diff.get("cmd_id") if isinstance(diff, dict) else None
            if cmd is None or cmd in known["cmds"]:
                self.metrics.duplicates.inc()          # the same alert again, nothing new to show
                return
            text = known["text"] + "\n" + profile_line(diff)
            tags = known["tags"] + ([PROFILED_TAG] if PROFILED_TAG not in known["tags"] else [])
            ok, status = self._deliver("PATCH", f"/annotations/{known['id']}", {"text": text, "tags": tags},
                                       quiet={404})
            if ok:
                self.metrics.updated.inc()
                known.update(text=text, tags=tags)
                known["cmds"].add(cmd)
                return
            del self._posted[key]
            if status != 404:
                return
            log.info("grafana annotations: annotation %s is gone; posting the alert again", known["id"])
        self._post(key, alert, t_first, diff)

    def _post(self, key: tuple, alert: Alert, t_first: int | None, diff) -> None:
        """Post a new annotation for ``alert`` and remember its id under ``key`` (an incident, or an
        (alert_id, status)), with the profile diff it shows if any."""
        body = annotation_payload(alert, t_first, self.dashboard_uid)
        ok, resp = self._deliver("POST", "/annotations", body)
        if not ok:
            return
        self.metrics.sent.inc()
        ann_id = resp.get("id") if isinstance(resp, dict) else None
        if isinstance(ann_id, int):
            self._posted[key] = {"id": ann_id, "text": body["text"], "tags": body["tags"], "end": body["timeEnd"],
                                 "cmds": {diff.get("cmd_id")} if isinstance(diff, dict) else set()}
            while len(self._posted) > self.remember:
                self._posted.popitem(last=False)

    def _deliver(self, method: str, path: str, body: dict, quiet=frozenset()):
        """(True, Grafana's answer) once delivered, else (False, the refusing status or None);
        counts failures. Statuses in ``quiet`` are not counted (the caller handles them)."""
        def once():
            try:
                return getattr(self.api.client, method)(path, json=body)
            except GrafanaClientError as e:
                if e.status_code in RETRY_STATUS:
                    raise Retryable(str(e.status_code)) from e
                raise
            except GrafanaServerError as e:
                raise Retryable(str(e.status_code)) from e
            except (GrafanaTimeoutError, GrafanaException, OSError) as e:   # connection errors are OSErrors
                raise Retryable(type(e).__name__) from e

        try:
            return True, self.retry(once, self.metrics.retried, "grafana annotations")
        except GrafanaClientError as e:
            if e.status_code not in quiet:
                self.metrics.failed.inc()
                log.error("grafana annotations: Grafana refused %s %s (%s): %s", method, path,
                          e.status_code, getattr(e, "message", e))
            return False, e.status_code
        except (Retryable, SinkClosed) as e:
            self.metrics.failed.inc()
            log.error("grafana annotations: giving up on %s %s (%s)", method, path, e)
            return False, None

"""The shared half of the dashboards' alert sinks: bounded queues, background senders, retries.

:class:`~stepwatch.dashboards.annotations.AnnotationSink` (Grafana) and
:class:`~stepwatch.dashboards.alertmanager.AlertmanagerSink` (Alertmanager) both sit on the processor's
alert callback and must never block it. Each is a :class:`QueueSink` holding one or more
:class:`Lane` s — a bounded queue and the thread that empties it (the Grafana sink has one lane, the
Alertmanager sink one per URL, so a dead member of an HA pair never delays the other):

* ``submit`` puts the alert on every lane's queue and returns at once; a full queue **drops** the
  alert and counts it (the only way an alert is lost while the sink is open), a closed sink drops all;
* the lane's thread takes up to ``batch`` items at a time and hands them to :meth:`Lane.handle` (the
  sink's delivery), then calls :meth:`Lane.tick` (the Alertmanager sink re-sends firing alerts there);
  an unexpected exception is logged and counts the items as failed, and the thread goes on;
* a delivery that fails in a way worth retrying raises :class:`Retryable` inside the function given to
  :meth:`QueueSink.retry`, which retries it with ``tenacity``: exponential backoff from ``backoff_s``
  doubling up to ``backoff_max_s``, plus a random jitter of up to ``backoff_s``, until it succeeds,
  ``max_attempts`` (if set) are spent or the sink closes (then :class:`SinkClosed`);
* :meth:`QueueSink.close` stops accepting alerts, waits up to ``timeout`` seconds for the queues to
  drain, stops the threads and counts what is still queued as failed.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

POLL_S = 0.05          # how long a lane's thread waits for an item before looking at its clock again


class Retryable(Exception):
    """A delivery failure worth retrying (connection error, timeout, 5xx, 408, 429)."""


class SinkClosed(Exception):
    """The sink closed while a delivery waited to be retried."""


class Lane:
    """One bounded queue and the thread that empties it. Subclass and override :meth:`handle` (and
    :meth:`tick` / :meth:`wait_s` for periodic work), or pass ``handle``. ``queued`` (a gauge),
    ``dropped`` and ``failed`` (counters) are Prometheus metrics (or labelled children of them)."""

    def __init__(self, sink: "QueueSink", name: str, label: str, maxsize: int, *, queued, dropped, failed,
                 batch: int = 1, handle=None):
        if maxsize < 1 or batch < 1:
            raise ValueError("maxsize and batch must be >= 1")
        self.sink, self.label, self.batch = sink, label, int(batch)
        self.q: queue.Queue = queue.Queue(maxsize=maxsize)
        self.idle = threading.Event()
        self.idle.set()
        self.m_queued, self.m_dropped, self.m_failed = queued, dropped, failed
        if handle is not None:
            self.handle = handle
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "Lane":
        self.thread.start()
        return self

    def put(self, item) -> bool:
        """Queue ``item``; never blocks. False (and counted as dropped) when the queue is full."""
        self.idle.clear()
        self.m_queued.inc()
        try:
            self.q.put_nowait(item)
        except queue.Full:
            self.m_queued.dec()
            self.m_dropped.inc()
            return False
        return True

    # ------------------------------------------------------------------ the lane's thread
    def handle(self, items: list) -> None:
        """Deliver ``items`` (at most ``batch``), counting what was sent or failed."""
        raise NotImplementedError

    def tick(self) -> None:
        """Called after every turn of the thread's loop, with or without items."""

    def wait_s(self) -> float:
        """How long the thread may wait for an item this turn (0: do not wait)."""
        return POLL_S

    def _take(self) -> list:
        wait = self.wait_s()
        try:
            first = self.q.get(timeout=wait) if wait > 0 else self.q.get_nowait()
        except queue.Empty:
            return []
        items = [first]
        while len(items) < self.batch:
            try:
                items.append(self.q.get_nowait())
            except queue.Empty:
                break
        return items

    def _run(self) -> None:
        while not self.sink._stop.is_set():
            items = self._take()
            try:
                if items:
                    self.handle(items)
                self.tick()
            except Exception:  # noqa: BLE001 - the thread must survive anything
                self.sink.log.exception("%s: unexpected error", self.label)
                self.m_failed.inc(len(items))
            finally:
                if items:
                    self.m_queued.dec(len(items))
                if self.q.empty():
                    self.idle.set()

    # ------------------------------------------------------------------ close
    def drain(self, deadline: float) -> bool:
        """Wait until the queue is empty and the thread idle, or ``deadline`` (monotonic) passes."""
        while not (self.q.empty() and self.idle.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.idle.wait(min(left, POLL_S))
        return True

    def discard(self) -> int:
        """After the thread stopped: empty the queue, count what was in it as failed; returns how many."""
        n = 0
        while True:
            try:
                self.q.get_nowait()
                n += 1
            except queue.Empty:
                break
        if n:
            self.m_failed.inc(n)
            self.m_queued.dec(n)
            self.sink.log.warning("%s: %d alert(s) not delivered before close", self.label, n)
        return n


class QueueSink:
    """Base of the non-blocking alert sinks (see the module docs). A subclass creates its lanes
    (appending them to ``self.lanes`` and starting them) after calling this constructor."""

    def __init__(self, *, backoff_s: float, backoff_max_s: float, max_attempts: int | None,
                 log: logging.Logger):
        self.backoff_s, self.backoff_max_s = float(backoff_s), float(backoff_max_s)
        self.max_attempts = max_attempts
        self.log = log
        self.lanes: list[Lane] = []
        self._closing = threading.Event()
        self._stop = threading.Event()

    def _put(self, item) -> bool:
        """``item`` on every lane; never blocks. False if a lane dropped it (full, or the sink closed)."""
        if self._closing.is_set():
            for lane in self.lanes:
                lane.m_dropped.inc()
            return False
        ok = True
        for lane in self.lanes:
            ok &= lane.put(item)
        return ok

    def _sleep(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise SinkClosed("closed while waiting to retry")

    def retry(self, fn, retried, label: str):
        """``fn()``, retried while it raises :class:`Retryable` (see the module docs); ``retried``: a
        counter incremented per retry. Raises the last :class:`Retryable` when ``max_attempts`` are
        spent, :class:`SinkClosed` when the sink closes meanwhile, and any other exception at once."""
        import tenacity                          # here: `stepwatch --help` need not load it

        def before_sleep(rs) -> None:
            retried.inc()
            self.log.debug("%s: attempt %d failed (%s); retrying in %.2fs", label, rs.attempt_number,
                           rs.outcome.exception(), rs.next_action.sleep)

        stop = tenacity.stop_when_event_set(self._stop)
        if self.max_attempts:
            stop = stop | tenacity.stop_after_attempt(self.max_attempts)
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(Retryable), stop=stop,
            wait=tenacity.wait_exponential(multiplier=self.backoff_s, max=self.backoff_max_s)
            + tenacity.wait_random(0, self.backoff_s),
            sleep=self._sleep, before_sleep=before_sleep, reraise=True)(fn)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop accepting alerts, wait up to ``timeout`` s for the queues to drain, stop the threads.
        True if every alert was handled (delivered, or given up for a non-retryable reason) in time."""
        self._closing.set()
        deadline = time.monotonic() + max(0.0, timeout)
        drained = True
        for lane in self.lanes:
            drained &= lane.drain(deadline)
        self._stop.set()
        left_over = 0
        for lane in self.lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()) + 0.1)
            left_over += lane.discard()
        return drained and not left_over

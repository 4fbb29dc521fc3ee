"""The base of every component's Prometheus metrics (node agent, processor, alert sinks).

Each instance has its own registry (tests run several components in one interpreter), can serve it
(``--metrics-port``), and reads its own counters back for tests and progress lines. It sits below
``agents``, ``stream`` and ``dashboards`` so that none of them imports another for it.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class Metrics:
    """Base of every component's metrics: its own registry, an exporter, and a reader for tests
    and progress lines."""

    registry: CollectorRegistry

    def serve(self, port: int, addr: str = "127.0.0.1"):
        return start_http_server(port, addr=addr, registry=self.registry)

    @staticmethod
    def value(metric, label: str | None = None) -> float:
        """Sum of a counter's (or gauge's) samples, optionally only those with one label value."""
        total = 0.0
        for m in metric.collect():
            for s in m.samples:
                if s.name.endswith("_created"):
                    continue
                if label is None or label in s.labels.values():
                    total += s.value
        return total

"""Helpers the efficiency detectors (:mod:`.mfu`, :mod:`.commbw`, :mod:`.dataloader`) share: the bounded
queue of rows for the store, firing/resolved bookkeeping by key, rounding for evidence."""
from __future__ import annotations

import math

import pyarrow as pa

from .base import Alert


def _pending_add(pending: list, t: pa.Table, cap: int) -> None:
    """Queue rows for the store (NaN stored as null, so SQL aggregates skip it); bounded by ``cap``."""
    t = pa.table({n: (pa.array(c.to_numpy(), from_pandas=True) if pa.types.is_floating(c.type) else c)
                  for n, c in zip(t.column_names, t.columns)})
    pending.append(t)
    while sum(x.num_rows for x in pending) > cap and len(pending) > 1:
        pending.pop(0)


class _Episodes:
    """Firing/resolved bookkeeping of one detector's alerts by key: fire once, resolve after ``clear``
    consecutive evaluations without the finding. Bounded by the number of live findings."""

    def __init__(self, clear: int):
        self.clear = clear
        self.open: dict[str, list] = {}          # key -> [alert, clean evaluations]

    def seen(self, key: str, make) -> list[Alert]:
        st = self.open.get(key)
        if st is not None:
            st[1] = 0
            return []
        a = make()
        if a is None:
            return []
        self.open[key] = [a, 0]
        return [a]

    def sweep(self, present: set, step_now: int, t_now: int) -> list[Alert]:
        out = []
        for key in list(self.open):
            if key in present:
                continue
            st = self.open[key]
            st[1] += 1
            if st[1] >= self.clear:
                a = st[0]
                out.append(Alert(job=a.job, kind=a.kind, status="resolved", step_first=a.step_first,
                                 step_detected=step_now, t_detected=t_now, ranks=a.ranks, nodes=a.nodes,
                                 cause=a.cause, severity=a.severity, evidence=a.evidence, cost_pct=a.cost_pct,
                                 suggestion=a.suggestion, alert_id=a.alert_id))
                del self.open[key]
        return out


def _r(x, nd: int = 3):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return round(x, nd) if math.isfinite(x) else None


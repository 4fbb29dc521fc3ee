"""The processor's side of targeted profiling (docs/profiling.md): alert -> signed ``control`` commands,
``profiles`` results -> side-by-side diff.

Lifecycle. When the processor emits a *firing* alert of a configured kind (default ``slow_rank``,
``slow_node``, ``regression``), :meth:`Issuer.on_alert` picks the suspect ranks (the alert's ranks,
at most ``max_suspects``; for a job-wide alert the rank with the highest busy time) and one healthy
*reference* rank in the same role (same pipeline stage and tp/cp/ep coordinates when the topology
has them; among those, the rank whose median busy time over the alignment window is closest to the
median), maps ranks to nodes from the topology and publishes one command per node on ``control``
(keyed by node), sealed with the Ed25519 private key (:func:`stepwatch.agents.profiling.seal`; agents
and probes verify with the public key only). Before issuing it enforces the cap: ranks in flight (issued, not
answered, not expired) plus the new ones must not exceed ``max_in_flight``; otherwise it records
``rejected`` rows with detail ``cap`` in the ``profiles`` table instead.

Results arrive on ``profiles`` (the processor stores every row); :meth:`Issuer.on_results` collects
them per command and, once a suspect and the reference both answered ``ok``, computes
:func:`stepwatch.agents.profiling.summary.diff` and returns it with the alert, which the processor re-emits
(same ``alert_id`` and status) on the ``alerts`` topic and to its callback with a ``profile_diff``
section in ``evidence``. That re-emission is not written to the ``alerts`` table again: the table
keeps one row per (alert_id, status), and the diff can always be recomputed from the stored
summaries (``stepwatch profile diff CMD_ID``).

The cap is kept by this processor for the commands it issues. With one processor (the default
deployment) that is the cluster-wide cap; with P processors set ``max_in_flight`` to cap / P.
"""
from __future__ import annotations

import collections
import copy
import json
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from stepwatch.wire import tables as wire
from stepwatch.agents import profiling
from stepwatch.agents.profiling import protocol, summary

log = logging.getLogger("stepwatch.processor.profiling")

DEFAULT_ALERT_KINDS = {"slow_rank": "torch", "slow_node": "torch", "regression": "torch"}


@dataclass
class ProfilingSettings:
    """What the processor profiles on an alert. ``alert_kinds`` maps alert kind -> profiler kind
    (``torch`` | ``py-spy``); ``steps`` per profile; ``ttl_s`` a command's lifetime (the deadline of
    the profile too); ``max_in_flight`` the cap on ranks profiling at once."""

    key: object                                  # Ed25519PrivateKey (profiling.load_private_key)
    alert_kinds: dict = field(default_factory=lambda: dict(DEFAULT_ALERT_KINDS))
    steps: int = 10
    ttl_s: float = 120.0
    max_in_flight: int = 4
    max_suspects: int = 2
    reference: bool = True

    @classmethod
    def from_env(cls, env=None) -> "ProfilingSettings | None":
        """From ``STEPWATCH_PROFILING_PRIVATE_KEY[_FILE]`` (None without a key) and optionally
        ``STEPWATCH_PROFILE_ON`` (``slow_rank=torch,regression=py-spy``), ``STEPWATCH_PROFILE_STEPS``,
        ``STEPWATCH_PROFILE_TTL_S``, ``STEPWATCH_PROFILE_MAX_IN_FLIGHT``."""
        env = os.environ if env is None else env
        key = profiling.load_private_key(env=env)
        if key is None:
            return None
        s = cls(key=key)
        on = env.get("STEPWATCH_PROFILE_ON")
        if on:
            kinds = {}
            for part in on.split(","):
                k, _, v = part.strip().partition("=")
                if k:
                    kinds[k] = v or "torch"
            s.alert_kinds = kinds
        s.steps = int(env.get("STEPWATCH_PROFILE_STEPS", s.steps))
        s.ttl_s = float(env.get("STEPWATCH_PROFILE_TTL_S", s.ttl_s))
        s.max_in_flight = int(env.get("STEPWATCH_PROFILE_MAX_IN_FLIGHT", s.max_in_flight))
        return s


def settings_from_env(env=None) -> ProfilingSettings | None:
    """:meth:`ProfilingSettings.from_env`, logging (not raising) a key that cannot be read."""
    try:
        return ProfilingSettings.from_env(env)
    except (protocol.KeyError_, ValueError) as e:
        log.error("targeted profiling off: %s", e)
        return None


@dataclass
class Pending:
    cmd_id: str
    job: str
    suspects: list
    reference: list
    expires_at: int
    kind: str
    alert: object = None
    t_issued: float = 0.0                       # monotonic
    results: dict = field(default_factory=dict)  # rank -> final row
    done: bool = False

    def ranks(self) -> list:
        return list(self.suspects) + list(self.reference)


def busy_by_rank(state) -> np.ndarray:
    """(R,) median busy time (step - comm wait) per rank over the job's alignment window (NaN if none)."""
    st, wt = state.planes["step_ms"], state.planes["comm_wait_ms"]
    busy = np.where(state.filled, st - np.nan_to_num(wt), np.nan)
    with np.errstate(all="ignore"):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmedian(busy, axis=0) if busy.shape[1] else np.empty(0)


def choose_ranks(state, alert_ranks, max_suspects: int = 2, want_reference: bool = True) -> tuple[list, list]:
    """(suspects, [reference]) for an alert on a job whose alignment state is ``state``."""
    R = int(state.world_size)
    busy = busy_by_rank(state) if R else np.empty(0)
    suspects = [int(r) for r in alert_ranks if 0 <= int(r) < R][:max_suspects]
    if not suspects and R and np.isfinite(busy).any():
        suspects = [int(np.nanargmax(busy))]
    if not suspects or not want_reference:
        return suspects, []

    def coord(a) -> np.ndarray:                # (R,) coordinate per rank, -1 where unknown
        out = np.full(R, -1, np.int64)
        if a is not None:
            n = min(len(a), R)
            out[:n] = np.asarray(a[:n], np.int64)
        return out

    # role = (pipeline stage, tp, cp, ep coordinates): the reference runs the same part of the model
    roles = [coord(state.stage)] + [coord(state.coords.get(c)) for c in ("tp", "cp", "ep")]
    s0 = suspects[0]
    healthy = np.ones(R, bool)
    bad = np.array([int(r) for r in alert_ranks if 0 <= int(r) < R] + suspects, np.int64)
    healthy[bad] = False
    same = healthy.copy()
    for a in roles:
        same &= a == a[s0]
    cand = np.flatnonzero(same) if same.any() else np.flatnonzero(healthy)
    if not len(cand):
        return suspects, []
    b = np.full(R, np.nan)
    b[:min(len(busy), R)] = busy[:R]
    vals = b[cand]
    if np.isfinite(vals).any():
        ref = cand[int(np.nanargmin(np.abs(vals - np.nanmedian(vals))))]
    else:
        ref = cand[0]
    return suspects, [int(ref)]


class Issuer:
    def __init__(self, settings: ProfilingSettings, kafka, producer):
        self.settings = settings
        self.kafka = kafka
        self.producer = producer
        self.pending: dict[str, Pending] = {}
        self.issued = 0
        self.capped = 0
        self.diffs: collections.deque = collections.deque(maxlen=1000)   # (command, diff), newest last

    # ------------------------------------------------------------------ cap
    def in_flight(self, now_ns: int | None = None) -> int:
        """Ranks issued, not answered and not expired."""
        now = time.time_ns() if now_ns is None else now_ns
        n = 0
        for p in list(self.pending.values()):
            if p.expires_at <= now:
                if p.expires_at + 600e9 < now:
                    self.pending.pop(p.cmd_id, None)
                continue
            n += sum(1 for r in p.ranks() if r not in p.results)
        return n

    # ------------------------------------------------------------------ issue
    def on_alert(self, state, alert) -> list[dict]:
        """Commands for a firing alert of a configured kind; returns ``profiles`` rows the processor
        stores itself (cap reached, node unknown)."""
        kind = self.settings.alert_kinds.get(alert.kind)
        if alert.status != "firing" or not kind:
            return []
        suspects, reference = choose_ranks(state, alert.ranks, self.settings.max_suspects, self.settings.reference)
        if not suspects:
            return []
        nodes = {r: (str(state.nodes[r]) if r < len(state.nodes) else "") for r in suspects + reference}
        _, rows = self.issue(alert.job, nodes, suspects, reference, kind, self.settings.steps, alert.alert_id,
                             alert=alert)
        return rows

    def issue(self, job: str, nodes: dict, suspects: list, reference: list, kind: str, steps: int, reason: str = "",
              alert=None, ttl_s: float | None = None) -> tuple[str, list[dict]]:
        now = time.time_ns()
        ttl = self.settings.ttl_s if ttl_s is None else ttl_s
        cmd_id = protocol.new_command(job, "-", [], 1).get("cmd_id")
        ranks = list(suspects) + list(reference)
        base = {"cmd_id": cmd_id, "job": job, "kind": kind, "reason": reason, "steps": steps, "t": now}

        def refused(detail):
            return [dict(base, node=nodes.get(r) or None, rank=r, status="rejected", detail=detail,
                         role="reference" if r in reference else "suspect") for r in ranks]

        busy = self.in_flight(now)
        if busy + len(ranks) > self.settings.max_in_flight:
            self.capped += 1
            log.warning("not profiling %s ranks %s for alert %s: cap reached (%d of %d in flight)", job, ranks, reason,
                        busy, self.settings.max_in_flight)
            return cmd_id, refused(f"cap: {busy} profiles in flight, cap {self.settings.max_in_flight}")
        unknown = [r for r in ranks if not nodes.get(r)]
        if unknown:
            return cmd_id, refused(f"node of rank(s) {unknown} unknown (no topology yet)")
        by_node: dict[str, list] = {}
        for r in ranks:
            by_node.setdefault(nodes[r], []).append(r)
        try:                                     # every envelope first: a command is sent whole or not at all
            sealed = [(node, profiling.seal(protocol.new_command(
                job, node, rs, steps, kind, reason, reference=[r for r in rs if r in reference], ttl_s=ttl, now_ns=now,
                cmd_id=cmd_id), self.settings.key)) for node, rs in by_node.items()]
        except ValueError as e:                  # over the envelope's bounds (docs/limits.md)
            return cmd_id, refused(f"command not sent: {e}")
        for node, env in sealed:
            self.producer.send(self.kafka.topic("control"), env, key=node.encode(), headers=protocol.control_headers())
        self.producer.flush(5)
        self.pending[cmd_id] = Pending(cmd_id, job, list(suspects), list(reference), now + int(ttl * 1e9), kind,
                                       alert=alert, t_issued=time.monotonic())
        self.issued += 1
        log.info("profiling %s: suspects %s, reference %s, %d steps of %s (command %s, alert %s)", job, suspects,
                 reference, steps, kind, cmd_id, reason)
        return cmd_id, []

    # ------------------------------------------------------------------ results
    def on_results(self, t: pa.Table) -> list[tuple[Pending, dict]]:
        """Record result rows; returns (command, diff) for each command whose suspect and reference
        profiles are now both in."""
        out = []
        cols = [c for c in ("cmd_id", "rank", "status", "summary", "role") if c in t.column_names]
        for r in t.select(cols).to_pylist():
            p = self.pending.get(r.get("cmd_id"))
            if p is None or p.done or r.get("rank") is None:
                continue
            p.results[int(r["rank"])] = r
            d = command_diff(p.suspects, p.reference, p.results)
            if d is not None:
                p.done = True
                self.diffs.append((p, d))
                out.append((p, d))
        return out


def command_diff(suspects, reference, results: dict) -> dict | None:
    """The diff of the first suspect and reference whose results are ``ok`` (None until both are)."""
    def ok(r):
        x = results.get(r)
        return x is not None and x.get("status") == "ok" and x.get("summary")
    s = next((r for r in suspects if ok(r)), None)
    ref = next((r for r in reference if ok(r)), None)
    if s is None or ref is None:
        return None
    d = summary.diff(json.loads(results[s]["summary"]), json.loads(results[ref]["summary"]))
    d.update(suspect_rank=s, reference_rank=ref)
    return d


def diff_rows_table(job: str, alert_id: str, cmd_id: str, d: dict, t_ns: int | None = None) -> pa.Table:
    """The ``profile_diffs`` rows of one diff: slower entries at positions 1, 2, ... and faster ones at
    -1, -2, ..."""
    t_ns = time.time_ns() if t_ns is None else int(t_ns)
    rows = []
    for sign, entries in ((1, d.get("slower", [])), (-1, d.get("faster", []))):
        for i, x in enumerate(entries, 1):
            rows.append({"alert_id": alert_id or "", "job": job, "cmd_id": cmd_id,
                         "suspect_rank": d.get("suspect_rank"), "reference_rank": d.get("reference_rank"),
                         "position": sign * i, "name": x["name"], "suspect_ms": x["suspect_ms"],
                         "reference_ms": x["reference_ms"], "delta_ms": x["delta_ms"], "ratio": x.get("ratio"),
                         "t": t_ns})
    return pa.Table.from_pylist(rows, schema=wire.PROFILE_DIFFS)


def alert_with_diff(alert, cmd_id: str, d: dict):
    """A copy of ``alert`` whose evidence carries ``profile_diff`` (the top slower entries)."""
    a = copy.copy(alert)
    a.evidence = dict(alert.evidence)
    a.evidence["profile_diff"] = {"cmd_id": cmd_id, **d}
    return a


def profile_rows_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=wire.PROFILES)

"""Hang localization: from the ranks' in-flight states, the rank(s) a hung job waits for.

In a real hang the ranks have usually finished the same step: most are blocked inside the next
collective, waiting for the one(s) that never arrive. The probe's watchdog (:mod:`stepwatch.agents.probe.watchdog`)
reports, for a step that runs far longer than usual, what its rank is doing: in collective *op* of
process group *group* with the group's sequence number *seq*, in the DataLoader, or in compute, with the
main thread's Python stack. The node agent adds what it sees of a rank that cannot speak
(:mod:`stepwatch.agents.inflight`: process stopped, gone, or silent). Both arrive as ``inflight`` rows.

:func:`locate` takes the newest row of every rank since the job's newest step end and finds:

* the **waiting** ranks: those in the collective (group, op, seq) most ranks are in;
* the rank(s) that **never arrived**, in this order: a process the agent sees **stopped** (SIGSTOP, a
  debugger), **gone** (exited, killed, OOM) or **silent** (alive, sends nothing: stuck in a C call that
  holds the GIL); a rank in the same group at the same seq but another op (**mismatch**: the ranks' code
  paths diverged); at an **earlier seq** of that group (it has not reached the collective yet, or skipped
  one); in **another collective** (another group, or a later seq); in **compute** or in the **data
  loader** (its stack says where); and a rank with **no report at all** (its node's host samples tell
  whether the node itself is gone);
* when the waiting group is smaller than the job (a subgroup), at most ``group size - waiting`` of them.

It returns the culprit ranks (at most ``max_names``), the evidence (the waiting collective, each culprit's
state, op/group/seq, step, stack and innermost stack line, counts per state) and what to try.

Cost: O(rows in the window since the newest step end) with numpy/pyarrow, only when the stall detector
is about to raise ``job_hang``. Nothing is kept between calls.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: step kinds the probe marks (the ``phases`` entries of a step / ``step_kind`` of an in-flight row)
STEP_KINDS = {"first_step": "first", "first": "first", "eval": "eval", "checkpoint": "checkpoint"}

_ORDER = ("stopped", "gone", "silent", "mismatch", "behind", "other_collective", "compute", "data", "no_report")


def _ints(col) -> np.ndarray:
    if pa.types.is_timestamp(col.type):
        col = col.cast(pa.int64())
    return col.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)


def latest(ctx, since_ns: int) -> pa.Table | None:
    """The newest in-flight row of every rank observed at or after ``since_ns`` (None: none)."""
    w = getattr(ctx, "inflight", None)
    if w is None or not len(w):
        return None
    t = w.select(lo=int(since_ns))
    if t is None:
        return None
    rank, tt = _ints(t.column("rank")), _ints(t.column("t"))
    order = np.lexsort((tt, rank))
    rs = rank[order]
    last = np.r_[rs[1:] != rs[:-1], True]
    return t.take(pa.array(order[last]))


def step_in_progress(ctx, since_ns: int) -> int | None:
    """The newest step the ranks' watchdogs report in progress since ``since_ns`` (None: none reported)."""
    t = latest(ctx, since_ns)
    if t is None or "step" not in t.column_names:
        return None
    src = t.column("source")
    st = t.column("step").filter(pc.equal(src, "probe")) if "source" in t.column_names else t.column("step")
    v = pc.max(st).as_py() if len(st) else None
    return int(v) if v is not None else None


def kinds_in_progress(ctx, since_ns: int) -> set[str]:
    """Kinds (first, eval, checkpoint) of the step in progress, as the ranks' watchdogs reported it."""
    t = latest(ctx, since_ns)
    if t is None or t.column("step_kind").null_count == t.num_rows:
        return set()
    out: set[str] = set()
    for v in pc.unique(t.column("step_kind").drop_null()).to_pylist():
        out |= {STEP_KINDS.get(k.strip(), k.strip()) for k in v.split(",") if k.strip()}
    return out


def _str(t: pa.Table, name: str) -> np.ndarray:
    return np.asarray(t.column(name).fill_null("").to_pylist(), dtype=object) if t.num_rows <= 4096 else \
        t.column(name).fill_null("").to_numpy(zero_copy_only=False).astype(object)


def locate(ctx, since_ns: int, max_names: int = 8, now_ns: int | None = None) -> dict | None:
    """The ranks a hung job waits for (see the module docstring); None when no rank reported."""
    t = latest(ctx, since_ns)
    if t is None:
        return None
    R = int(ctx.world_size)
    rank = _ints(t.column("rank"))
    ok = (rank >= 0) & (rank < R)
    if not ok.all():
        t, rank = t.filter(pa.array(ok)), rank[ok]
    state, source = _str(t, "state"), _str(t, "source")
    op, group = _str(t, "op"), _str(t, "group")
    seq, gsize = _ints(t.column("seq")), _ints(t.column("group_size"))
    coll = (state == "collective") & (source == "probe")
    what = np.full(len(rank), "", dtype=object)
    waiting = np.zeros(len(rank), bool)
    top = None
    if coll.any():
        keys = np.array([f"{g}\x00{o}\x00{s}" for g, o, s in zip(group[coll], op[coll], seq[coll])], dtype=object) \
            if coll.sum() <= 4096 else (group[coll] + "\x00" + op[coll] + "\x00" + seq[coll].astype(str).astype(object))
        u, inv, cnt = np.unique(keys.astype(str), return_inverse=True, return_counts=True)
        best = int(np.argmax(cnt))
        idx = np.flatnonzero(coll)
        waiting[idx[inv == best]] = True
        w0 = idx[inv == best][0]
        top = {"op": op[w0], "group": group[w0], "seq": int(seq[w0]) if seq[w0] >= 0 else None,
               "group_size": int(gsize[w0]) if gsize[w0] > 0 else None}
        other = coll & ~waiting
        same_g = other & (group == top["group"])
        ts = top["seq"] if top["seq"] is not None else -1
        what[same_g & (seq == ts) & (op != top["op"])] = "mismatch"
        what[same_g & (seq >= 0) & (seq < ts)] = "behind"
        what[other & (what == "")] = "other_collective"
    agent = source == "agent"
    for s in ("stopped", "gone", "silent"):
        what[agent & (state == s)] = s
    what[(source == "probe") & (state == "compute")] = "compute"
    what[(source == "probe") & (state == "data")] = "data"
    # ranks that reported before but sent nothing in this hang
    seen = np.zeros(R, bool)
    if ctx.last_step is not None and len(ctx.last_step) == R:
        seen = np.asarray(ctx.last_step) >= 0
    have = np.zeros(R, bool)
    have[rank] = True
    silent_ranks = np.flatnonzero(seen & ~have)
    counts = {s: int(np.count_nonzero(what == s)) for s in _ORDER[:-1]}
    counts["waiting"] = int(waiting.sum())
    counts["done"] = int(np.count_nonzero(state == "done"))
    counts["no_report"] = int(len(silent_ranks))
    cand: list[tuple[int, int, int]] = []          # (priority, rank, row or -1)
    for pri, s in enumerate(_ORDER[:-1]):
        for i in np.flatnonzero(what == s)[:max_names * 4]:
            cand.append((pri, int(rank[i]), int(i)))
    if top is not None or counts["stopped"] + counts["gone"] + counts["silent"]:
        cand += [(len(_ORDER) - 1, int(r), -1) for r in silent_ranks[:max_names * 4]]
    cand.sort()
    limit = len(cand)
    if top is not None and top["group_size"] and top["group_size"] < R:
        limit = max(top["group_size"] - counts["waiting"], 0)      # a subgroup: only its missing members
    cand = cand[:min(limit, max_names)]
    if top is None and not cand:
        return {"ranks": [], "nodes": [], "evidence": {"inflight": {"states": counts}}, "suggestion": None}
    host = host_ages(ctx, sorted({ctx.node_of(r) for p, r, i in cand if i < 0} - {""}))
    culprits = []
    for pri, r, i in cand:
        node = ctx.node_of(r)
        c = {"rank": r, "node": node, "what": _ORDER[pri]}
        if i >= 0:
            one = t.slice(i, 1)
            one = pa.Table.from_arrays([c.cast(pa.int64()) if pa.types.is_timestamp(c.type) else c
                                        for c in one.columns], names=one.column_names)
            row = {k: v for k, v in one.to_pylist()[0].items() if v is not None and v != ""}
            for k in ("state", "source", "op", "group", "seq", "step", "step_kind", "pid"):
                if k in row:
                    c[k] = row[k]
            if "elapsed_ms" in row:
                c["elapsed_s"] = round(row["elapsed_ms"] / 1e3, 1)
            if row.get("stack"):
                c["stack"] = row["stack"]
                c["at"] = stack_line(row["stack"])
        elif node in host:
            c["node_host_behind_s"] = host[node]
            if host[node] is None or host[node] > 10:
                c["what"] = "node_gone"
        culprits.append(c)
    ev = {"states": counts, "culprits": culprits}
    if top is not None:
        wr = np.flatnonzero(waiting)
        since = _ints(t.column("since"))[wr]
        ev["waiting"] = dict(top, ranks=int(len(wr)), sample=sorted(int(x) for x in rank[wr][:8]))
        if now_ns is not None and (since > 0).any():
            ev["waiting"]["for_s"] = round((int(now_ns) - int(since[since > 0].min())) / 1e9, 1)
    ev["mismatch"] = any(c["what"] == "mismatch" for c in culprits)
    ranks = [c["rank"] for c in culprits]
    return {"ranks": ranks, "nodes": [c["node"] for c in culprits], "evidence": {"inflight": ev},
            "suggestion": suggestion(top, culprits)}


def stack_line(stack: str) -> str:
    """The innermost frame of the program itself: the last stack line outside torch and the Python
    library (the innermost line when all are)."""
    lines = [ln for ln in stack.split("\n") if ln.strip()]
    for ln in reversed(lines):
        f = ln.rsplit(":", 1)[0]
        if "/torch/" not in f and "/lib/python3" not in f and "site-packages" not in f:
            return ln
    return lines[-1] if lines else ""


def host_ages(ctx, nodes: list[str]) -> dict:
    """Seconds the nodes' newest host sample is behind the job's (None: none in the window)."""
    w = getattr(ctx, "host", None)
    if w is None or not len(w) or not nodes:
        return {}
    t = w.select(None, None)
    if t is None:
        return {}
    job_t = int(w.newest)
    out = {}
    for n in nodes[:8]:
        tt = t.filter(pc.equal(t.column("node"), pa.scalar(n, t.column("node").type))).column("t")
        newest = pc.max(tt.cast(pa.int64())).as_py() if len(tt) else None
        out[n] = None if newest is None else round((job_t - int(newest)) / 1e9, 1)
    return out


def _where(c: dict) -> str:
    return f"rank {c['rank']}" + (f" on {c['node']}" if c.get("node") else "") + \
        (f" (pid {c['pid']})" if c.get("pid") else "")


#: what to try, by what the first culprit is doing ({where}: the rank, {wait}: the collective the others
#: wait in, {at}: " at <file:line>" when known, {pid}/{op}/{group}/{seq}: the culprit's)
_ADVICE = {
    "stopped": "{where} is stopped (SIGSTOP or a debugger) and {wait}: resume it (kill -CONT {pid}) or find who "
               "stopped it.",
    "gone": "{where} has exited and {wait}: read its log and the node's kernel log (OOM killer: dmesg); restart the "
            "job from the last checkpoint.",
    "silent": "{where} is alive but sends nothing and {wait}: it is probably stuck in a C call that holds the GIL; "
              "look with py-spy dump --native --pid {pid} on its node.",
    "node_gone": "{where} sent nothing and its node's agent stopped reporting: the node is down or cut off; {wait}.",
    "mismatch": "{where} called {op} (group {group}, seq {seq}) while {wait}: the ranks' code paths diverged (a "
                "rank-dependent branch, an exception handled on one rank only){at}; compare the stacks.",
    "behind": "{where} is at an earlier collective ({op}, seq {seq}) while {wait}: it has not reached the "
              "collective, or skipped one on a code path the others did not take{at}.",
    "other_collective": "{where} is blocked in another collective ({op}, group {group}, seq {seq}) while {wait}: "
                        "the ranks issue collectives in different orders{at}.",
    "compute": "{where} never reached the collective: it is running Python code{at} while {wait}; look at that "
               "function (a long or stuck computation, a lock, I/O, a rank-dependent loop); py-spy dump --pid {pid} "
               "shows it live.",
    "data": "{where} is waiting on its DataLoader{at} while {wait}: check its workers (crashed or stuck worker, slow "
            "storage); set a DataLoader timeout.",
}
_ADVICE_ELSE = ("{where} sent nothing while {wait}: check that its process runs (the probe's watchdog may be off) "
                "and its node.")


def suggestion(top: dict | None, culprits: list[dict]) -> str | None:
    """What to try, for the first culprit (the most telling one) and the collective the others wait in."""
    if not culprits:
        return None
    c = culprits[0]
    wait = (f"the others wait in {top['op']} (group {top['group']}, seq {top['seq']})" if top else
            "the others are blocked")
    s = _ADVICE.get(c["what"], _ADVICE_ELSE).format(
        where=_where(c), wait=wait, at=f" at {c['at']}" if c.get("at") else "", pid=c.get("pid", "PID"),
        op=c.get("op"), group=c.get("group"), seq=c.get("seq"))
    if len(culprits) > 1:
        s += f" {len(culprits) - 1} more rank(s) did not arrive either (evidence.inflight.culprits)."
    return s

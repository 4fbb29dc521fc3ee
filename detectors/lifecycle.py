"""A job's life: how its ranks ended, told apart from a hang.

Every rank leaves a word when its process ends (``inflight`` rows, state ``exited`` from the probe's
goodbye, :mod:`stepwatch.agents.probe.exitwatch`, or ``gone`` from the node agent when the process went
without one). :class:`JobLife` keeps, per rank, its first end and any later one (a clean exit followed by
an abort in teardown); :class:`Lifecycle` judges the job from them, in event time:

* **finished** - every rank that reported ended with status 0: a ``job_end`` *event* (severity
  ``info``, stored with the alerts, never sent as an alert), which closes the job's open incidents;
* **stopped** - the first rank to end was ended by SIGTERM, SIGINT or SIGHUP (a scheduler's or a user's
  stop) and every rank has ended. Ranks are ordered by when they ended at the earliest: a rank the
  agent saw gone may have died as early as its last datagram; and a stop with a rank that ended hard
  (gone, a fatal signal, an exception not from a lost peer) within ``culprit_window_s`` is a launcher's
  answer to that rank's death (torchrun and ``torch.multiprocessing`` SIGTERM the others when one rank
  dies, often before the agent sees it go): a crash: a ``job_end`` event with outcome ``stopped``;
* **exit failed** - every rank ended, and the only failures are of ranks that had finished their work:
  a status-0 goodbye followed by a fatal signal (an abort in the interpreter's teardown, e.g. a C++
  destructor: ``terminate called without an active exception``), or an abnormal end at the job's last
  step while every other rank exited 0: one ``exit_failed`` *warning* (the work is done, the exit is
  not clean), then the ``job_end`` event;
* **ended while hung** - a ``job_hang`` was open when the ranks began to end (the job was killed because
  it hung): a ``job_end`` event with that outcome; the hang alert already said who and where;
* **time_limit**, **cancelled**, **preempted**, **node_fail** - the scheduler said so: a Slurm epilog
  (``stepwatch slurm epilog``, :mod:`stepwatch.agents.slurm`; an ``inflight`` row with source ``slurm``,
  state ``sched_end``, the Slurm state in ``error``) reported the job ``TIMEOUT``, ``CANCELLED``, ... : a
  ``job_end`` event with that outcome, whatever the ranks were doing (hung or not) and however they ended
  (SIGTERM, or SIGKILL after ``KillWait``: no ``rank_crash``). For a job whose prolog was heard
  (``sched_start``), ranks that all ended by a stop signal or without a word wait ``sched_wait_s`` for
  the epilog's word before being judged. Any other state (``COMPLETED``, ``FAILED``) is kept in the
  evidence (``scheduler``) of the judgement below;
* **crashed** - the first rank to end ended abnormally (an exception, a non-zero status, a fatal signal,
  or gone without a word: SIGKILL, ``os._exit``, the OOM killer): one critical ``rank_crash`` alert,
  raised when every rank has ended or ``grace_s`` after that end while others still run (then the
  evidence says what they are doing: blocked in which collective, from :func:`detectors.hang.locate`).
  It names the rank whose end explains the rest: among the abnormal ends within ``culprit_window_s`` of
  the first, a rank gone without a word or ended by a fatal signal before one that raised an exception,
  and an exception that is not a peer's lost connection (``Connection closed by peer``, an NCCL or gloo
  error: what the others raise when a rank dies) before one that is, then the earliest.

While a rank has ended and the judgement waits, and after it, the job is not hung: :class:`Stall` asks
:meth:`JobLife.holds_hang`. New steps after the end (the same job id restarted from a checkpoint) start
a new life: :meth:`JobLife.restarted` tells the processor to start new baselines.

Cost: O(new in-flight rows) per tick (a filter on the state column); state: two small dicts per rank
that ended (bounded by the job's ranks).
"""
from __future__ import annotations

import re
import signal as _signal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import hang
from .base import Alert, Detector, JobContext, StepBlock, stable_id
from .settings import Setting

STOP_SIGNALS = {int(_signal.SIGTERM), int(_signal.SIGINT), int(_signal.SIGHUP)}
#: how an exception a rank raises reads when it is a peer's death seen through a collective
PEER_LOST = re.compile(r"connection|closed|reset by peer|broken pipe|peer|timed? ?out|nccl|gloo|hccl|"
                       r"processgroup|collective|watchdog|socket|EOF", re.I)
EVENT_KINDS = {"job_end"}


def signame(sig: int | None) -> str:
    try:
        return _signal.Signals(int(sig)).name
    except (TypeError, ValueError):
        return f"signal {sig}"


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$', re.M)


def traceback_line(tb: str) -> str:
    """The innermost frame of the program itself in a Python traceback (``file:line in function``),
    outside torch and the Python library; the innermost frame when all are; "" when none."""
    frames = _FRAME.findall(tb or "")
    for f, line, fn in reversed(frames):
        if "/torch/" not in f and "/lib/python3" not in f and "site-packages" not in f:
            return f"{f}:{line} in {fn.strip()}"
    return f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2].strip()}" if frames else ""


class End:
    """One rank's end: ``how`` is ``ok`` | ``error`` (non-zero status or exception) | ``stop`` (SIGTERM,
    SIGINT, SIGHUP) | ``fatal`` (another signal) | ``gone`` (no word)."""

    __slots__ = ("t", "t_lo", "how", "code", "signal", "error", "stack", "pid", "node", "step")

    def __init__(self, row: dict):
        self.t = int(row["t"])
        # when it ended at the earliest: a goodbye is sent as the process ends; the agent sees a process
        # gone at its next look, and the rank's last datagram ('since') bounds the end from below
        since = row.get("since")
        self.t_lo = int(since) if row.get("state") == "gone" and since and 0 < int(since) <= self.t else self.t
        self.code, self.signal = row.get("exit_code"), row.get("signal")
        self.error, self.stack, self.pid = row.get("error"), row.get("stack"), row.get("pid")
        self.node, self.step = row.get("node") or "", row.get("step")
        if row.get("state") == "gone":
            self.how = "gone"
        elif self.signal is not None:
            self.how = "stop" if int(self.signal) in STOP_SIGNALS else "fatal"
        elif self.code not in (None, 0):
            self.how = "error"
        else:
            self.how = "ok"

    @property
    def abnormal(self) -> bool:
        return self.how in ("error", "fatal", "gone")

    def words(self) -> str:
        if self.how == "gone":
            return "ended without a word (SIGKILL, os._exit, the OOM killer or a crash in native code)"
        if self.signal is not None:
            return f"was ended by {signame(self.signal)}"
        if self.error:
            return f"exited with status {self.code}: {self.error}"
        return f"exited with status {self.code}"

    def doc(self) -> dict:
        d = {"how": self.how, "t_ns": self.t}
        for k in ("code", "signal", "error", "pid", "node"):
            v = getattr(self, k)
            if v not in (None, ""):
                d["exit_code" if k == "code" else k] = v
        if self.signal is not None:
            d["signal_name"] = signame(self.signal)
        return d


class JobLife:
    """How a job's ranks ended (see the module docs); fed the job's in-flight rows."""

    def __init__(self):
        self.first: dict[int, End] = {}          # rank -> its first end
        self.later: dict[int, End] = {}          # rank -> an end after a status-0 goodbye (teardown)
        self.outcome: str | None = None          # finished | stopped | exit_failed | crashed, once judged
        self.t_outcome = 0
        self.step_outcome = -1                   # the job's newest step when it was judged
        self.crash_alert: Alert | None = None
        self.hung_ns = 0                         # a job_hang is open (since this event time): ends end a hung job
        self.sched_start = 0                     # when the scheduler said the job started (Slurm prolog), ns
        self.sched_end: dict | None = None       # the scheduler's word on its end: state, exit_code, signal, t

    def add(self, t: pa.Table) -> None:
        if t is None or not t.num_rows or "state" not in t.column_names:
            return
        if "source" in t.column_names:
            sched = pc.fill_null(pc.equal(t.column("source"), "slurm"), False)
            if pc.any(sched).as_py():
                self._add_sched(t.filter(sched))
                t = t.filter(pc.invert(sched))
                if not t.num_rows:
                    return
        st = t.column("state")
        m = pc.or_(pc.equal(st, "exited"), pc.equal(st, "gone"))
        if not pc.any(m).as_py():
            return
        t = t.filter(m)
        cols = [c for c in ("rank", "t", "since", "state", "exit_code", "signal", "error", "stack", "pid", "node",
                            "step") if c in t.column_names]
        t = t.select(cols)
        for c in ("t", "since"):
            if c in t.column_names and pa.types.is_timestamp(t.schema.field(c).type):
                t = t.set_column(t.column_names.index(c), c, t.column(c).cast(pa.int64()))
        for row in sorted(t.to_pylist(), key=lambda r: r["t"]):
            r, e = int(row["rank"]), End(row)
            have = self.first.get(r)
            if have is None:
                self.first[r] = e
            elif have.how == "gone" and row.get("state") == "exited" and 0 <= e.t - have.t <= 10_000_000_000:
                e.t, e.t_lo = have.t, min(have.t_lo, e.t_lo)     # the agent saw it go before its goodbye was
                self.first[r] = e                                # read: the probe's word says how
            elif have.how == "ok" and e.how in ("fatal", "error") and r not in self.later:
                self.later[r] = e                # a clean goodbye, then the teardown failed

    def _add_sched(self, t: pa.Table) -> None:
        if pa.types.is_timestamp(t.schema.field("t").type):
            t = t.set_column(t.column_names.index("t"), "t", t.column("t").cast(pa.int64()))
        t = t.select([c for c in ("t", "state", "exit_code", "signal", "error") if c in t.column_names])
        for row in t.to_pylist():
            ts = int(row["t"])
            if row.get("state") == "sched_start":
                self.sched_start = self.sched_start or ts
            elif row.get("state") == "sched_end" and self.sched_end is None:
                self.sched_end = {"scheduler": "slurm", "state": row.get("error"), "exit_code": row.get("exit_code"),
                                  "signal": row.get("signal"), "t_ns": ts}

    def sched_stop(self) -> str | None:
        """The outcome the scheduler's end names (time_limit, cancelled, ...), None for any other end."""
        from stepwatch.agents.slurm import SCHED_STOPS
        return SCHED_STOPS.get((self.sched_end or {}).get("state") or "")

    def ended(self, seen: np.ndarray) -> tuple[list[int], list[int]]:
        """(ranks that ended, ranks that reported and have not) among ``seen`` (ranks with a step)."""
        done = [r for r in seen.tolist() if r in self.first]
        return done, [r for r in seen.tolist() if r not in self.first]

    def holds_hang(self) -> bool:
        """A rank has ended: what follows is the job's end or a crash, judged here, not a hang."""
        return bool(self.first)

    def restarted(self, steps_event_ns: int) -> bool:
        """Steps newer than the judged end: the job id started again (a restart from a checkpoint)."""
        return self.outcome is not None and steps_event_ns > self.t_outcome


class Lifecycle(Detector):
    """Judges how a job ended (see the module docs) on every tick of its event time.

    Settings: :attr:`SETTINGS` (the list below is made from it).
    """

    name = "lifecycle"

    SETTINGS = (
        Setting("grace_s", 2.0, 0.001, 600.0, "s", "after a rank ended abnormally, seconds of event time the others "
                "may take to end too before a crash is raised with them still running"),
        Setting("culprit_window_s", 5.0, 0.001, 600.0, "s", "abnormal ends this close after the first are weighed "
                "for the culprit (the agent sees a process without a goodbye up to its tick later)"),
        Setting("settle_s", 1.0, 0.0, 600.0, "s", "once every rank has ended, seconds of event time before the job "
                "is judged (the ranks' last steps, fetched with their goodbyes, are read first)"),
        Setting("sched_wait_s", 10.0, 0.0, 600.0, "s", "a job whose Slurm prolog was heard, its ranks all ended by a "
                "stop signal or without a word: seconds of event time to wait for the epilog's word"),
    )

    def __init__(self, **kw):
        self._bind(kw)

    def _derive(self) -> None:
        self.grace_ns, self.window_ns = int(self.grace_s * 1e9), int(self.culprit_window_s * 1e9)
        self.settle_ns, self.sched_wait_ns = int(self.settle_s * 1e9), int(self.sched_wait_s * 1e9)

    def update(self, ctx: JobContext, block: StepBlock) -> list[Alert]:
        return []

    def tick(self, ctx: JobContext, now_ns: int) -> list[Alert]:
        life = getattr(ctx, "life", None)
        if life is None or life.outcome is not None or not life.first and not life.sched_stop():
            return []
        last = ctx.last_step if ctx.last_step is not None else np.zeros(0, np.int64)
        seen = np.flatnonzero(last >= 0)
        if not len(seen):
            return []                                    # no step of the job read yet: nothing to judge
        caught_up = getattr(ctx, "caught_up", None)
        if getattr(ctx, "backlog", False) or caught_up is not None and not caught_up():
            return []                                    # its last steps may still be on their way
        done, alive = life.ended(seen)
        stop = life.sched_stop()
        if stop:                                         # the scheduler ended it (time limit, scancel): its word
            now = max([int(now_ns)] + [e.t for e in life.first.values()])
            return [self._job_end(ctx, life, stop, done, now)]
        if not done:
            return []
        now = max(int(now_ns), max(e.t for e in life.first.values()))
        if (life.sched_start and life.sched_end is None and all(life.first[r].how in ("stop", "gone") for r in done)
                and now - min(life.first[r].t for r in done) < self.sched_wait_ns):
            return []                                    # a scheduler's kill, perhaps: its epilog says which
        ends = sorted(((life.first[r].t_lo, life.first[r].t, r) for r in done))
        t0, _, r0 = ends[0]
        first = life.first[r0]
        crashed = first.abnormal or first.how == "stop" and self._hard_end_near(life, done, first.t)
        t_seen = min(life.first[r].t for r in done)      # the first end seen (a SIGSTOPped rank's last word
        if alive:                                        # is far older than its death: not t_lo here)
            if life.hung_ns and life.hung_ns <= t_seen:
                return []                                # a hung job being ended: its hang alert said it
            if crashed and now - min(e.t for e in life.first.values() if e.abnormal) >= self.grace_ns:
                return self._crash(ctx, life, done, alive, now)
            return []                                    # the others may still end: wait
        # every rank that reported has ended: judged once their last rows have had time to be read (a
        # consumer's position moves with what it fetched, not with what was handled: steps fetched with
        # the goodbyes may still wait in the same poll)
        if now - max(life.first[r].t for r in done) < self.settle_ns:
            return []
        if life.hung_ns and life.hung_ns <= t_seen:
            return [self._job_end(ctx, life, "ended_while_hung", done, now)]
        if crashed and not self._teardown_only(ctx, life, done):
            return self._crash(ctx, life, done, alive, now)
        out = []
        failed = [r for r in done if life.first[r].abnormal or r in life.later]
        if first.how == "stop":
            outcome = "stopped"
        elif failed:
            outcome = "exit_failed"
            out.append(self._exit_failed(ctx, life, failed, now))
        else:
            outcome = "finished"
        out.append(self._job_end(ctx, life, outcome, done, now))
        return out

    # -- judgements ---------------------------------------------------------------------------------
    def _hard_end_near(self, life: JobLife, done: list[int], t_stop: int) -> bool:
        """A rank ended hard (gone without a word, a fatal signal, an exception that is not a peer's lost
        connection) within the culprit window of the first stop signal: the stop was a launcher's answer
        to that rank's death (torchrun and torch.multiprocessing SIGTERM the others when one rank dies,
        before the agent has even looked), not a scheduler's stop (which signals every rank)."""
        for r in done:
            e = life.first[r]
            if e.abnormal and e.t_lo <= t_stop + self.window_ns and not (
                    e.how == "error" and e.error and PEER_LOST.search(e.error)):
                return True
        return False

    def _teardown_only(self, ctx, life: JobLife, done: list[int]) -> bool:
        """Every abnormal end is of a rank whose work was done: all others exited 0 and it had reached
        their last step."""
        bad = [r for r in done if life.first[r].abnormal]
        ok = [r for r in done if life.first[r].how == "ok"]
        if not bad or not ok:
            return False
        ls = ctx.last_step
        if ls is None or len(ls) <= max(done):
            return False
        top = max(int(ls[r]) for r in ok)
        return all(int(ls[r]) >= top for r in bad)

    def _culprit(self, life: JobLife) -> int:
        bad = [(e.t_lo, r) for r, e in life.first.items() if e.abnormal]
        t0 = min(t for t, _ in bad)
        near = [(t, r) for t, r in bad if t - t0 <= self.window_ns]

        def pri(tr):
            e = life.first[tr[1]]
            if e.how in ("gone", "fatal"):
                p = 0
            elif e.error and PEER_LOST.search(e.error):
                p = 2
            else:
                p = 1
            return (p, tr[0], tr[1])
        return min(near, key=pri)[1]

    def _crash(self, ctx, life: JobLife, done, alive, now: int) -> list[Alert]:
        r = self._culprit(life)
        e = life.first[r]
        node = e.node or ctx.node_of(r)
        last = int(ctx.last_step[r]) if ctx.last_step is not None and len(ctx.last_step) > r else None
        ev = {"outcome": "crashed", "rank": r, "end": e.doc(), "last_step": last,
              "ranks_ended": len(done), "ranks_running": len(alive),
              "ends": {str(x): life.first[x].doc() for x in sorted(done, key=lambda x: life.first[x].t)[:8]}}
        if e.stack:
            ev["stack"] = e.stack[-2048:]
            at = traceback_line(e.stack)
            if at:
                ev["at"] = at
        others = ""
        if alive:
            ev["running"] = sorted(alive)[:16]
            loc = hang.locate(ctx, min(life.first[x].t for x in done) - 60_000_000_000, now_ns=now)
            w = ((loc or {}).get("evidence", {}).get("inflight", {}) or {}).get("waiting")
            if w:
                ev["others_waiting"] = w
                others = f"; the others wait in {w.get('op')} (group {w.get('group')}, seq {w.get('seq')})"
            else:
                others = f"; {len(alive)} other rank(s) still run, blocked or about to fail"
        inflight = hang.step_in_progress(ctx, min(life.first[x].t for x in done) - 120_000_000_000)
        if inflight is not None and (last is None or inflight > last + 1):
            ev["step_in_progress"] = inflight            # the watchdogs' word: steps after the last stored one
        where = f"rank {r}" + (f" on {node}" if node else "") + (f" (pid {e.pid})" if e.pid else "")
        at = f" at {ev['at']}" if ev.get("at") else ""
        step = f" after step {last}" if last is not None and last >= 0 else ""
        sugg = (f"{where} {e.words()}{step}{at}{others}. Read its log "
                + ("and the node's kernel log (dmesg: the OOM killer, a GPU Xid) " if e.how in ("gone", "fatal") else "")
                + "for the cause, fix it, and restart the job from its last checkpoint.")
        a = Alert(job=ctx.job, kind="rank_crash", status="firing",
                  step_first=(last + 1) if last is not None and last >= 0 else max(int(ctx.max_step), 0),
                  step_detected=max(int(ctx.max_step), 0), t_detected=now, ranks=[r], nodes=[node],
                  cause="unknown", severity="critical", evidence=ev, cost_pct=100.0, suggestion=sugg)
        life.outcome, life.t_outcome, life.step_outcome, life.crash_alert = "crashed", now, int(ctx.max_step), a
        return [a]

    def _exit_failed(self, ctx, life: JobLife, failed: list[int], now: int) -> Alert:
        r = failed[0]
        e = life.later.get(r) or life.first[r]
        node = e.node or ctx.node_of(r)
        ev = {"outcome": "exit_failed", "ranks": failed[:16],
              "ends": {str(x): (life.later.get(x) or life.first[x]).doc() for x in failed[:8]}}
        sugg = (f"The job's work finished, but rank {r}" + (f" on {node}" if node else "") + f" {e.words()} while "
                "exiting (after its last step): its exit status says failure although the training completed. "
                "Commonly a native library's teardown (a C++ thread or destructor: 'terminate called without an "
                "active exception'); call torch.distributed.destroy_process_group() before exiting, and check "
                "that the checkpoint was written.")
        return Alert(job=ctx.job, kind="exit_failed", status="firing", step_first=max(int(ctx.max_step), 0),
                     step_detected=max(int(ctx.max_step), 0), t_detected=now, ranks=failed[:64],
                     nodes=[ctx.node_of(x) for x in failed[:64]], cause="unknown", severity="warning",
                     evidence=ev, cost_pct=0.0, suggestion=sugg)

    def _job_end(self, ctx, life: JobLife, outcome: str, done: list[int], now: int) -> Alert:
        codes: dict[str, int] = {}
        for r in done:
            e = life.first[r]
            k = e.how if e.how != "stop" else signame(e.signal)
            codes[k] = codes.get(k, 0) + 1
        life.outcome, life.t_outcome, life.step_outcome = outcome, now, int(ctx.max_step)
        ev = {"outcome": outcome, "ranks_ended": len(done), "ends_by_kind": codes,
              "last_step": int(ctx.max_step)}
        if life.sched_end is not None:
            ev["scheduler"] = dict(life.sched_end)
        if life.hung_ns:
            ev["hung"] = True
        words = {"time_limit": "was ended by the scheduler at its time limit",
                 "cancelled": "was cancelled (scancel or the scheduler)",
                 "preempted": "was preempted by the scheduler",
                 "node_fail": "was ended by the scheduler: a node failed",
                 "finished": "finished: every rank exited with status 0",
                 "stopped": "was stopped: its ranks were ended by a signal (a scheduler's or a user's stop)",
                 "exit_failed": "finished its work; a rank's exit failed (see its exit_failed warning)",
                 "ended_while_hung": "was ended while it hung (see its job_hang alert)"}[outcome]
        return Alert(job=ctx.job, kind="job_end", status="resolved", step_first=max(int(ctx.max_step), 0),
                     step_detected=max(int(ctx.max_step), 0), t_detected=now, cause="unknown", severity="info",
                     evidence=ev, cost_pct=0.0, suggestion=f"Job {ctx.job} {words} after step {int(ctx.max_step)}.",
                     alert_id=stable_id(ctx.job, "job_end", [], int(now // 1_000_000_000)))

"""Helpers of the real-run evaluation and tests: a training job that owns its cores, as on a training
node, and the training script's own clock."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

#: a foreign busy process: ``python -c HOG <core> rt|plain <mark file>``, pinned to that core from its start,
#: named ``cpu-hog``, killed with its parent; as urgent as a real-time training job (``rt``: SCHED_RR 1, busy
#: 12 ms of every 18, so the kernel's real-time throttling never stalls the core) or busy all the time
HOG = ("import ctypes, os, sys, time\n"
       "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
       "libc = ctypes.CDLL(None)\n"
       "libc.prctl(15, b'cpu-hog', 0, 0, 0)\n"                      # PR_SET_NAME: its name in /proc/<pid>/stat
       "libc.prctl(1, 9, 0, 0, 0)\n"                                # PR_SET_PDEATHSIG: SIGKILL when the test dies
       "rt = sys.argv[2] == 'rt'\n"
       "if rt:\n"
       "    os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))\n"
       "with open(sys.argv[3] + '.tmp', 'w') as f:\n"              # when it takes the core (its start-up
       "    f.write(repr(time.time()))\n"                          # on a loaded machine: up to ~0.5 s)
       "os.rename(sys.argv[3] + '.tmp', sys.argv[3])\n"
       "end = time.monotonic() + 120\n"                             # never outlives a run
       "while time.monotonic() < end:\n"
       "    t = time.monotonic() + 0.012\n"                         # busy 12 ms ...
       "    while time.monotonic() < t:\n        pass\n"
       "    if rt:\n        time.sleep(0.006)\n")                  # ... of every 18 (real-time: see the docs)


def realtime(pid: int, core: int | None = None, on: bool = True) -> bool:
    """Every thread of ``pid`` and of its descendants (only those pinned to ``core`` when given) to
    ``SCHED_RR`` priority 1, or back to ``SCHED_OTHER`` (threads they start later inherit it): the training
    job then owns its cores against whatever else this shared machine runs, as on a training node. False
    where that is not allowed (no root or CAP_SYS_NICE)."""
    import psutil
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return False
    ok = True
    for pr in procs:
        try:
            if core is not None and pr.cpu_affinity() != [core]:
                continue
            for th in pr.threads():
                os.sched_setscheduler(th.id, *((os.SCHED_RR, os.sched_param(1)) if on else
                                               (os.SCHED_OTHER, os.sched_param(0))))
        except (psutil.Error, ProcessLookupError):
            continue
        except PermissionError:
            ok = False
    return ok


def jitter_is_real(out: str, step_detected: int, threshold: float = 1.1, window: int = 20,
                   ratio: float = 0.2) -> bool:
    """Whether the training script's own clock (the ``ends`` its ranks report in ``out``/rank*.json) shows
    jitter by the jitter detector's own rule at ``step_detected``: at least ``ratio`` of the ``window``
    steps before it slower than ``threshold`` x the larger of the trailing 21-step median and the last 5
    steps' median of the job's step time (the median over the ranks)."""
    return jitter_in(_rank_ends(out), step_detected, threshold, window, ratio)


def _rank_ends(out: str) -> list[np.ndarray]:
    """The ranks' own step-end times (s), one array per rank, from ``out``/rank*.json."""
    ends = []
    for f in Path(out).glob("rank*.json"):
        try:
            ends.append(np.asarray(json.loads(f.read_text())["ends"], dtype=float))
        except (OSError, ValueError, KeyError):
            continue
    return ends


def _job_steps(ends: list) -> np.ndarray | None:
    """The job's step times (ms) by the ranks' own clocks: per step, the median over the ranks; ``v[i]`` is
    step i+1's time. None without two ends of any rank."""
    ends = [np.diff(np.asarray(e, dtype=float)) * 1e3 for e in ends if len(e) > 1]
    if not ends:
        return None
    n = min(len(e) for e in ends)
    return np.median(np.vstack([e[:n] for e in ends]), axis=0)


def jitter_in(ends: list, step_detected: int, threshold: float = 1.1, window: int = 20, ratio: float = 0.2) -> bool:
    """:func:`jitter_is_real` on the ranks' own step-end times (s), one array per rank."""
    v = _job_steps(ends)
    if v is None:
        return False
    n = len(v)
    hi = min(int(step_detected), n)
    slow = 0
    for i in range(max(hi - window, 21), hi):
        b = max(np.median(v[i - 21:i]), np.median(v[i - 5:i]))
        slow += v[i] > threshold * b
    return slow >= ratio * window


def step_times_around(out: str, at: int, width: int = 20) -> tuple[float, float] | None:
    """The job's median step time (ms; the median over the ranks of each step, by the ranks' own clocks,
    ``out``/rank*.json) over the ``width`` steps before step ``at`` and the ``width`` steps after it: what the
    script saw an injected fault do, so a missed fault can be told from a fault that did not take."""
    v = _job_steps(_rank_ends(out))
    if v is None:
        return None
    before, after = v[max(at - 1 - width, 0):max(at - 1, 0)], v[at:at + width]
    if not len(before) or not len(after):
        return None
    return float(np.median(before)), float(np.median(after))


def _work_ms(rep: dict) -> np.ndarray:
    """A rank's own work per step (ms; ``[i]`` is step ``i + 1``'s): its main thread's CPU time (``cpu``:
    ``time.thread_time`` at each step end) plus the time its forward passes spent off the CPU (``off``:
    the pad's sleep that stands for device time, a late wake-up from it, waiting for a core), which the CPU
    clock does not see. Without ``off`` (an older report), the CPU time alone."""
    cpu = np.diff(np.asarray(rep.get("cpu") or [], dtype=float)) * 1e3
    off = np.diff(np.asarray(rep.get("off") or [], dtype=float)) * 1e3
    return cpu + off if len(off) == len(cpu) else cpu


def straggle_is_real(out: str, rank: int, step_first: int, step_detected: int, share: float = 0.05) -> bool:
    """Whether the training script's own clock shows ``rank`` working longer over the steps an alert
    named it for: its own work per step (:func:`_work_ms`: CPU time plus its forward passes' time off the
    CPU; a rank the machine woke late from its device-time sleep, or left waiting for a core, worked longer
    by its own wall clock) over ``[step_first, step_detected]`` above its median over the 20 steps before by
    at least ``share`` of the job's median step time. A rank the machine really slowed, not one the detector
    imagined."""
    try:
        rep = json.loads((Path(out) / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return False
    cpu = _work_ms(rep)                                                       # cpu[i]: step i+1's work ms
    step = np.diff(np.asarray(rep.get("ends") or [], dtype=float)) * 1e3
    lo, hi = max(int(step_first) - 1, 0), min(int(step_detected), len(cpu))
    if hi - lo < 3 or lo < 10:
        return False
    before = cpu[max(lo - 20, 0):lo]
    return float(np.median(cpu[lo:hi]) - np.median(before)) >= share * float(np.median(step))


def slowdown_is_real(out: str, step_first: int, step_detected: int, share: float = 0.05) -> bool:
    """Whether the training script's own clock shows every rank working longer from ``step_first`` on, as a
    job-wide ``regression`` of cause computation says: each rank's own work per step (:func:`_work_ms`) over
    ``[step_first, step_detected]`` above its median over the 20 steps before by at least ``share`` of the
    job's median step time. The machine slowed the whole job (its CPU's clock, a busy sibling thread), not
    the detector. A run that short of steps before the change proves nothing (False)."""
    reps = []
    for f in sorted(Path(out).glob("rank*.json")):
        try:
            reps.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            return False
    if not reps:
        return False
    for rep in reps:
        cpu = _work_ms(rep)
        step = np.diff(np.asarray(rep.get("ends") or [], dtype=float)) * 1e3
        lo, hi = max(int(step_first) - 1, 0), min(int(step_detected), len(cpu))
        if hi - lo < 3 or lo < 10 or not len(step):
            return False
        if float(np.median(cpu[lo:hi]) - np.median(cpu[max(lo - 20, 0):lo])) < share * float(np.median(step)):
            return False
    return True

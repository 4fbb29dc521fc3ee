"""Clocks of the probe other than ``perf_counter_ns``: the step thread's CPU time and run-queue wait
(:class:`_ThreadCpu`), and device events around collectives on CUDA/NPU tensors (:class:`DeviceTiming`,
a part the :class:`~.core.Probe` composes)."""
from __future__ import annotations

import os
import sys
import threading
import time

MAX_DEV_CALLS = 4096                  # device event pairs awaiting their replay (beyond: timed by the host)


class _ThreadCpu:
    """The calling thread's CPU time and run-queue wait, cumulative ns: ``read() -> (cpu, wait)``.

    Both come from one ``pread`` of ``/proc/thread-self/schedstat`` (the scheduler's own accounting:
    time on a CPU, and time *runnable but waiting for a CPU*, which is what a competing process on the
    rank's core costs it). Where that file is missing (no ``CONFIG_SCHED_INFO``), the CPU time comes
    from ``CLOCK_THREAD_CPUTIME_ID`` and the wait is -1 (unknown). The file is reopened when the
    reading thread changes or after a fork. Read by :meth:`StepFold.cpu_sample` at each drain (every ~500 ms),
    not per step."""

    def __init__(self):
        self.fd, self.tid, self.pid, self.proc = -1, 0, 0, True

    def read(self) -> tuple[int, int]:
        if self.proc:
            tid = threading.get_native_id()
            if tid != self.tid or self.fd < 0 or self.pid != os.getpid():
                self._reopen(tid)
            if self.fd >= 0:
                try:
                    f = os.pread(self.fd, 96, 0).split()
                    return int(f[0]), int(f[1])
                except (OSError, ValueError, IndexError):
                    self.proc = False
        return time.thread_time_ns(), -1

    def _reopen(self, tid: int) -> None:
        if self.fd >= 0 and self.pid == os.getpid():
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd, self.tid, self.pid = -1, tid, os.getpid()
        try:
            self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.proc = False


class DeviceTiming:
    """Device timing of synchronous collectives (torch.cuda / torch.npu events). A part of
    :class:`~.core.Probe` with no collaborators: the collective wrappers call :meth:`begin`/:meth:`end`
    live, the fold calls :meth:`elapsed` when it replays the call. Its state: the device modules seen
    (``mods``), the pooled event pairs (``pool``), the pairs awaiting their replay (``calls``), and the
    counters ``timed``/``unready``."""

    def __init__(self):
        self.mods: dict = {}                 # device type -> torch.cuda / torch.npu (False: none)
        self.pool: dict = {}                 # device type -> free (start, end) event pairs
        self.calls: dict = {}                # token -> (device type, start event, end event)
        self.next = 0
        self.timed = self.unready = 0
        # step boundaries (see step_mark): the device module, its free events, token -> event, the last
        # boundary's event, steps timed on the device / by the host because an event had not completed
        self.step_mod = None
        self.step_pool: list = []
        self.marks: dict = {}
        self.prev_mark = None
        self.steps_timed = self.steps_unready = 0
        # how far the device runs behind the host at the last step boundary (ns): the boundary's event
        # completes this long after the host recorded it. Exact in its changes (each step adds the
        # device's interval less the host's), clamped at 0 (the device never runs ahead of the host) and
        # 0 at the first boundary; a Lindley recursion, the backlog of a queue. Host time spent waiting
        # for data while the device still had this much queued work did not hold the device.
        self.lag_ns = 0

    @staticmethod
    def accelerator_in_use() -> int:
        """1 once this process uses CUDA (its context exists) or has torch_npu loaded: only then do the
        collective wrappers look at their payload's device (checked at every replay until true; never
        initialises CUDA)."""
        if sys.modules.get("torch_npu") is not None:
            return 1
        torch = sys.modules.get("torch")
        try:
            return 1 if torch is not None and torch.cuda.is_initialized() else 0
        except Exception:  # noqa: BLE001
            return 0

    def after_fork(self) -> None:
        """In a forked child: the parent's events in flight are the parent's."""
        self.calls.clear()
        self.marks.clear()
        self.prev_mark = None
        self.lag_ns = 0

    # ---- step boundaries on the device
    #
    # On CUDA/NPU the host only queues a step's kernels and runs ahead of the device until something
    # synchronises (``loss.item()``, a full launch queue, a host-side collective), so the host's time
    # between two step ends swings (2.7 / 9.0 ms alternating on an H200, one rank on NCCL) while the
    # device's does not. At every step boundary the hot path records one event on the current stream
    # (``step_mark``); the fold takes the step's time as the device time between the previous
    # boundary's event and this one (``step_elapsed``), i.e. the interval between the device finishing
    # one step's work and the next's, idle time waiting for the host included. The probe replays a
    # boundary only once its event completed (``Probe._drain`` holds the events from the first one
    # still running, for at most ``HOLD_NS``), so a step's time is the host's only when its event did
    # not complete within that (counted in ``steps_unready``).

    def step_mark(self) -> int:
        """Live, at a step boundary while an accelerator is in use: record an event on the current
        stream and return its token (-1: no device events, or too many waiting)."""
        mod = self.step_mod
        if mod is None:
            mod = False
            if sys.modules.get("torch_npu") is not None:
                mod = getattr(sys.modules.get("torch"), "npu", False) or False
            else:
                torch = sys.modules.get("torch")
                try:
                    if torch is not None and torch.cuda.is_initialized():
                        mod = torch.cuda
                except Exception:  # noqa: BLE001
                    mod = False
            if mod is not False and not hasattr(mod, "Event"):
                mod = False
            self.step_mod = mod
        if mod is False or len(self.marks) >= MAX_DEV_CALLS:
            return -1
        e = self.step_pool.pop() if self.step_pool else mod.Event(enable_timing=True)
        e.record()
        tok = self.next
        self.next = (tok + 1) & 0x3FFFFFFF
        self.marks[tok] = e
        return tok

    def step_ready(self, tok: int) -> bool:
        """Whether a boundary's event completed (an unknown token: yes, nothing to wait for)."""
        e = self.marks.get(tok)
        if e is None:
            return True
        try:
            return bool(e.query())
        except Exception:  # noqa: BLE001
            return True

    def step_elapsed(self, tok: int, host_ns: int) -> int:
        """Folding a step boundary: the device time (ns) since the previous boundary's event when both
        completed, else ``host_ns`` (the first boundary, or one unready: ``steps_unready``). This
        boundary's event becomes the previous one; the older goes back to the pool."""
        e = self.marks.pop(tok, None)
        prev, self.prev_mark = self.prev_mark, e
        if e is None or prev is None:
            if prev is not None:
                self.step_pool.append(prev)
            return host_ns
        try:
            if e.query():
                ns = int(prev.elapsed_time(e) * 1e6)
                if ns >= 0:
                    self.steps_timed += 1
                    host_ns = ns
                else:
                    self.steps_unready += 1
            else:
                self.steps_unready += 1
        except Exception:  # noqa: BLE001 - a device error is the training's to report, not ours
            self.steps_unready += 1
        self.step_pool.append(prev)
        return host_ns

    def step_start(self, tok: int) -> None:
        """Folding a step that opens at a boundary of its own (``begin_step`` after ``end_step``): its
        event is where the step's device time starts."""
        e = self.marks.pop(tok, None)
        if self.prev_mark is not None:
            self.step_pool.append(self.prev_mark)
        self.prev_mark = e

    def step_drop(self, tok: int) -> None:
        """An event at an optimizer step that did not end a step (explicit mode): back to the pool."""
        e = self.marks.pop(tok, None)
        if e is not None:
            self.step_pool.append(e)

    def begin(self, x) -> int:
        """Live, before a synchronous collective on a device tensor: record a start event on the
        current stream (``torch.cuda.Event``/``torch.npu.Event``, pooled) and return its token (-1:
        no device events; the host time is kept). On CUDA/NPU the host only launches the collective,
        so the host's wall time would be the launch; the events, read at the replay (``query()``
        first: never a synchronisation), give the kernel's time on the device, waiting for peers
        included, which is then split into transfer and wait as on the CPU."""
        kind = x.device.type
        mod = self.mods.get(kind)
        if mod is None:
            torch = sys.modules.get("torch")
            mod = getattr(torch, kind, None) if torch is not None else None
            if mod is None or not hasattr(mod, "Event"):
                mod = False
            self.mods[kind] = mod
        if mod is False or len(self.calls) >= MAX_DEV_CALLS:
            return -1
        pool = self.pool.get(kind)
        if pool:
            e0, e1 = pool.pop()
        else:
            e0, e1 = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
        e0.record()
        tok = self.next
        self.next = (tok + 1) & 0x3FFFFFFF
        self.calls[tok] = (kind, e0, e1)
        return tok

    def end(self, tok: int) -> None:
        d = self.calls.get(tok)
        if d is not None:
            d[2].record()

    def elapsed(self, tok: int, host_ns: int) -> int:
        """Folding: the device time of a collective (ns) when its end event completed, else the
        host's (counted in ``unready``); the events go back to the pool."""
        d = self.calls.pop(tok, None)
        if d is None:
            return host_ns
        kind, e0, e1 = d
        try:
            if e1.query():
                self.timed += 1
                host_ns = int(e0.elapsed_time(e1) * 1e6)
            else:
                self.unready += 1
        except Exception:  # noqa: BLE001 - a device error is the training's to report, not ours
            self.unready += 1
        self.pool.setdefault(kind, []).append((e0, e1))
        return host_ns

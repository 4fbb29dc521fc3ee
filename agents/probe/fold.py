"""The fold: the hot path's events become steps, and each finished step a packed frame.

Every few hundred events (or ``flush_ms``, 500 ms), the probe's drain hands the event log to
:meth:`StepFold.replay`, which applies the events in order to the step state (what the hooks would have done
live, but warm and in a tight loop) and packs every finished step as one fixed-size frame (:mod:`stepwatch.wire.datagram`)
into the probe's datagram buffer: ``_probefast.pack_step`` in C, or :meth:`StepFold._pack_py` (the step's values,
packed by :func:`stepwatch.wire.datagram.pack_frame`), byte for byte the same.
:class:`StepFold` is a part the :class:`~.core.Probe` composes.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

from . import eventlog as _ev
from .collectives import DEFAULT_COMM_GBPS
from .timing import _ThreadCpu
from .eventlog import K_BEGIN, K_BUCKET, K_COLL, K_COUNT, K_DATA, K_DCOLL, K_END, K_GC, K_MARK, K_OPT_POST, K_PHASE
from stepwatch.wire.datagram import (GCREC, HDR, MAGIC, MAX_CALLS, MAX_COMM, MAX_DATAGRAM, MAX_FRAME, MAX_GC,
                                     MAX_PENDING, MAX_PHASES, T_BATCH, VERSION, pack_frame)

_OPENING = frozenset((K_DATA, K_COLL, K_DCOLL, K_BUCKET))   # events that open a step in automatic mode
                                                            # (and K_OPT_POST with a pre-hook time)


class Position(NamedTuple):
    """The step in progress as of the last replay (:meth:`StepFold.position`): copies, never the fold's own."""
    step: int                 # the step number (of the open step, else of the next one)
    start: int                # perf ns the open step started at
    open: bool                # a step is open
    primary: int | None       # id() of the optimizer whose step ends a training step
    explicit: bool            # begin_step seen: steps are the user's
    used: tuple               # per phase slot: used in the open step
    seq: list                 # collectives replayed per comm slot (per-group sequence numbers)


class StepFold:
    """Events -> steps -> frames, and the state of the step in progress. A part the :class:`~.core.Probe`
    composes; its collaborators: ``transport`` (the frames go into its buffer, it sends them), ``timing``
    (the device events of collectives timed on the device), ``names`` (phase ids and slots, collective keys
    and traffic factors) and ``identity`` (the rank in every frame, resolved at the first one). The probe's
    drain hands it the event log's batch (:meth:`replay`) after :meth:`cpu_sample`."""

    def __init__(self, transport, timing, names, identity):
        self.transport, self.timing, self.names, self.identity = transport, timing, names, identity
        self._gcbuf = bytearray(HDR.size + MAX_GC * GCREC.size)   # header room: sent alone when full
        self._gcmv = memoryview(self._gcbuf)
        self.gc_row_min_ns = 0
        self._ns_per_byte = 1.0 / DEFAULT_COMM_GBPS
        self._explicit = False                # begin_step seen: steps are the user's (explicit mode)
        self._primary_opt: int | None = None  # id() of the optimizer whose step ends a training step
        self._opt_slot: int | None = None
        self._cpu_clock = _ThreadCpu()        # the step thread's CPU clocks (cpu_sample)
        self._seq = [0] * MAX_COMM            # collectives replayed per comm slot (per-group sequence numbers)
        self._marks: dict[int, int] = {}      # kind phase slot -> perf ns it was marked in the open step
        self.reset_counters()
        self.reset_step_state()

    def position(self) -> Position:
        """Where the fold stands (read-only, from any thread: the watchdog's, the goodbye's, the profile's
        step boundaries); the phase flags and sequence numbers are copies."""
        return Position(self._step, self._t0_perf, self._open, self._primary_opt, self._explicit,
                        tuple(self._ph_used), list(self._seq))

    def claim_primary(self, opt_id: int) -> bool:
        """The first optimizer to finish a step is the one whose step ends training steps: True when
        ``opt_id`` became it (once per process)."""
        if self._primary_opt is not None:
            return False
        self._primary_opt = opt_id
        return True

    def configure(self, start_step: int, comm_gbps: float, gc_row_min_ns: int) -> None:
        """``init``'s settings: the number of the next step, the link bandwidth of the transfer estimate
        (GB/s = bytes/ns; 0: none) and the shortest collection sent as a ``gc`` row."""
        self._step = int(start_step)
        self._ns_per_byte = 1.0 / comm_gbps if comm_gbps > 0 else 0.0
        self.gc_row_min_ns = gc_row_min_ns

    def drop_open(self) -> None:
        """``shutdown``: the step in progress is nobody's (the next ``init`` opens a new one)."""
        self._open = False

    def reset_counters(self) -> None:
        self.n_steps = 0
        self.gc_rows_dropped = 0
        self.phases_dropped = 0

    def reset_step_state(self) -> None:
        """All per-step state; the phase lists are allocated here once and only zeroed afterwards."""
        self._open = False
        self._step = 0
        self._t0_perf = 0
        self._t0_wall = 0
        if not hasattr(self, "_ph_ns"):
            self._ph_ns = [0] * MAX_PHASES
            self._ph_used = [False] * MAX_PHASES
            self._ph_touched: list[int] = []      # named phase slots (>= 2) used in this step
        self._calls: list[tuple] = []             # this step's collectives: (slot, count, bytes, ns, wait ns | None)
        self._buckets: dict[int, list] = {}        # this step's DDP buckets per slot (see _bucket_calls)
        self._cpu_rates = (-1.0, -1.0)             # CPU and run-queue wait per wall ns, this replay (see cpu_sample)
        self._cpu_prev = None                      # (perf ns, cpu ns, wait ns) at the last sample
        self._zero_phases()
        self._gc_ns = self._gc_count = 0
        self._data_queue = self._samples = self._tokens = -1
        self._n_gc = 0

    def after_fork(self) -> None:
        """In a forked child: the parent's steps, counters and optimizer are the parent's."""
        self.reset_counters()
        self.reset_step_state()
        self._primary_opt = None
        self._seq = [0] * MAX_COMM
        self._marks = {}

    def cpu_sample(self, now: int, tid: int | None) -> None:
        """The step thread's CPU time and run-queue wait since the last replay, as rates per wall ns, which
        the replay applies to each step it packs: one ``pread`` per replay (every ~500 ms, or every step
        end where steps are longer or a profile runs), nothing on the step path. A replay run by another
        thread (a collective's callback filling the log) samples nothing; its steps get null."""
        self._cpu_rates = (-1.0, -1.0)
        if tid is None or threading.get_ident() != tid:
            return
        c, w = self._cpu_clock.read()
        prev = self._cpu_prev
        self._cpu_prev = (now, c, w)
        if prev is None or now <= prev[0] or c < prev[1]:
            return
        dt = now - prev[0]
        self._cpu_rates = ((c - prev[1]) / dt, (w - prev[2]) / dt if w >= prev[2] >= 0 else -1.0)

    def replay(self, events: list) -> None:
        """Apply the events, in order, to the step state: what the hooks would have done live. The
        state lives in locals while the batch is replayed (the loop runs once per event, a few
        hundred at a time; attribute traffic per event would be most of its cost)."""
        open_, explicit, t0p, t0w = self._open, self._explicit, self._t0_perf, self._t0_wall
        ph, used, touched = self._ph_ns, self._ph_used, self._ph_touched
        calls, gc_ns, gc_count, dq = self._calls, self._gc_ns, self._gc_count, self._data_queue
        samples, tokens, step = self._samples, self._tokens, self._step
        tr = self.transport                      # frames go into its buffer, it sends them
        primary, off = self._primary_opt, tr.wall_off
        buf, boff, inst = tr.buf, tr.off, tr.instance
        names = self.names
        ids, keys = names.phase_ids, names.comm_key
        traffic, nspb = names.c_traffic, self._ns_per_byte
        opt_slot = self._opt_slot
        seqs, marks = self._seq, self._marks
        rate_c, rate_w = self._cpu_rates
        ident = self.identity                    # (the rank of every frame)
        buckets = self._buckets
        dev_time = self.timing.elapsed                     # (a device-timed collective: its events)
        timing = self.timing                               # (a step boundary's device event: step_elapsed)
        fast = _ev._fast
        pack = fast.pack_step if fast is not None else None      # the frame in one C call
        for kind, slot, t0, t1, a, b in events:
            if not open_ and (kind == K_BEGIN or not explicit and (kind in _OPENING or kind == K_OPT_POST and t0)):
                # a step opens at t0: in explicit mode at begin_step(), in automatic mode at its first event
                # (a DataLoader call, a collective, an optimizer's pre-hook); what came before is nobody's
                if kind == K_BEGIN:
                    explicit = self._explicit = True
                    if a >= 0:
                        step = a
                open_, t0p, t0w = True, t0, t0 + off
                self._zero_phases()
                calls, gc_ns, gc_count, dq, samples, tokens = [], 0, 0, -1, -1, -1
                buckets.clear()
                if kind == K_BEGIN:
                    if b:                               # the device's start of this step
                        timing.step_start(int(b) - 1)
                    continue
            if kind == K_DATA:
                if a >= 0 and dq < 0:
                    dq = a
                ph[0] += t1 - t0                        # (the data slot is always sent: no "used" flag)
                continue
            if kind == K_COLL or kind == K_DCOLL:       # raw: summed and split into comm/wait when packed
                seqs[slot] += 1
                if kind == K_COLL:
                    calls.append((slot, 1, a, t1 - t0, None if b < 0 else b))
                else:                                   # timed on the device (see DeviceTiming.begin)
                    calls.append((slot, 1, a, dev_time(int(b), t1 - t0), None))
                if len(calls) >= MAX_CALLS:
                    self._calls = calls
                    self._squash_calls()
                    calls = self._calls
                continue
            if kind == K_BUCKET:                        # a DDP bucket: summed per slot, see _bucket_calls
                seqs[slot] += 1                         # (a collective of the group: its sequence number)
                if b >= 0:                              # timed on the device (see DeviceTiming.begin)
                    t1 = t0 + dev_time(int(b), t1 - t0)
                bk = buckets.get(slot)
                if bk is None:
                    buckets[slot] = [1, a, t0, t1, a, [(t0, t1)]]
                else:
                    bk[0] += 1
                    bk[1] += a
                    if t0 >= bk[2]:
                        bk[2], bk[4] = t0, a
                    if t1 > bk[3]:
                        bk[3] = t1
                    if len(bk[5]) < MAX_CALLS:          # (beyond: the rest count as exposed, see _bucket_calls)
                        bk[5].append((t0, t1))
                continue
            if kind == K_OPT_POST:
                if t0:                                  # the optimizer phase (any optimizer)
                    if opt_slot is None:
                        opt_slot = self._opt_slot = names.slot_for_phase("optimizer")
                    if opt_slot >= 0:
                        if not used[opt_slot]:
                            used[opt_slot] = True
                            touched.append(opt_slot)
                        ph[opt_slot] += t1 - t0
                if explicit or a != primary:
                    if b:
                        timing.step_drop(int(b) - 1)
                    continue
                t0, reopen, number = t1, True, -1       # the primary optimizer: a step ends, the next starts
            elif kind == K_END:
                if not open_:
                    continue
                reopen, number = False, -1
            elif kind == K_BEGIN:
                explicit = self._explicit = True      # (an open step: it ends, the next one opens)
                reopen, number = True, a
            elif kind == K_GC:
                gc_ns += t1
                gc_count += 1
                if t1 >= self.gc_row_min_ns:
                    self._gc_row(t0, t1, slot, a, int(b))
                continue
            elif kind == K_PHASE:
                self._add_phase(slot, a)
                continue
            elif kind == K_MARK:
                if slot >= 0 and slot not in marks:
                    marks[slot] = t0
                continue
            elif kind == K_COUNT:
                if a >= 0:
                    samples = (samples if samples > 0 else 0) + a
                if t0 >= 0:
                    tokens = (tokens if tokens > 0 else 0) + t0
                continue
            else:
                continue
            # ---- the open step ends at t0: its frame is packed into the datagram buffer
            wall = t0 + off
            if marks or not self.n_steps:               # step kinds: phases eval/checkpoint/first_step (ms)
                self._kind_phases(t0, t0p)
            self.n_steps += 1
            step_ns = t0 - t0p                          # its CPU time and run-queue wait: at this
            cpu_ns = step_ns * rate_c if rate_c >= 0 else -1.0     # replay's rates (see cpu_sample)
            cw_ns = step_ns * rate_w if rate_w >= 0 else -1.0
            if b:                                       # on a device: the time between its boundaries there
                dev = timing.step_elapsed(int(b) - 1, -1)
                if dev >= 0:
                    # the device's backlog when the step started (see DeviceTiming.lag_ns) hid that much
                    # of the host's wait for data: the device did not wait for it
                    lag = timing.lag_ns
                    if ph[0] and lag > 0:
                        ph[0] = ph[0] - lag if ph[0] > lag else 0
                    lag += dev - step_ns
                    timing.lag_ns = lag if lag > 0 else 0
                    step_ns = dev
            hidden_ns = self._bucket_calls(calls, buckets) if buckets else 0.0
            if tr.connected or t0 - tr.t_connect >= tr.reconnect_ns:
                if not ident.ready:
                    ident.resolve()
                if boff > MAX_DATAGRAM - MAX_FRAME:       # the buffer is full: it leaves now
                    tr.off = boff
                    tr.send_buf(t0)
                    boff = tr.off
                n_gc = self._n_gc
                if pack is not None:                     # C: the frame in one call
                    boff = pack(buf, boff, inst, ident.rank, step, t0w, wall, step_ns, ph[0],
                                ph[1] if used[1] else -1, gc_ns, gc_count, dq, samples, tokens, tr.dropped,
                                touched, ph, ids, calls, traffic, nspb, keys,
                                self._gcmv[16:16 + n_gc * GCREC.size] if n_gc else None, cpu_ns, cw_ns,
                                hidden_ns)
                else:
                    boff = self._pack_py(boff, step, t0w, wall, step_ns, gc_ns, gc_count, dq, samples, tokens,
                                         calls, n_gc, cpu_ns, cw_ns, hidden_ns)
                self._n_gc = 0
                tr.frames += 1
            else:                                        # nobody listens (a reconnect was tried < 1 s ago)
                self._n_gc = 0
                tr.lost(1, "no_agent")
            step = step + 1 if number < 0 else number
            # zero what this step used (no allocation but the next step's call list)
            ph[0] = ph[1] = 0
            used[0] = used[1] = False
            if touched:
                for i in touched:
                    ph[i] = 0
                    used[i] = False
                touched.clear()
            if calls:
                calls.clear()
            gc_ns = gc_count = 0
            dq = samples = tokens = -1
            open_, t0p, t0w = reopen, t0, wall
            # (sent on time by the drain, Probe._drain: flush_ms after the last send at the drain's own time)
            if tr.frames >= MAX_PENDING or (tr.need_hello and tr.connected):
                tr.off = boff
                tr.flush(t0)
                boff = tr.off
        tr.off = boff
        self._open, self._t0_perf, self._t0_wall, self._calls = open_, t0p, t0w, calls
        self._gc_ns, self._gc_count, self._data_queue = gc_ns, gc_count, dq
        self._samples, self._tokens, self._step = samples, tokens, step

    def _bucket_calls(self, calls: list, buckets: dict) -> float:
        """The step's DDP buckets as one call per slot (and clear them); returns the ns of their
        communication hidden behind backward. The reducer launches each bucket's all-reduce while
        backward goes on, so most of their time overlaps computation; what held the step (the exposed
        part) is the tail from the last launch (the end of backward) to the last completion. That tail
        is the call's time, split into transfer (the last bucket's payload at ``comm_gbps``) and waiting
        for peers; count and bytes are all the buckets'. The communication in flight is the union of the
        buckets' intervals (launch to completion): the tail is its last part, the rest of it overlapped
        backward (the hidden ns returned; the frame's ``comm_total_ns`` is the exposed ns plus these)."""
        nspb, traffic = self._ns_per_byte, self.names.c_traffic
        hidden = 0.0
        for s, (count, nbytes, last_launch, last_done, last_bytes, spans) in buckets.items():
            tail = last_done - last_launch if last_done > last_launch else 0
            tr = last_bytes * traffic[s] * nspb
            calls.append((s, count, nbytes, tail, float(tail - tr) if tail > tr else 0.0))
            spans.sort()
            union, lo, hi = 0, spans[0][0], spans[0][1]          # the union of the intervals before the tail
            for t0, t1 in spans:
                if t0 > hi:
                    union += hi - lo
                    lo, hi = t0, t1
                elif t1 > hi:
                    hi = t1
            union += hi - lo
            if union > tail:
                hidden += union - tail
        buckets.clear()
        return float(hidden)

    def _squash_calls(self) -> None:
        """A step with very many collectives: sum its calls so far per slot (bounded memory)."""
        agg, _, _ = self._sum_calls(self._calls)
        self._calls = [(k, c, b, t, w) for k, (c, b, t, w) in agg.items()]

    def _sum_calls(self, calls) -> tuple[dict, float, float]:
        """Per accumulator slot [count, bytes, ns, wait ns], and the step's comm and wait ns. A call
        timed on the CPU without a known wait (a blocking collective) splits into the transfer its
        payload needs at ``comm_gbps`` (comm) and the rest (waiting for peers)."""
        agg: dict[int, list] = {}
        traffic, nspb = self.names.c_traffic, self._ns_per_byte
        comm_ns = wait_ns = 0.0
        for s, count, nbytes, dt, wait in calls:
            if wait is None:
                tr = nbytes * traffic[s] * nspb
                wait = dt - tr if dt > tr else 0.0
            a = agg.get(s)
            if a is None:
                agg[s] = [count, nbytes, dt, wait]
            else:
                a[0] += count
                a[1] += nbytes
                a[2] += dt
                a[3] += wait
            comm_ns += dt - wait
            wait_ns += wait
        return agg, comm_ns, wait_ns

    def _pack_py(self, boff: int, step: int, t0w: int, wall: int, step_ns: int, gc_ns: int, gc_count: int,
                 dq: int, samples: int, tokens: int, calls: list, n_gc: int, cpu_ns: float = -1.0,
                 cw_ns: float = -1.0, hidden_ns: float = 0.0) -> int:
        """One step's frame at ``boff`` in the datagram buffer, in Python (``_probefast.pack_step`` does
        the same in C, byte for byte); returns the new offset. The exposed communication is what the
        calls held the step (comm + wait: a blocking collective, an async one's launch and ``wait()``,
        the DDP buckets' tail); the total adds ``hidden_ns``, the buckets' time behind backward."""
        transport = self.transport               # (tr below: a call's transfer ns)
        buf, inst = transport.buf, transport.instance
        ph, used, touched = self._ph_ns, self._ph_used, self._ph_touched
        ids, keys = self.names.phase_ids, self.names.comm_key
        traffic, nspb = self.names.c_traffic, self._ns_per_byte
        data_ns = ph[0]
        one = None
        if not calls:
            comms, comm_ns, wait_ns = None, 0.0, 0.0
        elif len(calls) == 1:                    # (the common case, without a dict)
            one = calls[0]
            k, count, nbytes, tt, wait = one
            if wait is None:
                tr = nbytes * traffic[k] * nspb
                wait = tt - tr if tt > tr else 0.0
                one = (k, count, nbytes, tt, wait)
            comms, comm_ns, wait_ns = None, tt - wait, wait
        else:
            comms, comm_ns, wait_ns = self._sum_calls(calls)
        if used[1]:
            compute_ns = ph[1]
        else:                                    # not given: the rest of the step, less the run-queue wait
            compute_ns = step_ns - data_ns - comm_ns - wait_ns - gc_ns - (cw_ns if cw_ns > 0 else 0.0)
            if compute_ns < 0:
                compute_ns = 0
        if one:
            k, count, nbytes, tt, wait = one
            comm = ((*keys[k], count, nbytes, tt, wait),)
        elif comms:
            comm = [(*keys[k], count, nbytes, tt, wait) for k, (count, nbytes, tt, wait) in comms.items()]
        else:
            comm = ()
        return pack_frame(buf, boff, inst, self.identity.rank,
                          (step, t0w, wall, step_ns, data_ns, compute_ns, comm_ns, wait_ns, gc_ns, gc_count, dq,
                           samples, tokens, transport.dropped & 0xFFFFFFFF, cpu_ns, cw_ns, comm_ns + wait_ns + hidden_ns,
                           comm_ns + wait_ns),
                          [(ids[i], ph[i]) for i in touched], comm,
                          self._gcmv[16:16 + n_gc * GCREC.size] if n_gc else ())

    def _kind_phases(self, t_end: int, t_start: int) -> None:
        """Folding, at a step end: the kinds marked in the step become phases (ms from the mark to the
        step end; ``checkpoint`` also gets the time inside the save calls), and the first step of the
        process gets ``first_step`` (its length)."""
        marks = self._marks
        if marks:
            for s, tm in marks.items():
                self._add_phase(s, max(t_end - tm, 0) if not self._ph_used[s] else 0)
            marks.clear()
        if not self.n_steps:
            self._add_phase(self.names.slot_for_phase("first_step"), t_end - t_start)

    def _gc_row(self, t: int, dt: int, generation: int, collected: int, uncollectable: int) -> None:
        """One collection as a ``gc`` row of the step (replay)."""
        n = self._n_gc
        tr = self.transport
        GCREC.pack_into(self._gcbuf, HDR.size + n * GCREC.size, t + tr.wall_off, dt, generation,
                        collected, uncollectable)
        n += 1
        if n == MAX_GC and self.n_steps:
            # a burst of collections: send them now on their own (no step record)
            HDR.pack_into(self._gcbuf, 0, MAGIC, VERSION, T_BATCH, tr.instance, self.identity.rank, 0, 0, MAX_GC, 0)
            tr.sendto(self._gcmv, frames=1)
            n = 0
        elif n == MAX_GC:
            self.gc_rows_dropped += 1       # nothing is sent before the first step: reuse the last slot
            n -= 1
        self._n_gc = n

    def _zero_phases(self) -> None:
        ph, used = self._ph_ns, self._ph_used
        ph[0] = ph[1] = 0
        used[0] = used[1] = False
        if self._ph_touched:
            for i in self._ph_touched:
                ph[i] = 0
                used[i] = False
            self._ph_touched.clear()

    def _add_phase(self, slot: int, ns: int) -> None:
        if slot < 0:
            self.phases_dropped += 1
            return
        if not self._ph_used[slot]:
            self._ph_used[slot] = True
            if slot >= 2:
                self._ph_touched.append(slot)
        self._ph_ns[slot] += ns

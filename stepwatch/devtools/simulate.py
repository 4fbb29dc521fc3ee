"""Simulated telemetry of one synchronous data-parallel training job, with injected faults.

:class:`Simulation` produces what the node agents of a cluster would send for one job (docs/wire-format.md):
``topology`` (one row per rank), ``steps`` (one row per rank per step), ``host`` (one row per node
per step) and ``gc`` (one row per Python garbage collection), as Arrow tables in the wire schemas of
:mod:`stepwatch.wire.tables`, plus ground-truth labels of the injected faults for evaluating detectors.

Model of one step (all durations float64 milliseconds)
------------------------------------------------------
Every rank ``r`` of step ``s`` spends::

    busy[r]  = data_ms + compute_ms + gap + gc_ms      (its own work)
    comm_ms                                             (collective transfer time)

``gap`` is the host-side time (Python, operator dispatch, checkpoint writing, CPU contention); it has
no column of its own and is what is left of the step: ``gap = step_ms - data_ms - compute_ms -
comm_ms - comm_wait_ms - gc_ms``. Training is synchronous, so the slowest rank gates everyone::

    step_ms          = max over ranks of (busy + comm_ms)   (the same value on every rank)
    comm_wait_ms[r]  = step_ms - busy[r] - comm_ms[r]       (>= 0; the slowest rank waits least)

Steps follow each other in time: every rank of a step shares ``t_start``/``t_end``, ``t_end =
t_start + step_ms`` and the next step starts at this step's ``t_end``. ``step_ms`` is rounded up to
whole microseconds and ``t0_ns`` to whole seconds, so every timestamp is microsecond-aligned (and
converts with ``as_py()`` without pandas).

Baseline behaviour (``noise`` scales every random term; ``noise=0`` gives a noiseless job):

* nominal shares of the step: data wait 4%, compute 68%, host gap 6%, comm 12%; the rest is the
  wait for the slowest rank. All nominal durations are scaled once at start-up (on a few clean
  calibration steps) so that the median step time of a clean job equals ``step_ms``, whatever
  the number of ranks.
* per rank and step: heavy-tailed compute noise (Student-t, df=3, clipped to [-3, 8], times
  ``noise``/sqrt(3) of compute), small jitter on data/gap/comm, a step-wide comm jitter shared by
  all ranks, rare data-wait blips (probability 1e-4 per rank-step, exponential with mean
  ``1.5*noise`` of the step), static per-rank compute offsets (std ``0.2*noise``, within +-1%).
* Python GC: each rank collects with probability ``gc_rate`` per step (generation 0/1/2 with
  70/25/5%, about 1/3/8 ms); it appears in ``gc`` rows and in ``gc_ms``/``gc_count``.
* a checkpoint every ``checkpoint_every`` steps (steps ``k*checkpoint_every``, k >= 1): all ranks
  spend 30-50% of a step extra in the host gap; host rows show the disk writes.
* pipeline parallelism: with ``pp > 1`` the ranks are laid out stage-major, ``stage = rank //
  (ranks // pp)``, and stage ``k`` computes ``1 + 0.15 * k / (pp - 1)`` times the base work (the
  last stage is 15% busier): stage peers are alike, stages differ.

Faults (:class:`Fault`, several may combine; effects add up; they draw their randomness from their
own streams, so a faulted job equals the clean job of the same seed outside the faults' effects):

* ``slow-rank``: that rank's compute grows by ``pct``% of its nominal busy time (its accelerator
  shows a lower clock and higher temperature in ``host.accel``); the job's step time rises.
* ``regression``: every rank spends ``pct``% of ``step_ms`` more in the phase named by ``cause``:
  ``io`` -> data_ms (host iowait up, DataLoader queue empty), ``communication`` -> comm_ms (RDMA
  retransmits up), ``computation`` -> compute_ms, ``cpu`` -> host gap.
* ``gc-storm``: the rank (every rank if ``rank`` is None) collects generation 2 about 4 times per
  step, adding on average ``pct``% of its nominal busy time as ``gc_ms``.
* ``cpu-contention``: a foreign process ``monitor-plugin`` (about 40 cores, ``cpu_pct`` ~4000)
  runs on the node of ``rank``: the node's ``cpu_util``/``load1`` rise, it leads ``top_procs``, and
  every rank of that node gets ``pct``% of its nominal busy time slower (3/4 host gap, 1/4 compute,
  varying from step to step).
* ``gc-jitter``: unsynchronised Python GC across the job: on each step a few random ranks (Poisson,
  mean 0.35 per step, whatever the world size) pause for a generation-2 collection of about
  ``pct``% of ``step_ms`` (gamma-distributed); the pausing rank gates the step, so about 30% of the
  steps are slower while the median step stays put.
* ``data-stall``: intermittent DataLoader stalls: on about 25% of the steps (random) the data wait
  grows by about ``pct``% of ``step_ms`` on every rank (``rank`` None: shared storage) or on that rank
  only; the affected nodes show iowait and an empty prefetch queue.
* ``comm-slow``: communication slowdown of one data-parallel group, the ranks sharing ``rank``'s
  pipeline stage and tensor-parallel coordinate (with ``tp > 1`` one rank per tp-block): their
  ``comm_ms`` grows by ``pct``% of their nominal busy time (varying a little per step), so the whole
  job waits for them.
* ``rank-hang``: ``rank`` stops reporting steps (and GC, comm records) from ``start``; the other
  ranks go on and the node's host samples continue.
* ``job-hang``: every rank stops reporting from ``start`` while the host samples continue; with
  ``rank``, that rank stops first (no step >= ``start``) and the others two steps later (they block
  in the collective waiting for it).
* ``small-messages``: the gradient all-reduce goes out in ``2,048`` small calls per step instead of one
  bucket (no tensor fusion): the comm rows' ``count`` rises to 2,048 with the same total payload, and
  every rank's comm time grows by ``pct``% of ``step_ms`` (per-call latency).
* ``slow-link``: the data-parallel group of ``rank`` (as ``comm-slow``) loses ``pct``% of its link
  bandwidth: its transfer time is divided by ``1 - pct/100``, so the whole job waits for it.
* ``dataloader-starved``: the DataLoader cannot keep up: on every step the data wait grows by ``pct``% of
  ``step_ms`` on every rank (``rank`` None) or on that rank's node, and the prefetch queue is empty.
* ``clean``: nothing.

Every fault takes ``every`` (default 1): active only on steps ``start + k * every`` (an intermittent
straggler is ``slow-rank:rank=5,pct=30,start=50,every=3``).

``comm=True`` adds a ``comm`` table to :meth:`Simulation.generate`: per rank and step one ``all_reduce`` row
on its data-parallel group (``group`` = ``dp<stage * tp + tp coordinate>``, ``group_size`` its ranks,
``bytes`` sized for 75% of the nominal RDMA bus bandwidth, see ``_LINK_UTIL``) whose ``time_ms`` is the
transfer plus the wait for the group's last rank (``wait_ms``), and one ``barrier`` row on ``world``
holding the rest of ``comm_wait_ms`` (the wait for the other groups), as the probe records them: a
collective's wall time includes its wait. Topology rows carry ``device_type`` H100, ``dtype`` bf16,
``model_flops_per_token`` and ``model_params`` (each rank's share of a 2e9-parameter dense model).

Determinism: step ``s`` draws from ``np.random.default_rng([seed, s, stream])``, so the same
arguments give the same rows, and ``generate(a, b)`` then ``generate(b, c)`` equals
``generate(a, c)``. Everything is built from numpy arrays for all ranks (and all steps of a
chunk) at once; the only Python loop is over the steps of a chunk.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa

from stepwatch import __version__
from stepwatch.wire.tables import COMM, GC, HOST, STEPS, TOPOLOGY, JOB_RE
# the model (fault specs, nominal constants) and the table builders live beside this module (the in-flight
# states: siminflight.py)
from stepwatch.devtools.simmodel import (Fault, _check_fault, parse_fault, _BLIP_P, _CALIB_STEPS, _COMM, _COMPUTE,
                                         _DATA, _FOREIGN, _GAP, _GC_GEN_MS, _GC_GEN_P, _HANG_LAG, _JITTER_PAUSES, _KIND_CAUSE, _PARAMS, _STALL_P,
                                         _STORM_PER_STEP, _S_ACCEL, _S_BASE, _S_CKPT, _S_FAULT, _S_GC, _S_HOST,
                                         _S_QUEUE, _T_CLIP)
from stepwatch.devtools.simtables import SimTables, _strings, _tiled_string_array

__all__ = ["Simulation"]


# --------------------------------------------------------------------------- simulation

class Simulation(SimTables):
    """Telemetry of one synchronous data-parallel job of ``ranks`` ranks (see the module docs).

    Parameters: ``job`` job id; ``ranks`` world size; ``ranks_per_node`` consecutive ranks per node
    (``node-0000``, ``node-0001``, ...); ``steps`` length of the job (faults with ``end=None`` and the
    labels end at ``steps - 1``; :meth:`generate` may still go beyond); ``step_ms`` median step time of
    the clean job (ms); ``faults`` :class:`Fault` objects or spec strings; ``seed``; ``pp`` pipeline
    stages (must divide ``ranks``); ``tp`` tensor-parallel size (coordinates only; must divide
    ``ranks // pp``); ``t0_ns`` start time of step 0 (UTC ns; default: now, rounded down to the
    second); ``checkpoint_every`` steps between checkpoints (0/None: none); ``noise`` relative noise
    level (0 = noiseless); ``gc_rate`` baseline probability of a GC per rank per step;
    ``samples_per_rank``/``seq_len`` per-rank batch (``tokens = samples * seq_len``);
    ``cpus_per_node`` host cores; ``accel`` whether host rows carry per-accelerator metrics; ``comm``
    whether :meth:`generate` also returns a ``comm`` table (one all_reduce row per rank per step).

    Attributes: ``world_size``; ``nodes`` (R,) node name per rank; ``node_index`` (R,) node number per
    rank; ``node_names`` (N,) node names; ``stage`` (R,) pipeline stage per rank; ``faults``.
    """

    def __init__(self, job: str = "demo", ranks: int = 1024, ranks_per_node: int = 8, steps: int = 300,
                 step_ms: float = 1000.0, faults=(), seed: int = 0, pp: int = 1, t0_ns: int | None = None,
                 checkpoint_every: int | None = 100, noise: float = 0.02, *, tp: int = 1,
                 gc_rate: float = 0.02, samples_per_rank: int = 8, seq_len: int = 4096,
                 cpus_per_node: int = 192, accel: bool = True, comm: bool = False):
        if not JOB_RE.fullmatch(str(job)):
            raise ValueError(f"bad job id {job!r} (must match {JOB_RE.pattern})")
        if ranks < 1 or ranks_per_node < 1:
            raise ValueError(f"ranks ({ranks}) and ranks_per_node ({ranks_per_node}) must be >= 1")
        if pp < 1 or ranks % pp:
            raise ValueError(f"pp={pp} must be >= 1 and divide ranks={ranks}")
        if tp < 1 or (ranks // pp) % tp:
            raise ValueError(f"tp={tp} must be >= 1 and divide ranks/pp={ranks // pp}")
        if step_ms <= 0 or not np.isfinite(step_ms):
            raise ValueError(f"step_ms={step_ms} must be > 0")
        if noise < 0 or not 0 <= gc_rate <= 1:
            raise ValueError(f"noise ({noise}) must be >= 0 and gc_rate ({gc_rate}) in [0, 1]")
        self.job = str(job)
        self.world_size = int(ranks)
        self.ranks_per_node = int(ranks_per_node)
        self.steps = int(steps)
        self.step_ms = float(step_ms)
        self.seed = int(seed)
        self.pp, self.tp = int(pp), int(tp)
        self.checkpoint_every = int(checkpoint_every or 0)
        self.noise = float(noise)
        self.gc_rate = float(gc_rate)
        self.samples_per_rank, self.seq_len = int(samples_per_rank), int(seq_len)
        self.cpus_per_node = int(cpus_per_node)
        self.accel = bool(accel)
        self.comm = bool(comm)
        self.hang_lag = _HANG_LAG           # job-hang with a rank: steps the others go on (with_inflight: 0)
        self.long_steps: dict = {}          # step -> (kind, extra ms on every rank): evaluation, checkpoint
        self.t0_ns = int(t0_ns) if t0_ns is not None else (time.time_ns() // 1_000_000_000) * 1_000_000_000

        R = self.world_size
        fl = []
        for f in faults:
            f = parse_fault(f) if isinstance(f, str) else _check_fault(Fault(**asdict(f)))
            if f.rank is not None and f.rank >= R:
                raise ValueError(f"bad value {f.rank} for key 'rank' in fault {f.spec()!r} "
                                 f"(world size is {R})")
            if f.kind != "clean" and f.start >= self.steps:
                raise ValueError(f"bad value {f.start} for key 'start' in fault {f.spec()!r} "
                                 f"(the job has steps 0..{self.steps - 1})")
            if f.kind != "clean":
                fl.append(f)
        self.faults: list[Fault] = fl

        ranks_arr = np.arange(R)
        self.node_index = (ranks_arr // self.ranks_per_node).astype(np.int64)
        self.n_nodes = int(self.node_index[-1]) + 1
        width = max(4, len(str(self.n_nodes - 1)))
        self.node_names = np.array([f"node-{i:0{width}d}" for i in range(self.n_nodes)])
        self.nodes = self.node_names[self.node_index]
        self.local_rank = (ranks_arr % self.ranks_per_node).astype(np.int64)
        self.ranks_on_node = np.bincount(self.node_index, minlength=self.n_nodes)
        per_stage = R // self.pp
        self.stage = (ranks_arr // per_stage).astype(np.int32)
        self._dp = ((ranks_arr % per_stage) // self.tp).astype(np.int32)
        self._tp = (ranks_arr % self.tp).astype(np.int32)

        # static per-rank properties
        rng = np.random.default_rng([self.seed, 0xC0FFEE])
        work = 1.0 + (0.15 * self.stage / (self.pp - 1) if self.pp > 1 else np.zeros(R))
        offset = np.clip(rng.standard_normal(R) * 0.2 * self.noise, -0.009, 0.009)
        self._work = work * (1.0 + offset)            # compute multiplier per rank
        self._nominal_raw = _DATA + _COMPUTE * work + _GAP   # nominal busy (pre-calibration units)

        # calibrate the scale (ms per nominal unit) on a few clean steps
        self._unit = 1.0
        peaks = []
        for k in range(_CALIB_STEPS):
            d, c, g, m = self._base_phases(np.random.default_rng([self.seed, 0xCA11B, k]))
            peaks.append(np.max(d + c + g + m))
        self._unit = self.step_ms / float(np.median(peaks))
        #: nominal busy time (data + compute + gap, ms) of each rank on a clean step
        self.nominal_busy_ms = self._nominal_raw * self._unit

        # time axis: _ends[i] = t_end (ns) of step i, known for steps < len(_ends)
        self._ends = np.zeros(0, np.int64)

        # per-rank string blobs for fast string columns
        self._job_blob, self._job_offs = _strings([self.job])
        self._node_blob, self._node_offs = _strings(self.nodes)
        self._nodename_blob, self._nodename_offs = _strings(self.node_names)
        self._node_pa = pa.array(self.nodes.tolist(), pa.string())

    # ----------------------------------------------------------------------- numeric core

    def _base_phases(self, rng: np.random.Generator):
        """Clean per-rank (data, compute, gap, comm) of one step, in the current units (ms)."""
        R, z, u = self.world_size, self.noise, self._unit
        t = np.clip(rng.standard_t(3, R), *_T_CLIP) / np.sqrt(3.0)
        compute = _COMPUTE * self._work * (1.0 + z * t)
        data = _DATA * (1.0 + 2.5 * z * np.abs(rng.standard_normal(R)))
        blip = rng.random(R) < _BLIP_P
        if z > 0 and blip.any():
            data[blip] += np.minimum(rng.exponential(1.5 * z, int(blip.sum())), 10 * z)
        gap = _GAP * np.maximum(1.0 + 2.5 * z * rng.standard_normal(R), 0.2)
        common = 1.0 + 0.5 * z * rng.standard_normal()
        comm = _COMM * np.maximum(common + 0.25 * z * rng.standard_normal(R), 0.2)
        return data * u, compute * u, gap * u, comm * u

    def _is_checkpoint(self, steps: np.ndarray) -> np.ndarray:
        ce = self.checkpoint_every
        if ce <= 0:
            return np.zeros(len(steps), bool)
        return (steps > 0) & (steps % ce == 0)

    def checkpoint_steps(self, start: int = 0, stop: int | None = None) -> list[int]:
        """Steps in [start, stop) (default: the whole job) that carry a checkpoint spike (no fault)."""
        s = np.arange(start, self.steps if stop is None else stop)
        return s[self._is_checkpoint(s)].tolist()

    def _numeric(self, start: int, stop: int, full: bool = True) -> dict:
        """Per-rank arrays (S, R) for steps [start, stop), GC events and per-step values; ``full``
        also draws the noise of the host/accel/queue columns (not needed for the time axis)."""
        R, S = self.world_size, stop - start
        steps = np.arange(start, stop, dtype=np.int64)
        data = np.empty((S, R)); compute = np.empty((S, R)); gap = np.empty((S, R)); comm = np.empty((S, R))
        ckpt_frac = np.zeros(S)
        ckpt = self._is_checkpoint(steps)
        ev_step, ev_rank, ev_gen, ev_dur, ev_u = [], [], [], [], []
        fault_rngs = []
        N, rpn = self.n_nodes, self.ranks_per_node
        comm_fault = np.zeros(S, bool)
        io_fault = np.zeros(S, bool)
        for f in self.faults:
            if f.kind == "regression" and f.cause == "communication":
                comm_fault |= f.active(steps)
            elif f.kind == "regression" and f.cause == "io":
                io_fault |= f.active(steps)
        if full:   # per-step random draws for the host / accel / queue columns
            h_z = np.empty((S, 12, N)); h_py = np.empty((S, N, rpn)); h_ret = np.empty((S, N), np.int64)
            a_z = np.empty((S, 4, R)) if self.accel else None
            q = np.empty((S, R), np.int32)
        for i, s in enumerate(steps.tolist()):
            data[i], compute[i], gap[i], comm[i] = self._base_phases(
                np.random.default_rng([self.seed, s, _S_BASE]))
            if ckpt[i]:
                crng = np.random.default_rng([self.seed, s, _S_CKPT])
                ckpt_frac[i] = crng.uniform(0.3, 0.5)
                gap[i] += self.step_ms * ckpt_frac[i] * (1.0 + 0.02 * crng.standard_normal(R))
            if s in self.long_steps:                  # a long step by design (see with_inflight)
                gap[i] += self.long_steps[s][1]
            if self.gc_rate > 0:
                grng = np.random.default_rng([self.seed, s, _S_GC])
                r = np.flatnonzero(grng.random(R) < self.gc_rate)
                if len(r):
                    gen = np.searchsorted(np.cumsum(_GC_GEN_P), grng.random(len(r)), side="right")
                    gen = np.minimum(gen, 2)
                    dur = np.asarray(_GC_GEN_MS)[gen] * grng.lognormal(0.0, 0.4, len(r))
                    ev_step.append(np.full(len(r), i)); ev_rank.append(r); ev_gen.append(gen)
                    ev_dur.append(dur); ev_u.append(grng.random(len(r)))
            fault_rngs.append([np.random.default_rng([self.seed, s, _S_FAULT + j])
                               for j in range(len(self.faults))])
            if full:
                hrng = np.random.default_rng([self.seed, s, _S_HOST])
                h_z[i] = hrng.standard_normal((12, N))
                h_py[i] = hrng.standard_normal((N, rpn))
                h_ret[i] = hrng.poisson(200.0 if comm_fault[i] else 0.05, N)
                if self.accel:
                    a_z[i] = np.random.default_rng([self.seed, s, _S_ACCEL]).standard_normal((4, R))
                q[i] = np.random.default_rng([self.seed, s, _S_QUEUE]).integers(1, 5, R)

        # faults
        contention = np.zeros((S, self.n_nodes), bool)
        io_node = np.repeat(io_fault[:, None], self.n_nodes, axis=1)   # nodes with iowait
        slow_ranks = np.zeros((S, R))   # extra compute (ms), for accel evidence
        hung = np.zeros((S, R), bool)   # rows not reported (rank-hang / job-hang)
        small = np.zeros(S, bool)       # steps whose all-reduce goes out in small calls
        step_pct = self.step_ms / 100.0
        for j, f in enumerate(self.faults):
            act = f.active(steps)
            if f.kind == "job-hang" and f.rank is not None:   # the others stop _HANG_LAG steps later
                late = f.active(steps) & (steps >= f.start + self.hang_lag)
                hung[late] = True
            if not act.any():
                continue
            idx = np.flatnonzero(act)
            if f.kind == "slow-rank":
                add = f.pct / 100.0 * self.nominal_busy_ms[f.rank]
                compute[idx, f.rank] += add
                slow_ranks[idx, f.rank] += add
            elif f.kind == "regression":
                add = f.pct * step_pct
                target = {"io": data, "communication": comm, "computation": compute, "cpu": gap}[f.cause]
                target[idx] += add
            elif f.kind == "cpu-contention":
                node = self.node_index[f.rank]
                on = np.flatnonzero(self.node_index == node)
                add = f.pct / 100.0 * self.nominal_busy_ms[on]
                for i in idx:
                    k = fault_rngs[i][j].lognormal(-0.045, 0.3, len(on))   # mean ~1
                    gap[i, on] += 0.75 * add * k
                    compute[i, on] += 0.25 * add * k
                contention[idx, node] = True
            elif f.kind == "gc-jitter":
                for i in idx:
                    frng = fault_rngs[i][j]
                    n = int(frng.poisson(_JITTER_PAUSES))
                    if not n:
                        continue
                    ev_step.append(np.full(n, i)); ev_rank.append(frng.integers(0, R, n))
                    ev_gen.append(np.full(n, 2)); ev_u.append(frng.random(n))
                    ev_dur.append(f.pct * step_pct * frng.gamma(4.0, 0.25, n))
            elif f.kind == "data-stall":
                who = np.arange(R) if f.rank is None else np.array([f.rank])
                nodes = np.unique(self.node_index[who])
                for i in idx:
                    frng = fault_rngs[i][j]
                    if frng.random() < _STALL_P:
                        add = f.pct * step_pct * frng.gamma(6.0, 1.0 / 6.0)
                        data[i, who] += add * np.maximum(1.0 + 0.05 * frng.standard_normal(len(who)), 0.5)
                        io_node[i, nodes] = True
            elif f.kind == "comm-slow":
                grp = self.dp_group_of(f.rank)
                add = f.pct / 100.0 * self.nominal_busy_ms[grp]
                for i in idx:
                    comm[i, grp] += add * fault_rngs[i][j].lognormal(-0.02, 0.2)
            elif f.kind == "slow-link":
                grp = self.dp_group_of(f.rank)
                keep = max(1.0 - f.pct / 100.0, 0.05)
                comm[np.ix_(idx, grp)] /= keep
            elif f.kind == "small-messages":
                comm[idx] += f.pct * step_pct
                small[idx] = True
            elif f.kind == "dataloader-starved":
                who = np.arange(R) if f.rank is None else np.flatnonzero(self.node_index == self.node_index[f.rank])
                data[np.ix_(idx, who)] += f.pct * step_pct
            elif f.kind == "rank-hang":
                hung[idx, f.rank] = True
            elif f.kind == "job-hang":
                if f.rank is None:
                    hung[idx] = True
                else:
                    hung[idx, f.rank] = True
            elif f.kind == "gc-storm":
                who = np.arange(R) if f.rank is None else np.array([f.rank])
                mean_ms = f.pct / 100.0 * self.nominal_busy_ms[who] / _STORM_PER_STEP
                for i in idx:
                    frng = fault_rngs[i][j]
                    cnt = frng.poisson(_STORM_PER_STEP, len(who))
                    n = int(cnt.sum())
                    if not n:
                        continue
                    ev_step.append(np.full(n, i)); ev_rank.append(np.repeat(who, cnt))
                    ev_gen.append(np.full(n, 2)); ev_u.append(frng.random(n))
                    ev_dur.append(np.repeat(mean_ms, cnt) * frng.gamma(4.0, 0.25, n))

        if ev_step:
            ev_step = np.concatenate(ev_step); ev_rank = np.concatenate(ev_rank)
            ev_gen = np.concatenate(ev_gen); ev_dur = np.concatenate(ev_dur); ev_u = np.concatenate(ev_u)
            order = np.lexsort((ev_u, ev_rank, ev_step))
            ev_step, ev_rank, ev_gen, ev_dur, ev_u = (a[order] for a in (ev_step, ev_rank, ev_gen, ev_dur, ev_u))
            flat = ev_step * R + ev_rank
            gc_ms = np.bincount(flat, weights=ev_dur, minlength=S * R).reshape(S, R)
            gc_count = np.bincount(flat, minlength=S * R).reshape(S, R)
        else:
            ev_step = ev_rank = ev_gen = np.zeros(0, np.int64)
            ev_dur = ev_u = np.zeros(0)
            gc_ms = np.zeros((S, R)); gc_count = np.zeros((S, R), np.int64)

        busy = data + compute + gap + gc_ms
        # rounded up to whole microseconds, so that all timestamps stay microsecond-aligned
        # (pyarrow's as_py() cannot turn other nanosecond times into datetimes without pandas)
        step_ms = np.ceil(np.max(busy + comm, axis=1) * 1000.0) / 1000.0
        comm_wait = np.maximum(step_ms[:, None] - busy - comm, 0.0)
        out = dict(host_z=h_z, host_py=h_py, host_retrans=h_ret, accel_z=a_z, queue=q) if full else {}
        return dict(**out, steps=steps, data=data, compute=compute, gap=gap, comm=comm, gc_ms=gc_ms,
                    gc_count=gc_count, busy=busy, step_ms=step_ms, comm_wait=comm_wait, ckpt=ckpt,
                    ckpt_frac=ckpt_frac, contention=contention, comm_fault=comm_fault, io_fault=io_fault,
                    io_node=io_node, hung=hung, small=small,
                    slow_extra=slow_ranks, ev=(ev_step, ev_rank, ev_gen, ev_dur, ev_u))

    def _time_axis(self, start: int, step_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """t_start/t_end (ns) for consecutive steps from ``start`` with the given step times; the
        ends are remembered so later chunks continue the same time axis."""
        self._advance_to(start)
        t0 = self.t0_ns if start == 0 else int(self._ends[start - 1])
        ends = t0 + np.cumsum(np.round(step_ms * 1e3).astype(np.int64) * 1000)
        starts = np.concatenate([[t0], ends[:-1]])
        stop = start + len(step_ms)
        if stop > len(self._ends):
            self._ends = np.concatenate([self._ends[:start], ends])
        return starts, ends

    def _advance_to(self, step: int, chunk: int = 64) -> None:
        """Make sure the end times of all steps before ``step`` are known (simulating them if a
        caller skipped ahead)."""
        while len(self._ends) < step:
            a = len(self._ends)
            b = min(step, a + chunk)
            self._time_axis(a, self._numeric(a, b, full=False)["step_ms"])

    def step_times(self, start: int, stop: int) -> np.ndarray:
        """Job step time (ms) of steps [start, stop), without building tables."""
        return self._numeric(start, stop, full=False)["step_ms"]

    # ----------------------------------------------------------------------- tables

    def topology(self) -> pa.Table:
        """TOPOLOGY table, one row per rank.

        Layout (stage-major): ``pp = rank // (ranks // pp)``, ``dp = (rank % (ranks // pp)) // tp``,
        ``tp = rank % tp``; ``ep``/``cp`` null (unknown). ``device`` is ``cuda:<local rank>``.
        """
        R = self.world_size
        const = lambda v: pa.DictionaryArray.from_arrays(np.zeros(R, np.int32), pa.array([v])).cast(pa.string())
        cols = [
            _tiled_string_array(self._job_blob, self._job_offs, R),
            pa.array(np.arange(R, dtype=np.int32)),
            _tiled_string_array(self._node_blob, self._node_offs, 1),
            pa.array(np.full(R, R, np.int32)),
            pa.array([f"cuda:{i}" for i in range(self.ranks_per_node)]).take(pa.array(self.local_rank)),
            pa.array(self._dp), pa.array(self._tp), pa.array(self.stage),
            pa.nulls(R, pa.int32()), pa.nulls(R, pa.int32()),
            const("pytorch"), const(f"stepwatch-sim/{__version__}"), const("H100"), const("bf16"),
            pa.array(np.full(R, 6.0 * _PARAMS)),
            pa.array(np.full(R, int(_PARAMS / (self.tp * self.pp)), np.int64)),
            pa.nulls(R, pa.float64()),
            const("user"),                                   # flops_source: the figure above is given
            pa.nulls(R, pa.int64()), pa.nulls(R, pa.int64()),   # slurm_job, slurm_step: not under Slurm
        ]
        return pa.Table.from_arrays(cols, schema=TOPOLOGY)

    def generate(self, start: int, stop: int) -> dict[str, pa.Table]:
        """Telemetry of steps [start, stop): ``{"steps", "host", "gc"}`` tables.

        ``steps``: one row per rank per step, ordered by step then rank. ``host``: one row per node
        per step (``t`` = the step's ``t_end``), ordered by step then node. ``gc``: one row per
        collection, ordered by step, rank, time. Chunks may be generated in any order; steps
        skipped over are simulated (without tables) to continue the time axis.
        """
        start, stop = int(start), int(stop)
        if start < 0 or stop < start:
            raise ValueError(f"bad step range [{start}, {stop})")
        if stop == start:
            out = {"steps": STEPS.empty_table(), "host": HOST.empty_table(), "gc": GC.empty_table()}
            if self.comm:
                out["comm"] = COMM.empty_table()
            return out
        nm = self._numeric(start, stop)
        t_start, t_end = self._time_axis(start, nm["step_ms"])
        out = {"steps": self._steps_table(nm, t_start, t_end),
               "host": self._host_table(nm, t_end),
               "gc": self._gc_table(nm, t_start)}
        if self.comm:
            out["comm"] = self._comm_table(nm)
        hung = nm["hung"]
        if hung.any():   # hung ranks report nothing; their nodes' host samples go on
            keep = pa.array(~hung.ravel())
            out["steps"] = out["steps"].filter(keep)
            if "comm" in out:                          # two comm rows per rank and step
                out["comm"] = out["comm"].filter(pa.array(np.repeat(~hung.ravel(), 2)))
            if out["gc"].num_rows:
                ev_step, ev_rank = nm["ev"][0], nm["ev"][1]
                out["gc"] = out["gc"].filter(pa.array(~hung[ev_step, ev_rank]))
        return out


    # ----------------------------------------------------------------------- labels

    def labels(self) -> list[dict]:
        """Ground truth, one dict per injected fault (``clean`` adds none).

        Keys: ``job``; ``kind``; ``spec`` (round-trips through :func:`parse_fault`); ``start``;
        ``end`` (inclusive; ``steps - 1`` when the fault runs to the end); ``ranks`` and ``nodes``
        (the affected ranks and their nodes; empty lists for job-wide faults: a regression or a
        gc-storm on all ranks; for a job-hang with ``rank``, the rank that stopped first);
        ``scope`` (``rank`` | ``node`` | ``group`` | ``job``); ``pct``; ``cause`` (the taxonomy of
        docs/incidents.md: io | cpu | gc | communication | computation; None for rank-hang, which has none);
        for cpu-contention also ``process`` (the foreign process name); for comm-slow ``group`` (its
        name in the comm rows); ``every`` when the fault is intermittent.
        """
        out = []
        for f in self.faults:
            if f.kind in ("slow-rank", "rank-hang") or (f.kind in ("gc-storm", "data-stall")
                                                         and f.rank is not None):
                ranks, scope = [int(f.rank)], "rank"
            elif f.kind == "cpu-contention":
                ranks = np.flatnonzero(self.node_index == self.node_index[f.rank]).tolist()
                scope = "node"
            elif f.kind in ("comm-slow", "slow-link"):
                ranks, scope = self.dp_group_of(f.rank).tolist(), "group"
            elif f.kind == "dataloader-starved" and f.rank is not None:
                ranks = np.flatnonzero(self.node_index == self.node_index[f.rank]).tolist()
                scope = "node"
            elif f.kind == "job-hang" and f.rank is not None:
                ranks, scope = [int(f.rank)], "job"     # the job hangs; the rank stopped first
            else:
                ranks, scope = [], "job"
            d = {"job": self.job, "kind": f.kind, "spec": f.spec(), "start": int(f.start),
                 "end": int(self.steps - 1 if f.end is None else f.end),
                 "ranks": ranks, "nodes": sorted({str(self.nodes[r]) for r in ranks}), "scope": scope,
                 "pct": float(f.pct), "cause": f.cause if f.kind == "regression" else _KIND_CAUSE[f.kind]}
            if f.kind == "cpu-contention":
                d["process"] = _FOREIGN
            if f.kind in ("comm-slow", "slow-link"):
                d["group"] = self.dp_group_name(f.rank)
            if f.every > 1:
                d["every"] = int(f.every)
            out.append(d)
        return out

    def write_labels(self, path) -> None:
        """Write :meth:`labels` (a JSON array, exactly that list) to ``path``."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.labels(), indent=2) + "\n")


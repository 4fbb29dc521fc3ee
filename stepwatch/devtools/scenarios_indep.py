"""A second, independent scenario family for ``stepwatch eval``: a producer written from
``docs/wire-format.md`` alone (it shares no code, noise law or fault shape with
``stepwatch.devtools.simulate``), and a consumer-order model that interleaves the messages of several topics
and partitions the way a Kafka consumer group may deliver them.

**The job.** ``ranks`` ranks, ``per_node`` per node, ``pp`` pipeline stages (contiguous blocks of ranks,
each stage with its own work multiplier, as stages do different work). Every rank's busy time in a step is
the sum of its phases: data wait, compute, GC pause and host time (dispatch, Python); the step is
synchronous, so every rank's step time is the slowest rank's busy time plus the collective transfer, and
``comm_wait_ms`` is what a rank waited for the slowest one. Noise, all of it multiplicative:

* a job-wide AR(1) drift (phi 0.97, innovation sd 0.4 %) on every phase: the slow wander of a real job;
* per rank and step, Student-t noise with 3 degrees of freedom (scale 1 %, clipped at +-8 %) on compute and
  host time: heavy tails, so single ranks spike now and then;
* a static per-rank speed offset (sd 0.6 %) and per-stage multipliers;
* data wait: a gamma-distributed wait with an occasional (0.3 % of rank-steps) slow batch of 2-3x;
* GC: a gen-0/1 pause of ~1-3 ms on most steps, a gen-2 pause (30-60 ms) on a random 0.3 % of rank-steps;
* a checkpoint every ``checkpoint_every`` steps: +30-40 % step time on every rank (host time), not a fault.

**Faults** (each with its ground-truth label, in the dict form ``stepwatch.devtools.eval`` scores): a straggler
(5-30 % of the rank's busy time, a 3-step ramp, optional end); an intermittent straggler (slow on a random
40 % of steps); a phase regression on every rank of comm transfer, data wait, GC or host time, with or
without recovery (``phase`` in the label; ``pct`` is the effect on that phase); a CPU hog on one node
(every rank of the node loses 15-30 % of its speed, host time mostly; the node's host samples show the
foreign process); a NIC with retransmits on one node (comm transfer of the whole job up, the node's
``rdma_retrans`` counter high); a hang (one rank stops, the rest block a step later; or all stop at once;
host samples go on).

**Messages.** Rows are sent per node and per topic, ``steps_per_msg`` steps per message (the agent's
batching), keyed by job, on partition ``crc32(job) % partitions`` of each topic, Arrow IPC (zstd
buffers from 500 rows on). Every message has a produce time: the newest event it holds plus a random agent delay.

**Consumer order.** :func:`deliveries` gives each message a delivery time at the consumer: in order
(produce time), or shuffled: every (topic, partition) is read with its own delay that changes every 20-60 s
(0 to 90 s behind), one partition chosen at random is paused for 60-120 s, and at the start one freshly
assigned partition is read alone for its first 30 s. Each partition stays in offset order and nothing is
delivered before it was produced: an order a real consumer group can produce.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from stepwatch.wire import catalog

T0_NS = 1_767_225_600_000_000_000          # 2026-01-01T00:00:00Z
TS = pa.timestamp("ns", tz="UTC")

#: label cause per phase (the cause taxonomy of docs/incidents.md)
PHASE_CAUSE = {"comm": "communication", "data": "io", "gc": "gc", "host": "cpu", "compute": "computation"}


@dataclass
class IndepScenario:
    name: str
    faults: list[dict] = field(default_factory=list)
    ranks: int = 256
    per_node: int = 8
    pp: int = 1
    steps: int = 240
    seed: int = 1
    step_ms: float = 1000.0
    steps_per_msg: int = 5
    nodes_per_msg: int = 1          # >1: a relay batches several nodes' rows (large jobs)
    partitions: int = 6
    checkpoint_every: int | None = 50
    note: str = ""
    family: str = "indep"
    # the noise law (the random sweep draws them; the named scenarios keep these defaults)
    noise: float = 0.01             # scale of the per-rank, per-step Student-t noise on compute and host time
    dof: float = 3.0                # its degrees of freedom (heavy tails below ~5)
    clip: float = 0.08              # ... clipped at this
    ar_phi: float = 0.97            # job-wide AR(1) drift: autocorrelation
    ar_sd: float = 0.004            # ... and innovation sd
    shuffle: bool = False           # (the sweep: deliver in a consumer-group shuffle)
    gc_scale: float = 1.0           # GC pauses (ms) scaled by this (pauses are absolute times: a heap's, not a step's)

    @property
    def large(self) -> bool:
        return self.ranks >= 8192

    @property
    def job(self) -> str:
        return f"ind-{self.name}"


def _t3(rng, shape, scale, clip, dof=3.0):
    return np.clip(rng.standard_t(dof, size=shape) * scale, -clip, clip)


@dataclass
class Message:
    kind: str
    partition: int
    produce_ns: int
    payload: bytes
    rows: int
    seq: int = 0                    # production order (a tie-break)


def _encode(t: pa.Table) -> bytes:
    """Arrow IPC stream; zstd buffers for messages of 500 rows or more (smaller ones gain little)."""
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression="zstd" if t.num_rows >= 500 else None)
    with pa.ipc.new_stream(sink, t.schema, options=opts) as w:
        w.write_table(t)
    return sink.getvalue().to_pybytes()


class IndepJob:
    """Generates one scenario: arrays for all steps and ranks at once, then its messages and labels."""

    def __init__(self, sc: IndepScenario):
        self.sc = sc
        R, S = sc.ranks, sc.steps
        rng = np.random.default_rng(sc.seed * 7919 + 17)
        self.rng = rng
        self.R, self.S = R, S
        self.node_of = np.arange(R) // sc.per_node
        self.nodes = np.array([f"hx{sc.seed % 97:02d}-n{n:04d}" for n in range(int(self.node_of.max()) + 1)])
        self.stage = (np.arange(R) * sc.pp // R).astype(np.int32)
        stage_mult = np.array([1.0, 1.07, 0.93, 1.12, 0.97, 1.05, 1.0, 1.09])[:max(sc.pp, 1)]
        if sc.pp == 1:
            stage_mult = np.array([1.0])
        base = sc.step_ms
        # the phases of an average rank's step (ms): compute dominates, then transfer, host, data, GC
        comp0, host0, data0, comm0 = 0.70 * base, 0.06 * base, 0.05 * base, 0.14 * base
        drift = np.zeros(S)
        e = rng.normal(0.0, sc.ar_sd, S)
        for s in range(1, S):
            drift[s] = sc.ar_phi * drift[s - 1] + e[s]
        jm = (1.0 + drift)[:, None]                                   # (S, 1)
        speed = 1.0 + rng.normal(0.0, 0.006, R)                      # static per-rank offset
        work = stage_mult[self.stage] * speed                         # (R,)
        compute = comp0 * jm * work * (1.0 + _t3(rng, (S, R), sc.noise, sc.clip, sc.dof))
        host = host0 * jm * work * (1.0 + _t3(rng, (S, R), sc.noise, sc.clip, sc.dof))
        data = data0 * jm * rng.gamma(16.0, 1.0 / 16.0, (S, R))
        slowb = rng.random((S, R)) < 0.003
        data = np.where(slowb, data * rng.uniform(2.0, 3.0, (S, R)), data)
        gc = np.where(rng.random((S, R)) < 0.7, rng.uniform(1.0, 3.0, (S, R)), 0.0)
        gen2 = rng.random((S, R)) < 0.003
        gc = np.where(gen2, rng.uniform(30.0, 60.0, (S, R)), gc) * sc.gc_scale
        comm = comm0 * jm[:, 0] * (1.0 + rng.normal(0.0, 0.01, S))  # (S,) transfer, shared by all ranks
        if sc.checkpoint_every:
            ck = (np.arange(S) % sc.checkpoint_every == sc.checkpoint_every - 1) & (np.arange(S) > 0)
            host[ck] += base * rng.uniform(0.30, 0.40, (int(ck.sum()), 1))
        self.retrans = np.zeros((S, len(self.nodes)), dtype=np.int64)
        self.hog = {}                                                 # node -> (start, end, cpu_pct)
        self.hang_at = None                                           # (step, culprit rank or None)
        self.labels_: list[dict] = []
        for f in sc.faults:
            compute, host, data, gc, comm = self._fault(f, compute, host, data, gc, comm, comp0, host0, data0,
                                                        comm0)
        self.compute, self.host_ms, self.data, self.gc, self.comm = compute, host, data, gc, comm
        busy = data + compute + gc + host
        slowest = busy.max(axis=1)
        step = slowest + comm
        self.step = step
        self.wait = (slowest[:, None] - busy) + rng.uniform(0.05, 0.3, (S, R))   # plus the sync itself
        self.busy = busy
        t = np.empty(S + 1, dtype=np.int64)
        t[0] = T0_NS
        t[1:] = T0_NS + np.cumsum(np.round(step * 1e6).astype(np.int64))
        self.t_start, self.t_end = t[:-1], t[1:]
        self.reported = np.ones((S, R), dtype=bool)
        if self.hang_at is not None:
            s0, culprit = self.hang_at
            if culprit is None:
                self.reported[s0:] = False
            else:
                self.reported[s0:, culprit] = False
                self.reported[s0 + 1:] = False                        # the rest block in the next collective
        self.t_stop = int(self.t_end[-1])                             # host samples go on until here

    # -- faults ---------------------------------------------------------------------------------------
    def _fault(self, f, compute, host, data, gc, comm, comp0, host0, data0, comm0):
        S, R, rng = self.S, self.R, self.rng
        kind = f["kind"]
        start = int(f["start"])
        end = int(f.get("end", S - 1))
        pct = float(f.get("pct", 0.0))
        on = np.zeros(S, dtype=bool)
        on[start:end + 1] = True
        lab = {"job": self.sc.job, "start": start, "end": end, "pct": pct, "ranks": [], "nodes": [],
               "scope": "job", "cause": None}
        if kind in ("straggler", "intermittent"):
            r = int(f["rank"])
            ramp = np.clip((np.arange(S) - start + 1) / 3.0, 0.0, 1.0) * on
            if kind == "intermittent":
                ramp = ramp * (rng.random(S) < 0.4)
                lab["every"] = 2                           # "about one step in 2-3" (the table prints it)
            extra = pct / 100.0 * (comp0 + host0 + data0) * self.stage_mult_of(r)
            compute = compute.copy()
            compute[:, r] += extra * ramp
            lab.update(kind="slow-rank", ranks=[r], nodes=[str(self.nodes[self.node_of[r]])], scope="rank",
                       cause="computation")
        elif kind == "phase":
            ph = f["phase"]
            m = 1.0 + pct / 100.0 * on
            if ph == "comm":
                comm = comm * m
            elif ph == "data":
                data = data * m[:, None]
            elif ph == "gc":
                # more gen-2 collections: each rank pauses on more steps; pct is the GC time added (of GC)
                extra = (rng.random((S, R)) < 0.25) * rng.uniform(20.0, 40.0, (S, R)) * on[:, None]
                base_gc = max(float(gc.mean()), 1e-9)
                gc = gc + extra * (pct / 100.0 * base_gc / max(float(extra[on].mean()) if on.any() else 1.0, 1e-9))
            elif ph == "host":
                host = host * m[:, None]
            lab.update(kind="regression", cause=PHASE_CAUSE[ph], phase=ph)
            if f.get("nic_node") is not None:
                n = int(f["nic_node"])
                self.retrans[on, n] = rng.integers(2000, 6000, int(on.sum()))
                lab["evidence_node"] = str(self.nodes[n])
        elif kind == "cpu-hog":
            n = int(f["node"])
            rs = np.flatnonzero(self.node_of == n)
            host = host.copy()
            compute = compute.copy()
            slow = pct / 100.0 * (comp0 + host0 + data0) * on
            host[:, rs] += 0.6 * slow[:, None] * (1.0 + _t3(rng, (S, len(rs)), 0.1, 0.3))
            compute[:, rs] += 0.4 * slow[:, None]
            self.hog[n] = (start, end, 180.0 + 2.0 * pct)
            lab.update(kind="cpu-contention", ranks=[int(x) for x in rs], nodes=[str(self.nodes[n])],
                       scope="node", cause="cpu", process=f.get("process", "backup-agent"))
        elif kind == "hang":
            r = f.get("rank")
            self.hang_at = (start, None if r is None else int(r))
            lab.update(kind="job-hang", ranks=[] if r is None else [int(r)],
                       nodes=[] if r is None else [str(self.nodes[self.node_of[int(r)]])], cause="communication",
                       end=S - 1, pct=100.0)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        self.labels_.append(lab)
        return compute, host, data, gc, comm

    def stage_mult_of(self, r: int) -> float:
        return 1.0

    def labels(self) -> list[dict]:
        return [dict(x) for x in self.labels_]

    # -- rows -----------------------------------------------------------------------------------------
    def topology(self) -> pa.Table:
        R, sc = self.R, self.sc
        dp = np.arange(R) % max(R // max(sc.pp, 1), 1)
        return pa.table({
            "job": pa.array([sc.job] * R), "rank": pa.array(np.arange(R, dtype=np.int32)),
            "node": pa.array(self.nodes[self.node_of].tolist()), "world_size": pa.array(np.full(R, R, np.int32)),
            "device": pa.array([f"cuda:{r % sc.per_node}" for r in range(R)]),
            "dp": pa.array(dp.astype(np.int32)), "tp": pa.array(np.zeros(R, np.int32)),
            "pp": pa.array(self.stage), "framework": pa.array(["indep-producer"] * R),
        })

    def _names(self, ranks: np.ndarray) -> pa.Array:
        return pa.array(self.nodes.tolist()).take(pa.array(self.node_of[ranks]))

    def _steps_table(self, steps: np.ndarray, ranks: np.ndarray) -> pa.Table:
        n = len(steps)
        jitter = self.rng.integers(0, 2_000_000, n)                 # ranks finish within ~2 ms of each other
        return pa.table({
            "job": pa.array([self.sc.job] * n), "node": self._names(ranks),
            "rank": pa.array(ranks.astype(np.int32)), "step": pa.array(steps.astype(np.int64)),
            "t_start": pa.array(self.t_start[steps], pa.int64()).cast(TS),
            "t_end": pa.array(self.t_end[steps] - jitter, pa.int64()).cast(TS),
            "step_ms": pa.array(self.step[steps] - jitter / 1e6), "data_ms": pa.array(self.data[steps, ranks]),
            "compute_ms": pa.array(self.compute[steps, ranks]), "comm_ms": pa.array(self.comm[steps]),
            "comm_wait_ms": pa.array(self.wait[steps, ranks]), "gc_ms": pa.array(self.gc[steps, ranks]),
            "gc_count": pa.array((self.gc[steps, ranks] > 0).astype(np.int32)),
            "samples": pa.array(np.full(n, 8, np.int64)), "tokens": pa.array(np.full(n, 8 * 4096, np.int64)),
        })

    def _gc_table(self, steps: np.ndarray, ranks: np.ndarray) -> pa.Table:
        n = len(steps)
        dur = self.gc[steps, ranks]
        return pa.table({
            "job": pa.array([self.sc.job] * n), "node": self._names(ranks),
            "rank": pa.array(ranks.astype(np.int32)),
            "t": pa.array(self.t_start[steps] + (0.3 * self.step[steps] * 1e6).astype(np.int64), pa.int64()).cast(TS),
            "generation": pa.array(np.where(dur > 20, 2, 0).astype(np.int32)), "duration_ms": pa.array(dur),
            "collected": pa.array(np.full(n, 500, np.int64)), "uncollectable": pa.array(np.zeros(n, np.int64)),
        })

    def _comm_table(self, steps: np.ndarray, ranks: np.ndarray, op: str, share: float, count: int,
                    nbytes: int) -> pa.Table:
        n = len(steps)
        wait = self.wait[steps, ranks] * share
        return pa.table({
            "job": pa.array([self.sc.job] * n), "node": self._names(ranks),
            "rank": pa.array(ranks.astype(np.int32)), "step": pa.array(steps.astype(np.int64)),
            "op": pa.array([op] * n), "group": pa.array([f"dp{x}" for x in range(max(self.sc.pp, 1))]).take(
                pa.array(self.stage[ranks])),
            "count": pa.array(np.full(n, count, np.int64)), "bytes": pa.array(np.full(n, nbytes, np.int64)),
            "time_ms": pa.array(self.comm[steps] * share + wait), "wait_ms": pa.array(wait),
        })

    def _host_table(self, node: np.ndarray, ts: np.ndarray) -> pa.Table:
        k = len(ts)
        rng = self.rng
        si = np.clip(np.searchsorted(self.t_end, ts), 0, self.S - 1)   # the step each sample falls in
        cpu = np.clip(rng.normal(55.0, 4.0, k), 0, 100)
        hog = np.zeros(k, dtype=bool)
        hog_pct = np.zeros(k)
        for n, (a, b, pct) in self.hog.items():
            m = (node == n) & (si >= a) & (si <= b)
            hog |= m
            hog_pct[m] = pct
        cpu = np.where(hog, np.minimum(100.0, cpu + 30.0), cpu)
        # top 5 processes: 4 training ranks and a monitoring agent, or the hog first
        names = np.tile(np.array(["python"] * 4 + ["node-exporter"], dtype=object), (k, 1))
        pids = np.tile(np.array([4000, 4001, 4002, 4003, 911], dtype=np.int64), (k, 1))
        pct = np.concatenate([97.0 + rng.normal(0, 1.5, (k, 4)), np.full((k, 1), 1.5)], axis=1)
        names[hog, 1:] = names[hog, :4]
        pids[hog, 1:] = pids[hog, :4]
        pct[hog, 1:] = pct[hog, :4]
        names[hog, 0], pids[hog, 0], pct[hog, 0] = "backup-agent", 31337, hog_pct[hog]
        procs = pa.ListArray.from_arrays(pa.array(np.arange(0, 5 * k + 1, 5, dtype=np.int32)), pa.StructArray.from_arrays(
            [pa.array(pids.ravel()), pa.array(names.ravel().tolist()), pa.array(pct.ravel())],
            names=["pid", "name", "cpu_pct"]))
        return pa.table({
            "job": pa.array([self.sc.job] * k), "node": pa.array(self.nodes.tolist()).take(pa.array(node)),
            "t": pa.array(ts, pa.int64()).cast(TS), "cpu_util": pa.array(cpu),
            "cpu_iowait": pa.array(np.clip(rng.normal(1.0, 0.3, k), 0, 100)),
            "cpu_steal": pa.array(np.zeros(k)), "load1": pa.array(rng.normal(40.0, 2.0, k)),
            "mem_used": pa.array(np.full(k, 300 << 30, np.int64)),
            "mem_available": pa.array(np.full(k, 200 << 30, np.int64)),
            "net_rx_bps": pa.array(rng.normal(8e9, 2e8, k)), "net_tx_bps": pa.array(rng.normal(8e9, 2e8, k)),
            "rdma_retrans": pa.array(self.retrans[si, node].astype(np.int64)),
            "top_procs": procs,
        })

    def messages(self, with_comm: bool = True) -> list[Message]:
        """Every message of the job, in produce order: rows per node (``nodes_per_msg`` nodes) and per
        topic, ``steps_per_msg`` steps (host: 5 samples) per message."""
        sc, rng = self.sc, self.rng
        job = sc.job
        out: list[Message] = []
        part = {k: zlib.crc32(f"{k}|{job}".encode()) % sc.partitions
                for k in catalog.TELEMETRY}

        def emit(kind, t: pa.Table, group: np.ndarray, produce_of):
            """Slice ``t`` (rows sorted by ``group``) into one message per group."""
            if t.num_rows == 0:
                return
            order = np.argsort(group, kind="stable")
            t, group = t.take(pa.array(order)), group[order]
            cut = np.flatnonzero(np.r_[True, np.diff(group) != 0, True])
            for a, b in zip(cut[:-1], cut[1:]):
                out.append(Message(kind, part[kind], int(produce_of(int(group[a]))), _encode(t.slice(a, b - a)),
                                   int(b - a)))

        out.append(Message("topology", part["topology"], T0_NS - 2_000_000_000, _encode(self.topology()), self.R))
        k, g = sc.steps_per_msg, max(1, sc.nodes_per_msg)
        ngroups = int(self.node_of.max()) // g + 1
        nchunks = (self.S + k - 1) // k
        delay = rng.uniform(0.05, 0.8, (nchunks, ngroups))            # the agent's flush delay
        last_step = np.minimum((np.arange(nchunks) + 1) * k, self.S) - 1

        def produce(grp, extra=0):
            c, ng = divmod(grp, ngroups)
            return int(self.t_end[last_step[c]] + delay[c, ng] * 1e9) + extra

        ss, rr = np.nonzero(self.reported)
        grp = (ss // k) * ngroups + self.node_of[rr] // g
        emit("steps", self._steps_table(ss, rr), grp, produce)
        gm = self.gc[ss, rr] > 0
        emit("gc", self._gc_table(ss[gm], rr[gm]), grp[gm], lambda x: produce(x, 1000))
        if with_comm:
            t = pa.concat_tables([self._comm_table(ss, rr, "all_reduce", 0.8, 12, 400 << 20),
                                  self._comm_table(ss, rr, "all_gather", 0.2, 4, 50 << 20)])
            emit("comm", t, np.concatenate([grp, grp]), lambda x: produce(x, 2000))
        # host: one sample per second per node (phase-shifted per node), 5 per message
        N = len(self.nodes)
        phase = rng.uniform(0, 1e9, N).astype(np.int64)
        nsamp = int((self.t_stop - T0_NS) // 1_000_000_000)
        node = np.repeat(np.arange(N), nsamp)
        ts = T0_NS + phase[node] + np.tile(np.arange(nsamp, dtype=np.int64) * 1_000_000_000, N)
        keep = ts < self.t_stop
        node, ts = node[keep], ts[keep]
        si = np.tile(np.arange(nsamp), N)[keep] // 5
        hgrp = si * ngroups + node // g
        hmax = np.zeros(int(hgrp.max()) + 1, dtype=np.int64)
        np.maximum.at(hmax, hgrp, ts)
        hdelay = rng.uniform(0.01, 0.3, len(hmax))
        emit("host", self._host_table(node, ts), hgrp, lambda x: int(hmax[x] + hdelay[x] * 1e9))
        out.sort(key=lambda m: m.produce_ns)
        for i, m in enumerate(out):
            m.seq = i
        return out

    def step_starts(self) -> np.ndarray:
        return self.t_start.copy()


def deliveries(msgs, shuffle: bool, seed: int = 0) -> tuple[list[int], np.ndarray]:
    """Consumer order of ``msgs`` (objects with ``kind``, ``partition``, ``produce_ns``): the message
    indexes in delivery order and every message's delivery time (ns). ``shuffle=False``: produce order.
    Otherwise each (topic, partition) source is read with its own delay that changes every 20-60 s
    (0, 1, 5, 30 or 90 s behind), one source is paused for 60-120 s mid-stream, and one freshly assigned
    source is read alone for the first 30 s; a source stays in offset order and no message is delivered
    before it is produced."""
    n = len(msgs)
    prod = np.array([m.produce_ns for m in msgs], dtype=np.int64)
    if not shuffle:
        order = sorted(range(n), key=lambda i: (prod[i], i))
        return order, prod.copy()
    rng = np.random.default_rng(seed * 104729 + 3)
    src = {}
    for i, m in enumerate(msgs):
        src.setdefault((m.kind, m.partition), []).append(i)
    keys = sorted(src)
    t_lo, t_hi = int(prod.min()), int(prod.max())
    first = keys[int(rng.integers(len(keys)))]
    paused = keys[int(rng.integers(len(keys)))]
    p_at = t_lo + int(rng.uniform(0.2, 0.6) * (t_hi - t_lo))
    p_len = int(rng.uniform(60, 120) * 1e9)
    deliver = np.zeros(n, dtype=np.int64)
    for k in keys:
        idx = sorted(src[k], key=lambda i: (prod[i], i))
        # piecewise-constant read delay for this source
        cuts = [t_lo]
        while cuts[-1] < t_hi + int(200e9):
            cuts.append(cuts[-1] + int(rng.uniform(20, 60) * 1e9))
        cuts = np.array(cuts)
        delays = rng.choice(np.array([0, 1, 5, 30, 90]) * 1_000_000_000, size=len(cuts),
                            p=[0.35, 0.3, 0.2, 0.1, 0.05])
        prev = 0
        for i in idx:
            c = prod[i] + int(delays[np.searchsorted(cuts, prod[i], side="right") - 1])
            if k != first and c < t_lo + 30_000_000_000:
                c = t_lo + 30_000_000_000                          # the others wait behind the fresh one
            if k == paused and p_at <= c < p_at + p_len:
                c = p_at + p_len
            c = max(c, prev, prod[i])
            deliver[i] = prev = c
    tie = rng.random(n)
    order = sorted(range(n), key=lambda i: (deliver[i], tie[i]))
    # keep each source in offset order among equal delivery times
    pos = {}
    fixed = []
    per_src_sorted = {k: sorted(v, key=lambda i: (prod[i], i)) for k, v in src.items()}
    for i in order:
        k = (msgs[i].kind, msgs[i].partition)
        j = pos.get(k, 0)
        fixed.append(per_src_sorted[k][j])
        pos[k] = j + 1
    return fixed, deliver


def _suite() -> list[IndepScenario]:
    S = IndepScenario
    hog = lambda node, pct, start, **kw: dict(kind="cpu-hog", node=node, pct=pct, start=start, **kw)  # noqa: E731
    return [
        S("clean", [], seed=101, note="t3 noise, AR(1) drift, checkpoints every 50 steps"),
        S("clean-pp4", [], seed=102, pp=4, note="4 pipeline stages with their own work multipliers"),
        S("clean-ckpt10", [], seed=103, checkpoint_every=10, steps_per_msg=10,
          note="checkpoint every 10 steps, 10 steps per message"),
        S("strag-5", [dict(kind="straggler", rank=133, pct=5, start=60)], seed=111),
        S("strag-8-pp4", [dict(kind="straggler", rank=190, pct=8, start=70)], seed=112, pp=4),
        S("strag-15-end", [dict(kind="straggler", rank=17, pct=15, start=60, end=150)], seed=113,
          note="ends at 150: must resolve, one incident"),
        S("strag-30", [dict(kind="straggler", rank=255, pct=30, start=80)], seed=114),
        S("intermittent-25", [dict(kind="intermittent", rank=150, pct=25, start=60)], seed=115,
          note="slow on ~40% of steps"),
        S("comm-up-30-nic", [dict(kind="phase", phase="comm", pct=30, start=90, nic_node=7)], seed=121,
          note="comm transfer +30% on every rank, NIC retransmits on one node"),
        S("comm-up-15-back", [dict(kind="phase", phase="comm", pct=15, start=60, end=210)], seed=122,
          steps=300, note="comm +15% for 150 steps, then back"),
        S("data-up-60", [dict(kind="phase", phase="data", pct=60, start=90)], seed=123),
        S("gc-up-200-back", [dict(kind="phase", phase="gc", pct=200, start=80, end=170)], seed=124),
        S("host-up-40", [dict(kind="phase", phase="host", pct=40, start=100)], seed=125),
        S("cpu-hog", [hog(23, 20, 70)], seed=131, note="one node's CPU hog slows the whole job"),
        S("cpu-hog-pp4", [hog(20, 25, 70, end=180)], seed=132, pp=4),
        S("hang-rank", [dict(kind="hang", rank=201, start=150)], seed=141,
          note="rank 201 stops, the rest block a step later; host samples go on"),
        S("hang-all", [dict(kind="hang", start=160)], seed=142),
        S("strag-5-16k", [dict(kind="straggler", rank=9000, pct=5, start=60)], ranks=16384, steps=140, seed=151,
          nodes_per_msg=32, note="2,048 nodes; a relay sends 32 nodes' rows per message"),
    ]


SCENARIOS: list[IndepScenario] = _suite()

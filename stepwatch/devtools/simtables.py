"""The Arrow tables of a simulated job (:class:`stepwatch.devtools.simulate.Simulation`): steps, host,
accelerator, comm and GC rows built from the numeric core's arrays, without per-row Python work."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from stepwatch.agents.probe.collectives import LINK_GBPS, bus_factor
from stepwatch.devtools.simmodel import (_COMM, _DATA, _FOREIGN, _FOREIGN_CORES, _FOREIGN_PID, _LINK_UTIL, _PY_PID0,
                                         _SMALL_CALLS, _TOP_N)
from stepwatch.wire.tables import ACCEL, COMM, GC, HOST, STEPS, TOP_PROC

# --------------------------------------------------------------------------- arrow helpers

def _strings(values) -> tuple[bytes, np.ndarray]:
    """(utf-8 data blob, int64 offsets) of a sequence of strings."""
    enc = [str(v).encode() for v in values]
    offs = np.zeros(len(enc) + 1, np.int64)
    np.cumsum([len(b) for b in enc], out=offs[1:])
    return b"".join(enc), offs


def _tiled_string_array(blob: bytes, offs: np.ndarray, reps: int) -> pa.Array:
    """A string array holding the base sequence (``blob``/``offs``) ``reps`` times, built without
    any per-row Python work."""
    n = len(offs) - 1
    total = int(offs[-1])
    o = (np.arange(reps, dtype=np.int64)[:, None] * total + offs[None, :-1]).ravel()
    o = np.append(o, reps * total)
    if reps * total < 2**31 - 1:
        return pa.StringArray.from_buffers(n * reps, pa.py_buffer(o.astype(np.int32)),
                                           pa.py_buffer(blob * reps))
    return pa.LargeStringArray.from_buffers(n * reps, pa.py_buffer(o), pa.py_buffer(blob * reps)
                                            ).cast(pa.string())


def _ts(ns: np.ndarray) -> pa.Array:
    return pa.array(np.ascontiguousarray(ns, dtype=np.int64)).view(pa.timestamp("ns", tz="UTC"))



# --------------------------------------------------------------------------- tables

class SimTables:
    """The table builders of :class:`~stepwatch.devtools.simulate.Simulation` (a mixin: they read its
    layout, ``_unit`` and string blobs)."""

    def _steps_table(self, nm: dict, t_start: np.ndarray, t_end: np.ndarray) -> pa.Table:
        S, R = nm["data"].shape
        n = S * R
        rep = lambda a: np.repeat(a, R)
        data = nm["data"]
        # DataLoader prefetch queue: empty when the rank waited noticeably for data, else 1..4
        queue = np.where(data > 3.0 * _DATA * self._unit, 0, nm["queue"]).astype(np.int32)
        cols = [
            _tiled_string_array(self._job_blob, self._job_offs, n),
            _tiled_string_array(self._node_blob, self._node_offs, S),
            pa.array(np.tile(np.arange(R, dtype=np.int32), S)),
            pa.array(rep(nm["steps"])),
            _ts(rep(t_start)), _ts(rep(t_end)),
            pa.array(rep(nm["step_ms"])),
            pa.array(data.ravel()), pa.array(nm["compute"].ravel()), pa.array(nm["comm"].ravel()),
            pa.array(nm["comm_wait"].ravel()), pa.array(nm["gc_ms"].ravel()),
            pa.array(nm["gc_count"].ravel().astype(np.int32)),
            pa.array(np.full(n, self.samples_per_rank, np.int64)),
            pa.array(np.full(n, self.samples_per_rank * self.seq_len, np.int64)),
            pa.nulls(n, STEPS.field("phases").type),
            pa.array(queue.ravel()),
        ]
        cols += [pa.nulls(n, f.type) for f in list(STEPS)[len(cols):]]    # (cpu_ms, cpu_wait_ms: not simulated)
        return pa.Table.from_arrays(cols, schema=STEPS)

    def _host_table(self, nm: dict, t_end: np.ndarray) -> pa.Table:
        steps = nm["steps"]
        S, N, rpn = len(steps), self.n_nodes, self.ranks_per_node
        n = S * N
        z = nm["host_z"]                                               # (S, 12, N) standard normals
        cont = nm["contention"]                                        # (S, N)
        ckpt = nm["ckpt"][:, None]
        cores = self.cpus_per_node
        per_node = self.ranks_on_node[None, :]

        foreign = np.where(cont, 100.0 * _FOREIGN_CORES * (1.0 + 0.05 * z[:, 0]), 0.0)
        # training processes: ~100% of a core each (a bit less when a foreign process competes)
        py = np.clip(100.0 + 8.0 * nm["host_py"] - 12.0 * cont[:, :, None], 1.0, None)
        py[np.broadcast_to(np.arange(rpn)[None, None, :] >= per_node[:, :, None], py.shape)] = -1.0
        loader = 60.0 * per_node * (1.0 + 0.1 * z[:, 1])              # DataLoader workers
        busy_pct = np.clip(py, 0, None).sum(axis=2) + loader + foreign + 150.0
        cpu_util = np.clip(busy_pct / cores * (1.0 + 0.03 * z[:, 2]), 0.0, 100.0)
        iowait = np.abs(0.3 + 0.15 * z[:, 3]) + 2.0 * ckpt \
            + np.where(nm["io_node"], np.abs(6.0 + z[:, 4]), 0.0)
        steal = np.abs(0.02 * z[:, 5])
        load1 = np.abs(per_node * 2.0 + 1.5 + z[:, 6] + np.where(cont, _FOREIGN_CORES, 0.0))
        mem_total = 2 * 1024**4
        mem_used = (0.35 * mem_total * (1.0 + 0.01 * z[:, 7])).astype(np.int64)
        mem_avail = (mem_total - mem_used - int(0.1 * mem_total)).astype(np.int64)
        disk_read = np.abs(2.0e8 * (1.0 + 0.2 * z[:, 8]))
        disk_write = np.abs(1.0e7 * (1.0 + 0.3 * z[:, 9])) + ckpt * 2.0e9
        net_rx = np.abs(5.0e7 * (1.0 + 0.1 * z[:, 10]))
        net_tx = np.abs(5.0e7 * (1.0 + 0.1 * z[:, 11]))
        retrans = nm["host_retrans"]

        # top_procs: the training processes and any foreign process, top 5 by cpu_pct
        cand = np.concatenate([py, foreign[:, :, None] - (~cont[:, :, None]) * 1.0], axis=2)  # absent < 0
        cand = cand.reshape(n, rpn + 1)
        order = np.argsort(-cand, axis=1, kind="stable")[:, :_TOP_N]
        top = np.take_along_axis(cand, order, axis=1)
        valid = top >= 0
        counts = valid.sum(axis=1)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(counts, out=offsets[1:])
        sel = order[valid]                                    # candidate column: local rank or rpn
        is_foreign = sel == rpn
        pids = np.where(is_foreign, _FOREIGN_PID, _PY_PID0 + sel).astype(np.int64)
        names = pa.array(["python", _FOREIGN]).take(pa.array(is_foreign.astype(np.int8)))
        procs = pa.StructArray.from_arrays([pa.array(pids), names, pa.array(np.round(top[valid], 1))],
                                           fields=list(TOP_PROC))
        top_procs = pa.ListArray.from_arrays(pa.array(offsets), procs, type=HOST.field("top_procs").type)

        # the precision real collectors report (/proc/stat percentages to 0.01, load to 0.01,
        # rates in whole bytes/s, memory in pages): full-precision noise would not compress like data
        r2 = lambda x: np.round(x, 2).ravel()   # noqa: E731
        page = 4096
        cols = [
            _tiled_string_array(self._job_blob, self._job_offs, n),
            _tiled_string_array(self._nodename_blob, self._nodename_offs, S),
            _ts(np.repeat(t_end, N)),
            pa.array(r2(cpu_util)), pa.array(r2(iowait)), pa.array(r2(steal)),
            pa.array(r2(load1)), pa.array((mem_used // page * page).ravel()),
            pa.array((mem_avail // page * page).ravel()),
            pa.array(np.round(disk_read).ravel()), pa.array(np.round(disk_write).ravel()),
            pa.array(np.round(net_rx).ravel()), pa.array(np.round(net_tx).ravel()), pa.array(retrans.ravel()),
            top_procs,
            self._accel(nm) if self.accel else pa.nulls(n, HOST.field("accel").type),
        ]
        return pa.Table.from_arrays(cols, schema=HOST)

    def _accel(self, nm: dict) -> pa.Array:
        """Per-node list of accelerator samples (one per local rank, in rank order). A slow rank's
        device shows a lower clock and a higher temperature."""
        S, R = nm["compute"].shape
        z = nm["accel_z"]                                             # (S, 4, R)
        util = np.clip(100.0 * nm["compute"] / nm["step_ms"][:, None], 0.0, 100.0)
        slow = nm["slow_extra"] / np.maximum(nm["compute"] - nm["slow_extra"], 1e-9)   # relative slowdown
        clock = 1980.0 / (1.0 + slow) + 5.0 * z[:, 0]
        temp = 62.0 + 3.0 * z[:, 1] + 25.0 * np.minimum(slow, 1.0)
        power = 300.0 + 4.0 * util + 10.0 * z[:, 2]
        mem = (6.0e10 * (1.0 + 0.01 * z[:, 3])).astype(np.int64)
        node_off = np.zeros(self.n_nodes + 1, np.int64)
        np.cumsum(self.ranks_on_node, out=node_off[1:])
        offsets = (np.arange(S, dtype=np.int64)[:, None] * R + node_off[None, :-1]).ravel()
        offsets = np.append(offsets, S * R).astype(np.int32)
        # as nvidia-smi / npu-smi report them: whole %, MiB, °C, 0.1 W, MHz
        vals = pa.StructArray.from_arrays(
            [pa.array(np.tile(self.local_rank.astype(np.int32), S)), pa.array(np.round(util).ravel()),
             pa.array((mem // (1 << 20) * (1 << 20)).ravel()), pa.array(np.round(temp).ravel()),
             pa.array(np.round(np.abs(power), 1).ravel()), pa.array(np.round(np.abs(clock)).ravel())],
            fields=list(ACCEL))
        return pa.ListArray.from_arrays(pa.array(offsets), vals, type=HOST.field("accel").type)

    def dp_group_of(self, rank: int) -> np.ndarray:
        """Ranks of the data-parallel group of ``rank`` (same pipeline stage and tp coordinate)."""
        return np.flatnonzero((self.stage == self.stage[rank]) & (self._tp == self._tp[rank]))

    def dp_group_name(self, rank: int) -> str:
        """The ``group`` name of ``rank``'s data-parallel group in the comm rows."""
        return f"dp{int(self.stage[rank]) * self.tp + int(self._tp[rank])}"

    def _comm_payload(self) -> tuple[int, int]:
        """(gradient all-reduce payload per rank and step in bytes, data-parallel group size): sized so
        that the nominal comm time reaches ``_LINK_UTIL`` of the nominal RDMA bus bandwidth."""
        n = self.world_size // (self.tp * self.pp)
        comm_ms = _COMM * self._unit
        fac = float(bus_factor("all_reduce", max(n, 1))) or 1.0
        return int(_LINK_UTIL * LINK_GBPS["rdma"] * 1e9 * comm_ms / 1e3 / fac), n

    def _comm_table(self, nm: dict) -> pa.Table:
        """Per rank and step: the all_reduce on the rank's data-parallel group (time = transfer + wait for
        the group's last rank) and a ``barrier`` on ``world`` with the rest of the rank's comm wait."""
        S, R = nm["comm"].shape
        gid = self.stage.astype(np.int64) * self.tp + self._tp
        G = int(gid.max()) + 1
        own = nm["busy"] + nm["comm"]                                   # (S, R) arrival + transfer
        gmax = np.full((S, G), -np.inf)
        for g in range(G):                                              # G groups (<= ranks / dp size)
            gmax[:, g] = own[:, gid == g].max(axis=1)
        in_group = np.minimum(np.maximum(gmax[:, gid] - own, 0.0), nm["comm_wait"])
        rest = nm["comm_wait"] - in_group
        payload, n = self._comm_payload()
        calls = np.where(nm["small"], _SMALL_CALLS, 1).astype(np.int64)
        names = pa.array([f"dp{g}" for g in range(G)] + ["world"])
        ranks = np.tile(np.arange(R, dtype=np.int32), S)
        step = np.repeat(nm["steps"], R)
        # interleave per (step, rank): all_reduce row, then barrier row
        m = S * R
        def inter(a, b):
            out = np.empty(2 * m, dtype=np.result_type(a, b))
            out[0::2], out[1::2] = a, b
            return out
        cols = [
            _tiled_string_array(self._job_blob, self._job_offs, 2 * m),
            self._node_pa.take(pa.array(np.repeat(ranks, 2))),
            pa.array(np.repeat(ranks, 2)),
            pa.array(np.repeat(step, 2)),
            pa.DictionaryArray.from_arrays(np.tile(np.array([0, 1], np.int32), m),
                                           pa.array(["all_reduce", "barrier"])).cast(pa.string()),
            names.take(pa.array(inter(np.tile(gid, S), np.full(m, G)))),
            pa.array(inter(np.repeat(calls, R), np.ones(m, np.int64))),
            pa.array(inter(np.full(m, payload, np.int64), np.zeros(m, np.int64))),
            pa.array(inter((nm["comm"] + in_group).ravel(), rest.ravel())),
            pa.array(inter(in_group.ravel(), rest.ravel())),
            pa.array(inter(np.full(m, n, np.int32), np.full(m, R, np.int32))),
        ]
        return pa.Table.from_arrays(cols, schema=COMM)

    def _gc_table(self, nm: dict, t_start: np.ndarray) -> pa.Table:
        ev_step, ev_rank, ev_gen, ev_dur, ev_u = nm["ev"]
        n = len(ev_step)
        if not n:
            return GC.empty_table()
        # collections of one rank in one step happen one after the other (they do not overlap)
        # during the rank's own work in that step; times are whole microseconds, strictly
        # increasing within a rank, so (job, rank, t) stays a unique key
        R = self.world_size
        flat = ev_step * R + ev_rank                      # sorted
        first = np.r_[True, flat[1:] != flat[:-1]]
        pos = np.arange(n)
        k = pos - np.maximum.accumulate(np.where(first, pos, 0))   # index within the group
        before = np.cumsum(ev_dur) - ev_dur
        prior = before - np.maximum.accumulate(np.where(first, before, 0.0))
        slack = np.maximum(nm["busy"][ev_step, ev_rank] - nm["gc_ms"][ev_step, ev_rank], 0.0)
        t_us = np.round((ev_u * slack + prior) * 1e3).astype(np.int64) + k
        t = t_start[ev_step] + t_us * 1000
        collected = np.round(ev_dur * 900.0 * (1 + ev_gen)).astype(np.int64)
        cols = [
            _tiled_string_array(self._job_blob, self._job_offs, n),
            self._node_pa.take(pa.array(ev_rank)),
            pa.array(ev_rank.astype(np.int32)),
            _ts(t),
            pa.array(ev_gen.astype(np.int32)),
            pa.array(ev_dur.astype(np.float64)),
            pa.array(collected),
            pa.array(np.zeros(n, np.int64)),
        ]
        return pa.Table.from_arrays(cols, schema=GC)


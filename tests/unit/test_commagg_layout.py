"""comm_bw's aggregate (detectors/commagg.py) folds a batch laid out like the last one by reusing its layout:
only the times and waits are folded (two bincounts, not six), and the accumulators are still bit for bit a
row-by-row fold of every row in arrival order, also across layout changes, multi-step batches and signed
zeros."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from stepwatch.detectors.commagg import _CommAggregate

pytestmark = pytest.mark.unit

R = 32


def batch(steps, rng, gather: bool, drop=None, scale=1, zeros=False) -> pa.Table:
    """One row per (rank, collective) per step, ranks in order: all_reduce (payload), barrier, and with
    ``gather`` an all_gather (payload rows then unevenly spaced); ``drop`` leaves out a (step, rank)'s
    barrier row, ``scale`` multiplies the all_reduce bytes, ``zeros`` gives two g0 ranks -0.0 and 0.0 ms."""
    cols = {k: [] for k in ("rank", "step", "op", "group", "count", "bytes", "time_ms", "wait_ms", "group_size")}

    def row(*v):
        for k, x in zip(cols, v):
            cols[k].append(x)
    for s in steps:
        for r in range(R):
            t = float(rng.random() * 10)
            if zeros and r in (0, 4):
                t = -0.0 if r == 0 else 0.0
            row(r, s, "all_reduce", f"g{r % 4}", 1, (1 << 20) * (1 + r % 4) * scale, t, float(rng.random()), 8)
            if drop != (s, r):
                row(r, s, "barrier", "world", 1, 0, float(rng.random()), float(rng.random()), R)
            if gather:
                row(r, s, "all_gather", f"t{r // 8}", 2, 4096, float(rng.random() * 3), float(rng.random()), 8)
    return pa.table({"rank": pa.array(cols["rank"], pa.int32()), "step": pa.array(cols["step"], pa.int64()),
                     "op": cols["op"], "group": cols["group"], "count": pa.array(cols["count"], pa.int64()),
                     "bytes": pa.array(cols["bytes"], pa.int64()), "time_ms": cols["time_ms"],
                     "wait_ms": cols["wait_ms"], "group_size": pa.array(cols["group_size"], pa.int32())})


def reference(agg: _CommAggregate, batches: list[pa.Table]) -> dict:
    """Each accumulator of the newest steps computed row by row in arrival order (bincount's order: each
    sum from 0.0, each row added in turn; the least time as np.minimum.at from inf gives it)."""
    key = {(agg.ops.names[o], agg.groups.names[g]): k for k, (o, g) in enumerate(zip(agg.key_op, agg.key_group))}
    ref: dict = {}
    for t in batches:
        rows = t.to_pylist()
        steps = sorted({r["step"] for r in rows})
        for s in steps:
            e = ref.setdefault(s, {"tt": 0.0, "tw": 0.0, "rw": np.zeros(R), "rs": np.zeros(R, bool), "k": {},
                                   "members": set()})
            mine = [r for r in rows if r["step"] == s]
            if len(steps) == 1:                                 # a one-step batch adds its numpy sums
                e["tt"] += np.array([r["time_ms"] for r in mine]).sum()
                e["tw"] += np.array([r["wait_ms"] for r in mine]).sum()
            else:
                tt = tw = 0.0
                for r in mine:
                    tt, tw = tt + r["time_ms"], tw + r["wait_ms"]
                e["tt"], e["tw"] = e["tt"] + tt, e["tw"] + tw
            rw = np.zeros(R)
            for r in mine:
                rw[r["rank"]] += r["wait_ms"]
                e["rs"][r["rank"]] = True
            e["rw"] += rw
            per: dict = {}
            for r in mine:
                if r["op"] in ("barrier", "wait") or r["count"] <= 0 or r["bytes"] <= 0:
                    continue
                k = key[(r["op"], r["group"])]
                a = per.setdefault(k, {"ktime": 0.0, "kwait": 0.0, "kbytes": 0.0, "kcount": 0.0, "krows": 0,
                                       "kmin": np.full(1, np.inf), "kgs": np.nan, "hist": np.zeros(6)})
                a["ktime"] += r["time_ms"]
                a["kwait"] += r["wait_ms"]
                a["kbytes"] += float(r["bytes"])
                a["kcount"] += float(r["count"])
                a["krows"] += 1
                np.minimum.at(a["kmin"], [0], [r["time_ms"]])
                a["kgs"] = np.fmax(a["kgs"], float(r["group_size"]))
                b = np.searchsorted([4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20],
                                    r["bytes"] / max(r["count"], 1), side="right")
                a["hist"][b] += r["count"]
                e["members"].add((k << 31) | r["rank"])
            for k, a in per.items():
                c = e["k"].setdefault(k, {"ktime": 0.0, "kwait": 0.0, "kbytes": 0.0, "kcount": 0.0, "krows": 0.0,
                                          "kmin": np.inf, "kgs": np.nan, "hist": np.zeros(6)})
                for f in ("ktime", "kwait", "kbytes", "kcount", "krows"):
                    c[f] += a[f]
                c["kmin"] = np.minimum(c["kmin"], a["kmin"][0])
                c["kgs"] = np.fmax(c["kgs"], a["kgs"])
                c["hist"] = c["hist"] + a["hist"]
    return ref


def bits(x) -> bytes:
    return np.asarray(x, dtype=np.float64).tobytes()


@pytest.mark.parametrize("gather", [False, True])
def test_steady_batches_fold_only_times_and_waits_bit_for_bit(monkeypatch, gather):
    rng = np.random.default_rng(11)
    plan = [[0], [1], [2], [3], [4], [5], [6, 7], [8, 9], [10, 11], [12, 13]]
    batches = [batch(s, rng, gather, drop=(3, 5) if s == [3] else None, scale=2 if s == [10, 11] else 1,
                     zeros=s == [2]) for s in plan]
    agg = _CommAggregate(40)
    calls = []
    real = np.bincount

    def counting(*a, **k):
        calls[-1] += 1
        return real(*a, **k)
    monkeypatch.setattr(np, "bincount", counting)
    for t in batches:
        calls.append(0)
        agg.ingest(t, 1 << 16)
    monkeypatch.setattr(np, "bincount", real)
    # steps 1, 2 and 5 (one step, laid out like the last) and 8-9 (two steps like 6-7): the per-rank
    # wait and one shared bincount of the payload times and waits (and the steps' totals when two)
    assert [calls[i] for i in (1, 2, 5)] == [2, 2, 2]
    assert calls[7] == 3
    ref = reference(agg, batches)
    assert sorted(ref) == list(range(14))
    for s, e in ref.items():
        i = s % agg.W
        assert agg.slot_step[i] == s
        assert bits(agg.tt[i]) == bits(e["tt"]) and bits(agg.tw[i]) == bits(e["tw"]), s
        assert bits(agg.rw[i, :R]) == bits(e["rw"]) and agg.rs[i, :R].tolist() == e["rs"].tolist(), s
        ks = sorted(e["k"])
        assert np.flatnonzero(agg.krows[i] > 0).tolist() == ks, s
        for f in ("ktime", "kwait", "kbytes", "kcount", "krows", "kmin", "kgs"):
            assert bits(getattr(agg, f)[i, ks]) == bits([e["k"][k][f] for k in ks]), (s, f)
        assert bits(agg.hist[i]) == bits(sum(c["hist"] for c in e["k"].values())), s
        assert agg.members[i].tolist() == sorted(e["members"]), s
    z = agg.kmin[2, sorted(ref[2]["k"])[0]]                     # g0 at step 2: -0.0 and 0.0, as minimum.at
    assert z == 0 and bits(z) == bits(ref[2]["k"][sorted(ref[2]["k"])[0]]["kmin"])

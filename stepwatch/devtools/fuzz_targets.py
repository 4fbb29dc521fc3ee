"""Fuzzing the agent-side boundaries with ``hypothesis``: structured hostile inputs, counted.

- :func:`fuzz_datagram` — the node agent's datagram decode (:meth:`stepwatch.agents.agent.Agent.handle`
  and the Arrow tables of :meth:`~stepwatch.agents.agent.Agent.tick`): hellos with every field of
  every JSON type and out-of-range integers, batch frames with wrong counts and random bytes for their
  records, several frames in one datagram, bit flips of valid datagrams, random bytes, from three
  different senders (peer credentials).
- :func:`fuzz_control` — the control-command verify, agent side
  (:meth:`stepwatch.agents.control.AgentControl.handle_message`) and probe side
  (:meth:`stepwatch.agents.profiling.ProbeControl.handle`): random bytes, bit flips of sealed envelopes,
  envelopes with the right signature over malformed bodies (what a buggy or compromised signer could
  send), envelopes signed by an untrusted key, truncations, and valid commands.

Inputs: ``n/20`` (at least 500) drawn from the hypothesis strategies, the rest byte-level mutations
of those (bit flips, int32/int64/NaN edge values, insertions, deletions, truncation, splices:
:func:`mutate`), so that ``n`` = 100,000 takes minutes, not hours (hypothesis draws ~100 structured
inputs a second here). Each returns ``{"boundary", "tried", "structured", "mutated", "crashes",
"hangs", "seconds", "per_s", "examples", ...}``:
``crashes`` counts inputs for which the code under test raised (it must never: a bad input is counted
and skipped), ``hangs`` inputs that took longer than ``hang_s``; ``examples`` holds the first few
failures (type and message, never the input bytes). :func:`fuzz_control` also counts
``accepted_unverified``: inputs that were not validly sealed but got forwarded or started a profile
(must be 0). ``stepwatch bench fuzz`` registers both; ``python -m stepwatch.devtools.fuzz_targets
{datagram,control} N [--seed S]`` runs one.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

HANG_S = 1.0


EDGES = (b"\x00", b"\xff", b"\x7f", b"\x80", b"\x00\x00\x00\x80", b"\xff\xff\xff\x7f",
         b"\x00\x00\x00\x00\x00\x00\x00\x80", b"\xff\xff\xff\xff\xff\xff\xff\x7f",
         b"\x00\x00\x00\x00\x00\x00\xf8\x7f")          # NaN as a float64


def mutate(data: bytes, rng, corpus: list) -> bytes:
    """1-4 byte-level mutations of a structured input (what a coverage-less byte fuzzer would do):
    bit flips, edge values (int32/int64 limits, NaN) written over 1-8 bytes, insertions, deletions,
    truncation, duplicated slices, splices with another input."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        n = len(b)
        if op == 0 and n:
            b[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            e = rng.choice(EDGES)
            i = rng.randrange(n)
            b[i:i + len(e)] = e
        elif op == 2:
            i = rng.randint(0, n)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op == 3 and n:
            i = rng.randrange(n)
            del b[i:i + rng.randint(1, 16)]
        elif op == 4 and n:
            del b[rng.randint(0, n):]
        elif op == 5 and n:
            i = rng.randrange(n)
            j = rng.randint(i, min(n, i + 64))
            b[j:j] = b[i:j]
        elif op == 6:
            other = rng.choice(corpus)[0]
            i = rng.randint(0, n)
            b[i:] = other[rng.randint(0, len(other)):]
    return bytes(b[:70000])


def _runner(strategy, n: int, seed: int, one, structured: int | None = None):
    """Run ``one(example)`` on ``n`` inputs: ``structured`` of them (default n/20, at least 500) drawn
    from the hypothesis ``strategy`` (generation only: no shrinking, no database), the rest byte-level
    mutations (:func:`mutate`) of those, seeded by ``seed``. Returns (counters, seconds)."""
    import random

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    st_ = {"tried": 0, "crashes": 0, "hangs": 0, "examples": [], "structured": 0, "mutated": 0}
    corpus: list = []

    def timed(x):
        st_["tried"] += 1
        t0 = time.perf_counter()
        try:
            one(x)
        except Exception as e:  # noqa: BLE001 - that is what we count
            st_["crashes"] += 1
            if len(st_["examples"]) < 5:
                st_["examples"].append(f"{type(e).__name__}: {str(e)[:200]}")
        if time.perf_counter() - t0 > HANG_S:
            st_["hangs"] += 1

    k = min(n, structured or max(500, n // 20))

    @hseed(seed)
    @settings(max_examples=k, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(x):
        if len(corpus) < 5000:
            corpus.append(x)
        timed(x)

    t0 = time.perf_counter()
    run()
    st_["structured"] = st_["tried"]
    rng = random.Random(seed)
    while st_["tried"] < n and corpus:
        data, extra = rng.choice(corpus)
        timed((mutate(data, rng, corpus), extra))
    st_["mutated"] = st_["tried"] - st_["structured"]
    return st_, time.perf_counter() - t0


# ---------------------------------------------------------------------------- datagrams

def _datagram_strategy():
    from hypothesis import strategies as st

    from stepwatch.wire.datagram import (COMM, GCREC, HDR, MAGIC, MAX_COMM, MAX_GC, MAX_PHASES, PHASE, STEP,
                                         T_BATCH, T_HELLO, T_PROFILE, VERSION)
    edge = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, -2**63, 10**30])
    ints = st.one_of(st.integers(-2**70, 2**70), edge, st.integers(0, 64))
    leaf = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=24))
    jval = st.recursive(leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                        max_leaves=8)
    names = st.dictionaries(st.one_of(st.integers(0, 2**20).map(str), st.text(max_size=6)),
                            st.one_of(st.text(max_size=300), jval), max_size=6)
    hello = st.fixed_dictionaries({}, optional={
        "job": st.one_of(st.text(max_size=600), st.sampled_from(["j1", "j2", "a/b", "", " "]), jval),
        "rank": ints, "world_size": ints, "node": st.one_of(st.text(max_size=300), jval), "names": st.one_of(names, jval),
        "dp": ints, "tp": ints, "pp": ints, "ep": ints, "cp": ints, "model_params": ints,
        "model_flops_per_token": st.one_of(st.floats(), ints), "group_sizes": st.one_of(
            st.dictionaries(st.text(max_size=8), st.one_of(ints, jval), max_size=4), jval),
        "device": jval, "device_type": jval, "dtype": jval, "framework": jval, "ctl": jval, "pid": jval})
    good_hello = st.fixed_dictionaries({"job": st.sampled_from(["j1", "j2"]), "rank": st.integers(0, 7),
                                        "world_size": st.just(8), "names": st.just({"1": "all_reduce", "2": "dp"})})
    inst = st.one_of(st.sampled_from([1, 2, 3]), st.integers(-2**31, 2**31 - 1))

    def hello_dgram(typ=T_HELLO):
        return st.builds(lambda i, r, body: HDR.pack(MAGIC, VERSION, typ, i, r, 0, 0, 0, 0) + body, inst,
                         st.integers(-2**31, 2**31 - 1),
                         st.one_of(st.one_of(hello, good_hello, jval).map(lambda d: json.dumps(d).encode()),
                                   st.binary(max_size=64)))

    def frame(ns, nc, ng, npz, i, r, pad, data):
        size = ns * STEP.size + npz * PHASE.size + nc * COMM.size + ng * GCREC.size
        body = (data * (size // max(len(data), 1) + 1))[:size] if data else bytes(size)
        return HDR.pack(MAGIC, VERSION, T_BATCH, i, r, ns, nc, ng, npz) + body[:max(0, size + pad)]

    frames = st.builds(frame, st.integers(0, 2), st.integers(0, MAX_COMM + 2), st.integers(0, MAX_GC + 2),
                       st.integers(0, MAX_PHASES + 2), inst, st.integers(-2**31, 2**31 - 1),
                       st.sampled_from([0, 0, 0, -1, -8, 3]), st.binary(min_size=1, max_size=96))
    batch = st.lists(frames, min_size=1, max_size=3).map(b"".join)
    valid = st.builds(lambda i, n, t: HDR.pack(MAGIC, VERSION, T_BATCH, i, 0, 1, 0, 0, 0) + STEP.pack(
        n, t, t + 1, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0, -1, -1, -1, 0, 1.0, 0.0, 0.0, 0.0), st.sampled_from([1, 2, 3]),
        st.integers(0, 10**6), st.integers(0, 2**62))

    def flip(b, pos, bit):
        if not b:
            return b
        a = bytearray(b)
        a[pos % len(a)] ^= 1 << bit
        return bytes(a)

    flipped = st.builds(flip, st.one_of(batch, valid, hello_dgram()), st.integers(0, 10**6), st.integers(0, 7))
    anyd = st.one_of(hello_dgram(), hello_dgram(T_PROFILE), hello_dgram(99), batch, valid, flipped,
                     st.binary(max_size=256))
    return st.tuples(anyd, st.sampled_from([0, 1, 2, 3]))


def fuzz_datagram(n: int, seed: int = 0) -> dict:
    """Fuzz the agent's datagram decode with ``n`` inputs; see the module doc."""
    from stepwatch.agents.agent import Agent
    from stepwatch.agents.socket_trust import IngressLimits, Peer
    d = tempfile.mkdtemp(prefix="sw-fuzz-")
    agent = Agent(None, socket_dir=d, node="fz", plugins=[], limits=IngressLimits(max_instances=64))
    peers = [None, Peer(101, 1000, 1000), Peer(102, 1000, 1000), Peer(103, 2000, 2000)]
    k = {"n": 0, "rows": 0}

    def one(x):
        data, p = x
        agent.handle(data, time.monotonic(), peers[p])
        k["n"] += 1
        if k["n"] % 64 == 0:                       # build the Arrow tables of what was accepted
            k["rows"] += sum(t.num_rows for _, _, t in agent.tick())

    try:
        st_, secs = _runner(_datagram_strategy(), n, seed, one)
        k["rows"] += sum(t.num_rows for _, _, t in agent.tick())
    finally:
        agent.close()
        shutil.rmtree(d, ignore_errors=True)
    m = agent.metrics
    return {"boundary": "agent datagram decode", "tried": st_["tried"], "structured": st_["structured"],
            "mutated": st_["mutated"], "crashes": st_["crashes"],
            "hangs": st_["hangs"], "seconds": round(secs, 2), "per_s": round(st_["tried"] / max(secs, 1e-9)),
            "examples": st_["examples"], "rows_built": k["rows"], "bad_datagrams": int(m.value(m.bad_datagrams)),
            "dropped": {k2: int(v) for k2, v in _labels(m.dropped).items()}}


def _labels(counter) -> dict:
    out = {}
    for metric in counter.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[s.labels.get("reason", "")] = s.value
    return out


# ---------------------------------------------------------------------------- control commands

def _control_strategy(priv, other):
    from hypothesis import strategies as st

    from stepwatch.agents import profiling as pf
    from stepwatch.agents.profiling import protocol
    edge = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 10**30, time.time_ns() + 60 * 10**9])
    ints = st.one_of(st.integers(-2**70, 2**70), edge, st.integers(0, 16))
    leaf = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=24))
    jval = st.recursive(leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                        max_leaves=8)
    body = st.fixed_dictionaries({}, optional={
        "cmd_id": st.one_of(st.text(max_size=80), jval), "job": st.one_of(st.sampled_from(["fz", "x"]), jval),
        "node": st.one_of(st.sampled_from(["fz-node", "other"]), jval), "ranks": st.one_of(st.lists(ints, max_size=5), jval),
        "reference": st.one_of(st.lists(ints, max_size=3), jval), "steps": ints,
        "kind": st.one_of(st.sampled_from(["torch", "py-spy", "x"]), jval), "reason": jval,
        "issued_at": ints, "expires_at": ints})

    def signed(d, raw_tail):
        b = json.dumps(d).encode() if raw_tail is None else raw_tail
        kid = protocol.key_id(priv.public_key())
        return protocol.MAGIC + kid + priv.sign(protocol.DOMAIN + kid + b) + b

    def valid(i, steps, node, kind, key):
        now = time.time_ns()
        c = protocol.new_command("fz", node, [7], steps, kind, "r", ttl_s=60, now_ns=now, cmd_id=f"c{i}")
        return pf.seal(c, key)

    good = st.builds(valid, st.integers(0, 10**9), st.integers(1, 300), st.sampled_from(["fz-node", "other"]),
                     st.sampled_from(["py-spy"]), st.sampled_from([priv, other]))
    forged = st.builds(signed, body, st.one_of(st.none(), st.none(), st.binary(max_size=200)))

    def flip(b, pos, bit):
        a = bytearray(b)
        a[pos % len(a)] ^= 1 << bit
        return bytes(a)

    flipped = st.builds(flip, good, st.integers(0, 10**6), st.integers(0, 7))
    truncated = st.builds(lambda b, k: b[:k], good, st.integers(0, 300))
    junk = st.one_of(st.binary(max_size=300), st.binary(max_size=100).map(lambda b: protocol.MAGIC + b),
                     body.map(lambda d: json.dumps(d).encode()))
    return st.tuples(st.one_of(good, forged, flipped, truncated, junk), st.sampled_from([None, b"fz-node", b"x"]))


def fuzz_control(n: int, seed: int = 0) -> dict:
    """Fuzz the control-command verify on both sides with ``n`` inputs; see the module doc."""
    from stepwatch.agents import profiling as pf
    from stepwatch.agents.profiling import protocol
    from stepwatch.agents.agent import Agent
    from stepwatch.wire.datagram import HDR, MAGIC, T_PROFILE, VERSION
    pem, pub = protocol.keygen()
    priv = pf.load_private_key(env={protocol.ENV_PRIVATE: pem.decode()})
    other = pf.load_private_key(env={protocol.ENV_PRIVATE: protocol.keygen()[0].decode()})
    keys = pf.load_public_keys(env={protocol.ENV_PUBLIC: pub})
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="sw-fuzzc-", dir=shm)
    agent = Agent(None, socket_dir=d, node="fz-node", plugins=[])
    agent.enable_profiling(keys, os.path.join(d, "tr"), cooldown_s=0.0, consume=False, state_dir=d)
    ctl = agent.control
    transport = SimpleNamespace(instance=5, path=os.path.join(d, "nobody.sock"))
    pc = pf.ProbeControl(transport, SimpleNamespace(rank=7, job="fz"),
                         lambda inst, rank: HDR.pack(MAGIC, VERSION, T_PROFILE, inst, rank, 0, 0, 0, 0), lambda on: None)
    pc.limits = pf.ProbeLimits(d, env={"STEPWATCH_PROFILE_DIR": os.path.join(d, "tr")})
    pc.keys = keys
    pc._keys_loaded.set()
    pc.REFUSAL_REPLY_S = 0.0
    k = {"unverified": 0, "agent_ok": 0, "probe_ok": 0}

    def verified(data) -> bool:
        try:
            pf.open_envelope(data, keys)
            return True
        except protocol.BadCommand:
            return False

    def one(x):
        data, key = x
        ok = verified(data)
        f0 = ctl.metrics.forwarded._value.get()
        ctl.handle_message(data, key)
        ctl.rows.clear()
        if not ok and (ctl.metrics.forwarded._value.get() != f0):
            k["unverified"] += 1
        pc.handle(data)                                # the probe, as if the envelope reached its socket
        if pc.run is not None:
            if not ok:
                k["unverified"] += 1
            k["probe_ok"] += 1
            pc.run.state = "done"
            pc.run = None
        k["agent_ok"] += ok

    try:
        st_, secs = _runner(_control_strategy(priv, other), n, seed, one)
    finally:
        agent.close()
        shutil.rmtree(d, ignore_errors=True)
    reg = agent.metrics.registry
    rej = {}
    for metric in reg.collect():
        if metric.name == "stepwatch_agent_profile_commands_rejected":
            rej = {s.labels["reason"]: int(s.value) for s in metric.samples if s.name.endswith("_total")}
    return {"boundary": "control command verify (agent and probe)", "tried": st_["tried"],
            "structured": st_["structured"], "mutated": st_["mutated"],
            "crashes": st_["crashes"], "hangs": st_["hangs"], "seconds": round(secs, 2),
            "per_s": round(st_["tried"] / max(secs, 1e-9)), "examples": st_["examples"],
            "accepted_unverified": k["unverified"], "verified_inputs": k["agent_ok"],
            "probe_runs_started": k["probe_ok"], "agent_rejected": rej, "probe_rejected": dict(pc.rejected)}


FUZZERS = {"datagram": fuzz_datagram, "control": fuzz_control}


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m stepwatch.devtools.fuzz_targets",
                                description="fuzz an agent-side boundary with hypothesis and print what was tried")
    p.add_argument("boundary", choices=sorted(FUZZERS) + ["all"])
    p.add_argument("n", type=int, nargs="?", default=100_000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import logging
    logging.disable(logging.WARNING)                 # the code under test logs its refusals (rate-limited)
    bad = 0
    for name in (sorted(FUZZERS) if a.boundary == "all" else [a.boundary]):
        r = FUZZERS[name](a.n, a.seed)
        print(json.dumps(r, sort_keys=True), flush=True)
        bad += r["crashes"] + r["hangs"] + r.get("accepted_unverified", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["fuzz_datagram", "fuzz_control", "FUZZERS"]

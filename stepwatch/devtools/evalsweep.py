"""``stepwatch eval --sweep N``: random scenario sweeps instead of a fixed family, so there is no scenario
to tune to.

Every scenario is drawn at random (seeded: ``--seed`` gives other draws) and produced by the independent
producer (:mod:`stepwatch.devtools.scenarios_indep`, written from the wire format alone), then fed through
the real processor and scored by the families' scorer (:func:`stepwatch.devtools.eval.score`). Drawn:

* the noise law: per-rank Student-t noise of scale 0.3-4 % (log-uniform) with 2.5, 3, 5 or 30 degrees
  of freedom (heavy tails to near-Gaussian), clipped at 4-10x its scale; a job-wide AR(1) drift with
  autocorrelation 0-0.99 and innovation sd 0.1-1 %; a checkpoint every 40-120 steps or none;
* the job: 2-256 ranks by default (log-uniform over powers of two; ``--sweep-max-ranks`` up to 16,384: a
  4,096-rank scenario takes minutes on a 2-core machine), 1-8 pipeline stages, a step of 10 ms-10 s
  (log-uniform; GC pauses are absolute times, scaled to the step below 1 s);
* the delivery: 1-20 steps per message (at most 10 s of steps: an agent ships every second), 1-8 partitions, produce order or a consumer-group shuffle;
* half the scenarios are clean; the other half hold one fault from step 80-140: a straggler on a random
  rank (effect 2-50 % of its busy time, log-uniform), persistent, transient (30-100 steps) or intermittent,
  or a job-wide change of one phase (comm transfer, data wait, host time; 2-50 % of the step, persistent
  or transient).

Reported: **false incidents per 10,000 clean job-steps** (incidents none of whose alerts matches a fault,
over the clean scenarios' steps), and **detection power against effect / noise**: the share of faults found
and decided within 8 steps of their first step, per bin of the fault's effect in units of the noise sd the
detector faces, measured on the producer's rows of a clean copy of the scenario (a straggler: its excess
over the robust sd of its stage's busy time relative to the others'; a phase change: its step-time excess
over the robust sd of the job's step-to-step change; see :func:`effect_in_sd`). Goals: <= 1 false incident per 10,000
clean job-steps; power >= 0.95 for persistent effects of >= 4 noise sd.
"""
from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from stepwatch.devtools.eval import run_scenario, score
from stepwatch.devtools.scenarios_indep import IndepJob, IndepScenario

#: a message holds at most this much event time: an agent ships every interval (1 s), and a producer that
#: batched a minute of steps would hold back its job's steps longer than the hang threshold (a hang and a
#: batch then look alike)
MAX_BATCH_MS = 10_000.0
_MAD_TO_SIGMA = 1.4826
BINS = [(0.0, 2.0), (2.0, 4.0), (4.0, 8.0), (8.0, 16.0), (16.0, math.inf)]
DECIDE_STEPS = 8


def _loguni(rng, lo, hi):
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def draw(i: int, seed: int = 0, max_ranks: int = 256) -> tuple[IndepScenario, dict]:
    """Scenario ``i`` of the sweep (deterministic in ``i`` and ``seed``) and what was drawn."""
    rng = np.random.default_rng(1_000_003 * (seed + 1) + i)
    ranks = int(2 ** rng.integers(1, int(math.log2(max_ranks)) + 1))
    pp = int(rng.choice([p for p in (1, 2, 4, 8) if ranks // p >= 2]))
    step_ms = _loguni(rng, 10.0, 10_000.0)
    noise = _loguni(rng, 0.003, 0.04)
    dof = float(rng.choice([2.5, 3.0, 5.0, 30.0]))
    clipk = float(rng.uniform(4.0, 10.0))
    ar_phi, ar_sd = float(rng.uniform(0.0, 0.99)), _loguni(rng, 0.001, 0.01)
    steps = 240
    clean = i % 2 == 0
    faults, info = [], {"clean": clean}
    if not clean:
        start = int(rng.integers(80, 141))
        pct = _loguni(rng, 2.0, 50.0)
        shape = str(rng.choice(["persistent", "persistent", "transient", "intermittent"]))
        kind = str(rng.choice(["straggler", "straggler", "phase"]))
        f = {"start": start, "pct": round(pct, 2)}
        if shape == "transient":
            f["end"] = min(start + int(rng.integers(30, 101)), steps - 1)
        if kind == "straggler":
            f.update(kind="intermittent" if shape == "intermittent" else "straggler", rank=int(rng.integers(0, ranks)))
        else:
            ph = str(rng.choice(["comm", "data", "host"]))
            share = {"comm": 0.14, "data": 0.05, "host": 0.06}[ph]
            f.update(kind="phase", phase=ph, pct=round(min(pct / share, 400.0), 2))   # pct of the step -> of the phase
            shape = "transient" if "end" in f else "persistent"
        faults = [f]
        info.update(kind=f["kind"], shape=shape, pct_step=round(pct, 2))
    sc = IndepScenario(
        name=f"sweep-{seed}-{i}", faults=faults, ranks=ranks, per_node=min(8, ranks), pp=pp, steps=steps,
        seed=10_000 + 97 * seed + i, step_ms=step_ms,
        steps_per_msg=max(1, min(int(rng.integers(1, 21)), int(MAX_BATCH_MS // step_ms))),
        partitions=int(rng.integers(1, 9)),
        checkpoint_every=None if rng.random() < 0.4 else int(rng.integers(40, 121)),
        nodes_per_msg=max(1, ranks // 512), noise=noise, dof=dof, clip=clipk * noise, ar_phi=ar_phi, ar_sd=ar_sd,
        shuffle=bool(rng.random() < 0.5),
        gc_scale=min(1.0, step_ms / 1000.0), note="random sweep")
    info.update(ranks=ranks, pp=pp, step_ms=round(step_ms, 1), noise=round(noise, 4), dof=dof,
                ar_phi=round(ar_phi, 3), ar_sd=round(ar_sd, 4), spm=sc.steps_per_msg, partitions=sc.partitions,
                shuffle=sc.shuffle)
    return sc, info


def effect_in_sd(sc: IndepScenario, info: dict) -> float:
    """The fault's effect in units of the noise the detector faces, measured on the producer's own rows of
    a clean copy of the scenario (same seed, no fault; steps 20 on): a straggler's effect against the
    robust sd (1.4826 MAD) of its stage's ranks' busy time (the reported step time less the wait, as the
    processor derives it) relative to the median of their stage's others; a job-wide phase change's
    against the robust sd of the job's step-to-step change (the median step time over the ranks). Robust:
    what the detectors take as noise, so rare spikes (checkpoints, gen-2 GC, a slow batch) are not.

    Measured, not modelled: the scenario's parameters alone missed noise the producer adds (each rank's
    step end early by up to 2 ms, uniformly, every step: ~7 % of a 10 ms rank's work; the data wait's
    spread; the slowest of many noisy ranks setting the job's step), and called a ~1-sd straggler of a
    4-rank 10 ms job a 6-sd one, and a 2.5-sd job-wide change an 8-sd one."""
    job = IndepJob(dataclasses.replace(sc, faults=[]))
    S, R = job.S, job.R
    if info.get("kind") in ("straggler", "intermittent"):
        r = int(sc.faults[0]["rank"]) if sc.faults else 0
        full = np.flatnonzero(job.stage == job.stage[r])                # the rank's stage
        steps, ranks = np.repeat(np.arange(20, S), len(full)), np.tile(full, S - 20)
        t = job._steps_table(steps, ranks)
        busy = (np.asarray(t["step_ms"]) - np.asarray(t["comm_wait_ms"])).reshape(S - 20, len(full))
        # the rank and up to 32 others of its stage, each against the median of the stage's others
        pick = np.unique(np.concatenate([np.flatnonzero(full == r), np.arange(0, len(full), -(-len(full) // 32))]))
        x = np.concatenate([busy[:, j] / np.median(np.delete(busy, j, axis=1), axis=1) - 1.0
                            for j in pick.tolist()]) if len(full) > 1 else np.zeros(1)
    else:
        steps, ranks = np.repeat(np.arange(20, S), R), np.tile(np.arange(R), S - 20)
        t = job._steps_table(steps, ranks)
        med = np.median(np.asarray(t["step_ms"]).reshape(S - 20, R), axis=1)
        x = np.diff(med / np.median(med))
    sd = _MAD_TO_SIGMA * float(np.median(np.abs(x - np.median(x))))
    return info["pct_step"] / 100.0 / max(sd, 1e-9)


def run_sweep(a) -> int:
    n = int(a.sweep)
    seed = int(getattr(a, "seed", 0) or 0)
    base = Path(tempfile.mkdtemp(prefix="stepwatch-sweep-"))
    clean_steps = clean_false = 0
    rows = []
    t0 = time.perf_counter()
    print(f"stepwatch eval --sweep {n}: random scenarios (seed {seed}), independent producer, real processor",
          flush=True)
    for i in range(n):
        sc, info = draw(i, seed, int(getattr(a, "sweep_max_ranks", 256) or 256))
        t1 = time.perf_counter()
        res = run_scenario(sc, base / sc.name, shuffle=sc.shuffle, shuffle_seed=seed)
        s = score(res)
        shutil.rmtree(base / sc.name, ignore_errors=True)
        desc = (f"{info['ranks']:>5} ranks pp{info['pp']} {info['step_ms']:>7.1f} ms noise {100 * info['noise']:.2f}% "
                f"t{info['dof']:g} ar {info['ar_phi']:.2f} spm {info['spm']:>2} parts {info['partitions']}"
                f"{' shuffled' if info['shuffle'] else ''}")
        if info["clean"]:
            clean_steps += sc.steps
            clean_false += s["inc_false"]
            verdict = f"clean: {s['inc_false']} false incident(s)" + (
                " (" + ", ".join(sorted({x.kind for x in s["inc_false_alerts"]})) + ")" if s["inc_false"] else "")
        else:
            f = s["faults"][0]
            eff = effect_in_sd(sc, info)
            decided = bool(f["found"] and f.get("delay_steps", 99) <= DECIDE_STEPS)
            rows.append({"effect_sd": eff, "found": f["found"], "decided": decided, "shape": info["shape"],
                         "kind": info["kind"], "pct": info["pct_step"], "false": s["inc_false"]})
            verdict = (f"{info['kind']} {info['shape']} {info['pct_step']:.1f}% ({eff:.1f} sd): "
                       + (f"found in {f.get('delay_steps')} steps" if f["found"] else "missed")
                       + (f", {s['inc_false']} false incident(s)" if s["inc_false"] else ""))
        print(f"  {i:>3} {desc}  {time.perf_counter() - t1:5.1f}s  {verdict}", flush=True)
    shutil.rmtree(base, ignore_errors=True)
    per10k = clean_false / clean_steps * 10_000 if clean_steps else float("nan")
    print(f"\nfalse incidents on clean scenarios: {clean_false} over {clean_steps:,} job-steps = {per10k:.2f} per "
          f"10,000 (goal <= 1)")
    print("\ndetection power against effect / noise (found and decided within "
          f"{DECIDE_STEPS} steps; persistent | all shapes):")
    print(f"{'effect (noise sd)':<18} {'persistent':>12} {'all':>12}")
    ok = True
    for lo, hi in BINS:
        sel = [r for r in rows if lo <= r["effect_sd"] < hi]
        per = [r for r in sel if r["shape"] == "persistent"]
        pf = f"{sum(r['decided'] for r in per)}/{len(per)}" if per else "-"
        af = f"{sum(r['decided'] for r in sel)}/{len(sel)}" if sel else "-"
        label = f"{lo:g}-{hi:g}" if math.isfinite(hi) else f">= {lo:g}"
        print(f"{label:<18} {pf:>12} {af:>12}")
    strong = [r for r in rows if r["effect_sd"] >= 4 and r["shape"] == "persistent"]
    power = sum(r["decided"] for r in strong) / len(strong) if strong else float("nan")
    print(f"\npower for persistent effects >= 4 sd: {power:.3f} (goal >= 0.95, {len(strong)} faults)")
    ok = (per10k <= 1.0) and (not strong or power >= 0.95)
    print(f"({time.perf_counter() - t0:.0f}s)  targets: {'all met' if ok else 'NOT MET'}")
    return 0 if ok else 1

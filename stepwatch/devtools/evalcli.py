"""``stepwatch eval``: runs the scenario families (:mod:`stepwatch.devtools.evalsuite`, the independent
producer's :mod:`stepwatch.devtools.scenarios_indep`) through the processor in produce order and in a
consumer-group shuffle (:func:`stepwatch.devtools.eval.run_scenario`), scores them
(:func:`stepwatch.devtools.eval.score`), and prints the table, the summary and whether the targets are met."""
from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

from stepwatch.devtools.eval import TARGETS, _target_ok, run_detector_bench, run_scenario, score, totals
from stepwatch.devtools.evalreport import COLUMNS, _fmt_table, report, table_rows
from stepwatch.devtools.evalsuite import SCENARIOS


def _families(a) -> dict[str, list]:
    from stepwatch.devtools.scenarios_indep import SCENARIOS as INDEP
    fam = getattr(a, "family", None) or "all"
    out = {}
    if fam in ("all", "sim"):
        out["sim"] = SCENARIOS
    if fam in ("all", "indep"):
        out["indep"] = INDEP
    return out


def summary(results: dict, out=sys.stdout) -> dict:
    """One column per (family, consumer order): the figures the issue asks for, and the goals."""
    keys = list(results)
    tots = {k: totals(results[k]) for k in keys}
    for t in tots.values():
        t["diagnosis_missed"] = t["diagnosis_n"] - t["diagnosis_ok"]
    f3 = lambda v: "nan" if isinstance(v, float) and math.isnan(v) else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    g = lambda v: "nan" if isinstance(v, float) and math.isnan(v) else f"{v:g}"  # noqa: E731
    lines = [
        ("recall (faults >= 5% on their phase)", "recall", f3, ">= 0.99"),
        ("precision (incidents)", "precision", f3, ">= 0.99"),
        ("precision (alerts)", "alert_precision", f3, ""),
        ("right rank/node", "localised", f3, ">= 0.99"),
        ("right cause", "cause", f3, ">= 0.95"),
        ("median delay (steps)", "median_delay_steps", g, "<= 3"),
        ("delay, 5% stragglers (steps)", "delay_5pct_steps", g, "<= 8"),
        ("median delay at emission (steps)", "median_emit_steps", g, ""),
        ("5% stragglers at emission (steps)", "emit_5pct_steps", g, ""),
        ("hang delay, max (s)", "hang_delay_max_s", g, "<= 35"),
        ("false job_hang", "false_job_hang", str, "0"),
        ("alerts on clean scenarios", "clean_alerts", str, "0"),
        ("incidents per fault (mean)", "incidents_per_fault", lambda v: f"{v:.2f}", "1"),
        ("incidents per fault (max)", "incidents_per_fault_max", str, "1"),
        ("faults found / >= 5%", None, None, ""),
    ]
    rows = []
    for label, k, fmt, goal in lines:
        if k is None:
            rows.append([label] + [f"{tots[c]['found_ge5']}/{tots[c]['faults_ge5']}" for c in keys] + [goal])
        else:
            rows.append([label] + [fmt(tots[c][k]) for c in keys] + [goal])
    print(_fmt_table(["figure"] + [f"{f} {o}" for f, o in keys] + ["goal"], rows), file=out)
    allmet = True
    for c in keys:
        t = tots[c]
        applies = {"small_delay_steps": t["small_n"] > 0, "delay_5pct_steps": t["n_5pct"] > 0,
                   "hang_delay_max_s": t["hang_n"] > 0, "median_delay_steps": t["delay_n"] > 0 or not t["hang_n"]}
        fails = [f"{k} {op} {x}" for k, op, x in TARGETS if applies.get(k, True) and not _target_ok(t[k], op, x)]
        t["targets_met"] = not fails
        allmet &= not fails
        print(f"{c[0]} {c[1]}: targets " + ("all met" if not fails else "NOT MET: " + "; ".join(fails)), file=out)
    return {f"{f}/{o}": t for (f, o), t in tots.items()} | {"targets_met": allmet}


def run_eval(a) -> int:
    only = getattr(a, "only", None)
    fams = _families(a)
    orders = [o for o in ("in-order", "shuffled") if getattr(a, "order", "both") in ("both", o)]
    base = Path(a.data_dir) if getattr(a, "data_dir", None) else Path(tempfile.mkdtemp(prefix="stepwatch-eval-"))
    base.mkdir(parents=True, exist_ok=True)
    verbose = getattr(a, "show_alerts", False)
    shift = int(getattr(a, "seed", 0) or 0)
    results: dict[tuple[str, str], list] = {}
    t_all = time.perf_counter()
    for fam, scen in fams.items():
        scen = [s for s in scen if (not only or any(o in s.name for o in only.split(",")))
                and (getattr(a, "large", True) or not s.large)]
        if shift:
            import dataclasses
            scen = [dataclasses.replace(sc, seed=sc.seed + shift) for sc in scen]
        if not scen:
            continue
        for order in orders:
            print(f"stepwatch eval: family {fam}, {order}: {len(scen)} scenarios through the processor "
                  f"(data in {base})", flush=True)
            scored = results.setdefault((fam, order), [])
            for sc in scen:
                d = base / f"{fam}-{order}-{sc.name}"
                if d.exists():
                    shutil.rmtree(d)
                res = run_scenario(sc, d, shuffle=(order == "shuffled"), shuffle_seed=shift)
                s = score(res)
                scored.append((res, s))
                det = sum(res["detector_s"].values())
                print(f"  {sc.name:<22} {sc.ranks:>6,} ranks x {sc.steps} steps, {res['messages']:,} messages: "
                      f"{res['wall_s']:.1f}s (generation {res['sim_s']:.1f}s, detectors {det:.2f}s), "
                      f"{len(s['firing'])} alert(s)", flush=True)
                if verbose:
                    for e in res["emitted"]:
                        print(f"      [{e.alert.incident_id}] {e.alert.line()}")
                if not getattr(a, "keep", False):
                    shutil.rmtree(d, ignore_errors=True)
            print("", flush=True)
            print(f"== family {fam}, {order}")
            report(scored)
            print("", flush=True)
    print(f"({time.perf_counter() - t_all:.0f}s)\n")
    if not getattr(a, "data_dir", None) and not getattr(a, "keep", False):
        shutil.rmtree(base, ignore_errors=True)
    print("== summary")
    t = summary(results)
    if getattr(a, "json", None):
        Path(a.json).write_text(json.dumps({"totals": t, "columns": COLUMNS,
                                            "rows": {f"{f}/{o}": table_rows(v) for (f, o), v in results.items()}},
                                           indent=2, default=str) + "\n")
    return 0 if t["targets_met"] else 1


# --------------------------------------------------------------------------- CLI

def register(subparsers) -> None:
    """Add ``stepwatch eval`` to the CLI's subparsers (the entry point ``eval`` of the group ``stepwatch.commands``)."""
    e = subparsers.add_parser("eval", help="run the labelled scenario suite through the processor and "
                                           "score the detectors")
    e.add_argument("--only", help="comma-separated substrings of scenario names to run")
    e.add_argument("--no-large", dest="large", action="store_false", help="skip the 16,384-rank scenarios")
    e.add_argument("--show-alerts", action="store_true", help="print every alert as emitted")
    e.add_argument("--json", help="also write the table and totals here")
    e.add_argument("--data-dir", default=None, help="where the processors store (default: a temporary folder)")
    e.add_argument("--keep", action="store_true", help="keep each scenario's store")
    e.add_argument("--list", action="store_true", help="list the scenarios and exit")
    e.add_argument("--family", choices=("all", "sim", "indep"), default="all",
                   help="scenario family: the simulator's (sim), the independent producer's (indep), or both")
    e.add_argument("--order", choices=("both", "in-order", "shuffled"), default="both",
                   help="consumer order: produce order, a consumer-group shuffle, or both")
    e.add_argument("--seed", type=int, default=0, help="add this to every scenario's seed (other draws of "
                                                        "the same suite)")
    e.add_argument("--sweep", type=int, default=0, metavar="N",
                   help="instead: N random scenarios (noise law, ranks, step time, delivery and fault drawn at "
                        "random; --seed for other draws): false incidents per 10,000 clean job-steps and power "
                        "against effect / noise")
    e.add_argument("--sweep-max-ranks", type=int, default=256, help="largest job the sweep draws (power of two, "
                                                                      "up to 16384)")
    e.add_argument("--spool", default=None, help="with --real: score runs a node agent spooled on another machine "
                                                 "(the GPU runs of docs/eval.md)")
    e.add_argument("--real", action="store_true", help="instead: real training runs on this machine (gloo DDP/FSDP "
                                                       "under stepwatch wrap) with real injected faults, scored the "
                                                       "same way (needs torch; minutes)")
    e.set_defaults(func=_cmd_eval)


def _cmd_eval(a) -> int:
    if getattr(a, "sweep", 0):
        from stepwatch.devtools.evalsweep import run_sweep
        return run_sweep(a)
    if getattr(a, "real", False):
        from stepwatch.devtools.evalreal import run_real, runs
        if getattr(a, "list", False):
            for r in runs():
                print(f"real  {r.name:<16} {r.nproc} ranks  {r.note}")
            return 0
        return run_real(a)
    if getattr(a, "list", False):
        for fam, scen in _families(a).items():
            for s in scen:
                what = " ".join(f if isinstance(f, str) else ",".join(f"{k}={v}" for k, v in f.items())
                                for f in s.faults) or "clean"
                print(f"{fam:<5} {s.name:<22} {s.ranks:>6,} ranks  pp={s.pp}  {what}"
                      + (f"  ({s.note})" if s.note else ""))
        return 0
    return run_eval(a)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="stepwatch-eval")
    sub = p.add_subparsers(dest="cmd")
    register(sub)
    b = sub.add_parser("bench-detectors")
    b.add_argument("--ranks", type=int, default=16384)
    b.add_argument("--bench-steps", type=int, default=200)
    b.set_defaults(func=run_detector_bench)
    a = p.parse_args(argv)
    if not getattr(a, "func", None):
        p.print_help()
        return 2
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())

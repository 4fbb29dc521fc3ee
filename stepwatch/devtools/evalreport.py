"""The eval's table and totals report, shared by the scenario families (:mod:`.evalcli`), the real runs
(:mod:`.evalreal`) and the sweep."""
from __future__ import annotations

import sys

from stepwatch.devtools.eval import TARGETS, _target_ok, totals


def _fmt_table(cols: list[str], rows: list[list]) -> str:
    w = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(str(c)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(str(v).ljust(w[i]) for i, v in enumerate(vals)).rstrip()  # noqa: E731
    return "\n".join([line(cols), line(["-" * x for x in w])] + [line(r) for r in rows])


def _yn(v) -> str:
    return "n/a" if v is None else ("right" if v else "WRONG")


def table_rows(scored) -> list[list]:
    rows = []
    for res, s in scored:
        sc = res["scenario"]
        fl = s["faults"]
        if not fl:
            rows.append([sc.name, f"{sc.ranks:,}", "clean", "-", "-", "-", len(s["false"]), "-", "-", "-", "-", "-",
                         ",".join(sorted({a.kind for a in s["false"]})) or "-"])
            continue
        for i, f in enumerate(fl):
            lab = f["label"]
            what = lab["kind"] + (f" {lab['pct']:g}%" if lab["kind"] not in ("rank-hang", "job-hang") else "")
            if lab.get("phase"):
                what += f" {lab['phase']}"
            if lab.get("every"):
                what += f" 1/{lab['every']}"
            rows.append([
                sc.name if i == 0 else "", f"{sc.ranks:,}" if i == 0 else "", what,
                "found" if f["found"] else "MISSED",
                f["first_kind"] if f["found"] else "-",
                f["incidents"] if f["found"] else "-",
                len(s["false"]) if i == 0 else "",
                _yn(f["localised"]) if f["found"] else "-",
                _yn(f["cause_ok"]) if f["found"] else "-",
                (f"{f['delay_steps']:g}" + (f"/{f['emit_steps']:g}" if "emit_steps" in f else "")) if f["found"] else "-",
                f"{f['delay_s']:.1f}" if f["found"] else "-",
                ("-" if "diagnosis_ok" not in f else _yn(f["diagnosis_ok"])),
                (",".join(sorted({a.kind for a in s["false"]})) or "-") if i == 0 else "",
            ])
    return rows


COLUMNS = ["scenario", "ranks", "fault", "result", "first alert", "incidents", "false", "localisation", "cause",
           "delay steps (decided/emitted)", "delay s", "diagnosis", "false alarm kinds"]


def report(scored, out=sys.stdout, targets=None, applies=None) -> dict:
    print(_fmt_table(COLUMNS, table_rows(scored)), file=out)
    t = totals(scored)
    print("", file=out)
    print(f"faults of >= 5% effect: {t['found_ge5']}/{t['faults_ge5']} found   recall {t['recall']:.3f}", file=out)
    print(f"incidents: {t['incidents_tp']} right, {t['incidents_fp']} false   precision {t['precision']:.3f}   "
          f"incidents per fault {t['incidents_per_fault']:.2f} (max {t['incidents_per_fault_max']})", file=out)
    print(f"alerts: {t['alerts_tp']} matched a fault, {t['alerts_fp']} matched none (alert precision "
          f"{t['alert_precision']:.3f}); false job_hang {t['false_job_hang']}", file=out)
    print(f"right rank/node {t['localised']:.3f} of found   right cause {t['cause']:.3f} "
          f"(of {t['cause_n']} with a cause in the taxonomy)", file=out)
    print(f"median delay {t['median_delay_steps']:g} steps ({t['median_delay_s']:.1f} s; newest step seen at "
          f"emission: {t['median_emit_steps']:g}); 5% stragglers: {t['delay_5pct_steps']:g} steps (at emission "
          f"{t['emit_5pct_steps']:g}); 3% faults: "
          f"{t['small_found']}/{t['small_n']} found, delay {t['small_delay_steps']:g} steps", file=out)
    if t["hang_n"]:
        print(f"hangs (not in the median: their delay is the hang threshold, 30 s): {t['hang_n']} found, delay "
              f"median {t['hang_delay_median_s']:.1f} s, max {t['hang_delay_max_s']:.1f} s", file=out)
    if t.get("crash_n"):
        print(f"crashes: {t['crash_n']} found, named at most {t['crash_delay_max_s']:.1f} s after the rank's last "
              f"step", file=out)
    print(f"alerts on clean scenarios {t['clean_alerts']}   pipeline-stage false positives {t['stage_fp']}", file=out)
    t["diagnosis_missed"] = t["diagnosis_n"] - t["diagnosis_ok"]
    if t["diagnosis_n"]:
        print(f"efficiency diagnoses (kind and remedy text): {t['diagnosis_ok']}/{t['diagnosis_n']} right", file=out)
    applies = {"small_delay_steps": t["small_n"] > 0, "stage_fp": True, "delay_5pct_steps": t["n_5pct"] > 0,
               "hang_delay_max_s": t["hang_n"] > 0, "median_delay_steps": t["delay_n"] > 0 or not t["hang_n"],
               "crash_delay_max_s": t.get("crash_n", 0) > 0, **(applies or {})}
    fails = [f"{k} {op} {x}" for k, op, x in (targets or TARGETS)
             if applies.get(k, True) and not _target_ok(t[k], op, x)]
    print("targets: " + ("all met" if not fails else "NOT MET: " + "; ".join(fails)), file=out)
    t["targets_met"] = not fails
    return t

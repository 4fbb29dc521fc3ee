"""`stepwatch eval` on a small subset: the same code path (encoded messages -> Processor.process_message ->
alignment -> detectors -> alerts) and the same scoring as the full suite, at 128 ranks."""
from __future__ import annotations

import argparse
import io
import json

import numpy as np
import pytest

from stepwatch.devtools.eval import run_detector_bench, run_scenario, score, totals
from stepwatch.devtools.evalcli import register
from stepwatch.devtools.evalreport import report
from stepwatch.devtools.evalsuite import SCENARIOS, Scenario

pytestmark = [pytest.mark.unit, pytest.mark.slow]

SMALL = [
    Scenario("t-clean-pp2", [], ranks=128, steps=120, seed=1, pp=2, checkpoint_every=20),
    Scenario("t-slow", ["slow-rank:rank=77,pct=20,start=40,end=80"], ranks=128, steps=110, seed=2),
    Scenario("t-contention", ["cpu-contention:rank=50,pct=25,start=40"], ranks=128, steps=100, seed=3),
    Scenario("t-comm-group", ["comm-slow:rank=5,pct=15,start=40"], ranks=128, steps=100, seed=4, tp=8, comm=True),
    Scenario("t-regress", ["regression:start=40,end=80,pct=15,cause=io"], ranks=128, steps=110, seed=5),
    Scenario("t-gc-jitter", ["gc-jitter:start=40,pct=30"], ranks=128, steps=110, seed=6),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for sc in SMALL:
        res = run_scenario(sc, tmp_path_factory.mktemp(sc.name))
        out[sc.name] = (res, score(res))
    return out


def only_fault(results, name):
    res, s = results[name]
    assert len(s["faults"]) == 1 and s["false"] == [], [a.line() for a in s["false"]]
    return s["faults"][0]


def test_clean_pipeline_job_gives_no_alert(results):
    res, s = results["t-clean-pp2"]
    assert s["firing"] == [] and s["stage_fp"] == []
    assert res["step_rows"] == 128 * 120


def test_straggler_found_named_with_cause_and_resolved(results):
    f = only_fault(results, "t-slow")
    assert f["found"] and f["localised"] and f["cause_ok"] and f["first_kind"] == "slow_rank"
    assert 0 <= f["delay_steps"] <= 6 and f["delay_s"] > 0
    res, _ = results["t-slow"]
    assert [e.alert.status for e in res["emitted"]] == ["firing", "resolved"]


def test_cpu_contention_is_one_node_alert_naming_the_process(results):
    f = only_fault(results, "t-contention")
    assert f["found"] and f["localised"] and f["cause_ok"] and f["first_kind"] == "slow_node"
    a = f["alerts"][0]
    assert a.ranks == list(range(48, 56))
    assert a.evidence["host"]["foreign"][0]["name"] == "monitor-plugin"
    assert "monitor-plugin" in a.evidence["cause_reason"]


def test_comm_slowdown_of_one_dp_group_is_one_group_alert(results):
    f = only_fault(results, "t-comm-group")
    assert f["found"] and f["localised"] and f["cause_ok"] and f["first_kind"] == "slow_group"
    a = f["alerts"][0]
    assert sorted(a.ranks) == list(range(5, 128, 8)) and a.cause == "communication"
    assert a.evidence["comm"]["ops"][0]["groups"] == ["dp5"]


def test_regression_and_recovery_both_match_with_cause(results):
    f = only_fault(results, "t-regress")
    assert f["found"] and f["localised"] and f["cause_ok"]
    assert [a.kind for a in f["alerts"] if a.kind in ("regression", "recovery")] == ["regression", "recovery"]
    # the efficiency detectors report the same fault: MFU fell, and the DataLoader queue ran empty (io)
    assert sorted({a.kind for a in f["alerts"]} - {"regression", "recovery"}) <= ["dataloader_starved", "mfu_regression"]


def test_gc_jitter_is_jitter_with_cause_gc(results):
    f = only_fault(results, "t-gc-jitter")
    assert f["found"] and f["cause_ok"] and f["first_kind"] == "jitter" and f["localised"]


def test_totals_and_table(results):
    scored = list(results.values())
    t = totals(scored)
    assert t["recall"] == 1.0 and t["precision"] == 1.0 and t["clean_alerts"] == 0
    buf = io.StringIO()
    t2 = report(scored, out=buf)
    text = buf.getvalue()
    assert "t-contention" in text and "slow_node" in text and "recall 1.000" in text
    # one incident per fault, no false incident, no false hang (the delay goals belong to the change-point
    # and straggler sensitivity: reported, not asserted here)
    assert t2["incidents_per_fault_max"] == 1 and t2["incidents_fp"] == 0 and t2["false_job_hang"] == 0
    assert "targets: " in text and "incidents per fault 1.00 (max 1)" in text
    json.dumps(t2, default=str)


def test_suite_has_what_the_issue_asks_for():
    names = [s.name for s in SCENARIOS]
    assert len(SCENARIOS) >= 20 and len(set(names)) == len(names)
    assert sum(s.ranks == 16384 for s in SCENARIOS) >= 3
    kinds = {f.split(":")[0] for s in SCENARIOS for f in s.faults}
    assert kinds >= {"slow-rank", "gc-storm", "gc-jitter", "data-stall", "cpu-contention", "comm-slow",
                     "regression", "rank-hang", "job-hang"}
    pcts = {float(f.split("pct=")[1].split(",")[0]) for s in SCENARIOS for f in s.faults if f.startswith("slow-rank")}
    assert {3.0, 5.0, 10.0, 30.0} <= pcts
    assert any("every=" in f for s in SCENARIOS for f in s.faults)
    assert any(s.pp > 1 and s.faults for s in SCENARIOS) and sum(not s.faults for s in SCENARIOS) >= 3


def test_cli_registration_and_detector_bench(capsys):
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["eval", "--only", "slow", "--no-large", "--json", "x.json"])
    assert a.only == "slow" and a.large is False and callable(a.func)
    # the bench's exit code says whether the 50 ms/step budget held on this machine: a figure, not
    # something a shared CI machine can promise, so only that it ran and printed its table is checked here
    assert run_detector_bench(argparse.Namespace(ranks=256, bench_steps=60)) in (0, 1)
    out = capsys.readouterr().out
    assert "ms/step for all detectors" in out and "256 ranks" in out
    assert "slow_rank" in out and "changepoint" in out


# ----------------------------------------------------------------------------- the independent family
def test_consumer_order_keeps_each_partition_in_order_and_reads_topics_far_apart():
    from stepwatch.devtools.scenarios_indep import IndepJob, IndepScenario, deliveries
    job = IndepJob(IndepScenario("t-order", [], ranks=64, steps=200, seed=4))
    msgs = job.messages()
    order, deliver = deliveries(msgs, shuffle=True, seed=4)
    assert sorted(order) == list(range(len(msgs)))
    prod = np.array([m.produce_ns for m in msgs])
    assert (deliver >= prod).all()                                   # nothing read before it is produced
    pos = {i: k for k, i in enumerate(order)}
    for src in {(m.kind, m.partition) for m in msgs}:
        idx = sorted((i for i, m in enumerate(msgs) if (m.kind, m.partition) == src), key=lambda i: (prod[i], i))
        assert [pos[i] for i in idx] == sorted(pos[i] for i in idx)   # offset order within a partition
    # at some point the host samples read are far (> 30 s of event time) ahead of the steps read
    newest = {"host": 0, "steps": 0}
    lead = 0
    for i in order:
        m = msgs[i]
        if m.kind in newest:
            newest[m.kind] = max(newest[m.kind], m.produce_ns)
            if newest["steps"]:
                lead = max(lead, newest["host"] - newest["steps"])
    assert lead > 30e9
    assert {m.kind for m in msgs} == {"topology", "steps", "host", "gc", "comm"}
    assert len({m.partition for m in msgs}) > 1                      # the job's topics on several partitions
    in_order, _ = deliveries(msgs, shuffle=False)
    assert [msgs[i].produce_ns for i in in_order] == sorted(prod.tolist())


@pytest.mark.parametrize("shuffle", [False, True])
def test_independent_family_through_the_processor(tmp_path, shuffle):
    from stepwatch.devtools.scenarios_indep import IndepScenario
    scen = [IndepScenario("t-clean-pp4", [], ranks=128, pp=4, steps=160, seed=7),
            IndepScenario("t-strag", [dict(kind="straggler", rank=77, pct=20, start=50, end=110)], ranks=128,
                          steps=160, seed=8),
            IndepScenario("t-hang", [dict(kind="hang", rank=30, start=90)], ranks=128, steps=160, seed=9)]
    out = {}
    for sc in scen:
        res = run_scenario(sc, tmp_path / f"{sc.name}-{shuffle}", shuffle=shuffle)
        out[sc.name] = (res, score(res))
    res, s = out["t-clean-pp4"]
    assert s["firing"] == [], [a.line() for a in s["false"]]
    _, s = out["t-strag"]
    [f] = s["faults"]
    assert f["found"] and f["localised"] and f["cause_ok"] and f["incidents"] == 1 and s["inc_false"] == 0
    # delay: the step the evidence sufficed at, never after what the processor had seen when it emitted
    assert f["alerts"][0].step_detected == 50 + f["delay_steps"] and 0 <= f["delay_steps"] <= f["emit_steps"]
    res, s = out["t-hang"]
    [f] = s["faults"]
    assert f["found"] and f["first_kind"] == "job_hang" and f["localised"] and s["false"] == []
    hang = f["alerts"][0]
    assert hang.ranks == [30] and hang.evidence["steps_read_to_end"] is True


def test_independent_suite_has_what_the_issue_asks_for():
    from stepwatch.devtools.scenarios_indep import SCENARIOS as INDEP, IndepJob
    kinds = {f["kind"] for s in INDEP for f in s.faults}
    assert kinds >= {"straggler", "intermittent", "phase", "cpu-hog", "hang"}
    assert {f["phase"] for s in INDEP for f in s.faults if f["kind"] == "phase"} >= {"comm", "data", "gc", "host"}
    assert any(f.get("end") for s in INDEP for f in s.faults if f["kind"] == "phase")          # with recovery
    assert any(f.get("nic_node") is not None for s in INDEP for f in s.faults)
    assert {f["pct"] for s in INDEP for f in s.faults if f["kind"] == "straggler"} >= {5, 30}
    assert sum(not s.faults for s in INDEP) >= 3 and any(s.pp > 1 and not s.faults for s in INDEP)
    assert all(s.steps_per_msg >= 5 for s in INDEP)
    # labels carry what the scoring needs
    lab = IndepJob(INDEP[[s.name for s in INDEP].index("comm-up-15-back")]).labels()[0]
    assert (lab["kind"], lab["phase"], lab["cause"], lab["start"], lab["end"], lab["scope"]) == \
        ("regression", "comm", "communication", 60, 210, "job")


def test_delay_is_the_deciding_step_and_emission_is_reported_beside_it():
    """A producer batching 5 steps per message: an alert decided at step 62 of a fault from 60 is
    emitted once the batch 60-64 is in. The delay is 2 steps (the evidence), the emission 4."""
    from types import SimpleNamespace

    from stepwatch.detectors.base import Alert
    from stepwatch.devtools.eval import Emitted
    lab = {"kind": "slow-rank", "pct": 10, "start": 60, "end": 100, "ranks": [7], "nodes": ["n0"],
           "scope": "rank", "cause": "computation"}
    a = Alert(job="j", kind="slow_rank", status="firing", step_first=60, step_detected=62, t_detected=0,
              ranks=[7], nodes=["n0"], cause="computation", severity="warning", evidence={}, cost_pct=1.0,
              suggestion="")
    starts = np.arange(120, dtype=np.int64) * 1_000_000_000
    res = {"labels": [lab], "emitted": [Emitted(a, 64, int(starts[65]), 0, int(starts[65]))],
           "step_starts": starts, "step_ms": 1000.0, "scenario": SimpleNamespace(pp=1, name="x", ranks=16)}
    s = score(res)
    [f] = s["faults"]
    assert (f["delay_steps"], f["emit_steps"]) == (2, 4)
    t = totals([(res, s)])
    assert t["median_delay_steps"] == 2 and t["median_emit_steps"] == 4

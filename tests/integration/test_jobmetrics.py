"""Per-job metrics (stream/jobmetrics.py) without servers: values, cardinality, lifecycle, exposition."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from promstack import PROMTOOL, promtool_check_metrics
from stepwatch.detectors.base import Alert
from stepwatch.stream.jobmetrics import JobMetrics
from testkit import make_block, make_ctx

pytestmark = pytest.mark.integration


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def samples(reg, job=None):
    out = []
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            if job is None or s.labels.get("job") == job:
                out.append(s)
    return out


def feed(jm, R, job, slow=7, steps=40, seed=0, block=4):
    ctx = make_ctx(R, job=job)
    rng = np.random.default_rng(seed)
    for b in range(0, steps, block):
        comp = 100 + rng.normal(0, 1.0, (block, R))
        comp[:, slow] *= 1.3
        jm.on_block(ctx, make_block(np.arange(b, b + block), comp))
    return ctx


def test_values_and_the_slow_rank_first():
    reg = CollectorRegistry()
    jm = JobMetrics(reg, top_k=3)
    feed(jm, 64, "a")
    s = {(x.name, x.labels.get("quantile"), x.labels.get("rank")): x.value for x in samples(reg, "a")}
    p50 = s[("stepwatch_job_step_duration_seconds", "0.5", None)]
    assert 0.1 < p50 < 0.2 and p50 <= s[("stepwatch_job_step_duration_seconds", "1", None)]
    assert s[("stepwatch_job_step_duration_seconds_count", None, None)] == 40
    assert s[("stepwatch_job_ranks_reporting", None, None)] == 64 and s[("stepwatch_job_last_step", None, None)] == 39
    slow = [(r, v) for (n, _, r), v in s.items() if n == "stepwatch_job_slowest_rank_busy_seconds"]
    assert len(slow) == 3 and max(slow, key=lambda x: x[1])[0] == "7"
    assert s[("stepwatch_job_busy_spread_ratio", None, None)] > 0.2


def test_series_count_does_not_grow_with_ranks():
    reg = CollectorRegistry()
    jm = JobMetrics(reg)
    for R, job in ((64, "small"), (16384, "big")):
        feed(jm, R, job)
        jm.on_alert(Alert(job=job, kind="slow_rank", status="firing", step_first=3, step_detected=9, t_detected=1,
                          ranks=[7], nodes=["n"], cause="computation"))
    assert len(samples(reg, "small")) == len(samples(reg, "big"))


def test_alerts_firing_resolved_and_point_kinds_expire():
    clock = Clock()
    reg = CollectorRegistry()
    jm = JobMetrics(reg, point_hold_s=60, clock=clock)
    feed(jm, 16, "a", slow=3, steps=8)
    a = Alert(job="a", kind="slow_rank", status="firing", step_first=1, step_detected=5, t_detected=1, ranks=[3],
              cause="computation")
    jm.on_alert(a)
    jm.on_alert(a)                                          # a re-send (profile diff) does not count twice
    jm.on_alert(Alert(job="a", kind="regression", status="firing", step_first=2, step_detected=6, t_detected=2,
                      cause="io"))

    def firing():
        return {(x.labels["kind"], x.labels["cause"]): x.value for x in samples(reg, "a")
                if x.name == "stepwatch_job_alerts_firing"}
    assert firing() == {("slow_rank", "computation"): 1, ("regression", "io"): 1}
    jm.on_alert(Alert(**{**a.__dict__, "status": "resolved"}))
    clock.t += 61
    assert firing() == {("slow_rank", "computation"): 0, ("regression", "io"): 0}   # kept at 0 while the job lives


def test_a_job_that_ends_leaves_the_registry():
    clock = Clock()
    reg = CollectorRegistry()
    jm = JobMetrics(reg, job_ttl_s=300, clock=clock)
    feed(jm, 16, "old", steps=8)
    clock.t += 200
    feed(jm, 16, "new", steps=8)
    clock.t += 150
    assert jm.jobs() == ["new"] and not samples(reg, "old") and samples(reg, "new")
    jm.forget("new")
    assert jm.jobs() == [] and [x.value for x in samples(reg) if x.name == "stepwatch_job_metrics_jobs"] == [0]


def test_top_k_hysteresis_keeps_healthy_ranks_from_churning():
    """Healthy ranks a hair apart: after the warm-up the exported set hardly changes; a straggler
    that appears later still displaces the weakest at once."""
    reg = CollectorRegistry()
    jm = JobMetrics(reg, top_k=5)
    ctx = make_ctx(1024, job="h")
    rng = np.random.default_rng(1)
    seen = set()
    for b in range(0, 200, 2):
        comp = 100 + rng.normal(0, 1.0, (2, 1024))
        if b >= 120:
            comp[:, 500] *= 1.2
        jm.on_block(ctx, make_block(np.arange(b, b + 2), comp))
        seen |= set(jm._jobs["h"].top.tolist())
    assert 500 in jm._jobs["h"].top
    assert len(seen) <= 5 + 3, seen


def test_efficiency_and_comm_rows():
    reg = CollectorRegistry()
    jm = JobMetrics(reg)
    feed(jm, 16, "e", steps=4)
    eff = pa.table({"job": ["e", "e", "x"], "step": [0, 1, 0], "mfu": [0.4, 0.42, 0.1],
                    "wall_ms": [100.0, 110.0, 5.0], "productive_ms": [100.0, 99.0, 5.0],
                    "tokens": [1000.0, 1000.0, 1.0], "samples": [8.0, 8.0, 1.0]})
    jm.on_rows("efficiency", eff)
    bw = pa.table({"job": ["e"] * 3, "step_hi": [9, 19, 19], "op": ["all_reduce"] * 3,
                   "busbw_gbps": [10.0, 40.0, 20.0], "util": [0.2, 0.8, 0.4]})
    jm.on_rows("comm_bw", bw)
    jm.on_rows("steps", eff)                                        # other tables are ignored
    s = {(x.name, x.labels.get("op")): x.value for x in samples(reg, "e")}
    assert s[("stepwatch_job_mfu_ratio", None)] == pytest.approx(0.42)
    assert s[("stepwatch_job_goodput_ratio", None)] == pytest.approx(199 / 210)
    assert s[("stepwatch_job_tokens_total", None)] == 2000 and s[("stepwatch_job_samples_total", None)] == 16
    assert s[("stepwatch_job_bus_bandwidth_bytes_per_second", "all_reduce")] == pytest.approx(30e9)   # newest window
    assert s[("stepwatch_job_bus_bandwidth_peak_ratio", "all_reduce")] == pytest.approx(0.4)          # worst group


@pytest.mark.skipif(not PROMTOOL, reason="Debian's prometheus package (promtool) is not installed")
def test_exposition_passes_promtool_with_processor_and_agent_metrics():
    from stepwatch.agents.agent import AgentMetrics
    from stepwatch.stream.processor_metrics import ProcessorMetrics
    pm = ProcessorMetrics()
    jm = JobMetrics(pm.registry)
    feed(jm, 64, "a")
    jm.on_alert(Alert(job="a", kind="slow_rank", status="firing", step_first=1, step_detected=5, t_detected=1))
    pm.lag.labels("t", "0").set(3)
    from stepwatch.dashboards.alertmanager import AlertmanagerSink
    from stepwatch.dashboards.annotations import AnnotationSink
    sinks = [AlertmanagerSink(["http://127.0.0.1:9"], registry=pm.registry),      # their counters too
             AnnotationSink("http://127.0.0.1:9", "t", registry=pm.registry)]
    am = AgentMetrics()
    am.records_in.labels("steps").inc()
    am.plugin_seconds.labels("cpu").observe(0.01)
    try:
        for reg in (pm.registry, am.registry):
            text = generate_latest(reg)
            r = promtool_check_metrics(text)
            assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (r.stdout, r.stderr)
        assert b"stepwatch_alertmanager_alerts_sent_total" in generate_latest(pm.registry)
    finally:
        for s in sinks:
            s.close(0.1)

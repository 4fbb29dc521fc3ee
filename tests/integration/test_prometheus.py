"""Per-job metrics in the real Prometheus (Debian's 2.42 on a free loopback port).

One stack for the module: the real broker, a processor serving its metrics, a node agent (subprocess)
serving its own, and Prometheus scraping both every second. Two simulated jobs with the same slow
rank stream through: 1,024 ranks and 64 ranks. PromQL over the HTTP API then finds the job's step
time and the slow rank among the top-k series, and the number of series per job is the same at both
sizes. The exporters' live output passes ``promtool check metrics``; the Prometheus-only Overview
dashboard's every query returns data.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import pytest

from promstack import (MISSING_PROM, PROMETHEUS, PROMTOOL, Prometheus, free_port, http_get, promtool_check_metrics,
                       wait_until)
from stepwatch.devtools.simsend import send_simulation
from stepwatch.devtools.simulate import Simulation
from stepwatch.kafkaio import KafkaSettings, ensure_topics, make_producer, send_table
from stepwatch.stream.processor import Processor

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not (PROMETHEUS and PROMTOOL), reason=MISSING_PROM)]

SIZES = {"pj1024": (1024, 777), "pj64": (64, 37)}      # job -> (ranks, slow rank)
STEPS = 70
SCRAPE = "1s"


@pytest.fixture(scope="module")
def stack(broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("promstack")
    kafka = KafkaSettings(bootstrap=broker.bootstrap, prefix=f"prom{uuid.uuid4().hex[:6]}.", partitions=2)
    ensure_topics(kafka)
    proc = Processor(kafka, tmp / "data", group="g-prom", flush_interval_s=0.3, lateness_s=2.0, idle_close_s=2.0,
                     on_alert=lambda a: None, profiling=None)
    mport, aport = free_port(), free_port()
    server, _ = proc.metrics.serve(mport)
    stop = threading.Event()
    th = threading.Thread(target=proc.run, kwargs={"stop_event": stop}, daemon=True)
    th.start()
    agent = subprocess.Popen([sys.executable, "-m", "stepwatch.agents.commands", "agent", "--bootstrap", broker.bootstrap,
                              "--topic-prefix", kafka.prefix, "--socket-dir", str(tmp / "agent"), "--plugins", "load,mem",
                              "--interval", "0.5", "--metrics-port", str(aport), "--job", "agent-host"],
                             stdout=subprocess.DEVNULL, stderr=open(tmp / "agent.log", "wb"), start_new_session=True)
    prom = Prometheus(tmp / "prom").start([
        # honor_labels: the job metrics' own `job` label (the training job) wins over the scrape job's
        {"job_name": "stepwatch-processor", "honor_labels": True,
         "static_configs": [{"targets": [f"127.0.0.1:{mport}"]}]},
        {"job_name": "stepwatch-agent", "static_configs": [{"targets": [f"127.0.0.1:{aport}"]}]},
    ], interval=SCRAPE)
    try:
        sims = {job: Simulation(job=job, ranks=ranks, steps=STEPS, step_ms=200.0, seed=11, comm=True,
                                faults=[f"slow-rank:rank={slow},pct=30,start=10"])
                for job, (ranks, slow) in SIZES.items()}
        prod = make_producer(kafka)
        for sim in sims.values():                    # topologies first, as agents send them when a job starts
            for f in send_table(prod, kafka, "topology", sim.topology()):
                f.get(30)
        wait_until(lambda: all(j in proc.jobs and proc.jobs[j].state.world_size == SIZES[j][0] for j in SIZES),
                   60, "the processor to know both topologies")
        sent = {}

        def stream(job):                             # live: each step sent when its t_end is reached
            sent[job] = send_simulation(sims[job], prod, kafka, rows_per_message=4096, pace=True)["steps"]
        senders = [threading.Thread(target=stream, args=(j,)) for j in sims]
        for t in senders:
            t.start()
        for t in senders:
            t.join(120)
        prod.close()
        sent = sum(sent.values())
        wait_until(lambda: proc.metrics.value(proc.metrics.records_out, "steps") >= sent
                   and all(j in proc.jobs and proc.jobs[j].state.open_steps() == 0 for j in SIZES),
                   240, "the processor to store and close every step")
        wait_until(lambda: all(prom.query(f'stepwatch_job_last_step{{job="{j}"}} == {STEPS - 1}') for j in SIZES),
                   30, "Prometheus to scrape the last step of both jobs")
        time.sleep(2.5)                                        # two more scrapes of the final values
        yield {"prom": prom, "proc": proc, "mport": mport, "aport": aport, "agent": agent}
    finally:
        prom.stop()
        if agent.poll() is None:
            agent.terminate()
            agent.wait(15)
        stop.set()
        th.join(30)
        server.shutdown()


def _value(res) -> float:
    assert len(res) == 1, res
    return float(res[0]["value"][1])


def test_step_time_and_the_slow_rank_among_the_top_k(stack):
    prom = stack["prom"]
    for job, (ranks, slow) in SIZES.items():
        p50 = _value(prom.query(f'stepwatch_job_step_duration_seconds{{job="{job}",quantile="0.5"}}'))
        p99 = _value(prom.query(f'stepwatch_job_step_duration_seconds{{job="{job}",quantile="0.99"}}'))
        mx = _value(prom.query(f'stepwatch_job_step_duration_seconds{{job="{job}",quantile="1"}}'))
        assert 0.18 < p50 < 0.4 and p50 <= p99 <= mx, (job, p50, p99, mx)
        mean = _value(prom.query(f'stepwatch_job_step_duration_seconds_sum{{job="{job}"}} / '
                                 f'stepwatch_job_step_duration_seconds_count{{job="{job}"}}'))
        assert 0.18 < mean < 0.4
        assert _value(prom.query(f'stepwatch_job_ranks_reporting{{job="{job}"}}')) == ranks
        top = prom.query(f'topk(5, stepwatch_job_slowest_rank_busy_seconds{{job="{job}"}})')
        assert 1 <= len(top) <= 5
        best = max(top, key=lambda r: float(r["value"][1]))
        assert best["metric"]["rank"] == str(slow), top                   # the slow rank leads the top k
        assert best["metric"]["node"] == f"node-{slow // 8:04d}"
        assert _value(prom.query(f'stepwatch_job_busy_spread_ratio{{job="{job}"}}')) > 0.15
        firing = prom.query(f'stepwatch_job_alerts_firing{{job="{job}",kind="slow_rank"}}')
        assert sum(float(r["value"][1]) for r in firing) == 1, firing
        for name in ("jitter_ratio", "goodput_ratio", "bus_bandwidth_peak_ratio"):
            res = prom.query(f'stepwatch_job_{name}{{job="{job}"}}')
            assert res and all(0 <= float(r["value"][1]) <= 1.5 for r in res), (name, res)
        # the simulator's model FLOPs assume its 1 s default step: MFU is only checked to be there
        assert _value(prom.query(f'stepwatch_job_mfu_ratio{{job="{job}"}}')) > 0
        assert _value(prom.query(f'stepwatch_job_bus_bandwidth_bytes_per_second{{job="{job}",op="all_reduce"}}')) > 0


def test_series_per_job_do_not_grow_with_ranks(stack):
    """The job's series now (an instant query) are the same at 64 and at 1,024 ranks; every series the
    job ever created in Prometheus (the series API over the whole run) exceeds them by at most k (the
    top-k ranks' warm-up and hysteresis keep churn down)."""
    prom = stack["prom"]
    now, ever = {}, {}
    for job in SIZES:
        now[job] = int(_value(prom.query(f'count({{job="{job}"}})')))
        series = prom.series(f'{{job="{job}"}}')
        ever[job] = len(series)
        assert "stepwatch_job_slowest_rank_busy_seconds" in {s["__name__"] for s in series}
    print(f"\nseries per job in Prometheus: now {now}, created over the run {ever}")
    assert now["pj1024"] == now["pj64"] <= 30, now
    # churn of the top-k over the whole run stays within k extra series at either size
    assert all(now[j] <= ever[j] <= now[j] + 5 for j in SIZES), (now, ever)


def test_both_exporters_are_scraped_and_pass_promtool(stack):
    prom = stack["prom"]
    # "up" is the last scrape's: one that timed out on a loaded machine reads "down" until the next one
    wait_until(lambda: prom.targets_up() == {"stepwatch-processor": "up", "stepwatch-agent": "up"}, 30,
               f"both targets up: {prom.targets_up()}")
    assert _value(prom.query('up{job="stepwatch-agent"}')) == 1
    wait_until(lambda: prom.query('stepwatch_agent_kafka_up{job="stepwatch-agent"} == 1'), 20, "the agent's Kafka up")
    assert prom.query('stepwatch_processor_steps_closed_total{job="stepwatch-processor"}')
    for port in (stack["mport"], stack["aport"]):
        text = http_get(f"http://127.0.0.1:{port}/metrics")
        r = promtool_check_metrics(text)
        assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (port, r.stdout, r.stderr)


def test_prometheus_only_overview_queries_return_data(stack):
    from stepwatch.dashboards import promdash
    prom = stack["prom"]
    checks = promdash.promql_checks()
    assert checks
    for c in checks:
        expr = promdash.expand(c.expr, job="pj1024|pj64")
        res = prom.query(expr)
        if c.nonempty:
            assert res, f"{c.where}: {expr} returned nothing"
        jobs = {r["metric"].get("job") for r in res if "job" in r["metric"]}
        assert jobs <= set(SIZES), (c.where, jobs)

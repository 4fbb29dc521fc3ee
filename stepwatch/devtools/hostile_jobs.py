"""``stepwatch bench hostile --kind jobs``: many job ids through the real broker and ``stepwatch process``
(the ingest rate at the processor's job cap against the rate below it)."""
from __future__ import annotations

import json
import time

import numpy as np

from stepwatch.devtools.hostile import Item, _arrow, _hdr, _print_log_tail, send_items, steps_table


def many_jobs_stream(jobs: int, messages: int, prefix: str, ranks: int = 8,
                     now_ns: int | None = None) -> list[Item]:
    """``messages`` step messages (one step of ``ranks`` ranks each) cycling over ``jobs`` job ids:
    job ``i % jobs`` sends its next step. Past ``max_jobs`` ids every message is for a job evicted a
    while ago (the least recently active one): the worst case of eviction and re-creation."""
    now = (now_ns or time.time_ns()) - 3600 * 10**9
    out = []
    for i in range(messages):
        j, s = i % jobs, i // jobs
        job = f"{prefix}-{j}"
        t = steps_table(job, np.arange(ranks), np.full(ranks, s), now + s * 1_000_000_000 + j * 1000)
        out.append(Item("steps", _arrow(t, "lz4"), _hdr(), job.encode(), rows=None, label="job", codec="lz4"))
    return out


def _ingest_run(base, jobs: int, messages: int, limits: list[str], idle_exit: float) -> dict:
    """One ``stepwatch process`` run (a child process, its own broker and store) over
    :func:`many_jobs_stream`; returns its stats with messages/s and rows/s (first message read to
    last flush, wall and CPU time)."""
    import subprocess
    import sys

    from stepwatch.devtools.broker import EmbeddedBroker
    from stepwatch.kafkaio import KafkaSettings, ensure_topics

    base.mkdir(parents=True, exist_ok=True)
    items = many_jobs_stream(jobs, messages, prefix=f"j{jobs}")
    with EmbeddedBroker(log_path=base / "broker.log") as broker:
        # one partition: the processor reads the messages in the order sent (jobs cycling), not one
        # partition's jobs after another's (which would hide the churn)
        s = KafkaSettings(bootstrap=broker.bootstrap, prefix="jobs.", partitions=1)
        ensure_topics(s)
        t = time.perf_counter()
        send_items(items, s)
        sent_s = time.perf_counter() - t
        cmd = [sys.executable, "-m", "stepwatch.cli", "process", "--bootstrap", broker.bootstrap, "--topic-prefix",
               s.prefix, "--data-dir", str(base), "--group", "jobs", "--idle-exit", str(idle_exit),
               "--stats-json", str(base / "_stats.json")]
        for lim in limits:
            cmd += ["--limit", lim]
        with open(base / "_processor.log", "wb") as log_f:
            rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=log_f, timeout=3600).returncode
    if rc != 0:
        _print_log_tail(base / "_processor.log")
        raise RuntimeError(f"stepwatch process exited {rc} (jobs={jobs})")
    st = json.loads((base / "_stats.json").read_text())
    span = st["t_last_flush"] - st["t_first_data"]
    cpu = st["cpu_last_flush"] - st["cpu_first_data"]
    return dict(st, jobs_ids=jobs, messages=messages, sent_s=sent_s, span_s=span, cpu_s=cpu,
                msg_per_s=messages / span, rows_per_s=st["rows_in"] / span,
                msg_per_cpu_s=messages / cpu, rows_per_cpu_s=st["rows_in"] / cpu)


def run_jobs_bench(a) -> int:
    """``stepwatch bench hostile --kind jobs``: the same number of step messages from ``--jobs``
    job ids (past ``max_jobs``: jobs evicted and created again all the time) and from
    ``--baseline-jobs`` ids (all held), each through the embedded broker into ``stepwatch process``;
    prints messages/s and rows/s of each and their ratio. Fails when the ratio is under 0.8."""
    import tempfile
    from pathlib import Path

    base = Path(a.data_dir or tempfile.mkdtemp(prefix="stepwatch-jobs-"))
    messages = a.job_rounds * a.jobs
    limits = [f"max_jobs={a.max_jobs}"] if a.max_jobs else []
    print(f"stepwatch bench hostile --kind jobs: {messages:,} step messages (8 rows each) from {a.jobs:,} job ids "
          f"and from {a.baseline_jobs:,}; {' '.join(limits) or 'max_jobs default'}; data in {base}")
    res = {}
    for n in (a.baseline_jobs, a.jobs):
        r = res[n] = _ingest_run(base / f"jobs-{n}", n, messages, limits, a.idle_exit or 10.0)
        print(f"  {n:>7,} job ids: {r['msg_per_s']:8,.0f} messages/s {r['rows_per_s']:9,.0f} rows/s "
              f"(wall, {r['span_s']:.1f}s); per CPU second {r['msg_per_cpu_s']:8,.0f} messages "
              f"{r['rows_per_cpu_s']:9,.0f} rows; held at the end {r['jobs']:,}, evicted {r.get('jobs_evicted', 0):,.0f}, "
              f"rebuilds {r.get('rebuilds')}")
    b, m = res[a.baseline_jobs], res[a.jobs]
    wall, cpu = m["msg_per_s"] / b["msg_per_s"], m["msg_per_cpu_s"] / b["msg_per_cpu_s"]
    rows = m["rows_per_s"] / b["rows_per_s"]
    print(f"ratio {a.jobs:,} / {a.baseline_jobs:,} job ids: messages/s {wall:.2f}, rows/s {rows:.2f} "
          f"(per CPU second {cpu:.2f})")
    if max(wall, cpu) < 0.8:
        print("FAILED: ingest at the job cap is more than 20 % slower than below it")
        return 1
    print("OK: ingest at the job cap within 20 % of the rate below it")
    return 0

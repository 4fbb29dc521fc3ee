"""Real distributed training, end to end: 4 gloo ranks on CPU instrumented by ``stepwatch wrap`` (no
code change in the script) -> probe -> node agent (Unix socket) -> the embedded broker -> processor ->
Parquet/DuckDB -> a ``slow_rank`` alert naming the rank that was made slower.

The GC-pressure run of issue 4: one rank collects a large heap every step (real ``gc.collect()`` pauses
plus the automatic collections its reference cycles trigger, no sleep); the probe records them through
``gc.callbacks`` (``gc`` rows, the step's ``gc_ms``/``gc_count``) and ``slow_rank`` names that rank with
cause ``gc``.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from stepwatch.agents.agent import Agent
from stepwatch.storage.views import connect
from stepwatch.stream.processor import Processor

pytestmark = [pytest.mark.realrun, pytest.mark.slow]

pytest.importorskip("torch", reason="the distributed test trains a real PyTorch model (pip install torch==2.13.0)")

import trainrun  # noqa: E402 - tests/trainrun.py


class Running:
    """An agent and a processor on threads, stopped by ``close``."""

    def __init__(self, kafka, data: Path, socket_dir: str, node: str, group: str, **agent_kw):
        self.agent = Agent(kafka, socket_dir=socket_dir, node=node, interval_s=0.5,
                           spool_dir=data / "_agent_spool", **agent_kw).start()
        self.proc = Processor(kafka, data, group=group, flush_interval_s=0.3, on_alert=lambda a: None)
        self.stop_agent, self.stop_proc = threading.Event(), threading.Event()
        self.t_agent = threading.Thread(target=self.agent.run, args=(self.stop_agent,), daemon=True)
        self.t_proc = threading.Thread(target=self.proc.run, kwargs={"stop_event": self.stop_proc}, daemon=True)
        self.t_agent.start()
        self.t_proc.start()

    def stored_steps(self) -> float:
        m = self.proc.metrics
        return m.value(m.records_out, "steps")

    def wait_stored(self, n: int, job: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rt = self.proc.jobs.get(job)
            if self.stored_steps() >= n and rt is not None and rt.state.open_steps() == 0:
                time.sleep(0.5)             # one more flush
                return
            assert self.t_proc.is_alive() and self.t_agent.is_alive()
            time.sleep(0.2)
        pytest.fail(f"{self.stored_steps()} of {n} step rows stored after {timeout}s; agent {self.agent.stats()}")

    def wait_job_end(self, job: str, timeout: float = 30.0) -> float | None:
        """Seconds until the processor judged ``job``'s end (its ``job_end`` event), or None after
        ``timeout``: the end is judged ``settle_s`` of event time after the last rank ended, time the node's
        host samples carry on after the steps are stored (closing at once left no job_end to read)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if any(e.job == job and e.kind == "job_end" for e in list(self.proc.events)):
                return time.monotonic() - t0
            time.sleep(0.1)
        return None

    def close(self) -> None:
        self.stop_agent.set()
        self.t_agent.join(30)
        self.stop_proc.set()
        self.t_proc.join(30)
        assert not self.t_agent.is_alive() and not self.t_proc.is_alive()


def test_four_gloo_ranks_through_the_pipeline_name_the_slow_rank(kafka, tmp_path, socket_dir):
    job, steps, slow = "dist-gloo", 80, 2
    run = Running(kafka, tmp_path, socket_dir, node="node-a", group="g-dist")
    try:
        t0 = time.monotonic()
        stats, _ = trainrun.run(socket_dir, job, {"SW_NPROC": 4, "SW_STEPS": steps, "SW_STEP_MS": 50,
                                                  "SW_SLOW_RANK": slow, "SW_SLOW_EXTRA_MS": 20})
        train_s = time.monotonic() - t0
        # zero-code mode instrumented every rank (and only the ranks: the launcher sent nothing)
        assert sorted(stats) == [0, 1, 2, 3]
        for r, st in stats.items():
            assert st["job"] == job and st["steps"] == steps, st
            # counters read before destroy_process_group, which sends the steps still waiting
            assert st["dropped"] == 0 and st["sent"] + st["pending"] == steps, st
        run.wait_stored(4 * steps, job)
    finally:
        run.close()
    con = connect(tmp_path)
    n, uniq, ranks = con.execute("SELECT count(*), count(DISTINCT (rank, step)), count(DISTINCT rank) FROM steps "
                                 "WHERE job = ?", [job]).fetchone()
    assert n == uniq == 4 * steps and ranks == 4
    # (a rank says hello again when its identity grows: the dtype its model runs in, seen at its first forward)
    topo = con.execute("SELECT DISTINCT rank, node, world_size, device, framework FROM topology WHERE job = ? "
                       "ORDER BY rank", [job]).fetchall()
    assert [t[0] for t in topo] == [0, 1, 2, 3]
    assert all(t[1] == "node-a" and t[2] == 4 and t[3] == "cpu" and t[4].startswith("pytorch-") for t in topo)
    # what the probe measured: one all_reduce per rank per step, a real payload, the wait on the fast ranks
    n_ar, bytes_ar = con.execute("SELECT count(*), min(bytes) FROM comm WHERE job = ? AND op = 'all_reduce' "
                                 "AND step > 0", [job]).fetchone()
    n_params = 64 * 128 + 128 + 128 * 10 + 10
    assert n_ar == 4 * (steps - 1) and bytes_ar == 4 * n_params
    waits = dict(con.execute("SELECT rank, median(comm_wait_ms) FROM steps WHERE job = ? AND step > 0 GROUP BY rank",
                             [job]).fetchall())
    assert all(waits[r] > waits[slow] + 10 for r in waits if r != slow), waits
    busy = con.execute("SELECT rank FROM rank_busy WHERE job = ? ORDER BY busy_ms DESC LIMIT 1", [job]).fetchone()
    assert busy[0] == slow
    opt = con.execute("SELECT count(*) FROM steps WHERE job = ? AND element_at(phases, 'optimizer')[1] > 0",
                      [job]).fetchone()[0]
    assert opt == 4 * steps
    assert con.execute("SELECT count(*) FROM host WHERE job = ?", [job]).fetchone()[0] >= 1
    # the pipeline names the slow rank, and only it
    alerts = con.execute("SELECT ranks, nodes, cause FROM alerts WHERE job = ? AND kind = 'slow_rank' "
                         "AND status = 'firing'", [job]).fetchall()
    assert alerts and all(a[0] == [slow] for a in alerts), alerts
    assert alerts[0][1] == ["node-a"]
    assert con.execute("SELECT count(*) FROM deadletter").fetchone()[0] == 0
    print(f"training {train_s:.1f}s, waits {waits}, alerts {alerts}")


def test_gc_pressure_in_one_gloo_rank_is_named_with_cause_gc(kafka, tmp_path, socket_dir):
    job, steps, gc_rank = "dist-gc", 80, 1
    run = Running(kafka, tmp_path, socket_dir, node="node-a", group="g-dist-gc")
    try:
        t0 = time.monotonic()
        stats, _ = trainrun.run(socket_dir, job, {"SW_NPROC": 4, "SW_STEPS": steps, "SW_STEP_MS": 50,
                                                  "SW_GC_RANK": gc_rank})
        train_s = time.monotonic() - t0
        assert sorted(stats) == [0, 1, 2, 3]
        for st in stats.values():
            assert st["steps"] == steps and st["dropped"] == 0, st
        run.wait_stored(4 * steps, job)
    finally:
        run.close()
    con = connect(tmp_path)
    # the probe measured real collections: many gc rows on the GC rank, few elsewhere
    rows = dict(con.execute("SELECT rank, count(*) FROM gc WHERE job = ? GROUP BY rank", [job]).fetchall())
    assert rows.get(gc_rank, 0) >= 3 * steps, rows
    assert all(rows.get(r, 0) * 10 <= rows[gc_rank] for r in range(4) if r != gc_rank), rows
    full = con.execute("SELECT count(*), median(duration_ms) FROM gc WHERE job = ? AND rank = ? AND generation = 2",
                       [job, gc_rank]).fetchone()
    assert full[0] >= steps - 1 and full[1] > 2.0, full
    # ... and in the step records: the GC rank's gc_ms far above its peers', its collections counted
    med = {r: (g, c) for r, g, c in con.execute(
        "SELECT rank, median(gc_ms), median(gc_count) FROM steps WHERE job = ? AND step > 0 GROUP BY rank",
        [job]).fetchall()}
    g_ms, g_n = med[gc_rank]
    assert g_ms > 5.0 and g_n >= 2, med
    assert all(med[r][0] * 5 < g_ms for r in med if r != gc_rank), med
    busy = con.execute("SELECT rank FROM rank_busy WHERE job = ? ORDER BY busy_ms DESC LIMIT 1", [job]).fetchone()
    assert busy[0] == gc_rank
    # the pipeline names the GC rank, and only it, with cause gc: its slow_rank alert says gc, and any
    # other alert naming it (a jitter of its pauses, decided on its own from the slow steps' phases, can
    # split GC pause and host CPU gap 50/50 when 4 ranks share 2 cores) is a consequence in that incident
    alerts = con.execute("SELECT kind, ranks, cause, incident_id FROM alerts WHERE job = ? AND status = 'firing' "
                         "AND kind IN ('slow_rank', 'jitter')", [job]).fetchall()
    named = [a for a in alerts if gc_rank in (a[1] or [])]
    roots = {a[3] for a in named if a[0] == "slow_rank" and a[2] == "gc"}
    rt = run.proc.jobs.get(job)
    assert roots and all(a[2] == "gc" for a in named if a[0] == "slow_rank") \
        and all(a[3] in roots for a in named), (alerts, rt and dict(
            topology_known=rt.state.topology_known, held_steps=sum(len(b) for b in rt.pending),
            open_steps=rt.state.open_steps(), max_step=rt.state.max_step,
            steps_to_detectors=run.proc.metrics.value(run.proc.metrics.steps_closed),
            alerts_emitted=[(a.kind, a.status, a.ranks, a.step_first) for a in run.proc.alerts if a.job == job]))
    assert all(a[1] == [gc_rank] for a in alerts if a[0] == "slow_rank"), alerts
    assert con.execute("SELECT count(*) FROM deadletter").fetchone()[0] == 0
    print(f"training {train_s:.1f}s, gc rows {rows}, gc_ms/gc_count medians {med}, alerts {alerts}")

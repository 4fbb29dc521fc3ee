"""Efficiency analytics on a real gloo training run (issue 9): the stored comm rows carry the payload
bytes and group size of every collective and the processor's ``comm_bw`` table a bandwidth per
collective; the DataLoader queue depth series differs between ``num_workers=0`` (nothing is ever
prefetched: all 0) and ``num_workers=2`` (batches are ready at some step starts)."""
from __future__ import annotations

import pytest

from stepwatch.storage.views import connect

pytestmark = [pytest.mark.realrun, pytest.mark.slow]

pytest.importorskip("torch", reason="trains a real PyTorch model (pip install torch==2.13.0)")

import trainrun  # noqa: E402 - tests/trainrun.py
from test_distributed import Running  # noqa: E402 - the agent+processor harness


def test_gloo_run_reports_bytes_bandwidth_and_dataloader_queue(kafka, tmp_path, socket_dir):  # noqa: F811
    steps = 30
    run = Running(kafka, tmp_path, socket_dir, node="node-e", group="g-eff")
    try:
        for nw in (0, 2):
            job = f"eff-nw{nw}"
            trainrun.run(socket_dir, job, {"SW_NPROC": 2, "SW_STEPS": steps, "SW_STEP_MS": 40, "SW_NUM_WORKERS": nw},
                         timeout=180)
            run.wait_stored(2 * (steps if nw == 0 else 2 * steps), job)
    finally:
        run.close()
    con = connect(tmp_path)
    # per-collective bytes and group size on the comm rows (the gradient all_reduce: 64x128+128+128x10+10 floats)
    ops = dict(con.execute("""SELECT op, max(bytes / count) FROM comm WHERE job = 'eff-nw0' AND count > 0
                              GROUP BY op""").fetchall())
    assert ops["all_reduce"] == (64 * 128 + 128 + 128 * 10 + 10) * 4
    assert con.execute("SELECT min(group_size), max(group_size) FROM comm WHERE job = 'eff-nw0' "
                       "AND op = 'all_reduce'").fetchone() == (2, 2)
    bw = con.execute("""SELECT count(*), min(busbw_gbps), max(bytes_per_call), any_value(link) FROM comm_bw
                        WHERE job = 'eff-nw0' AND op = 'all_reduce'""").fetchone()
    assert bw[0] >= 1 and bw[1] > 0 and bw[2] == ops["all_reduce"] and bw[3] == "loopback"
    # the DataLoader queue depth series: single-process loader all 0; two workers have batches ready
    q0 = [r[0] for r in con.execute("SELECT data_queue FROM steps WHERE job = 'eff-nw0' ORDER BY step, rank").fetchall()]
    q2 = [r[0] for r in con.execute("SELECT data_queue FROM steps WHERE job = 'eff-nw2' ORDER BY step, rank").fetchall()]
    assert q0 and all(v == 0 for v in q0), q0
    assert sum(v is not None and v > 0 for v in q2) >= len(q2) // 2, q2
    eff = con.execute("SELECT count(*), avg(data_queue_p50) FROM efficiency WHERE job = 'eff-nw2'").fetchone()
    assert eff[0] >= steps - 2 and eff[1] > 0

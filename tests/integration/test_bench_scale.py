"""``stepwatch bench scale`` runs end to end at a tiny size (a real broker, a real ``stepwatch process``
child, a real lake) and its figures are sane; the figures at 16,384 and 100,000 ranks come from running
the bench (docs/processor.md), not from here."""
from __future__ import annotations

import json
import math

from stepwatch.cli import main

import pytest
pytestmark = pytest.mark.integration


def test_bench_scale_tiny_job_end_to_end(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--ranks", "64", "--seconds", "5", "--drain", "30",
                 "--data-dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "step end -> queryable" in text and "consumer lag" in text and "kept up:" in text
    # every row sent was stored, every step became queryable
    assert r["rows_sent"]["steps"] == 64 * 5 and r["rows_sent"]["comm"] == 2 * 64 * 5
    assert r["rows_sent"]["host"] == 8 * 5
    assert r["rows_stored"] == r["rows_sent"]
    assert r["steps_queryable"] == 5 and r["complete"]
    # latencies: after the send, within the run plus the drain; percentiles ordered
    assert 0 < r["queryable_p50_s"] <= r["queryable_p99_s"] <= r["queryable_max_s"] < 35
    assert r["producer_late_p50_s"] >= 0
    assert r["rows_sent_per_s"] > 0 and r["rows_stored_per_s"] > 0
    assert r["lag_messages_p50"] >= 0 and r["lag_messages_p99"] >= r["lag_messages_p50"]
    assert r["messages_per_step"] == 4                       # steps, comm, host, gc: one message each
    # the processor's footprint: a real process of tens to hundreds of MB, a CPU share that is a share
    assert 30 < r["rss_peak_mb"] < 4000 and r["rss_end_mb"] <= r["rss_peak_mb"]
    assert 0 <= r["processor_cpu_share"] < 2 and not math.isnan(r["processor_cpu_share"])
    assert set(r["time_s"]) == {"decode", "align", "detectors", "flush"} and r["time_s"]["flush"] > 0
    assert isinstance(r["kept_up"], bool)

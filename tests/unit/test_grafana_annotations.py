"""AnnotationSink: every alert becomes a Grafana annotation (a region, tagged), delivery retries with
backoff through errors, and the caller is never blocked — even by a Grafana that hangs."""
from __future__ import annotations

import argparse
import gc
import threading
import time

from prometheus_client import CollectorRegistry

from grafana_fake import (T_DETECTED, T_FIRST, FakeGrafana, grafana, optional_spec,  # noqa: F401 (fixtures)
                          sample_alert)
from stepwatch.dashboards.annotations import AnnotationSink, annotation_payload
from stepwatch.dashboards.grafana_cmd import add_annotation_args, annotation_sink_from_args
from testkit import free_port

import pytest
pytestmark = pytest.mark.unit

T_FIRST, T_DET = T_FIRST, T_DETECTED
alert = sample_alert


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_payload_is_a_tagged_region_with_readable_text():
    p = annotation_payload(alert(), t_first_ns=T_FIRST)
    assert p["time"] == T_FIRST // 10**6 and p["timeEnd"] == T_DET // 10**6
    assert {"stepwatch", "job:j1", "kind:slow_rank", "cause:computation", "rank:13", "node:node-0001",
            "status:firing"} <= set(p["tags"])
    assert "rank 13 on node-0001" in p["text"] and "isolate slow nodes" in p["text"]
    assert "dashboardUID" not in p and "panelId" not in p
    a = alert()
    a.evidence["t_first_ns"] = T_FIRST
    assert annotation_payload(a)["time"] == T_FIRST // 10**6
    assert annotation_payload(alert())["time"] == T_DET // 10**6          # unknown start: a point
    assert annotation_payload(alert(), t_first_ns=T_DET + 10**9)["time"] == T_DET // 10**6


def test_firing_and_resolved_alerts_are_posted(grafana):
    reg = CollectorRegistry()
    sink = AnnotationSink(grafana.url, grafana.token, registry=reg)
    assert sink.submit(alert("firing"), t_first_ns=T_FIRST)
    assert sink(alert("resolved"), t_first_ns=T_FIRST)
    assert sink.close(5)
    assert [a["tags"][4] for a in grafana.annotations] == ["status:firing", "status:resolved"]
    assert all(a["time"] == T_FIRST // 10**6 and a["timeEnd"] == T_DET // 10**6 for a in grafana.annotations)
    assert reg.get_sample_value("stepwatch_grafana_annotations_sent_total") == 2
    assert reg.get_sample_value("stepwatch_grafana_annotations_dropped_total") == 0
    assert not sink.submit(alert()), "a closed sink accepts nothing"
    assert grafana.violations == []


def test_retries_with_backoff_until_grafana_answers(grafana):
    grafana.fail("POST", r"^/api/annotations$", 500, {"message": "database is locked"}, times=3)
    sink = AnnotationSink(grafana.url, grafana.token, backoff_s=0.02, backoff_max_s=0.1)
    t0 = time.monotonic()
    sink.submit(alert())
    assert sink.close(5)
    st = sink.stats()
    assert st["sent"] == 1 and st["retried"] == 3 and st["failed"] == 0
    assert [r.status for r in grafana.requests] == [500, 500, 500, 200]
    assert time.monotonic() - t0 >= 0.02 * (1 + 2 + 4)                # backoff 0.02, 0.04, 0.08 (+ jitter >= 0)
    assert len(grafana.annotations) == 1
    assert grafana.violations == []


def test_retries_through_connection_refused(optional_spec):
    port = free_port()                          # nothing listens: connection refused
    sink = AnnotationSink(f"http://127.0.0.1:{port}", FakeGrafana.token, backoff_s=0.02, backoff_max_s=0.05)
    sink.submit(alert())
    assert wait_for(lambda: sink.stats()["retried"] >= 2)
    g = FakeGrafana(spec=optional_spec).start(port=port)   # Grafana comes up
    try:
        assert sink.close(5)
        assert sink.stats()["sent"] == 1 and len(g.annotations) == 1
        assert g.violations == []
    finally:
        g.stop()


def test_submit_never_blocks_and_the_queue_is_bounded(grafana):
    release = threading.Event()
    grafana.fail("POST", r"^/api/annotations$", 200, {"id": 1, "message": "Annotation added"},
                 delay=10, release=release)          # the first request hangs until released
    sink = AnnotationSink(grafana.url, grafana.token, maxsize=5, timeout=10)
    sink.submit(alert())
    assert wait_for(lambda: len(grafana.requests) == 1)    # the worker is stuck in the request
    alerts = [alert(kind=f"k{i}") for i in range(600)]
    worst = []
    gc.disable()
    try:
        # best of 3 batches of 200: one OS preemption on a busy machine is not the sink blocking
        for batch in range(3):
            took = []
            for a in alerts[batch * 200:(batch + 1) * 200]:
                t = time.perf_counter()
                sink.submit(a)
                took.append(time.perf_counter() - t)
            worst.append(max(took))
            took.sort()
            assert took[len(took) * 99 // 100] < 0.001          # p99 of every batch
            if worst[-1] < 0.001:
                break
    finally:
        gc.enable()
    assert min(worst) < 0.001, f"submit took up to {min(worst) * 1e3:.3f} ms"
    submitted = 200 * len(worst)
    st = sink.stats()
    assert st["queued"] == 5 and st["dropped"] == submitted - 5
    release.set()
    assert sink.close(5)
    st = sink.stats()
    assert st["sent"] == 6 and st["dropped"] == submitted - 5 and st["failed"] == 0
    assert grafana.violations == []


def test_non_retryable_answers_are_counted_as_failed(grafana):
    grafana.fail("POST", r"^/api/annotations$", 400, {"message": "bad request"})
    sink = AnnotationSink(grafana.url, grafana.token, backoff_s=0.01)
    sink.submit(alert())
    sink.submit(alert("resolved"))
    assert sink.close(5)
    st = sink.stats()
    assert st["failed"] == 1 and st["sent"] == 1 and st["retried"] == 0


def test_close_gives_up_after_its_timeout(grafana):
    grafana.fail("POST", r"^/api/annotations$", 500, {"message": "down"}, times=10**6)
    sink = AnnotationSink(grafana.url, grafana.token, backoff_s=0.02, backoff_max_s=0.05)
    for _ in range(3):
        sink.submit(alert())
    t = time.monotonic()
    assert not sink.close(0.3)
    assert time.monotonic() - t < 2
    st = sink.stats()
    assert st["sent"] == 0 and st["failed"] == 3 and st["retried"] >= 1


def test_processor_flags_build_a_sink_used_as_on_alert(grafana, tmp_path):
    p = argparse.ArgumentParser()
    add_annotation_args(p)
    assert annotation_sink_from_args(p.parse_args([])) is None
    tok = tmp_path / "tok"
    tok.write_text(grafana.token)
    reg = CollectorRegistry()
    sink = annotation_sink_from_args(p.parse_args(["--grafana-url", grafana.url, "--grafana-token-file", str(tok)]),
                                     registry=reg)
    on_alert = sink                                  # what the processor calls for each alert
    on_alert(alert())
    assert sink.close(5) and len(grafana.annotations) == 1
    assert reg.get_sample_value("stepwatch_grafana_annotations_sent_total") == 1



def test_a_token_file_others_can_read_is_warned_about_and_a_rotated_one_is_used(grafana, tmp_path, caplog):
    """Issue 26 (low), as for Alertmanager's credentials file: ``--grafana-token-file`` at 0644 was
    accepted silently and read only at start, so after the token was rotated every annotation failed
    (401) until a restart. Now: a warning naming the flag and the mode (never the token); the file is
    read again when replaced; a file emptied mid-rewrite keeps the token in use. Neither the token nor the
    file's path is logged (docs/grafana.md)."""
    import os
    p = argparse.ArgumentParser()
    add_annotation_args(p)
    tok = tmp_path / "tok"
    tok.write_text(grafana.token + "\n")
    tok.chmod(0o644)
    caplog.set_level("DEBUG")
    caplog.set_level("DEBUG", logger="stepwatch.secrets")
    sink = annotation_sink_from_args(p.parse_args(["--grafana-url", grafana.url, "--grafana-token-file", str(tok)]),
                                     registry=CollectorRegistry())
    try:
        warned = [r.getMessage() for r in caplog.records if r.name == "stepwatch.secrets"]
        assert warned == ["--grafana-token-file: a secret file whose mode 0644 lets other users read or "
                          "change it (at most 0600: chmod 600 it)"], warned
        sink(alert())
        assert wait_for(lambda: len(grafana.annotations) == 1)
        grafana.token = "rotated-token-9876543210"          # Grafana now takes only the new token ...
        new = tmp_path / "tok.new"                            # ... which replaces the file, as a Secret does
        new.write_text(grafana.token + "\n")
        os.replace(new, tok)
        sink(alert(kind="jitter"))
        assert wait_for(lambda: len(grafana.annotations) == 2 or sink.stats()["failed"]), sink.stats()
        assert len(grafana.annotations) == 2 and sink.stats()["failed"] == 0, sink.stats()
        tok.write_text("")                                    # caught mid-rewrite: the token in use stays
        sink(alert(kind="rank_stall"))
        assert wait_for(lambda: len(grafana.annotations) == 3 or sink.stats()["failed"]), sink.stats()
        assert len(grafana.annotations) == 3 and sink.stats()["failed"] == 0, sink.stats()
    finally:
        sink.close(5)
    assert "rotated-token" not in caplog.text and "test-token" not in caplog.text and str(tok) not in caplog.text

def _with_diff(a, cmd_id="3f2a9c0e1b7d4a55"):
    """What the processor re-sends when a profile diff arrives (stream.profiling.alert_with_diff):
    the same alert_id and status, evidence.profile_diff added."""
    from stepwatch.stream.profiling import alert_with_diff
    return alert_with_diff(a, cmd_id, {
        "suspect_rank": 13, "reference_rank": 12, "faster": [], "totals": {},
        "slower": [{"name": "slow_op", "suspect_ms": 21.0, "reference_ms": 1.0, "delta_ms": 20.01, "ratio": 21.0},
                   {"name": "aten::tanh", "suspect_ms": 0.5, "reference_ms": 0.25, "delta_ms": 0.25, "ratio": 2.0}]})


def test_a_profile_diff_resend_updates_the_alerts_annotation_instead_of_adding_one(grafana):
    reg = CollectorRegistry()
    sink = AnnotationSink(grafana.url, grafana.token, registry=reg)
    first = alert("firing")
    sink.submit(first, t_first_ns=T_FIRST)
    sink.submit(_with_diff(first))                   # the processor's re-send: same alert_id, status firing
    sink.submit(_with_diff(first))                   # the same diff again: nothing new
    sink.submit(alert("firing"))                     # a plain duplicate
    sink.submit(alert("resolved"), t_first_ns=T_FIRST)   # another status: its own annotation
    sink.submit(_with_diff(first, "0123456789abcdef"))   # a second command's diff (another node)
    assert sink.close(5)
    assert [r.method for r in grafana.writes()] == ["POST", "PATCH", "POST", "PATCH"]
    fired, resolved = grafana.annotations
    assert "status:firing" in fired["tags"] and "status:resolved" in resolved["tags"]
    lines = fired["text"].split("\n")
    assert lines[0] == first.line()
    assert lines[1:] == ["profile 3f2a9c0e1b7d4a55: rank 13 vs reference rank 12: slow_op +20.01 ms/step, "
                         "aten::tanh +0.25 ms/step",
                         "profile 0123456789abcdef: rank 13 vs reference rank 12: slow_op +20.01 ms/step, "
                         "aten::tanh +0.25 ms/step"]
    assert fired["tags"][-1] == "profiled" and fired["tags"].count("profiled") == 1
    assert fired["time"] == T_FIRST // 10**6 and fired["timeEnd"] == T_DET // 10**6   # the region is kept
    patch = grafana.writes()[1]
    assert patch.path == f"/api/annotations/{fired['id']}" and set(patch.body) == {"text", "tags"}
    st = sink.stats()
    assert (st["sent"], st["updated"], st["duplicates"], st["failed"]) == (2, 2, 2, 0)
    assert reg.get_sample_value("stepwatch_grafana_annotations_updated_total") == 2
    assert grafana.violations == []                  # POST and PATCH bodies and answers match Grafana 11.4's spec


def test_processor_resend_through_the_callback_leaves_one_annotation(grafana, tmp_path):
    """End to end through the processor's own re-send path (Processor.emitter.profile_results), with the
    sink as its on_alert callback, as `stepwatch process --grafana-url` wires it."""
    from types import SimpleNamespace

    from stepwatch.kafkaio import KafkaSettings
    from stepwatch.stream.processor import Processor
    sink = AnnotationSink(grafana.url, grafana.token)
    a = alert("firing")
    sink.submit(a, t_first_ns=T_FIRST)              # the first emission (AlertEmitter.emit)
    diff = _with_diff(a).evidence["profile_diff"]
    proc = Processor(KafkaSettings(), tmp_path, on_alert=sink, profiling=None, create_topics=False)
    proc.profiling = SimpleNamespace(on_results=lambda t: [
        (SimpleNamespace(alert=a, cmd_id=diff["cmd_id"], job=a.job), diff)])
    proc.emitter.profile_results(None)
    assert list(proc.lake.buffers) == ["profile_diffs"]                  # the comparison is stored as well
    assert sink.close(5)
    assert len(grafana.annotations) == 1 and "profile 3f2a9c0e1b7d4a55" in grafana.annotations[0]["text"]
    assert grafana.violations == []


def test_the_window_is_bounded_and_a_lost_annotation_is_posted_again(grafana):
    sink = AnnotationSink(grafana.url, grafana.token, remember=2)
    a, b, c = alert(kind="k1"), alert(kind="k2"), alert(kind="k3")
    for x in (a, b, c):
        sink.submit(x)
    sink.submit(_with_diff(a))                       # a was evicted (window 2): a new annotation, diff included
    sink.submit(_with_diff(c))                       # c is known: patched
    assert sink.close(5)
    assert [r.method for r in grafana.writes()] == ["POST"] * 4 + ["PATCH"]
    assert "profile 3f2a9c0e1b7d4a55" in grafana.annotations[3]["text"] and "profiled" in grafana.annotations[3]["tags"]
    assert len(sink._posted) == 2
    # the annotation was deleted in Grafana meanwhile: the PATCH gets 404 and the alert is posted again
    sink = AnnotationSink(grafana.url, grafana.token)
    d = alert(kind="k4")
    sink.submit(d)
    assert wait_for(lambda: sink.stats()["sent"] == 1)
    grafana.annotations.pop()
    sink.submit(_with_diff(d))
    assert sink.close(5)
    assert [r.status for r in grafana.writes()[-3:]] == [200, 404, 200]
    assert "profile 3f2a9c0e1b7d4a55" in grafana.annotations[-1]["text"]
    assert sink.stats()["failed"] == 0
    assert grafana.violations == []


def test_one_annotation_per_incident_patched_by_its_later_alerts(grafana):
    """Alerts of one incident (the straggler, the job-wide slowdown it caused, its resolution) are one
    annotation: posted once, then patched (text, status tag, kinds, the region's end)."""
    from stepwatch.detectors.base import Alert
    sink = AnnotationSink(grafana.url, grafana.token)
    a1 = alert("firing")
    a1.incident_id = "inc-0123456789abcdef"
    reg = Alert(job="j1", kind="regression", status="firing", step_first=a1.step_first, step_detected=200,
                t_detected=T_DET + 5 * 10**9, cause="communication", incident_id=a1.incident_id)
    res = alert("resolved")
    res.incident_id, res.t_detected = a1.incident_id, T_DET + 9 * 10**9
    other = alert("firing")
    other.alert_id, other.incident_id = "ffff000011112222", "inc-fedcba9876543210"
    for x in (a1, reg, reg, res, other):
        sink.submit(x, t_first_ns=T_FIRST)
    assert sink.close(5)
    assert [r.method for r in grafana.writes()] == ["POST", "PATCH", "PATCH", "POST"]
    one, two = grafana.annotations
    assert one["text"].split("\n") == [a1.line(), reg.line(), res.line()]
    assert "incident:inc-0123456789abcdef" in one["tags"] and "status:resolved" in one["tags"]
    assert "status:firing" not in one["tags"] and {"kind:slow_rank", "kind:regression"} <= set(one["tags"])
    assert one["time"] == T_FIRST // 10**6 and one["timeEnd"] == (T_DET + 9 * 10**9) // 10**6
    assert "incident:inc-fedcba9876543210" in two["tags"]
    assert sink.stats()["duplicates"] == 1 and grafana.violations == []

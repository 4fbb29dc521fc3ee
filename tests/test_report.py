"""The HTML post-mortem report: built from a simulated store, rendered by headless Chromium."""
import shutil
import subprocess
import sys

import pytest

from stepwatch.bench import build_query_store

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("rep")
    build_query_store(root, ranks=512, seconds=360, chunk=60)
    out = root / "report.html"
    r = subprocess.run([sys.executable, "-m", "stepwatch.cli", "report", "--data-dir", str(root),
                        "--job", "bench-hour", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return root, out, r.stdout


def test_report_is_self_contained_and_names_the_findings(report):
    _, out, stdout = report
    text = out.read_text()
    assert "stepwatch post-mortem: bench-hour" in text
    assert text.count('src="data:image/png;base64,') == 5          # plots embedded, no external files
    assert "http://" not in text and "https://" not in text
    assert f"slowest rank: {512 // 3}" in stdout                   # terminal summary
    assert "regression" in stdout and "cause communication" in stdout
    assert "slow_rank rank 170" in text


def test_report_for_unknown_job_is_a_clear_error(report):
    root, _, _ = report
    r = subprocess.run([sys.executable, "-m", "stepwatch.cli", "report", "--data-dir", str(root), "--job", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no steps stored for job 'nope'" in r.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine: install Debian's 'chromium' "
                                             "(.ci/run does) to check the report renders")
def test_report_renders_in_headless_chromium(report, tmp_path):
    _, out, _ = report
    shot = tmp_path / "report.png"
    prof = tmp_path / "profile"
    r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={prof}", "--window-size=1280,2400",
                        f"--screenshot={shot}", out.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 50_000, r.stderr[-2000:]
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={prof}", "--dump-dom", out.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert 'id="summary"' in dom and "slowest rank" in dom
    # a page of text alone screenshots to a few KB; >50 KB shows the embedded plots were painted

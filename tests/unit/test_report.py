"""The HTML post-mortem report: built from a simulated store, rendered by headless Chromium."""
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def report(query_store, tmp_path_factory):
    root, _ = query_store               # (tests/conftest.py: 256 ranks, 480 steps, slow rank 85; read only)
    out = tmp_path_factory.mktemp("rep") / "report.html"
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
    assert f"slowest rank: {256 // 3}" in stdout                   # terminal summary
    assert "regression" in stdout and "cause communication" in stdout
    assert f"slow_rank rank {256 // 3}" in text


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


def test_change_point_labels_never_pile_up():
    """16 change points of one noisy fault within a few steps: labels get rows where they do not overlap,
    and the rest stay unlabelled (their lines are drawn and counted in the legend)."""
    from stepwatch.report import label_rows
    xs = [22 + 40 * i for i in range(16)]                     # 16 change points over 655 steps
    rows = label_rows(xs, span=655, rows=4, gap=0.12)
    placed = [(x, r) for x, r in zip(xs, rows) if r is not None]
    assert len(placed) >= 8 and rows[0] == 0
    for r in range(4):
        on = [x for x, rr in placed if rr == r]
        assert all(b - a >= 0.12 * 655 for a, b in zip(on, on[1:])), (r, on)
    assert label_rows([5, 6, 7, 8, 9], span=100) == [0, 1, 2, 3, None]


def test_heatmap_rank_axis_shows_integer_ranks():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from stepwatch.report import rank_axis
    for n_bins, rbin, want in ((2, 1, ["0", "1"]), (16, 1, [str(i) for i in range(16)])):
        fig, ax = plt.subplots()
        ax.imshow(np.zeros((n_bins, 10)), aspect="auto", extent=[0, 10, n_bins * rbin - 0.5, -0.5])
        rank_axis(ax, n_bins, rbin)
        fig.canvas.draw()
        assert [t.get_text() for t in ax.get_yticklabels()] == want
        plt.close(fig)
    fig, ax = plt.subplots()                                  # 4,096 ranks in bins of 16
    ax.imshow(np.zeros((256, 10)), aspect="auto", extent=[0, 10, 256 * 16 - 0.5, -0.5])
    rank_axis(ax, 256, 16)
    fig.canvas.draw()
    ticks = [t for t in ax.get_yticks() if -0.5 <= t <= 4095.5]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    plt.close(fig)

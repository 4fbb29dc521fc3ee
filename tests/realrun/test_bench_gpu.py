"""``stepwatch bench gpu``: the GPU check a session runs on a lent machine with no network. Here on the CPU
(tiny shapes; nothing judged): the GPT runs plain and wrapped print their figures, the ddp_train jobs run
under wrap with one node agent spooling, and the spool, replayed through ``stepwatch eval --real --spool``
(an agent, the broker, a processor), gives each job its end and bus-bandwidth rows. With CUDA the same
command judges its goals (marked ``gpu``: skipped without it)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile

import pytest

pytestmark = [pytest.mark.realrun, pytest.mark.slow]


def _bench(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "stepwatch.cli", "bench", "gpu", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_bench_gpu_spools_its_jobs_and_the_replay_gives_each_its_end_and_bus_bandwidth(tmp_path):
    out = tmp_path / "gpu"
    r = _bench("--out", str(out), "--steps", "40", "--gpt-steps", "2", "--jobs", "clean-1,clean-2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["cuda"] is False and "goals" not in s                     # the CPU run judges nothing
    assert [x["rc"] for x in s["gpt"]["runs"]] == [0, 0, 0, 0]
    assert [x["wrapped"] for x in s["gpt"]["runs"]] == [False, True, False, True]
    assert abs(s["gpt"]["counted_vs_analytic_pct"]) < 5 and "overhead_pct" in s["gpt"]
    assert {k: v["rc"] for k, v in s["jobs"].items()} == {"g-clean-nccl-1": 0, "g-clean-gloo-2": 0}
    with tarfile.open(out / "spool.tgz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    rep = subprocess.run([sys.executable, "-m", "stepwatch.cli", "eval", "--real", "--spool",
                          str(tmp_path / "back" / "spool")], capture_output=True, text=True, timeout=600)
    text = rep.stdout
    for job, calls in (("g-clean-nccl-1", 40), ("g-clean-gloo-2", 80)):
        m = re.search(rf"^  {job} .*, (job_end \w+|no job_end)\n\s+(\d+) collective call\(s\) in \d+ comm row\(s\), "
                      rf"(\d+) comm_bw row", text, re.M)
        assert m, text[-3000:]
        assert m.group(1) == "job_end finished" and int(m.group(2)) == calls and int(m.group(3)) > 0, m.group(0)
    assert "job_hang job=g-clean" not in text, text[-3000:]


@pytest.mark.gpu
def test_bench_gpu_meets_its_goals_on_a_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here: `stepwatch bench gpu` on a GPU machine runs this check (docs/efficiency.md)")
    r = _bench("--out", str(tmp_path / "gpu"), timeout=1800)
    s = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert r.returncode == 0 and all(s["goals"].values()), json.dumps(s.get("goals"))

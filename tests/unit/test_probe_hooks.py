"""The in-process probe's automatic PyTorch hooks (optimizer steps, DataLoader waits, GC), fork, and
zero-code mode (``stepwatch wrap``). A bound Unix socket stands in for the node agent (probe_helpers.py)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from probe_helpers import probe, rx, split  # noqa: F401 - shared fixtures (sockdir: conftest.py)
from stepwatch.agents import probe as P
from stepwatch.wire import datagram

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch", reason="the automatic hooks instrument PyTorch (pip install torch==2.13.0)")


# --------------------------------------------------------------------------- automatic hooks

class SlowDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        time.sleep(0.001)
        return torch.randn(8), torch.randn(2)


def test_automatic_steps_from_optimizer_dataloader_wait_and_gc(probe, rx, sockdir):
    probe.init(job="auto", rank=0, world_size=1, socket_dir=sockdir, flush_ms=0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)    # a second optimizer
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=4)
    for i, (x, y) in enumerate(loader):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if i == 2:
            gc.collect()
        opt.step()
        other.step()
        if i == 5:
            break
    hello, names, steps, comm, gcs = split(rx.read())
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4, 5]       # the second optimizer does not split steps
    for s in steps:
        ph = {names[i]: ms for i, ms in s["phases"]}
        assert s["data_ms"] >= 4.0                                  # 4 samples x 1 ms in __next__
        assert ph["optimizer"] > 0
        assert s["step_ms"] >= s["data_ms"]
    # step i runs from the end of step i-1's optimizer step to the end of its own
    assert all(b["t_start"] == a["t_end"] for a, b in zip(steps, steps[1:]))
    assert steps[2]["gc_count"] >= 1 and steps[2]["gc_ms"] > 0
    assert any(g[2] == 2 for g in gcs)                              # the full collection, as a gc row
    assert hello["device"] == "cpu" and hello["world_size"] == 1
    assert hello["model_params"] == 8 * 2 + 2                      # the primary optimizer's parameters
    assert all(s["data_queue"] == 0 for s in steps)                # single-process loader: nothing prefetched


def test_dataloader_queue_depth_with_workers(probe, rx, sockdir):
    probe.init(job="queue", rank=0, world_size=1, socket_dir=sockdir, flush_ms=0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 2)),
                                         batch_size=4, num_workers=1, prefetch_factor=4)
    for i, (x, y) in enumerate(loader):
        ((model(x) - y) ** 2).mean().backward()
        time.sleep(0.03)                       # slow compute: the worker fills the queue
        opt.step()
    msgs = rx.read()
    _, _, steps, _, _ = split(msgs)
    assert len(steps) == 16
    assert {m[1] for m in msgs} == {probe.instance}              # the forked worker sent nothing
    assert all(s["data_queue"] >= 0 for s in steps)
    assert max(s["data_queue"] for s in steps[2:]) >= 1


def test_fork_child_is_a_new_silent_instance(probe, rx, sockdir):
    probe.init(job="fork", socket_dir=sockdir, auto=False, flush_ms=0)           # rank resolved lazily
    probe.begin_step()
    probe.end_step()
    pid = os.fork()
    if pid == 0:                                                     # child: one step, then leave
        try:
            os.environ["RANK"] = "0"
            probe.rank = 7                                           # as a launcher's child would learn it
            probe.begin_step()
            probe.end_step()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    msgs = rx.read()
    insts = {m[1] for m in msgs}
    assert len(insts) == 2 and probe.instance in insts
    child = [m for m in msgs if m[1] != probe.instance]
    assert [m[0] for m in child] == [datagram.T_HELLO, datagram.T_BATCH]
    assert child[0][3]["rank"] == 7 and child[1][3][0][0] == 0       # its own numbering from 0


# --------------------------------------------------------------------------- zero-code mode

def test_wrap_instruments_torch_processes_and_leaves_others_alone(rx, sockdir, tmp_path):
    other_site = tmp_path / "othersite"
    other_site.mkdir()
    (other_site / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE_RAN'] = '1'\n")
    env = dict(os.environ, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", PYTHONPATH=str(other_site))
    script = ("import sys, torch\n"
              "m = torch.nn.Linear(4, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              "for _ in range(3):\n"
              "    m(torch.randn(2, 4)).sum().backward(); o.step()\n"
              "import os; print(os.environ.get('OTHER_SITE_RAN'), 'stepwatch.agents.probe' in sys.modules)\n")
    cmd = [sys.executable, "-m", "stepwatch.agents.wrap", "--job", "wrapped", "--socket-dir", sockdir, "--",
           sys.executable, "-c", script]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "True"]          # the shadowed sitecustomize still ran
    hello, names, steps, comm, gcs = split(rx.read())
    assert hello["job"] == "wrapped" and hello["rank"] == 5 and hello["world_size"] == 8
    assert hello["local_rank"] == 1
    assert [s["step"] for s in steps] == [0, 1, 2] and all(s["rank"] == 5 for s in steps)
    # a process that never imports torch does not load the probe
    plain = "import sys; print('stepwatch.agents.probe' in sys.modules, 'torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-m", "stepwatch.agents.wrap", "--", sys.executable, "-c", plain],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["False", "False"], p.stderr
    assert rx.read() == []


def test_init_before_torch_is_imported_hooks_it_on_import(rx, sockdir):
    script = ("import sys\n"
              "from stepwatch import probe\n"
              f"probe.init(job='early', rank=0, world_size=1, socket_dir={sockdir!r})\n"
              "assert 'torch' not in sys.modules\n"          # init imports nothing heavy
              "import torch\n"
              "m = torch.nn.Linear(2, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              "for _ in range(2):\n"
              "    m(torch.ones(1, 2)).sum().backward(); o.step()\n"
              "print(probe.stats()['steps'])\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["2"], p.stderr
    hello, names, steps, comm, gcs = split(rx.read())
    assert hello["job"] == "early" and [s["step"] for s in steps] == [0, 1]


def test_wrap_without_command_is_a_usage_error():
    p = subprocess.run([sys.executable, "-m", "stepwatch.agents.wrap", "--job", "x"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "give a command" in p.stderr


def test_stepwatch_probe_reexports_the_module_api():
    from stepwatch import probe as sp
    assert sp.init is P.init and sp.step is P.step and sp.stats is P.stats and sp.phase is P.phase
    assert Path(sp.__file__).name == "probe.py"

"""The probe as a package a training image installs alone: it imports only the standard library, loads
from its directory where ``stepwatch`` is not importable (``stepwatch wrap``), and the ``stepwatch``
command names the extra a command needs instead of failing with a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stepwatch.agents import probe as P

from probe_helpers import Rx, rx, split  # noqa: F401 - shared fixtures (sockdir: conftest.py)

import pytest
pytestmark = pytest.mark.unit

PKG = Path(P.__file__).parent


def _run(code: str, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env)


def test_the_facade_offers_the_probe_packages_whole_api():
    """``from stepwatch import probe`` (docs/agents.md's explicit API) names what the probe package names:
    the same ``__all__``, each name the package's own object (``probe.mark_change`` included)."""
    from stepwatch import probe
    assert sorted(probe.__all__) == sorted(P.__all__)
    for name in P.__all__:
        assert getattr(probe, name) is getattr(P, name), name


def test_importing_the_probe_loads_only_the_standard_library():
    code = ("import json, sys\n"
            "import stepwatch.probe, stepwatch.agents.probe as p\n"
            "from stepwatch.agents.probe import core, hooks, eventlog, fold, transport, timing, watchdog, "
            "ddp_hooks, collectives\n"
            "from stepwatch.wire import datagram\n"
            "std = set(sys.stdlib_module_names)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} - std - {'stepwatch', '__main__'})))\n"
            "print(eventlog.FAST)\n")
    r = _run(code)
    assert r.returncode == 0, r.stderr
    third_party, fast = r.stdout.split("\n")[:2]
    # (a venv's site hook may add its own module: nothing that an extra installs, and no torch)
    loaded = set(json.loads(third_party))
    assert not loaded & {"numpy", "pyarrow", "duckdb", "torch", "kafka", "ruptures", "grafana_client",
                         "matplotlib", "psutil", "prometheus_client", "cryptography"}, loaded
    assert fast == "True"


def test_no_file_of_the_package_is_over_600_lines():
    sizes = {f.name: len(f.read_text().splitlines()) for f in PKG.iterdir() if f.suffix in (".py", ".c", ".h")}
    assert sizes and max(sizes.values()) <= 600, sizes


def test_the_package_loads_from_its_directory_where_stepwatch_is_not_importable(rx, sockdir):
    """``stepwatch wrap`` sets STEPWATCH_PROBE_FILE for interpreters without the package: the probe then
    loads by its directory, C hot path included, and sends the same steps."""
    code = ("import importlib.util as u, os, sys\n"
            "try:\n"
            "    import stepwatch\n"
            "    sys.exit('stepwatch is importable: the test proves nothing')\n"
            "except ImportError:\n"
            "    pass\n"
            f"f = {str(PKG / '__init__.py')!r}\n"
            "spec = u.spec_from_file_location('stepwatch_probe', f, submodule_search_locations=[os.path.dirname(f)])\n"
            "m = u.module_from_spec(spec); sys.modules['stepwatch_probe'] = m; spec.loader.exec_module(m)\n"
            f"p = m.init(job='bydir', rank=2, world_size=4, socket_dir={sockdir!r}, auto=False, flush_ms=0)\n"
            "for i in range(3):\n"
            "    with p.step(samples=8):\n"
            "        with p.phase('forward'): pass\n"
            "m.shutdown()\n"
            "print(m.eventlog.FAST, m.eventlog._fast.__name__, type(p._log).__name__)\n")
    r = _run(code, "-S", "-I")                    # no site-packages: no installed stepwatch
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "stepwatch_probe._probefast", "Log"]
    hello, names, steps, comm, gcs = split(rx.read())
    assert hello["job"] == "bydir" and [(s["rank"], s["step"], s["samples"]) for s in steps] == [(2, 0, 8), (2, 1, 8),
                                                                                                  (2, 2, 8)]


def test_a_command_whose_extra_is_missing_names_the_extra():
    """An install without an extra's packages (here: made unimportable) gets one line naming the extra to
    install, no traceback; ``stepwatch wrap`` (the standard library only) still runs."""
    block = "import sys\nfor m in ('pyarrow', 'duckdb', 'numpy'):\n    sys.modules[m] = None\n"
    r = _run(block + "from stepwatch.cli import main\nsys.exit(main(['agent', '--no-kafka']))\n")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "pip install 'stepwatch[agent]'" in r.stderr and "stepwatch agent: needs the Python package" in r.stderr
    r = _run(block + "from stepwatch.cli import main\nsys.exit(main(['report', '--job', 'j']))\n")
    assert r.returncode == 1 and "pip install 'stepwatch[report]'" in r.stderr, r.stderr
    r = _run(block + "from stepwatch.cli import main\nsys.exit(main(['wrap']))\n")
    assert r.returncode == 2 and "give a command" in r.stderr, r.stderr


def test_the_probe_never_imports_torch_itself_it_uses_the_programs():
    """agents/probe/torchref.py: the probe's torch is the one the program imported. Without it, the parts that
    work on torch (FLOPs, DDP patching) raise ImportError or do nothing, and torch stays unloaded; once the
    program imported torch, a submodule comes by name."""
    code = ("import sys\n"
            "from stepwatch.agents.probe import ddp_hooks, flops, torchref\n"
            "try:\n"
            "    flops.matmul_params(object())\n"
            "    print('no error')\n"
            "except ImportError as e:\n"
            "    print('ImportError', e.name)\n"
            "ddp_hooks.patch(None, None)\n"
            "print('torch' in sys.modules)\n"
            "import torch\n"
            "print(torchref.loaded() is torch, torchref.loaded('torch.utils.flop_counter').__name__)\n"
            "try:\n"
            "    torchref.loaded('numpy')\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["ImportError torch", "False", "True torch.utils.flop_counter",
                                     "loaded: name must be 'torch' or a torch submodule, got 'numpy'"], r.stdout

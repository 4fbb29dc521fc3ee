"""The checkout cannot shadow the install with a partial package: its ``stepwatch/`` links the design's
top-level folders (agents/, stream/, detectors/, storage/, dashboards/), so running from the repository root
imports the whole package, whatever is installed (a plain ``pip install .`` included)."""
from __future__ import annotations

import pytest

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

pytestmark = pytest.mark.unit


ROOT = Path(__file__).resolve().parents[2]


def test_running_from_the_repository_root_imports_the_whole_package():
    # -S: no site processing, so no editable-install finder can fill the gaps; the dependencies' folder is
    # put on the path as plain folders (as a non-editable install leaves it), after the root ('' for -c).
    sites = [p for p in sys.path if p.endswith("site-packages")] or [sysconfig.get_paths()["purelib"]]
    code = (f"import sys; sys.path.extend({sites!r}); "
            "import stepwatch, stepwatch.probe, stepwatch.agents.probe, stepwatch.stream.processor, "
            "stepwatch.detectors.slowrank, stepwatch.storage.lake, stepwatch.dashboards.build, stepwatch.cli; "
            "print(stepwatch.__file__); print(stepwatch.agents.probe.__file__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    pkg, probe = r.stdout.split()
    assert Path(pkg).parent == ROOT / "stepwatch"
    assert Path(probe).resolve() == ROOT / "agents" / "probe" / "__init__.py"


def test_each_top_level_folder_is_linked_into_the_package():
    for d in ("agents", "stream", "detectors", "storage", "dashboards"):
        link = ROOT / "stepwatch" / d
        assert link.is_symlink() and link.resolve() == ROOT / d, link

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


def _devtools_refs(path: Path, names: set[str]) -> set[str]:
    """The modules of stepwatch/devtools that ``path`` imports (absolute or relative, at any depth) or names
    in code as a module (``"stepwatch.devtools.demo_train"``) or a script beside it (``"ddp_train.py"``):
    docstrings and comments do not count."""
    import ast
    import re
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            mod = n.module or ""
            if n.level == 1 or mod == "stepwatch.devtools":
                out |= {mod.split(".")[0]} if mod and n.level == 1 else {a.name for a in n.names}
            elif mod.startswith("stepwatch.devtools."):
                out.add(mod.split(".")[2])
        elif isinstance(n, ast.Import):
            out |= {a.name.split(".")[2] for a in n.names if a.name.startswith("stepwatch.devtools.")}
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out |= set(re.findall(r"stepwatch\.devtools\.(\w+)", n.value))
            out |= {m[:-3] for m in re.findall(r"^\w+\.py$", n.value)}
    return out & names


def test_every_module_of_devtools_serves_a_stepwatch_command():
    """What ships in stepwatch/devtools is what a `stepwatch` command (demo, broker, simulate, bench, eval) reaches
    from its plug-in (pyproject.toml's entry points of the group stepwatch.commands, which stepwatch/cli.py
    loads); a script that only tests, docs or a one-off measurement run belongs in the repository's tools/ or
    tests/ (not installed)."""
    import tomllib
    dev = ROOT / "stepwatch" / "devtools"
    names = {p.stem for p in dev.glob("*.py")} - {"__init__"}
    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["stepwatch.commands"]
    assert set(plugins) == {"demo", "broker", "simulate", "bench", "eval"}, plugins
    reached: set[str] = set()
    todo = sorted({v.split(":")[0].rsplit(".", 1)[1] for v in plugins.values()} & names)
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += sorted(_devtools_refs(dev / f"{m}.py", names) - reached)
    assert names - reached == set(), "not reached from any stepwatch command: move to tools/ or tests/"
    assert not [p.name for p in dev.iterdir() if p.is_file() and p.suffix != ".py"], "not a module: tools/"

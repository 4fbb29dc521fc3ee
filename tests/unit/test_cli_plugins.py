"""The ``stepwatch`` command's plug-ins: commands found through the entry-point group ``stepwatch.commands``
(stepwatch/cli.py). The development tools (demo, broker, simulate, eval, bench) are such plug-ins, so a
product command loads no module of stepwatch.devtools, and a plug-in command loads its own plug-in only."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

DEVTOOLS = {"demo", "broker", "simulate", "eval", "bench"}


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_the_devtools_commands_are_found_through_their_entry_points():
    from stepwatch.cli import PLUGIN_GROUP, command_plugins
    found = command_plugins()
    assert PLUGIN_GROUP == "stepwatch.commands"
    assert DEVTOOLS <= set(found), sorted(found)
    assert all(found[c].module.startswith("stepwatch.devtools.") for c in DEVTOOLS), found
    r = subprocess.run([sys.executable, "-m", "stepwatch.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    listed = {line.split()[0] for line in r.stdout.splitlines() if line.startswith("    ") and line.split()}
    assert DEVTOOLS | {"process", "sql", "report", "compact", "agent", "wrap", "grafana"} <= listed, r.stdout


def test_a_product_command_loads_no_devtools_module_and_a_plugin_command_only_its_own():
    code = ("import sys\n"
            "from stepwatch.cli import main\n"
            "import contextlib, io\n"
            "def loaded(argv):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "    return sorted(m for m in sys.modules if m.startswith('stepwatch.devtools'))\n"
            "print(loaded(['process', '--help']))\n"
            "print(loaded(['sql', '--help']))\n"
            "print(loaded(['demo', '--help']))\n")
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    process, sql, demo = r.stdout.splitlines()
    assert process == "[]" and sql == "[]", r.stdout
    assert demo == "['stepwatch.devtools', 'stepwatch.devtools.commands']", r.stdout   # not eval's, not bench's


def test_an_installed_plugin_adds_its_command(tmp_path):
    """Any distribution with an entry point in the group adds a command; one whose module is gone is a
    clear error, not a traceback."""
    (tmp_path / "hello_plugin.py").write_text(
        "def register(sub):\n"
        "    p = sub.add_parser('hello', help='say hello')\n"
        "    p.add_argument('--name', default='world')\n"
        "    p.set_defaults(func=lambda a: print(f'hello {a.name}') or 0)\n")
    info = tmp_path / "hello_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[stepwatch.commands]\nhello = hello_plugin:register\n"
                                           "ghost = ghost_plugin_not_installed:register\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    sw = [sys.executable, "-m", "stepwatch.cli"]
    r = subprocess.run(sw + ["hello", "--name", "rank7"], capture_output=True, text=True, timeout=120, env=env)
    assert (r.returncode, r.stdout) == (0, "hello rank7\n"), r.stderr[-2000:]
    r = subprocess.run(sw + ["ghost"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip() == ("stepwatch ghost: the plug-in of this command is not installed "
                                "(its module ghost_plugin_not_installed is missing)"), r.stderr


def test_a_devtools_command_without_its_entry_point_says_the_tools_are_not_installed():
    """An installation whose metadata lacks the entry points (an editable install made before they existed):
    one clear message, exit 1."""
    code = ("import importlib.metadata as md, sys\n"
            "real = md.entry_points\n"
            "md.entry_points = lambda **kw: md.EntryPoints(()) if kw.get('group') == 'stepwatch.commands' "
            "else real(**kw)\n"
            "from stepwatch.cli import main\n"
            "sys.exit(main(['demo', '--steps', '3']))\n")
    r = _run(code)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("stepwatch demo: the development tools are not installed (stepwatch.devtools: "
                               "no entry point 'demo' in the group 'stepwatch.commands')."), r.stderr
    assert "pip install 'stepwatch[devtools]'" in r.stderr

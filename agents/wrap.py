"""``stepwatch wrap [--job J] -- <command…>``: run a command with every Python process it starts
instrumented, without changing the training script.

The command runs (``exec``, so signals and the exit code are the command's own) with:

- ``PYTHONPATH`` led by a directory holding a ``sitecustomize.py`` (written once per content into
  ``$XDG_CACHE_HOME/stepwatch`` or ``~/.cache/stepwatch``), which Python imports at start-up;
- ``STEPWATCH_WRAP=1`` (the ``sitecustomize`` does nothing without it), ``STEPWATCH_JOB`` from
  ``--job``, ``STEPWATCH_SOCKET_DIR`` from ``--socket-dir``, and ``STEPWATCH_PROBE_FILE`` naming the
  probe package's ``__init__.py`` for interpreters where the ``stepwatch`` package is not installed.

The ``sitecustomize`` adds a finder to ``sys.meta_path`` that waits for ``import torch``: a process
that never imports torch pays one string comparison per top-level import. When torch has finished
importing it loads the probe and calls :func:`stepwatch.agents.probe.auto_install` (hooks only; the
probe stays silent until the process completes an optimizer step, so launchers such as ``torchrun``
and DataLoader workers send nothing). Rank identity comes from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
(set by torchrun), else from ``torch.distributed`` at the first step. Under ``srun`` without torchrun,
those (and ``MASTER_ADDR``/``MASTER_PORT`` for ``env://``, the job id = the Slurm job id) are set from
Slurm's variables when unset (:mod:`stepwatch.agents.slurm`, docs/baremetal.md). A ``sitecustomize``
already on the path (e.g. Debian's) is still run after ours.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

SITECUSTOMIZE = r'''"""Written by ``stepwatch wrap``: instruments this process when it imports torch."""
import os as _os
import sys as _sys


def _stepwatch_instrument():
    try:
        try:
            from stepwatch.agents import probe as _probe
        except ImportError:
            _f = _os.environ.get("STEPWATCH_PROBE_FILE")
            if not _f:
                raise
            import importlib.util as _u
            _spec = _u.spec_from_file_location("stepwatch_probe", _f,  # the package, by its directory
                                               submodule_search_locations=[_os.path.dirname(_f)])
            _probe = _u.module_from_spec(_spec)
            _sys.modules["stepwatch_probe"] = _probe
            _spec.loader.exec_module(_probe)
        _probe.auto_install()
    except Exception as _e:  # never break the user's program
        _sys.stderr.write("stepwatch wrap: no instrumentation in pid %d: %r\n" % (_os.getpid(), _e))


class _StepwatchTorchFinder:
    """Finds nothing itself; on ``import torch`` it wraps torch's loader to instrument afterwards."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        try:
            _sys.meta_path.remove(self)
        except ValueError:
            pass
        import importlib.util as _u
        spec = _u.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        orig = loader.exec_module

        def exec_module(module):
            orig(module)
            _stepwatch_instrument()

        loader.exec_module = exec_module
        return spec


def _stepwatch_chain():
    """Run the sitecustomize this file shadows, if any."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
    if not any(_os.path.exists(_os.path.join(p or ".", "sitecustomize.py")) for p in rest):
        return
    import importlib.machinery as _m
    import importlib.util as _u
    spec = _m.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        mod = _u.module_from_spec(spec)
        spec.loader.exec_module(mod)


if _os.environ.get("STEPWATCH_WRAP") == "1":
    if "torch" in _sys.modules:
        _stepwatch_instrument()
    else:
        _sys.meta_path.insert(0, _StepwatchTorchFinder())
try:
    _stepwatch_chain()
except Exception as _e:
    _sys.stderr.write("stepwatch wrap: the shadowed sitecustomize failed: %r\n" % (_e,))
'''


def _owned_private_dir(d: Path) -> bool:
    try:
        st = d.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not (st.st_mode & 0o022)


def site_dir() -> Path:
    """A directory holding our ``sitecustomize.py`` (content-addressed, owned by this user)."""
    digest = hashlib.sha256(SITECUSTOMIZE.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stepwatch"
    for base in (cache, None):
        try:
            if base is None:
                d = Path(tempfile.mkdtemp(prefix="stepwatch-wrap-"))
            else:
                base.mkdir(parents=True, exist_ok=True, mode=0o755)
                d = base / f"wrap-{digest}"
                d.mkdir(exist_ok=True, mode=0o755)
            if not _owned_private_dir(d):
                continue
            f = d / "sitecustomize.py"
            if not f.exists() or f.read_text() != SITECUSTOMIZE:
                tmp = d / f".sitecustomize.{os.getpid()}.tmp"
                tmp.write_text(SITECUSTOMIZE)
                os.replace(tmp, f)
            return d
        except OSError:
            continue
    raise OSError("stepwatch wrap: found no private directory for sitecustomize.py")


def wrap_env(env: dict | None = None, job: str | None = None, socket_dir: str | None = None,
             cmd: list[str] | None = None) -> dict:
    """The environment a wrapped command runs with (see the module docstring); in a Slurm task, with the
    rank's identity and ``env://`` rendezvous taken from Slurm's variables (:func:`stepwatch.agents.slurm.rank_env`)."""
    from stepwatch.agents import slurm
    env = dict(os.environ if env is None else env)
    env.update(slurm.rank_env(env, launcher=slurm.is_launcher(cmd or [])))
    d = str(site_dir())
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = d + (os.pathsep + pp if pp else "")
    env["STEPWATCH_WRAP"] = "1"
    env["STEPWATCH_PROBE_FILE"] = str(Path(__file__).with_name("probe") / "__init__.py")
    if job:
        env["STEPWATCH_JOB"] = job
    if socket_dir:
        env["STEPWATCH_SOCKET_DIR"] = socket_dir
    return env


def add_wrap_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", default=os.environ.get("STEPWATCH_JOB"),
                   help="job id the ranks report (env STEPWATCH_JOB; default: TORCHELASTIC_RUN_ID, else the "
                        "agent's --job)")
    p.add_argument("--socket-dir", default=None,
                   help="directory of the node agent's socket (env STEPWATCH_SOCKET_DIR; default /run/stepwatch "
                        "when it exists, else /tmp/stepwatch)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")


def run_wrap(a) -> int:
    cmd = list(a.command or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("stepwatch wrap: give a command after --, e.g. stepwatch wrap --job j1 -- torchrun train.py",
              file=sys.stderr)
        return 2
    try:
        env = wrap_env(job=a.job, socket_dir=a.socket_dir, cmd=cmd)
    except ValueError as e:
        print(f"stepwatch wrap: {e}", file=sys.stderr)
        return 2
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:
        print(f"stepwatch wrap: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - exec does not return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stepwatch wrap", description="run a command with its Python processes "
                                "instrumented by the stepwatch probe")
    add_wrap_args(p)
    return run_wrap(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

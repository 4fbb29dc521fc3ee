"""torch as the training program loaded it: the probe's one way to reach torch.

The rule: **the probe never triggers torch's import.** It runs inside every rank (and, through
``stepwatch wrap``, inside any Python process the command starts: launchers, data workers, scripts that never
use torch), so importing torch itself would cost a process that never asked for it seconds and hundreds of
MB, and could load CUDA into a parent that forks. The probe therefore works on the ``torch`` module object
that the program already imported (``sys.modules["torch"]``): :mod:`.hooks` installs its patches from a
``sys.meta_path`` finder that waits for the program's ``import torch``, and :mod:`.ddp_hooks` and
:mod:`.flops` run only from those hooks or from a call that passes a torch model.

No module of the package writes ``import torch`` (the import-linter contract "The probe imports only the
standard library" in pyproject.toml forbids it, with no exception): they call :func:`loaded`, which returns
``torch`` or one of its submodules only once ``torch`` is loaded, and raises :class:`ImportError` otherwise.
A submodule (``torch.distributed``, ``torch.utils.flop_counter``) is imported by name through
:mod:`importlib` then: torch is in memory, its submodules are its own business (most are loaded already).
"""
from __future__ import annotations

import importlib
import sys


def loaded(name: str = "torch"):
    """The module ``name`` (``"torch"`` or a dotted submodule, ``"torch.distributed"``) when the program has
    imported torch; :class:`ImportError` when it has not (nothing is imported then) or when the submodule
    is not in this torch build."""
    if name != "torch" and not name.startswith("torch."):
        raise ValueError(f"loaded: name must be 'torch' or a torch submodule, got {name!r}")
    torch = sys.modules.get("torch")
    if torch is None:
        raise ImportError(f"{name}: the program has not imported torch (the probe never imports it)", name=name)
    if name == "torch":
        return torch
    mod = sys.modules.get(name)
    return mod if mod is not None else importlib.import_module(name)

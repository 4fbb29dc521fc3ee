"""``from stepwatch import probe``: the in-process probe (see :mod:`stepwatch.agents.probe`)."""
from stepwatch.agents.probe import (  # noqa: F401
    BadDatagram, Probe, add_phase, auto_install, begin_step, count, decode, default_socket_dir, end_step, flush,
    get, init, mark_step_kind, phase, shutdown, stats, step, transfer_ms,
)

__all__ = ["Probe", "init", "step", "begin_step", "end_step", "phase", "add_phase", "count", "stats", "flush",
           "shutdown", "get", "auto_install", "mark_step_kind", "decode", "BadDatagram", "default_socket_dir", "transfer_ms"]

"""``from stepwatch import probe``: the in-process probe's public API (see :mod:`stepwatch.agents.probe`).

A façade: ``__all__`` names what it offers, the same names as the package's own ``__all__``."""
from stepwatch.agents.probe import (
    BadDatagram, Probe, add_phase, analytic_flops_per_token, auto_install, begin_step, count, count_flops, decode,
    default_socket_dir, end_step, flush, get, init, mark_change, mark_step_kind, phase, set_flops_per_token,
    set_model_shape, shutdown, stats, step, transfer_ms,
)

__all__ = ["Probe", "init", "step", "begin_step", "end_step", "phase", "add_phase", "count", "stats", "flush",
           "shutdown", "get", "auto_install", "mark_step_kind", "mark_change", "decode", "BadDatagram",
           "default_socket_dir", "transfer_ms", "count_flops", "set_flops_per_token", "set_model_shape",
           "analytic_flops_per_token"]

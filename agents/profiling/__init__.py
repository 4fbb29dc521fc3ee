"""Targeted fine-grained profiling (docs/profiling.md): signing, summaries, diffs, and the probe-side runner.

Everything here imports only the standard library at module level (the probe loads it into the
training process); ``cryptography`` is imported when a key is loaded or a command verified (on a
helper thread in the probe), torch only when a ``torch`` profile runs, and ``py-spy`` is a separate
binary.

Commands. A command asks one node's agent to profile ``steps`` steps of some ranks of a job. It
travels as a *sealed envelope* (:func:`seal`), the same bytes on the ``control`` topic and on the
probe's control socket::

    b"SWC2" | key id (8 bytes: sha256 of the raw public key) | Ed25519 signature (64) | body

``body`` is the command as canonical JSON (:func:`canonical`, at most :data:`MAX_BODY` bytes). The
signature covers ``b"stepwatch-control/2\\0" + key id + body``. :func:`open_envelope` checks the
length, the magic, the key id and the signature **before** it decodes anything of the body, then
:func:`parse_command` checks every field's type and range. The processor (and ``stepwatch profile``)
hold the private key (:func:`load_private_key`: ``STEPWATCH_PROFILING_PRIVATE_KEY[_FILE]``); node
agents and probes hold only public keys (:func:`load_public_keys`: ``STEPWATCH_PROFILING_PUBLIC_KEY[_FILE]``,
several for a rotation), so a compromised node cannot forge commands for the others. Keys are never
logged or put into any row.

Probe side. :class:`ProbeControl` owns a non-blocking ``AF_UNIX``/``SOCK_DGRAM`` socket
``<socket_dir>/ctl/probe-<instance>.sock`` (``<socket_dir>/probe-<instance>.sock`` when there is no
writable ``ctl`` directory; mode 0660, or ``STEPWATCH_CTL_SOCKET_MODE``), announced in the probe's
hello as ``ctl``. The probe polls it with one non-blocking ``recv`` when it flushes (at most every
``flush_ms``), never per step. It verifies each envelope itself with its own public keys, accepts only
commands for its own job and rank that it has not seen, and clamps them (steps, deadline, py-spy rate:
:class:`ProbeLimits`); traces go only to its own trace directory (``STEPWATCH_PROFILE_DIR``). An
accepted command becomes a :class:`ProfileRun`: it starts at the first step boundary after the profiler
is ready, profiles exactly ``steps`` steps (or stops at the deadline, whichever comes first), then
writes the trace and its summary on a background thread and answers the agent with a ``T_PROFILE``
datagram (header + JSON).

The package, one direction of dependency (``lint-imports`` checks it): :mod:`.protocol` (keys, envelope,
commands) <- :mod:`.summary` (summaries, diffs) <- :mod:`.runner` (the probe side); all standard library.
The processor's side, :mod:`stepwatch.stream.profiling` (alert -> commands, results -> diff) and
``stepwatch profile`` (:mod:`stepwatch.stream.profiling_cli`), use this package; nothing here imports them.
"""
from __future__ import annotations

from .protocol import MAX_BODY, canonical, load_private_key, load_public_keys, open_envelope, parse_command, seal
from .runner import ProbeControl, ProbeLimits, ProfileRun

# the package's API: the names this docstring documents; the rest is imported from its module
# (:mod:`.protocol`, :mod:`.summary`, :mod:`.runner`)
__all__ = ["MAX_BODY", "canonical", "load_private_key", "load_public_keys", "open_envelope", "parse_command", "seal",
           "ProbeControl", "ProbeLimits", "ProfileRun"]

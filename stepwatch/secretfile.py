"""Secret files (a password, a signing key) that other local users can read: warned about by name, as
libpq and ssh do. A Kubernetes Secret mounted by the chart is ``0440`` owned by root (group: the pod's
fsGroup), which passes; a ``0644`` file in a home directory does not. The content is never read here
and never logged."""
from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger("stepwatch.secrets")

_warned: set = set()


def too_open(path) -> str | None:
    """Why ``path`` is readable by more than its owner allows (libpq's rule: at most 0600 when owned by
    this user, 0640 when owned by root), or None; None also when it cannot be stat'ed (the reader says)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    mode = stat.S_IMODE(st.st_mode)
    allowed = 0o640 if st.st_uid == 0 and os.getuid() != 0 else 0o600
    if mode & ~allowed & 0o077:
        return f"mode {mode:04o} lets other users read or change it (at most {allowed:04o}: chmod {allowed:o} it)"
    return None


def check(path, what: str) -> None:
    """Log a warning, once per file and mode, when the secret file ``path`` (named by ``what``, e.g. the
    environment variable that points at it) is too open (see :func:`too_open`)."""
    why = too_open(path)
    if why is None:
        return
    key = (str(path), why)
    if key not in _warned:
        _warned.add(key)
        log.warning("%s=%s: a secret file whose %s", what, path, why)

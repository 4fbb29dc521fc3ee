"""Secret files (a password, a signing key) that other local users can read: warned about by name, as
libpq and ssh do. A Kubernetes Secret mounted by the chart is ``0440`` owned by root (group: the pod's
fsGroup), which passes; a ``0644`` file in a home directory does not. The content is never read here
and never logged."""
from __future__ import annotations

import logging
import os
import stat
import threading

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


def check(path, what: str, show_path: bool = True) -> None:
    """Log a warning, once per file and mode, when the secret file ``path`` (named by ``what``, e.g. the
    environment variable that points at it; and by its path unless ``show_path`` is False) is too open
    (see :func:`too_open`)."""
    why = too_open(path)
    if why is None:
        return
    key = (str(path), why)
    if key not in _warned:
        _warned.add(key)
        log.warning("%s: a secret file whose %s", f"{what}={path}" if show_path else what, why)


def _version(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class Reread:
    """A value read from a secret file by ``read(path)`` at start (its errors raise there) and read again,
    when called, whenever the file was replaced or rewritten since (a Kubernetes Secret swaps its files
    on rotation): a call costs one ``stat``. A re-read that raises one of ``errors`` (the file empty or
    gone mid-rewrite) keeps the value in use and logs why, naming ``what`` (and the path unless
    ``show_path`` is False), never the value."""

    def __init__(self, path, read, what: str, errors: tuple = (OSError, ValueError), show_path: bool = True):
        self.path, self._read, self._errors = path, read, errors
        self.what = f"{what}={path}" if show_path else what
        self._lock = threading.Lock()
        self._version = _version(path)
        self._value = read(path)

    def __call__(self):
        v = _version(self.path)
        if v is not None and v != self._version:
            with self._lock:
                if v != self._version:
                    self._version = v
                    try:
                        self._value = self._read(self.path)
                        log.info("%s changed: read again", self.what)
                    except self._errors as e:
                        log.warning("%s: %s; the value read before stays in use", self.what, e)
        return self._value

"""Reading a configuration file as untrusted input: the bounds checked before anything is parsed or
converted (a ConfigMap anyone with edit rights on it can change), and the one exception the loader
raises. :mod:`stepwatch.config` validates what this returns."""
from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path

#: what a configuration file may be, checked before it is parsed or converted (a file is untrusted input:
#: a ConfigMap anyone with edit rights on it can change): its size, the nesting of its arrays and inline
#: tables (tomllib recurses per level: ~300 levels exhaust the interpreter's stack), and the digits of a
#: number (int() of more than 4300 digits raises ValueError; no setting needs more than a few)
MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_DIGITS = 40
MAX_MESSAGE = 400                   # characters of an error message (values and names in it are clipped)

class ConfigError(ValueError):
    """A file or setting that does not validate; the message names the file, the setting and its value
    (clipped: see :func:`stepwatch.config._show`) and, for a number, its valid range. The only exception the loader raises."""

    def __init__(self, msg: str):
        msg = str(msg)
        super().__init__(msg if len(msg) <= MAX_MESSAGE else msg[:MAX_MESSAGE - 1] + "…")


def read_bytes(p: Path) -> bytes:
    """The file's bytes, at most :data:`MAX_BYTES`: a regular file (a FIFO or device is refused, never
    waited on), unchanged while it was read (a writer caught mid-rewrite is refused, not half-read)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{p}: not a regular file")
        if st.st_size > MAX_BYTES:
            raise ConfigError(f"{p}: {st.st_size} bytes, larger than the {MAX_BYTES} a configuration may be")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_BYTES + 1)
        after = os.fstat(fd)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{p}: larger than the {MAX_BYTES} bytes a configuration may be")
    if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns) or len(data) != after.st_size:
        raise ConfigError(f"{p}: changed while being read (a writer mid-rewrite?); read again on the next change")
    return data


def prescan(text: str, p) -> None:
    """Refuse, before tomllib sees them, arrays/inline tables nested deeper than :data:`MAX_DEPTH` and
    numbers longer than :data:`MAX_DIGITS` digits (outside strings and comments; the line is named)."""
    i, n, depth, line, run = 0, len(text), 0, 1, 0
    while i < n:
        c = text[i]
        if c in "\"'":
            q = c * 3 if text.startswith(c * 3, i) else c
            j = i + len(q)
            while j < n:
                d = text[j]
                if d == "\\" and c == '"':
                    j += 2
                    continue
                if text.startswith(q, j):
                    j += len(q)
                    for _ in range(2 if len(q) == 3 else 0):     # up to two more quotes belong to a multi-line
                        if j < n and text[j] == c:               # string's content: """a""""" is a"" (TOML)
                            j += 1
                    break
                if d == "\n":
                    if len(q) == 1:              # an unterminated string: tomllib says so
                        break
                    line += 1
                j += 1
            i, run = j, 0
            continue
        if c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if c == "\n":
            line += 1
        if c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"{p}: line {line}: arrays or inline tables nested deeper than {MAX_DEPTH}")
        elif c in "]}":
            depth = max(0, depth - 1)
        if c.isdigit():
            run += 1
            if run > MAX_DIGITS:
                raise ConfigError(f"{p}: line {line}: a number of more than {MAX_DIGITS} digits")
        elif c != "_":
            run = 0
        i += 1


def decode(raw: bytes, p="<config>") -> dict:
    """A file's bytes as TOML data, after the bounds (size, UTF-8, not empty, nesting, digits); raises only
    :class:`ConfigError` (``p`` names the file)."""
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{p}: larger than the {MAX_BYTES} bytes a configuration may be")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    if not text.strip():
        raise ConfigError(f"{p}: empty (a file being rewritten?); a file of every default says so with a comment "
                          "or an empty [processor] table")
    prescan(text, p)
    try:
        return tomllib.loads(text)
    except (ValueError, RecursionError) as e:   # TOMLDecodeError is a ValueError (as is int()'s digit limit)
        raise ConfigError(f"{p}: not valid TOML: {str(e)[:200]}") from None

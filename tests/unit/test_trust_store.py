"""The store's files are the writer's (issue 26, finding 5): no local user can read the telemetry or
hold the writers' lock. Real uids: the tests run as root (the writer) and fork children that become
another uid before they try."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
import time

import pytest
from testkit import store_steps as steps

from stepwatch.storage.store import LakeStore, Marker

OTHER = 65534                      # nobody
HOLD_S = 3.0                       # how long the other uid holds the lock when it gets it

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another uid")]


@pytest.fixture
def base():
    """A folder every uid can traverse (pytest's tmp_path is root's 0700): only the store's own modes
    keep the other uid out."""
    d = tempfile.mkdtemp(prefix="stepwatch-store-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _attempt(fn) -> str:
    try:
        return fn()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


def other_uid_tries(lock: str, parquet: str, groups: list[int]) -> tuple[int, dict]:
    """A child of uid OTHER (supplementary ``groups``) opens the lock read-only and takes it (holding
    it HOLD_S when it can), and reads a Parquet file. Returns (pid, what it got) once it has tried."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: plain system calls, then _exit
        code = 0
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(groups[0] if groups else OTHER)
            os.setuid(OTHER)
            fds = []

            def take_lock():
                fd = os.open(lock, os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_EX)
                fds.append(fd)
                return "held"

            def read_parquet():
                with open(parquet, "rb") as f:
                    return "read %d bytes" % len(f.read())

            got = {"lock": _attempt(take_lock), "parquet": _attempt(read_parquet)}
            os.write(w, json.dumps(got).encode() + b"\n")
            if fds:
                time.sleep(HOLD_S)
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        line = f.readline()
    assert line, "the child of another uid died before it tried"
    return pid, json.loads(line)


def _modes(root: str) -> dict[str, int]:
    out = {root: stat.S_IMODE(os.lstat(root).st_mode)}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[p] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def _write_and_check_stall(st: LakeStore, lock: str, parquet: str, groups: list[int]) -> dict:
    pid, got = other_uid_tries(lock, parquet, groups)
    try:
        t0 = time.monotonic()
        st.write_flush({"steps": [steps("b", 0, 2)]}, {("t.steps", 0): Marker(2)})
        took = time.monotonic() - t0
    finally:
        os.waitpid(pid, 0)
    assert got["lock"] == "EACCES", got              # cannot even be opened, so it cannot be held
    assert took < HOLD_S / 2, f"the flush waited {took:.1f} s on a lock another uid held"
    return got


def test_store_files_are_private_and_no_other_uid_can_hold_the_writers_lock(base, monkeypatch):
    monkeypatch.delenv("STEPWATCH_LAKE_GROUP_READ", raising=False)
    root = os.path.join(base, "store")
    os.mkdir(root, 0o755)                           # an existing data dir, as an older version left it
    st = LakeStore(root).init()
    try:
        assert st.write_flush({"steps": [steps("a", 0, 3)]}, {("t.steps", 0): Marker(1)}) > 0
        modes = _modes(root)
        lock = os.path.join(root, "lake.sqlite.lock")
        parquet = next(p for p in modes if p.endswith(".parquet"))
        assert modes[root] == 0o700 and modes[lock] == 0o600 and modes[os.path.join(root, "lake.sqlite")] == 0o600
        bad = {p: oct(m) for p, m in modes.items() if m & 0o077}
        assert not bad, bad                          # nothing for the group, nothing for the world
        got = _write_and_check_stall(st, lock, parquet, [OTHER])
        assert got["parquet"] == "EACCES", got
        assert not {p: oct(m) for p, m in _modes(root).items() if m & 0o077}     # the second flush's files too
    finally:
        st.close()


def test_group_read_lets_the_writers_group_read_but_never_take_the_lock(base, monkeypatch):
    """``STEPWATCH_LAKE_GROUP_READ=1``: a reader of another uid in the writer's group (Grafana) reads
    the Parquet files; the lock stays 0600."""
    monkeypatch.setenv("STEPWATCH_LAKE_GROUP_READ", "1")
    root = os.path.join(base, "store")
    st = LakeStore(root).init()
    try:
        st.write_flush({"steps": [steps("a", 0, 3)]}, {("t.steps", 0): Marker(1)})
        modes = _modes(root)
        lock = os.path.join(root, "lake.sqlite.lock")
        parquet = next(p for p in modes if p.endswith(".parquet"))
        assert modes[root] == 0o750 and modes[lock] == 0o600 and modes[parquet] == 0o640
        bad = {p: oct(m) for p, m in modes.items() if m & 0o027}
        assert not bad, bad                          # no group write, nothing for the world
        got = _write_and_check_stall(st, lock, parquet, [os.getegid()])
        assert got["parquet"].startswith("read ") and got["parquet"] != "read 0 bytes", got
        got = _write_and_check_stall(st, lock, parquet, [OTHER])        # not in the group: nothing
        assert got["parquet"] == "EACCES", got
    finally:
        st.close()


def test_a_lock_file_of_another_uid_is_refused_and_an_old_0644_one_is_tightened(base, monkeypatch):
    monkeypatch.delenv("STEPWATCH_LAKE_GROUP_READ", raising=False)
    root = os.path.join(base, "store")
    st = LakeStore(root).init()
    lock = os.path.join(root, "lake.sqlite.lock")
    try:
        os.chmod(lock, 0o644)
        st.write_flush({"steps": [steps("a", 0, 1)]}, {})
        assert stat.S_IMODE(os.stat(lock).st_mode) == 0o600
        os.chown(lock, OTHER, OTHER)
        with pytest.raises(PermissionError, match=f"lake lock {lock} belongs to uid {OTHER}"):
            st.write_flush({"steps": [steps("a", 1, 1)]}, {})
    finally:
        st.close()


def test_a_bad_group_read_setting_names_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPWATCH_LAKE_GROUP_READ", "maybe")
    with pytest.raises(ValueError, match="STEPWATCH_LAKE_GROUP_READ='maybe'"):
        LakeStore(tmp_path / "store")

"""Tenants sharing the trace directory cannot make each other's profile exports write elsewhere
(issue 26, finding 2). Real uids: the tests run as root and start the victim's and the attacker's
processes under two other uids that share the trace directory's group (mode 1770, as in the chart)."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import site
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest

from stepwatch.agents.profiling import protocol, summary
from stepwatch.agents.profiling.runner import ProbeLimits, ProfileRun

VICTIM, ATTACKER, GROUP = 65534, 65533, 64242
CHECKPOINT = b"model weights, epoch 41\n"
PRIVATE_PREFIX = ".stepwatch-u"             # <trace dir>/.stepwatch-u<uid>: the documented private directory

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start processes under other uids")]

# The victim: a training process of uid VICTIM running real torch profiles (ProfileRun: kineto's
# export, the summary child, the rename) into each trace directory given, one after the other.
VICTIM_PY = textwrap.dedent("""
    import json, sys, threading, time
    import torch
    from stepwatch.agents.profiling.runner import ProbeLimits, ProfileRun

    class Ctl:                                 # the probe's end of the control socket, minus the socket
        def __init__(self):
            self.replies, self.ended = [], threading.Event()
        def reply(self, body):
            self.replies.append(body)
        def done(self, run):
            self.ended.set()

    x = torch.randn(64, 64)
    for trace_dir, cmd in json.loads(sys.argv[1]):
        ctl = Ctl()
        ctl.limits = ProbeLimits("/nonexistent", env={"STEPWATCH_PROFILE_DIR": trace_dir})
        run, step = ProfileRun(ctl, cmd, 0), 0
        while run.on_step(step):
            step += 1
            (x @ x).sum()
            time.sleep(0.005)
        assert ctl.ended.wait(60)
        print(json.dumps(ctl.replies[-1]), flush=True)
""")

# The attacker: uid ATTACKER, in the same group. Plants links to the victim's checkpoint at every name
# it is given, then watches the directories and, for every new entry, plants links at the names an
# export could derive from it (and inside it, where it can), until the stop file appears.
ATTACKER_PY = textwrap.dedent("""
    import json, os, sys, time
    target, stop, dirs, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    planted = set()
    def plant(p, to=target):
        try:
            os.symlink(to, p)
            planted.add(p)
        except OSError:
            pass
    for p, to in names:
        plant(p, to)
    print("ready", flush=True)
    seen = set()
    while not os.path.exists(stop):
        for d in dirs:
            for e in os.listdir(d):
                p = os.path.join(d, e)
                if p in planted or p in seen:
                    continue
                seen.add(p)
                for suffix in (".tmp", ".gz", ".gz.tmp", ".json", ".json.gz", ".json.gz.tmp"):
                    plant(p + suffix)
                if os.path.isdir(p):
                    plant(os.path.join(p, "x.json"))
        time.sleep(0.0005)
    print(json.dumps(sorted(seen)), flush=True)
""")


def as_user(uid: int):
    def become():
        os.setgroups([GROUP])
        os.setgid(GROUP)
        os.setuid(uid)
    return become


def python_for(uid: int, base: str) -> tuple[str, dict]:
    """An interpreter ``uid`` can run, with this environment's packages: ``sys.executable`` when it
    can, else the system's Python of the same version with a ``sitecustomize`` (in ``base``) that adds
    this environment's site-packages (here the interpreter lives under root's 0700 home)."""
    try:
        subprocess.run([sys.executable, "-c", ""], preexec_fn=as_user(uid), check=True, capture_output=True)
        return sys.executable, {}
    except PermissionError:
        pass
    exe = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/local/bin:/usr/bin:/bin")
    assert exe, f"no Python {sys.version_info.major}.{sys.version_info.minor} that uid {uid} may run"
    d = os.path.join(base, "site")
    os.mkdir(d, 0o755)
    with open(os.path.join(d, "sitecustomize.py"), "w") as f:
        f.write("import site\n" + "".join(f"site.addsitedir({p!r})\n" for p in site.getsitepackages()))
    os.chmod(os.path.join(d, "sitecustomize.py"), 0o644)
    return exe, {"PYTHONPATH": d}


@pytest.fixture
def shared():
    """A world-traversable base (pytest's tmp_path is root's 0700), the victim's home with its
    checkpoint (0600, the victim's), and two trace directories 1770 root:GROUP."""
    base = tempfile.mkdtemp(prefix="stepwatch-traces-", dir="/tmp")
    os.chmod(base, 0o755)
    home = os.path.join(base, "victim")
    os.mkdir(home, 0o700)
    ckpt = os.path.join(home, "ckpt.pt")
    with open(ckpt, "wb") as f:
        f.write(CHECKPOINT)
    os.chmod(ckpt, 0o600)
    for p in (home, ckpt):
        os.chown(p, VICTIM, GROUP)
    dirs = []
    for name in ("traces-a", "traces-b"):
        d = os.path.join(base, name)
        os.mkdir(d)
        os.chown(d, 0, GROUP)
        os.chmod(d, 0o1770)
        dirs.append(d)
    yield base, home, ckpt, dirs
    shutil.rmtree(base, ignore_errors=True)


def _gz_trace(path: str) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def test_another_tenant_cannot_redirect_a_trace_export(shared):
    base, home, ckpt, (dir_a, dir_b) = shared
    cmd_a = protocol.new_command("pj", "n1", [0], 3, "torch", "a1", ttl_s=120)
    cmd_b = protocol.new_command("pj", "n1", [0], 3, "torch", "a2", ttl_s=120)
    stem_a = os.path.join(dir_a, f"pj-r0-{cmd_a['cmd_id']}")
    # in A every name an export could predict is taken by a link to the checkpoint (the private
    # directory's name to the victim's home); in B the attacker only races
    names = [(stem_a + s, ckpt) for s in (".json.gz", ".json", ".json.gz.tmp")]
    names.append((os.path.join(dir_a, f"{PRIVATE_PREFIX}{VICTIM}"), home))
    stop = os.path.join(base, "stop")
    python, extra = python_for(VICTIM, base)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "PYTHONDONTWRITEBYTECODE": "1", **extra}
    attacker = subprocess.Popen([python, "-c", ATTACKER_PY, ckpt, stop, json.dumps([dir_a, dir_b]),
                                 json.dumps(names)], preexec_fn=as_user(ATTACKER), cwd=base, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout.readline().strip() == "ready", attacker.stderr.read()
        victim = subprocess.run([python, "-c", VICTIM_PY, json.dumps([[dir_a, cmd_a], [dir_b, cmd_b]])],
                                preexec_fn=as_user(VICTIM), cwd=home, env=env, capture_output=True, text=True,
                                timeout=120)
    finally:
        with open(stop, "w"):
            pass
        out, err = attacker.communicate(timeout=10)
    assert victim.returncode == 0, victim.stderr[-3000:]
    row_a, row_b = (json.loads(line) for line in victim.stdout.splitlines()[-2:])

    # nothing the victim could write was overwritten: the checkpoint is as it was
    st = os.lstat(ckpt)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == VICTIM
    with open(ckpt, "rb") as f:
        assert f.read() == CHECKPOINT
    # the links the attacker planted are still its own links (never replaced, never followed)
    for p, to in names:
        assert os.readlink(p) == to and os.lstat(p).st_uid == ATTACKER

    # B: the race found the directory's new entries, and the trace still landed at its name
    seen = json.loads(out.strip().splitlines()[-1])
    final_b = os.path.join(dir_b, f"pj-r0-{cmd_b['cmd_id']}.json.gz")
    assert final_b in seen and os.path.join(dir_b, f"{PRIVATE_PREFIX}{VICTIM}") in seen, (seen, err)
    assert row_b["status"] == "ok" and row_b["uri"] == "file://" + final_b, row_b
    # A: the name was taken, so the trace stays in a private directory of the victim (named in the row)
    assert row_a["status"] == "ok" and "is taken" in row_a["detail"], row_a
    path_a = row_a["uri"][len("file://"):]
    priv = os.path.dirname(path_a)
    assert os.path.dirname(priv) == dir_a and os.path.basename(priv).startswith(f"{PRIVATE_PREFIX}{VICTIM}-")
    for path, row in ((final_b, row_b), (path_a, row_a)):
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == VICTIM and stat.S_IMODE(st.st_mode) == 0o640
        assert st.st_size == row["bytes"] and _gz_trace(path)["traceEvents"]
    for d in (priv, os.path.join(dir_b, f"{PRIVATE_PREFIX}{VICTIM}")):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == VICTIM and stat.S_IMODE(st.st_mode) == 0o700
    # the export leaves nothing else behind: no plain JSON, no temporary file
    assert os.listdir(os.path.join(dir_b, f"{PRIVATE_PREFIX}{VICTIM}")) == []
    assert os.listdir(priv) == [os.path.basename(path_a)]


def test_a_trace_directory_others_can_write_without_the_sticky_bit_is_refused(tmp_path):
    """There another user could rename the private directory away and put a link in its place."""
    d = tmp_path / "traces"
    d.mkdir()
    os.chmod(d, 0o770)
    replies = []

    class Ctl:
        limits = ProbeLimits("/nonexistent", env={"STEPWATCH_PROFILE_DIR": str(d)})
        reply = staticmethod(replies.append)

        def done(self, run):
            pass

    run = ProfileRun(Ctl(), protocol.new_command("pj", "n1", [0], 3, "py-spy", "a1"), 0)
    assert run.on_step(0) is False
    (r,) = replies
    assert r["status"] == "failed" and "writable by others and not sticky" in r["detail"] and str(d) in r["detail"]
    assert os.listdir(d) == []


def test_the_summary_child_never_follows_a_link_at_a_predictable_temporary_name(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1,
                                                  "tid": 1, "ts": 0, "dur": 1000}]}))
    victim = tmp_path / "ckpt.pt"
    victim.write_bytes(CHECKPOINT)
    out = tmp_path / "t.json.gz"
    os.symlink(victim, str(out) + ".tmp")
    s = summary.summarize_in_subprocess(str(trace), 1, gzip_to=str(out))
    assert s["top"][0]["name"] == "aten::mm"
    assert victim.read_bytes() == CHECKPOINT and os.readlink(str(out) + ".tmp") == str(victim)
    assert _gz_trace(str(out))["traceEvents"] and not trace.exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "t.json.gz", "t.json.gz.tmp"]

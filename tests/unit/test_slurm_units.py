"""Slurm without a cluster (issue 30): the identity ``stepwatch wrap`` takes from a task's Slurm variables,
and the lifecycle's reading of the scheduler's word (a prolog's start, an epilog's end)."""
from __future__ import annotations

import pyarrow as pa

from stepwatch.wire import tables as wire
from stepwatch.wire.decode import conform
from stepwatch.agents import slurm
from stepwatch.agents.wrap import wrap_env
from stepwatch.detectors.lifecycle import Lifecycle

from test_lifecycle import S, T0, _ctx, _end

import pytest
pytestmark = pytest.mark.unit

TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "1", "SLURMD_NODENAME": "gpu07", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "gpu07"}


def test_wrap_under_srun_takes_rank_world_and_rendezvous_from_slurm():
    env = wrap_env(dict(TASK), cmd=["python", "train.py"])
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == str(20000 + 4242 % 10000)
    assert env["STEPWATCH_JOB"] == "4242" and env["STEPWATCH_NODE"] == "gpu07"


def test_what_is_already_set_wins_and_torchrun_sets_its_own_ranks():
    env = wrap_env(dict(TASK, RANK="7", MASTER_ADDR="10.0.0.1"), job="mine", cmd=["python", "t.py"])
    assert env["RANK"] == "7" and env["MASTER_ADDR"] == "10.0.0.1" and env["STEPWATCH_JOB"] == "mine"
    env = wrap_env(dict(TASK), cmd=["torchrun", "--nproc-per-node", "2", "t.py"])
    assert "RANK" not in env and "MASTER_PORT" not in env and env["STEPWATCH_JOB"] == "4242"


def _sched(ctx, event, dt_s, state=None, exit_code=None):
    row = {"job": "j", "node": "n0", "rank": 0, "t": T0 + int(dt_s * S), "source": "slurm",
           "state": "sched_" + event, "error": state, "exit_code": exit_code}
    ctx.life.add(conform(pa.Table.from_pylist([row]), wire.SCHEMAS["inflight"]))


def test_a_job_slurm_ended_at_its_time_limit_is_that_not_a_crash_or_a_hang():
    ctx = _ctx(R=2)
    _sched(ctx, "start", -100)
    ctx.life.hung_ns = T0 - 30 * S                 # it hung before the time limit came
    _end(ctx, 0, 0.0, signal=15)
    _end(ctx, 1, 2.0, state="gone")                # SIGKILL after KillWait: no word
    assert Lifecycle().tick(ctx, T0 + 5 * S) == []  # the prolog was heard: wait for the epilog's word
    _sched(ctx, "end", 6, state="TIMEOUT", exit_code=0)
    out = Lifecycle().tick(ctx, T0 + 7 * S)
    assert [(a.kind, a.severity, a.evidence["outcome"]) for a in out] == [("job_end", "info", "time_limit")]
    assert out[0].evidence["scheduler"]["state"] == "TIMEOUT" and out[0].evidence["hung"] is True


def test_a_cancelled_job_is_cancelled_and_the_scheduler_rows_are_no_rank_state():
    ctx = _ctx(R=2)
    _sched(ctx, "end", 1, state="CANCELLED")
    out = Lifecycle().tick(ctx, T0 + 2 * S)
    assert [(a.kind, a.evidence["outcome"]) for a in out] == [("job_end", "cancelled")]
    assert not ctx.life.first                      # rank 0's end is not the scheduler's row


def test_the_epilog_body_from_its_environment():
    b = slurm.sched_body("end", {"SLURM_JOB_ID": "9", "SLURM_JOB_EXIT_CODE2": "1:0", "SLURMD_NODENAME": "n1"},
                         "FAILED")
    assert slurm.check_sched(b) | {"t": 0} == {"event": "end", "job": "9", "state": "FAILED", "exit_code": 1,
                                               "signal": None, "t": 0}
    try:
        slurm.sched_body("end", {"SLURM_JOB_ID": "x;rm"})
    except ValueError as e:
        assert "SLURM_JOB_ID" in str(e)
    else:
        raise AssertionError("a bad job id was accepted")



def test_the_topology_row_names_the_slurm_job_and_step_for_sacct(monkeypatch, tmp_path):
    """A rank srun started says its Slurm job and step (SLURM_JOB_ID, SLURM_STEP_ID) in its hello; the agent's
    topology row keeps them (``sacct -j <slurm_job>.<slurm_step>``), also when the stepwatch job is named
    otherwise; a hello whose step is not a Slurm id (uint32) is refused, naming the field."""
    import pytest

    from stepwatch.agents.agent import identity_from_hello
    from stepwatch.agents.probe import Probe
    for k, v in dict(TASK, SLURM_STEP_ID="3").items():
        monkeypatch.setenv(k, v)
    p = Probe().init(job="llama-run", socket_dir=str(tmp_path), auto=False, flush_ms=0)
    try:
        hello = p.hello_payload()
    finally:
        p.shutdown()
    assert (hello["slurm_job"], hello["slurm_step"], hello["rank"]) == (4242, 3, 1)
    row = identity_from_hello(hello, "n0", None).topology_row()
    assert (row["job"], row["slurm_job"], row["slurm_step"]) == ("llama-run", 4242, 3)
    topo = conform(pa.Table.from_pylist([row]), wire.SCHEMAS["topology"])
    assert topo.column("slurm_step").type == pa.int64() and topo.column("slurm_step").to_pylist() == [3]
    for bad in (-1, 2**32, "3", True):
        with pytest.raises(ValueError, match="slurm_step"):
            identity_from_hello(dict(hello, slurm_step=bad), "n0", None)


def test_the_shipped_systemd_units_are_hardened_and_pass_systemd_analyze_verify(tmp_path):
    import shutil
    import subprocess

    import pytest

    from stepwatch.agents.commands import systemd_unit
    for name in ("agent", "processor"):
        text = systemd_unit(name)
        for need in ("User=stepwatch", "ProtectSystem=strict", "NoNewPrivileges=yes", "CapabilityBoundingSet=\n"):
            assert need in text, (name, need)
        f = tmp_path / f"stepwatch-{name}.service"
        f.write_text(text)
        if shutil.which("systemd-analyze") is None:
            pytest.skip("systemd-analyze not installed (apt-get install systemd)")
        r = subprocess.run(["systemd-analyze", "verify", str(f)], capture_output=True, text=True)
        assert r.returncode == 0 and "stepwatch" not in r.stderr, r.stderr
    assert "Group=stepwatch-probes" in systemd_unit("agent") and "--socket-group stepwatch-probes" in systemd_unit("agent")

"""Incidents: one fault's alerts (cause and consequences, re-fires) are one incident with a stable id,
kept across a processor restart through the store."""
from __future__ import annotations

import json

from stepwatch.detectors.base import Alert
from stepwatch.detectors.incidents import Incidents, incident_id

import pytest
pytestmark = pytest.mark.unit

J = "job-i"


def al(kind, status="firing", ranks=(), step_first=100, step=105, cause="computation", node=None, aid=""):
    ranks = list(ranks)
    nodes = [node or f"n{r // 8}" for r in ranks]
    return Alert(job=J, kind=kind, status=status, step_first=step_first, step_detected=step,
                 t_detected=step * 10**9, ranks=ranks, nodes=nodes, cause=cause, alert_id=aid)


def test_a_straggler_its_consequences_and_its_refire_are_one_incident():
    inc = Incidents()
    s = al("slow_rank", ranks=[13])
    inc.assign(s)
    assert s.incident_id == incident_id(J, s.alert_id) and s.evidence["incident"]["role"] == "root"
    reg = al("regression", step_first=98, step=110, cause="communication")    # the others wait longer
    jit = al("jitter", step_first=90, step=112, cause="computation")
    for a in (reg, jit):
        inc.assign(a)
        assert a.incident_id == s.incident_id and a.evidence["incident"]["role"] == "consequence"
    res = al("slow_rank", "resolved", ranks=[13], step=150, aid=s.alert_id)
    inc.assign(res)
    assert res.incident_id == s.incident_id and res.evidence["incident"]["status"] == "resolved"
    again = al("slow_rank", ranks=[13], step_first=170, step=175)             # re-fires within the cool-down
    inc.assign(again)
    assert again.incident_id == s.incident_id and again.evidence["incident"]["role"] == "refire"
    tl = again.evidence["incident"]["timeline"]
    assert [x[1:3] for x in tl] == [["slow_rank", "firing"], ["regression", "firing"], ["jitter", "firing"],
                                    ["slow_rank", "resolved"], ["slow_rank", "firing"]]
    done = al("slow_rank", "resolved", ranks=[13], step_first=170, step=200, aid=again.alert_id)
    inc.assign(done)
    assert done.evidence["incident"]["status"] == "resolved"     # the consequence regression holds nothing
    later = al("slow_rank", ranks=[13], step_first=400, step=405)            # long after: a new fault
    inc.assign(later)
    assert later.incident_id != s.incident_id
    json.dumps(later.row())


def test_unrelated_faults_stay_apart_and_a_recovery_closes_its_regression():
    inc = Incidents()
    s = al("slow_rank", ranks=[5], cause="computation")
    io = al("regression", step_first=102, step=108, cause="io")                # data wait up on every rank
    other = al("slow_rank", ranks=[77], step_first=101, step=107)
    for a in (s, io, other):
        inc.assign(a)
    assert len({s.incident_id, io.incident_id, other.incident_id}) == 3
    rec = al("recovery", step_first=180, step=190, cause="io")
    inc.assign(rec)
    assert rec.incident_id == io.incident_id and rec.evidence["incident"]["status"] == "resolved"
    # a local alert arriving after the job-wide change it explains becomes that incident's cause
    inc2 = Incidents()
    r = al("regression", step_first=60, step=64, cause="communication")
    s2 = al("slow_node", ranks=list(range(8, 16)), step_first=58, step=66, cause="cpu")
    inc2.assign(r)
    inc2.assign(s2)
    assert s2.incident_id == r.incident_id and s2.evidence["incident"]["role"] == "cause"
    assert s2.evidence["incident"]["ranks"] == list(range(8, 16))
    assert (s2.evidence["incident"]["kind"], s2.evidence["incident"]["cause"]) == ("slow_node", "cpu")


def test_the_incident_id_survives_a_processor_restart(tmp_path):
    from stepwatch.kafkaio import KafkaSettings
    from stepwatch.stream.processor import Processor

    p1 = Processor(KafkaSettings(), tmp_path, on_alert=lambda a: None, profiling=None)
    rt = p1._job(J)
    s = al("slow_rank", ranks=[13])
    p1.emitter.emit(rt, s)
    p1._flush()
    p2 = Processor(KafkaSettings(), tmp_path, on_alert=lambda a: None, profiling=None)   # a restart
    rt2 = p2._job(J)
    reg = al("regression", step_first=99, step=110, cause="communication")
    res = al("slow_rank", "resolved", ranks=[13], step=150, aid=s.alert_id)
    p2.emitter.emit(rt2, reg)
    p2.emitter.emit(rt2, res)
    assert reg.incident_id == res.incident_id == s.incident_id
    p2._flush()
    from stepwatch.storage.views import connect
    con = connect(tmp_path)
    rows = con.execute(f"SELECT kind, status, incident_id FROM alerts WHERE job = '{J}' "
                       "ORDER BY t_detected").fetchall()
    con.close()
    assert rows == [("slow_rank", "firing", s.incident_id), ("regression", "firing", s.incident_id),
                    ("slow_rank", "resolved", s.incident_id)]


def test_a_job_slowdown_a_straggler_explains_is_its_consequence_whatever_cause_it_was_given():
    """In synchronous training the job's step time rises by about a straggler's excess busy time; the
    job-wide change's own cause (the median rank's phases, the single node's host samples) says little
    then. Explained by magnitude and coinciding with the straggler's onset, it joins the straggler's
    incident, before or after it; a slowdown far larger than the excess, or a data-wait one, stays apart."""
    def strag(step_first, step, busy=60.0, peer=45.0, cause="computation"):
        a = al("slow_rank", ranks=[1], step_first=step_first, step=step, cause=cause, node="node-a")
        a.evidence = {"busy_ms": busy, "peer_median_ms": peer}
        return a

    def reg(step_first, step, before, after, cause="cpu", series="step_ms"):
        a = al("regression", step_first=step_first, step=step, cause=cause)
        a.evidence = {"series": series, "median_before_ms": before, "median_after_ms": after} if series == "step_ms" \
            else {"series": series, "step_median_before_ms": before, "step_median_after_ms": after}
        return a

    inc = Incidents()
    s, r = strag(100, 104), reg(100, 105, 48.0, 59.0)            # +11 ms of a 15 ms straggler
    inc.assign(s)
    inc.assign(r)
    assert r.incident_id == s.incident_id and r.evidence["incident"]["role"] == "consequence"
    p = reg(101, 110, 47.0, 56.0, series="host_gap_ms")          # a phase change: its step-time shift counts
    inc.assign(p)
    assert p.incident_id == s.incident_id
    inc = Incidents()                                            # the job-wide change seen first
    r, s = reg(99, 105, 46.0, 63.0), strag(102, 106, busy=60.0, peer=42.0, cause="cpu")
    inc.assign(r)
    inc.assign(s)
    assert s.incident_id == r.incident_id and s.evidence["incident"]["role"] == "cause"
    assert s.evidence["incident"]["kind"] == "slow_rank" and s.evidence["incident"]["cause"] == "cpu"
    inc = Incidents()
    s, big, io = strag(100, 104), reg(100, 105, 48.0, 90.0), reg(101, 106, 48.0, 55.0, cause="io")
    for a in (s, big, io):
        inc.assign(a)
    assert len({s.incident_id, big.incident_id, io.incident_id}) == 3
    inc = Incidents()                                            # long before the straggler: another change
    early, s = reg(40, 50, 48.0, 55.0), strag(100, 104)
    inc.assign(early)
    inc.assign(s)
    assert early.incident_id != s.incident_id


def test_a_straggler_names_the_incident_of_the_jitter_on_its_rank():
    inc = Incidents()
    j = al("jitter", ranks=[1], step_first=90, step=107, node="node-a")
    s = al("slow_rank", ranks=[1], step_first=106, step=112, cause="cpu", node="node-a")
    inc.assign(j)
    inc.assign(s)
    assert s.incident_id == j.incident_id and s.evidence["incident"]["role"] == "cause"
    assert (s.evidence["incident"]["kind"], s.evidence["incident"]["cause"]) == ("slow_rank", "cpu")


def test_a_job_slowdown_seen_before_its_straggler_is_one_incident_whatever_the_sizes_and_causes_then():
    """The real DDP case (tests/test_ddp_real.py, CI): a job-wide regression (cause cpu: the slow rank's
    run-queue wait is half the median of two ranks) confirmed three steps before the slow_rank alert, whose
    excess at confirmation was small against the job's shift and whose cause was still ``computation``
    (its host samples came later). One fault: the straggler names the regression's incident, and the
    regressions that follow join it. A data-wait or GC change seen first is another fault."""
    inc = Incidents()
    r = al("regression", step_first=96, step=100, cause="cpu")
    r.evidence = {"series": "step_ms", "median_before_ms": 48.0, "median_after_ms": 75.0}
    s = al("slow_rank", ranks=[1], step_first=103, step=105, cause="computation", node="node-a")
    s.evidence = {"busy_ms": 52.0, "peer_median_ms": 45.0}                      # 7 ms: explains < 27 ms
    inc.assign(r)
    inc.assign(s)
    assert s.incident_id == r.incident_id and s.evidence["incident"]["role"] == "cause"
    s.cause = "cpu"                                                             # its host samples came
    inc.refresh(s)
    assert (s.evidence["incident"]["kind"], s.evidence["incident"]["cause"]) == ("slow_rank", "cpu")
    later = al("regression", step_first=107, step=115, cause="cpu")
    inc.assign(later)
    assert later.incident_id == r.incident_id
    for cause in ("io", "gc"):
        inc = Incidents()
        r = al("regression", step_first=96, step=100, cause=cause)
        s = al("slow_rank", ranks=[1], step_first=103, step=105, cause="computation", node="node-a")
        inc.assign(r)
        inc.assign(s)
        assert s.incident_id != r.incident_id, cause


def test_a_job_wide_recovery_at_a_stragglers_onset_is_its_consequence():
    """Four ranks on two cores: the rank that sleeps leaves its core to its neighbour, whose CPU wait
    drops: the job's host gap 'recovers' (cause cpu) at the fault's onset. Inside the fault's incident;
    the same recovery long after the onset, or one of the data wait, is not."""
    inc = Incidents()
    s = al("slow_rank", ranks=[1], step_first=100, step=102, node="node-a")
    rec = al("recovery", step_first=101, step=110, cause="cpu")
    inc.assign(s)
    inc.assign(rec)
    assert rec.incident_id == s.incident_id and rec.evidence["incident"]["role"] == "consequence"
    assert rec.evidence["incident"]["status"] == "firing"             # a consequence closes nothing
    for step_first, cause in ((140, "cpu"), (101, "io")):
        inc = Incidents()
        s = al("slow_rank", ranks=[1], step_first=100, step=102, node="node-a")
        rec = al("recovery", step_first=step_first, step=step_first + 9, cause=cause)
        inc.assign(s)
        inc.assign(rec)
        assert rec.incident_id != s.incident_id, (step_first, cause)


def test_a_phase_regression_before_the_step_time_moved_is_the_stragglers_consequence_in_either_order():
    """The real DDP case again (a run where both alerts came from the same block of steps, the straggler
    placed first): the job's host gap rose 0.02 -> 1.8 ms from step 95 (the slow rank's run-queue wait,
    spread back over the steps of its ~500 ms sample) while its step time had not moved yet. The phase's
    own shift is the change's size: 11.5 ms of excess explains it; one incident, whichever comes first."""
    def strag():
        s = al("slow_rank", ranks=[1], step_first=102, step=104, cause="computation", node="node-a")
        s.evidence = {"busy_ms": 53.0, "peer_median_ms": 41.5}
        return s

    def reg():
        r = al("regression", step_first=95, step=100, cause="cpu")
        r.evidence = {"series": "host_gap_ms", "median_before_ms": 0.023, "median_after_ms": 1.829,
                      "step_median_before_ms": 47.0, "step_median_after_ms": 46.6}
        return r

    for order in ((strag(), reg()), (reg(), strag())):
        inc = Incidents()
        for a in order:
            inc.assign(a)
        assert order[0].incident_id == order[1].incident_id
        last = order[1].evidence["incident"]
        assert (last["kind"], last["ranks"]) == ("slow_rank", [1])


def test_a_further_job_slowdown_joins_the_fault_that_holds_the_first_one():
    """A real DDP run on a very loaded machine: rank 1 was named slow (a false alarm) at 80 and resolved
    at 102; the hog came at 101: a host-gap regression (cause cpu) from 100 joined the rank's incident,
    rank 1 fired again from 107 (a re-fire: same incident), and the job's host gap rose further from 111.
    That further rise is the same job-wide change during the same fault (the first one is inside the
    incident, so no job-wide incident of cause cpu exists to join), and it began 4 steps after the
    rank's newest fire (its onset now, not the false alarm's 80)."""
    inc = Incidents()
    s0 = al("slow_rank", ranks=[1], step_first=80, step=86, node="node-a")
    s0.evidence = {"busy_ms": 48.4, "peer_median_ms": 41.3}
    inc.assign(s0)
    inc.assign(al("slow_rank", "resolved", ranks=[1], step_first=80, step=102, node="node-a", aid=s0.alert_id))
    r1 = al("regression", step_first=100, step=105, cause="cpu")
    r1.evidence = {"series": "host_gap_ms", "median_before_ms": 0.025, "median_after_ms": 1.585}
    s1 = al("slow_rank", ranks=[1], step_first=107, step=110, cause="cpu", node="node-a")
    s1.evidence = {"busy_ms": 51.8, "peer_median_ms": 42.2}
    r2 = al("regression", step_first=111, step=115, cause="cpu")
    r2.evidence = {"series": "host_gap_ms", "median_before_ms": 1.604, "median_after_ms": 5.584,
                   "step_median_before_ms": 50.0, "step_median_after_ms": 72.0}     # 22 ms: not explained
    for a in (r1, s1, r2):
        inc.assign(a)
    assert r1.incident_id == s1.incident_id == r2.incident_id == s0.incident_id
    assert r2.evidence["incident"]["role"] == "consequence"
    other = al("regression", step_first=112, step=116, cause="io")                 # another fault
    inc.assign(other)
    assert other.incident_id != s0.incident_id


def test_a_recovery_that_names_the_regression_it_undoes_ends_that_regressions_incident():
    """A straggler's job-wide regression is a consequence inside the straggler's incident; its recovery, far
    past ``lead_steps`` of the onset, names the regression it undoes (``evidence.transient``) and so ends
    that fault, not a new incident of its own."""
    inc = Incidents()
    s = al("slow_rank", ranks=[1], step_first=100, step=104)
    reg = al("regression", step_first=100, step=103, cause="computation")
    for a in (s, reg):
        inc.assign(a)
    assert reg.incident_id == s.incident_id
    rec = al("recovery", step_first=240, step=250, cause="computation")
    rec.evidence = {"transient": {"regression_alert": reg.alert_id, "regression_step": 100,
                                  "recovery_step": 240, "steps": 140}}
    inc.assign(rec)
    assert rec.incident_id == s.incident_id and rec.evidence["incident"]["role"] == "recovery"
    # with no such link, a speed-up long after the onset is not taken as this fault's
    other = al("recovery", step_first=262, step=270, cause="communication")
    inc.assign(other)
    assert other.incident_id != s.incident_id


def test_a_rank_named_slow_for_the_cause_of_a_job_wide_change_still_firing_is_that_fault():
    """Every rank reads 15 ms slower from step 120 (a job-wide io regression, not recovered); at step 196 one
    rank, slower than its peers, is named slow_rank with cause io: the same fault on the rank it hit most
    (eval --real, data-all: it opened an incident of its own). A compute straggler then is another fault,
    and an io straggler after the io change recovered is a new one."""
    inc = Incidents()
    reg = al("regression", step_first=120, step=123, cause="io")
    inc.assign(reg)
    s = al("slow_rank", ranks=[1], step_first=196, step=204, cause="io")
    inc.assign(s)
    assert s.incident_id == reg.incident_id and s.evidence["incident"]["role"] == "consequence"
    c = al("slow_rank", ranks=[0], step_first=200, step=206, cause="computation")
    inc.assign(c)
    assert c.incident_id != reg.incident_id
    rec = al("recovery", step_first=260, step=264, cause="io")
    inc.assign(rec)
    assert rec.incident_id == reg.incident_id
    late = al("slow_rank", ranks=[3], step_first=300, step=305, cause="io")
    inc.assign(late)
    assert late.incident_id != reg.incident_id


def test_the_others_waiting_longer_for_a_straggler_that_still_fires_is_its_consequence_however_late():
    """A real 2-rank DDP run (CI, 2 cores): rank 1 sleeps 15 ms a step from step 100 (slow_rank, excess
    16.7 ms); sixty steps later the job's wait in collectives rose 9.5 -> 11.1 ms and again 9.7 -> 13.3 at
    198 (the sleeping rank a little slower still): rank 0 waiting for rank 1, so the straggler's incident.
    A network fault (the transfers, ``comm_ms``, longer), a wait far larger than the excess, or a wait
    rising after the straggler resolved stay apart."""
    def reg(step_first, before, after, series="comm_wait_ms", step_before=57.0, step_after=58.5):
        a = al("regression", step_first=step_first, step=step_first + 5, cause="communication")
        a.evidence = {"series": series, "median_before_ms": before, "median_after_ms": after,
                      "step_median_before_ms": step_before, "step_median_after_ms": step_after}
        return a

    def straggler(inc):
        s = al("slow_rank", ranks=[1], step_first=100, step=102, node="node-a")
        s.evidence = {"busy_ms": 56.7, "peer_median_ms": 40.05}
        inc.assign(s)
        return s

    for other in (reg(170, 2.0, 4.5, series="comm_ms"),                        # the transfers: another fault
                  reg(175, 9.5, 40.0, step_before=57.0, step_after=88.0)):     # 31 ms: over 1.5 x 16.7
        inc = Incidents()
        s = straggler(inc)
        inc.assign(other)
        assert other.incident_id != s.incident_id
    inc = Incidents()
    s = straggler(inc)
    w1, w2 = reg(160, 9.5, 11.1), reg(198, 9.7, 13.3, step_before=58.0, step_after=61.0)
    for a in (w1, w2):
        inc.assign(a)
        assert a.incident_id == s.incident_id and a.evidence["incident"]["role"] == "consequence"
    inc.assign(al("slow_rank", "resolved", ranks=[1], step_first=100, step=230, node="node-a", aid=s.alert_id))
    after = reg(300, 9.5, 11.1)                                     # the straggler gone: not its wait
    inc.assign(after)
    assert after.incident_id != s.incident_id


def test_a_compute_regression_while_a_cpu_contended_straggler_fires_is_that_contention_spreading():
    """A real 2-rank DDP run (this machine, idle): a busy process pinned to rank 1's core from step 101;
    slow_rank rank 1, cause cpu (excess 13.5 ms); at step 172 the job's compute rose 42.0 -> 50.3 ms (the
    hog reaching rank 0's vCPU). That is the same fault while the straggler fires; the same change beside a
    *compute* straggler, or one far larger than the excess, stays apart."""
    def reg(step_first, before, after, cause="computation"):
        a = al("regression", step_first=step_first, step=step_first + 5, cause=cause)
        a.evidence = {"series": "compute_ms", "median_before_ms": before, "median_after_ms": after,
                      "step_median_before_ms": 55.0, "step_median_after_ms": 58.0}
        return a

    def straggler(inc, cause):
        s = al("slow_rank", ranks=[1], step_first=103, step=105, node="node-a", cause=cause)
        s.evidence = {"busy_ms": 54.685, "peer_median_ms": 41.229}
        inc.assign(s)
        return s

    inc = Incidents()
    s = straggler(inc, "cpu")
    r = reg(172, 41.96, 50.32)
    inc.assign(r)
    assert r.incident_id == s.incident_id and r.evidence["incident"]["role"] == "consequence"
    for cause, other in (("computation", reg(172, 41.96, 50.32)), ("cpu", reg(172, 41.96, 90.0))):
        inc = Incidents()
        s = straggler(inc, cause)
        inc.assign(other)
        assert other.incident_id != s.incident_id, cause


def test_a_compute_regression_of_a_job_whose_median_moves_with_its_compute_straggler_is_that_straggler():
    """A real 2-rank DDP run (make test, idle): rank 1 sleeps 15 ms a step from step 100; slow_rank rank 1,
    computation (excess 15.5 ms); at step 216 the job's compute rose 48.1 -> 54.1 ms while it still fired
    and opened an incident of its own. With 2 ranks the job-level median is the mean of both: the
    straggler's own drift moves it. The same change in a 64-rank job, or one beyond the excess, stays a
    second fault."""
    def reg(ranks, after=54.075):
        a = al("regression", step_first=216, step=225, cause="computation")
        a.evidence = {"series": "compute_ms", "median_before_ms": 48.103, "median_after_ms": after,
                      "step_median_before_ms": 70.0, "step_median_after_ms": 76.0, "ranks": ranks}
        return a

    def straggler(inc):
        s = al("slow_rank", ranks=[1], step_first=91, step=103, node="node-a", cause="computation")
        s.evidence = {"busy_ms": 55.258, "peer_median_ms": 39.754}
        inc.assign(s)
        return s

    inc = Incidents()
    s = straggler(inc)
    r = reg(2)
    inc.assign(r)
    assert r.incident_id == s.incident_id and r.evidence["incident"]["role"] == "consequence"
    for other in (reg(64), reg(2, after=120.0)):
        inc = Incidents()
        s = straggler(inc)
        inc.assign(other)
        assert other.incident_id != s.incident_id


def test_an_io_regression_of_a_job_whose_median_moves_with_its_io_straggler_is_that_straggler():
    """eval --real, data-r1 (idle): rank 1 reads 15 ms slower per batch from step 120, slow_rank rank 1,
    cause io; 77 steps later the 2-rank job's data wait rose 3 % more (cause io) and opened a second
    incident. Half the job's ranks are the straggler's: its own drift moves the job's median. In a
    64-rank job the same change is another fault."""
    def reg(ranks):
        a = al("regression", step_first=194, step=199, cause="io")
        a.evidence = {"series": "data_ms", "median_before_ms": 16.0, "median_after_ms": 17.2,
                      "step_median_before_ms": 40.0, "step_median_after_ms": 41.2, "ranks": ranks}
        return a

    for ranks, joined in ((2, True), (64, False)):
        inc = Incidents()
        s = al("slow_rank", ranks=[1], step_first=117, step=122, node="node-a", cause="io")
        s.evidence = {"busy_ms": 40.0, "peer_median_ms": 25.0}
        inc.assign(s)
        r = reg(ranks)
        inc.assign(r)
        assert (r.incident_id == s.incident_id) is joined, (ranks, r.evidence["incident"])

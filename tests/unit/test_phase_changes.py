"""Per-phase change detection of the job as a whole (ChangePoint with ``phases``): regressions and
recoveries of data wait, communication, GC and host time that move the step time only a little, each
reported once with the phase's cause; and no regression/recovery flapping on a noisy step time."""
from __future__ import annotations


import numpy as np
import pytest

from stepwatch.detectors.base import JobContext
from stepwatch.detectors.changepoint import ChangePoint
from stepwatch.detectors.slowrank import SlowRank
from testkit import alerts_of, job_context, step_blocks

pytestmark = pytest.mark.unit

R = 32


def ctx(R: int = R) -> JobContext:
    return job_context(R, 8, job="job-ph")


def ar1(rng, S, phi, sd):
    e = rng.standard_normal(S) * sd * np.sqrt(1 - phi * phi)
    u = np.empty(S)
    u[0] = rng.standard_normal() * sd
    for i in range(1, S):
        u[i] = phi * u[i - 1] + e[i]
    return u


def job(S, seed=0, comm=None, data=None, gc=None, gap=None, step_noise=None, R=R):
    """Synchronous data-parallel steps (ms): data wait 5, compute 80, host gap 2, then an all-reduce of
    10, each with heavy-tailed per-rank noise and a step-wide AR(1) jitter (the network, the input
    pipeline); the step ends when the slowest rank is through, the others wait. ``comm``/``data``/``gc``
    /``gap`` (S,) override the job-wide level of a phase per step; ``step_noise`` (S,) multiplies the
    compute of every rank (a noisy, contended job)."""
    rng = np.random.default_rng(seed)

    def lvl(x, base):
        return np.full(S, base) if x is None else np.asarray(x, float)

    def per_rank(level, rel):
        common = 1.0 + ar1(rng, S, 0.5, rel)
        own = 1.0 + 0.5 * rel * np.clip(rng.standard_t(3, (S, R)), -4, 8) / np.sqrt(3)
        return np.maximum(level[:, None] * common[:, None] * own, 0.0)

    d = per_rank(lvl(data, 5.0), 0.05)
    c = per_rank(np.full(S, 80.0), 0.01)
    if step_noise is not None:
        c *= np.asarray(step_noise, float)[:, None]
    h = per_rank(lvl(gap, 2.0), 0.05)
    g = per_rank(lvl(gc, 0.0), 0.1)
    m = per_rank(lvl(comm, 10.0), 0.04)
    own = d + c + h + g
    step = np.repeat(np.max(own + m, axis=1, keepdims=True), R, axis=1)
    return dict(step_ms=step, data_ms=d, compute_ms=c, comm_ms=m, comm_wait_ms=step - own - m, gc_ms=g)


def feed(det, arrays, block_size=7):
    return alerts_of(det, ctx(arrays["step_ms"].shape[1]), step_blocks(arrays, block_size), strict=True)


@pytest.mark.parametrize("seed", range(4))
def test_comm_time_up_30pct_on_every_rank_is_one_communication_regression(seed):
    S = 400
    comm = np.full(S, 10.0)
    comm[150:] *= 1.3
    alerts = feed(ChangePoint(), job(S, seed=seed, comm=comm), block_size=1 + seed * 5)
    assert [(a.kind, a.cause) for a in alerts] == [("regression", "communication")], [a.evidence for a in alerts]
    a = alerts[0]
    ev = a.evidence
    assert abs(a.step_first - 150) <= 3 and a.step_detected - 150 <= 10
    assert ev["series"] == "comm_ms" and 22 < ev["effect_pct"] < 40
    # the step time moved only a little (~3 %; measured on the steps that decided it, as few as min_size = 4:
    # below the step time's own 5 % floor)
    assert 1.5 < ev["step_effect_pct"] < 5.0
    assert 2.0 < a.cost_pct < 4.0 and a.ranks == [] and "collective" in a.suggestion
    # the step-time detector alone (phases off) misses it: below its 5% effect
    assert feed(ChangePoint(phases=False), job(S, seed=seed, comm=comm)) == []


@pytest.mark.parametrize("seed", range(4))
def test_comm_up_30pct_for_150_steps_then_back_gives_regression_and_recovery(seed):
    """(The transient's mechanics: a 3 ms change of a ~97 ms step, measured as 2.2-3% on the few steps that
    decide it, is judged with a 2% bar: the default, 2.5%, is at its edge.)"""
    S = 450
    comm = np.full(S, 10.0)
    comm[120:270] *= 1.30
    alerts = feed(ChangePoint(phase_min_cost=2.0), job(S, seed=10 + seed, comm=comm), block_size=3 + seed)
    assert [(a.kind, a.cause) for a in alerts] == [("regression", "communication"),
                                                   ("recovery", "communication")]
    reg, rec = alerts
    assert abs(reg.step_first - 120) <= 3 and abs(rec.step_first - 270) <= 3
    # a 30% change of a phase with ~4% autocorrelated jitter (long-run sd ~7%: a 4-sigma shift) needs
    # a few to ~10 steps to reach t = 5
    assert reg.step_detected - 120 <= 40 and rec.step_detected - 270 <= 40
    assert rec.cost_pct == 0 and reg.alert_id != rec.alert_id
    # up and back: the recovery names the regression it undoes (a transient of ~150 steps)
    tr = rec.evidence["transient"]
    assert tr["regression_alert"] == reg.alert_id and tr["regression_step"] == reg.step_first
    assert abs(tr["steps"] - 150) <= 6 and "transient" not in reg.evidence


@pytest.mark.parametrize("seed", range(2))
def test_a_phase_change_that_costs_under_the_bar_is_not_alerted(seed):
    """Comm time +15% (1.5 ms of a ~97 ms step, 1.5%): under a phase's materiality (half the step time's
    5% bar); real jobs' phases move that much as their host's load changes. Asked for, it is found."""
    S = 450
    comm = np.full(S, 10.0)
    comm[120:270] *= 1.15
    assert feed(ChangePoint(), job(S, seed=10 + seed, comm=comm)) == []
    alerts = feed(ChangePoint(phase_min_cost=1.0), job(S, seed=10 + seed, comm=comm))
    assert [(a.kind, a.cause) for a in alerts] == [("regression", "communication"), ("recovery", "communication")]


@pytest.mark.parametrize("phase,base,new,cause", [("data", 5.0, 8.0, "io"), ("gc", 0.0, 2.5, "gc"),
                                                  ("gap", 2.0, 5.0, "cpu")])
def test_data_wait_gc_and_host_time_regressions_name_their_cause(phase, base, new, cause):
    S = 360
    lv = np.full(S, base)
    lv[100:250] = new
    alerts = feed(ChangePoint(), job(S, seed=5, **{phase: lv}))
    assert [(a.kind, a.cause) for a in alerts] == [("regression", cause), ("recovery", cause)]
    assert all(abs(a.step_first - s) <= 3 for a, s in zip(alerts, (100, 250)))
    series = {"data": "data_ms", "gc": "gc_ms", "gap": "host_gap_ms"}[phase]
    assert alerts[0].evidence["series"] == series and alerts[0].evidence["step_effect_pct"] < 5


@pytest.mark.parametrize("seed", range(3))
def test_gc_tripled_on_a_quarter_of_the_ranks_for_90_steps_is_a_gc_transient(seed):
    """GC is sparse: most rank-steps pause 1-3 ms (or not at all), a few pause long. From step 100 to 189
    a quarter of the ranks, each step a different quarter, pause ~12 ms more: the job's GC time triples
    (the mean over ranks), the median over ranks barely moves, the step time moves ~1%. One gc regression
    and one gc recovery that names it (a transient), nothing else; in 5-step blocks (an agent's batch)
    the regression is confirmed within the batch after the one it starts in."""
    rng = np.random.default_rng(70 + seed)
    S, Rg = 300, 64
    arr = job(S, seed=70 + seed, R=Rg)
    base = np.where(rng.random((S, Rg)) < 0.7, rng.uniform(1.0, 3.0, (S, Rg)), 0.0)
    extra = (rng.random((S, Rg)) < 0.25) * rng.uniform(8.0, 16.0, (S, Rg))
    extra[:100] = 0.0
    extra[190:] = 0.0
    gc = base + extra
    assert np.median(gc[100:190]) - np.median(gc[:100]) < 1.0 and gc[100:190].mean() > 2.5 * gc[:100].mean()
    # the steps as the synchronous job sees them: the slowest rank (its GC included) ends the step
    own = arr["data_ms"] + arr["compute_ms"] + arr["step_ms"] * 0 + gc
    step = np.repeat(np.max(own + arr["comm_ms"], axis=1, keepdims=True), Rg, axis=1)
    arr.update(gc_ms=gc, step_ms=step, comm_wait_ms=step - own - arr["comm_ms"])
    alerts = feed(ChangePoint(), arr, block_size=5)
    assert [(a.kind, a.cause, a.evidence["series"]) for a in alerts] == [
        ("regression", "gc", "gc_ms"), ("recovery", "gc", "gc_ms")], [a.evidence for a in alerts]
    reg, rec = alerts
    assert abs(reg.step_first - 100) <= 2 and reg.step_detected <= 109
    assert abs(rec.step_first - 190) <= 2 and rec.evidence["transient"]["regression_alert"] == reg.alert_id


def test_a_big_phase_change_is_one_alert_led_by_the_step_time():
    S = 300
    data = np.full(S, 5.0)
    data[150:] = 25.0                                   # +20 ms of ~107: the step time moves too
    alerts = feed(ChangePoint(), job(S, seed=6, data=data))
    assert [(a.kind, a.cause) for a in alerts] == [("regression", "io")]
    ev = alerts[0].evidence
    assert ev["series"] == "step_ms" and "data_ms" in ev["also_changed"]


@pytest.mark.parametrize("seed", range(5))
def test_clean_noisy_phases_give_nothing(seed):
    rng = np.random.default_rng(50 + seed)
    S = 1000
    # heavy-tailed, autocorrelated job-wide noise on every phase (and single slow steps)
    noise = 1.0 + ar1(rng, S, 0.7, 0.03) + 0.01 * np.clip(rng.standard_t(3, S), -5, 20)
    noise[rng.random(S) < 0.02] *= 1.5
    comm = 10.0 * (1.0 + ar1(rng, S, 0.7, 0.04))
    data = 5.0 * (1.0 + ar1(rng, S, 0.6, 0.06))
    assert feed(ChangePoint(), job(S, seed=seed, comm=comm, data=data, step_noise=noise), block_size=10) == []


@pytest.mark.parametrize("seed", range(4))
def test_noisy_contended_step_time_does_not_flap(seed):
    """A small job on shared CPUs: steady, bursty step-time noise (autocorrelated, heavy-tailed, ±10%),
    then one real fault (+25% from step 250, noisier still). One regression, nothing else: no
    regression/recovery taking turns on the noise."""
    rng = np.random.default_rng(70 + seed)
    S = 700
    burst = np.exp(ar1(rng, S, 0.6, 0.07) + 0.03 * np.clip(rng.standard_t(2, S), -10, 10))
    burst[250:] *= 1.25 * np.exp(ar1(rng, S - 250, 0.5, 0.06))
    alerts = feed(ChangePoint(), job(S, seed=seed, step_noise=burst), block_size=5)
    assert [a.kind for a in alerts] == ["regression"], [(a.kind, a.step_first) for a in alerts]
    assert abs(alerts[0].step_first - 250) <= 5


@pytest.mark.parametrize("seed", range(4))
def test_two_rank_job_on_shared_cores_does_not_flap(seed):
    """The real case: two DDP ranks on CPUs, steady bursty noise on both from the start, one foreign
    process on rank 1's core from step 250 (rank 1 slower and noisier; rank 0 waits for it)."""
    rng = np.random.default_rng(90 + seed)
    S, R2 = 700, 2
    base = np.exp(ar1(rng, S, 0.6, 0.08) + 0.04 * np.clip(rng.standard_t(2, S), -10, 10))
    arrays = job(S, seed=seed, step_noise=base, R=R2)
    extra = np.zeros(S)
    extra[250:] = 80.0 * 0.3 * np.exp(ar1(rng, S - 250, 0.5, 0.3))      # ~+30% on rank 1, bursty
    own = arrays["step_ms"] - arrays["comm_wait_ms"] - arrays["comm_ms"]
    arrays["compute_ms"][:, 1] += extra
    own[:, 1] += extra
    step = np.max(own + arrays["comm_ms"], axis=1, keepdims=True)
    arrays["step_ms"] = np.repeat(step, R2, axis=1)
    arrays["comm_wait_ms"] = arrays["step_ms"] - own - arrays["comm_ms"]
    alerts = feed(ChangePoint(), arrays, block_size=5)
    # the job's comm wait rises (rank 0 now waits for rank 1) with no pipeline stage to be imbalanced: a
    # straggler, which the slow-rank detector names (one incident naming rank 1, not a job-wide
    # "parallelism" regression beside it); never regression/recovery taking turns on the noise (before:
    # up to 16 alternating alerts on such a job). On one draw the same fault also shows as a compute
    # change placed 20 steps early on this very noisy series.
    kinds = [(a.kind, a.step_first, a.evidence["series"]) for a in alerts]
    assert len(alerts) <= 1 and all(a.kind == "regression" and a.evidence["series"] == "compute_ms"
                                    for a in alerts), kinds
    named = [a for a in feed(SlowRank(), arrays, block_size=5) if a.status == "firing"]
    assert named and named[0].ranks == [1] and abs(named[0].step_first - 250) <= 8, \
        [(a.kind, a.ranks, a.step_first) for a in named]


def test_persist_setting_is_validated():
    with pytest.raises(ValueError):
        ChangePoint(persist=0.3)


def test_the_warm_up_steps_are_no_before_to_compare_with():
    """A DataLoader filling its queue makes the first steps' data wait 5x: with the job's first 10 steps left
    out, no recovery is reported; judged from step 0, one is."""
    data = np.full(200, 5.0)
    data[:8] = 25.0
    kinds = lambda det: [(a.kind, a.evidence["series"]) for a in feed(det, job(200, seed=3, data=data))]  # noqa: E731
    assert kinds(ChangePoint()) == []
    # judged from step 0 the drop is a recovery (led by the step time it moved); alerted only when a
    # recovery need not undo a reported regression
    assert [k for k, _ in kinds(ChangePoint(warmup=0, steady=False, recovery_needs_regression=False))] == ["recovery"]
    assert kinds(ChangePoint(warmup=0)) == []


def test_a_recovery_that_undoes_no_reported_regression_is_not_alerted():
    """A job that gets faster some steps in (the machine's other processes settling) has nothing to
    recover from: no alert. A regression and its recovery later in the same job are both reported."""
    mult = np.ones(300)
    mult[:60] = 1.15                                     # compute 15% slower for the first 60 steps
    mult[180:240] = 1.2                                  # a real regression, then back
    got = [(a.kind, a.step_first) for a in feed(ChangePoint(), job(300, seed=4, step_noise=mult))]
    assert [k for k, _ in got] == ["regression", "recovery"], got
    assert abs(got[0][1] - 180) <= 3 and abs(got[1][1] - 240) <= 3, got


def _feed_from(det, arrays, start, stop, block_size=7):
    """Steps ``start``..``stop`` of ``arrays`` (their own step numbers), as a processor that met the job
    there would see them."""
    return alerts_of(det, ctx(arrays["step_ms"].shape[1]), step_blocks(arrays, block_size, start=start, stop=stop))


def test_a_processor_rebuilt_after_a_regression_reports_its_recovery_from_the_stored_alert():
    """The regression began before a rebuilt processor's replay window: the fresh detector never saw it
    happen, only the stored alert tells it. Handed the job's open alerts (stream/rebuild.py), it reports
    the recovery, marked transient with the regression's id; without them it has nothing to recover from.
    A regression a stored recovery already undid is not open."""
    mult = np.ones(360)
    mult[60:250] = 1.2                                   # regression at 60, back at 250
    arrays = job(360, seed=6, step_noise=mult)
    first = _feed_from(ChangePoint(), arrays, 0, 150)   # the processor before the restart
    assert [a.kind for a in first] == ["regression"], [(a.kind, a.step_first) for a in first]
    reg = first[0]
    rebuilt = ChangePoint()
    rebuilt.restore_open(first)
    got = _feed_from(rebuilt, arrays, 150, 360)         # replay window and live stream after the restart
    assert [a.kind for a in got] == ["recovery"], [(a.kind, a.step_first) for a in got]
    assert abs(got[0].step_first - 250) <= 3
    assert got[0].evidence["transient"]["regression_alert"] == reg.alert_id
    assert _feed_from(ChangePoint(), arrays, 150, 360) == []
    # a regression a stored recovery already undid is not open: the same drop is no recovery again
    undone = ChangePoint()
    undone.restore_open(first + got)
    assert _feed_from(undone, arrays, 150, 360) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_phase_that_shrinks_while_the_fault_goes_on_is_no_recovery(seed):
    """A compute regression at step 100 that lasts; at step 200 the all-reduce gets 30 % shorter (the
    network got quieter) while the job stays slow. That undoes no reported regression: no ``recovery``
    (CI: comm wait 11.2 -> 9.5 ms seventy steps into a 15 ms straggler, the job still at 57 ms a step
    against 43 before, was alerted as a recovery and opened an incident of its own). When the fault
    itself goes, the recovery is alerted and names the regression it undoes."""
    mult = np.ones(400)
    mult[100:] = 1.3
    comm = np.full(400, 10.0)
    comm[200:] = 7.0
    got = feed(ChangePoint(), job(400, seed=seed, step_noise=mult, comm=comm))
    assert [a.kind for a in got] == ["regression"], [(a.kind, a.step_first, a.evidence["series"]) for a in got]
    mult[300:] = 1.0                                     # now the fault goes
    got = feed(ChangePoint(), job(400, seed=seed, step_noise=mult, comm=comm))
    assert [a.kind for a in got] == ["regression", "recovery"], [(a.kind, a.step_first) for a in got]
    assert got[1].evidence["transient"]["regression_alert"] == got[0].alert_id


@pytest.mark.parametrize("seed", range(3))
def test_a_clear_phase_change_below_the_cost_floor_is_reported_and_a_submillisecond_one_is_not(seed):
    """The held-out producer's faults (docs/eval.md, family indep): GC per step 1.5 -> 4.5 ms on every rank
    of an ~900 ms step (0.3 % of it; there also host time +40 %, 2.2 % of it), many times its own noise sd
    while the step time's noise (2-3 % a step) hides it; the 2.5 % cost floor dropped all such changes
    (recall 0.79 on that family). A phase whose level moved by >= phase_clear_sd of its own noise is a
    change of what the job does: reported with its own cause. One that moved by less than a scheduler's
    time slice (0.06 ms of host time, real gloo ranks) is not, however many of its sd that is."""
    S = 300
    mult = np.full(S, 10.0)                              # compute 800 ms: a ~900 ms step
    gc = np.full(S, 1.5)
    gc[120:] = 4.5
    got = feed(ChangePoint(), job(S, seed=seed, step_noise=mult, gc=gc))
    assert [(a.kind, a.cause) for a in got] == [("regression", "gc")], [(a.kind, a.step_first) for a in got]
    assert abs(got[0].step_first - 120) <= 3 and got[0].cost_pct < 1.0
    tiny = np.full(S, 0.02)
    tiny[120:] = 0.08                                    # 4x, but 0.06 ms a step
    assert feed(ChangePoint(), job(S, seed=seed, step_noise=mult, gap=tiny)) == []


@pytest.mark.parametrize("seed", range(6))
def test_a_slowdown_that_came_slowly_is_held_and_a_step_change_is_still_decided_at_once(seed):
    """``decide_steps``: a job whose speed wanders (a random walk) or creeps up by 10 % over 120 steps
    reaches a level that passes the tests against the level before only long after the break the search
    places in it (the old code: regressions decided 57 steps after their first step on 2 of 6 ramps and 1
    of 6 walks, as on real clean runs). Such a level is held, never reported; the same 10 % as a step is
    decided within 12 steps (half of decide_steps)."""
    S = 300
    rng = np.random.default_rng(seed + 50)
    walk = np.cumsum(rng.standard_normal(S)) * 0.004
    ramp = np.ones(S)
    ramp[100:220] = 1 + np.linspace(0, 0.10, 120)
    ramp[220:] = 1.10
    for noise in (ramp, 1 + walk - walk.min()):
        got = alerts_of(ChangePoint(), ctx(), step_blocks(job(S, seed=seed, step_noise=noise), 1))
        assert [a for a in got if a.kind == "regression"] == []
    step = np.ones(S)
    step[150:] = 1.10
    got = [a for a in alerts_of(ChangePoint(), ctx(), step_blocks(job(S, seed=seed, step_noise=step), 1))
           if a.kind == "regression"]
    assert len(got) == 1 and abs(got[0].step_first - 150) <= 4 and got[0].step_detected - 150 <= 12

"""Change points: the offline find() and the streaming ChangePoint detector."""
from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

from stepwatch.detectors.base import JobContext, StepBlock
from stepwatch.detectors.changepoint import ChangePoint
from stepwatch.detectors.cpsearch import find, median_filter, noise_sigma
from testkit import alerts_of, job_context

pytestmark = pytest.mark.unit


# -- find() ------------------------------------------------------------------------------------------
def series(rng, n, changes=(), base=100.0, sd=0.02, spikes_every=0, tail=0.0):
    """Piecewise-constant level (``changes`` = [(index, factor)], cumulative) with Gaussian noise of
    relative sd, optional Student-t(3) noise and 40% single-step spikes every ``spikes_every``."""
    level = np.full(n, base)
    for i, f in changes:
        level[i:] *= f
    x = level * (1.0 + sd * rng.standard_normal(n) + tail * rng.standard_t(3, n))
    if spikes_every:
        x[int(rng.integers(0, spikes_every))::spikes_every] *= 1.4
    return x


def near(found, truth, tol=3):
    return len(found) == len(truth) and all(abs(f - t) <= tol for f, t in zip(sorted(found), truth))


def test_find_single_change():
    rng = np.random.default_rng(11)
    for _ in range(10):
        x = series(rng, 300, [(120, 1.10)], spikes_every=100, tail=0.005)
        assert near(find(x), [120])


def test_find_two_changes_up_and_down():
    rng = np.random.default_rng(12)
    for _ in range(10):
        x = series(rng, 400, [(100, 1.12), (250, 1 / 1.12)], spikes_every=50)
        assert near(find(x), [100, 250])


def test_find_no_change_with_spikes_and_heavy_tails():
    rng = np.random.default_rng(13)
    for n in (30, 200, 1000):
        for _ in range(20):
            x = series(rng, n, spikes_every=37, tail=0.01)
            x[rng.integers(0, n, size=max(1, n // 100))] *= 1.6     # random isolated outliers too
            assert find(x) == []


def test_find_change_at_the_end_with_min_size_points():
    rng = np.random.default_rng(14)
    x = series(rng, 200, [(194, 1.15)], sd=0.01)
    assert near(find(x), [194], tol=1)
    assert find(x[:197]) == []                  # only 3 points after it: not yet a segment


def test_find_spike_on_last_point_is_not_a_change():
    rng = np.random.default_rng(15)
    for _ in range(20):
        x = series(rng, 150)
        x[-1] *= 1.4
        assert find(x) == []


def test_find_handles_nan_and_maps_indices_back():
    rng = np.random.default_rng(16)
    x = series(rng, 300, [(150, 1.2)])
    x[rng.random(300) < 0.1] = np.nan
    x[150:153] = np.nan                          # the first points of the new segment are missing
    b = find(x)
    assert len(b) == 1 and 150 <= b[0] <= 156 and np.isfinite(x[b[0]])
    assert find(np.full(50, np.nan)) == []
    assert find([np.nan, 1.0, np.inf, 2.0]) == []


def test_find_degenerate_inputs():
    assert find([]) == []
    assert find([5.0] * 100) == []              # constant
    assert find([1.0, 2.0, 3.0]) == []          # shorter than 2 * min_size
    assert find(np.r_[np.ones(30), 2 * np.ones(30)]) == [30]     # exact steps, zero noise
    assert find(np.r_[np.ones(30), 2 * np.ones(30)], min_size=40) == []


def test_find_options():
    rng = np.random.default_rng(17)
    x = series(rng, 300, [(100, 1.2)])
    assert find(x, penalty=1e12) == []
    assert near(find(x, jump=5), [100])          # refined back to the exact point
    assert near(find(x, search="binseg"), [100])
    assert near(find(x, model="l1", penalty=50.0, refine=False), [100])
    with pytest.raises(ValueError):
        find(x, model="l1")                      # auto penalty is calibrated for l2 only
    with pytest.raises(ValueError):
        find(x, search="nope")


def test_find_is_fast_on_5000_points():
    rng = np.random.default_rng(18)
    x = series(rng, 5000, [(1000, 1.1), (2500, 1.2), (4000, 1 / 1.3)], spikes_every=100, tail=0.005)
    x[rng.random(5000) < 0.01] = np.nan
    t = time.perf_counter()
    b = find(x)
    elapsed = time.perf_counter() - t
    assert near(b, [1000, 2500, 4000])
    assert elapsed < 2.0, f"find() took {elapsed:.2f} s at n=5000"


def test_noise_sigma_and_median_filter():
    rng = np.random.default_rng(19)
    x = 3.0 * rng.standard_normal(20000)
    x[::50] += 100.0                              # spikes barely move the robust estimate
    x[10000:] += 40.0                             # nor does a level shift
    assert 2.8 < noise_sigma(x) < 3.3
    assert noise_sigma([1.0, 2.0]) == 0.0
    y = np.array([1, 1, 9, 1, 1, 5, 5, 5, 5, 9.0])
    assert list(median_filter(y, 5)) == [1, 1, 1, 1, 5, 5, 5, 5, 5, 5]


# -- streaming ChangePoint ---------------------------------------------------------------------------
R = 32


def ctx(pp: int = 1) -> JobContext:
    return job_context(R, 8, pp, job="job-cp")


def blocks(job_factor, data=None, block_size=10, seed=0, nan_steps=(), rank_factor=None):
    """Synchronous steps whose duration follows ``job_factor`` (per step); per-rank jitter is small.
    ``data`` (per step, ms) replaces the 5 ms data wait when given (the extra time is data wait);
    ``rank_factor`` (S, R) multiplies each rank's compute (stragglers, slow stages)."""
    rng = np.random.default_rng(seed)
    S = len(job_factor)
    compute = 80.0 * job_factor[:, None] * (1.0 + 0.002 * rng.standard_normal((S, R)))
    if rank_factor is not None:
        compute *= rank_factor
    d = np.full((S, R), 5.0) if data is None else np.repeat(np.asarray(data, float)[:, None], R, axis=1)
    own = d + compute + 2.0
    step = np.repeat(np.max(own + 10.0, axis=1, keepdims=True), R, axis=1)
    arrays = dict(step_ms=step, data_ms=d, compute_ms=compute, comm_ms=np.full((S, R), 10.0),
                  comm_wait_ms=step - own - 10.0, gc_ms=np.zeros((S, R)))
    for s in nan_steps:
        for a in arrays.values():
            a[s] = np.nan
    for i in range(0, S, block_size):
        sl = slice(i, min(S, i + block_size))
        steps = np.arange(sl.start, sl.stop, dtype=np.int64)
        yield StepBlock(steps=steps, t_end=(steps + 1) * 10**8, **{k: v[sl] for k, v in arrays.items()})


def job_noise(rng, S, spikes=True):
    """2% Gaussian + heavy-tailed (t3, 1%) step-time noise, 40% checkpoint spike every 100 steps."""
    f = 1.0 + 0.02 * rng.standard_normal(S) + 0.01 * rng.standard_t(3, S)
    if spikes:
        f[int(rng.integers(0, 100))::100] *= 1.4
    return f


def feed(det, gen, pp: int = 1):
    return alerts_of(det, ctx(pp), gen, strict=True)           # the detector must not leak numpy warnings


@pytest.mark.parametrize("seed", range(6))
def test_streaming_regression_then_recovery(seed):
    rng = np.random.default_rng(100 + seed)
    f = job_noise(rng, 500)
    f[150:] *= 1.10
    f[320:] /= 1.10
    alerts = feed(ChangePoint(), blocks(f, seed=seed, block_size=int(rng.integers(1, 30))))
    assert [a.kind for a in alerts] == ["regression", "recovery"]
    reg, rec = alerts
    assert abs(reg.step_first - 150) <= 3 and reg.step_detected - 150 <= 10
    assert abs(rec.step_first - 320) <= 3 and rec.step_detected - 320 <= 10
    assert reg.status == rec.status == "firing" and reg.ranks == []
    assert 6.0 < reg.cost_pct < 14.0 and rec.cost_pct == 0.0
    assert reg.cause == "computation" and rec.cause == "computation"
    assert reg.evidence["median_after_ms"] > reg.evidence["median_before_ms"]
    assert reg.evidence["phases"]["compute_ms"]["delta"] > 0
    assert reg.t_detected == (reg.step_detected + 1) * 10**8
    assert reg.alert_id != rec.alert_id


@pytest.mark.parametrize("seed", range(6))
def test_streaming_clean_series_with_checkpoint_spikes_gives_nothing(seed):
    rng = np.random.default_rng(200 + seed)
    assert feed(ChangePoint(), blocks(job_noise(rng, 800), seed=seed)) == []


def test_streaming_cause_io_when_data_wait_grows():
    rng = np.random.default_rng(300)
    S = 260
    f = job_noise(rng, S)
    data = np.full(S, 5.0)
    data[150:] = 20.0                            # the data loader falls behind: +15 ms per step
    alerts = feed(ChangePoint(), blocks(f, data=data))
    assert [a.kind for a in alerts] == ["regression"]
    a = alerts[0]
    assert abs(a.step_first - 150) <= 3
    assert a.cause == "io" and a.evidence["phase"] == "data_ms" and "DataLoader" in a.suggestion


def test_streaming_reports_each_change_once_as_the_window_slides():
    rng = np.random.default_rng(400)
    f = job_noise(rng, 1200)
    f[150:] *= 1.25
    alerts = feed(ChangePoint(), blocks(f, block_size=50))
    assert [(a.kind, abs(a.step_first - 150) <= 3) for a in alerts] == [("regression", True)]
    assert alerts[0].severity == "critical"


def test_streaming_small_shift_below_min_effect_is_ignored():
    rng = np.random.default_rng(500)
    f = 1.0 + 0.005 * rng.standard_normal(400)  # quiet: a 3% shift is obvious but below 5%
    f[200:] *= 1.03
    assert feed(ChangePoint(), blocks(f)) == []
    alerts = feed(ChangePoint(min_effect=0.02), blocks(f))
    assert [a.kind for a in alerts] == ["regression"] and abs(alerts[0].step_first - 200) <= 3


def test_streaming_nan_only_steps_emit_nothing():
    rng = np.random.default_rng(600)
    f = job_noise(rng, 300)
    nan_steps = list(range(40, 60)) + [100, 101]
    assert feed(ChangePoint(), blocks(f, nan_steps=nan_steps)) == []
    f[200:] *= 1.15
    alerts = feed(ChangePoint(), blocks(f, nan_steps=nan_steps + list(range(201, 204))))
    assert [a.kind for a in alerts] == ["regression"] and abs(alerts[0].step_first - 200) <= 4


def test_straggler_driven_change_is_left_to_slow_rank_but_a_slow_stage_is_reported():
    rng = np.random.default_rng(700)
    S = 400
    f = job_noise(rng, S)
    one = np.ones((S, R))
    one[150:300, 5] = 1.3                        # one slow rank: every step waits for it
    assert feed(ChangePoint(), blocks(f, rank_factor=one)) == []
    alerts = feed(ChangePoint(defer_stragglers=False), blocks(f, rank_factor=one))
    assert [(a.kind, a.cause) for a in alerts] == [("regression", "parallelism"), ("recovery", "parallelism")]
    assert abs(alerts[0].step_first - 150) <= 3 and abs(alerts[1].step_first - 300) <= 3
    stage = np.ones((S, R))
    stage[150:, 16:20] = 1.3                     # one pipeline stage of eight gets slower
    alerts = feed(ChangePoint(), blocks(f, rank_factor=stage), pp=8)
    assert [(a.kind, a.cause) for a in alerts] == [("regression", "parallelism")]
    assert abs(alerts[0].step_first - 150) <= 3
    assert alerts[0].evidence["busiest_stage_busy_delta_ms"] > 10
    # without stages in the topology the same 4 slow ranks look like stragglers: left to slow_rank
    assert feed(ChangePoint(), blocks(f, rank_factor=stage)) == []


def test_invalid_settings_rejected():
    with pytest.raises(ValueError):
        ChangePoint(window=10, min_size=5)
    with pytest.raises(ValueError):
        ChangePoint(every=0)


# -- find() defaults: long-run noise, local-trend confirmation ----------------------------------------
def test_find_does_not_cut_smooth_curves_or_ar1_noise_into_steps():
    rng = np.random.default_rng(30)
    t = np.arange(816, dtype=float)
    growth = 1000.0 * np.exp(2.0 * t / 816) * (1.0 + 0.003 * rng.standard_normal(816))   # a population curve
    assert len(find(growth)) <= 1
    assert len(find(growth, autocorr=False, trend=False)) > 20                   # what the old defaults did
    t = np.arange(104, dtype=float)
    co2 = 300 + 0.1 * t + 3.0 * np.sin(2 * np.pi * t / 12) + 0.2 * rng.standard_normal(104)
    assert find(co2) == []
    for phi in (0.5, 0.8):
        for _ in range(10):
            e = rng.standard_normal(600)
            u = np.zeros(600)
            for i in range(1, 600):
                u[i] = phi * u[i - 1] + e[i]
            assert find(u) == []


def test_find_keeps_an_abrupt_shift_on_a_trend_and_in_ar1_noise():
    rng = np.random.default_rng(31)
    t = np.arange(500, dtype=float)
    x = 0.02 * t + rng.standard_normal(500)
    x[300:] += 5.0
    assert near(find(x), [300])
    e = rng.standard_normal(500)
    u = np.zeros(500)
    for i in range(1, 500):
        u[i] = 0.6 * u[i - 1] + 0.8 * e[i]
    u[200:] += 8.0                                # 4 long-run sd (sigma_lr = 0.8 / 0.4 = 2)
    assert near(find(u), [200])


def test_noise_scales_reads_ar1_coefficient():
    from stepwatch.detectors.cpsearch import noise_scales
    rng = np.random.default_rng(32)
    for phi in (0.0, 0.5, 0.8):
        e = rng.standard_normal(20000)
        u = np.zeros(20000)
        for i in range(1, 20000):
            u[i] = phi * u[i - 1] + e[i] * np.sqrt(1 - phi * phi)
        sd, r, lr = noise_scales(u)
        assert abs(r - phi) < 0.06 and abs(sd - 1.0) < 0.1
        assert abs(lr - np.sqrt((1 + phi) / (1 - phi))) < 0.25


def test_bench_scores():
    from stepwatch.devtools.bench import changepoint_series, cp_cover, cp_f1
    assert cp_f1([], [], 100) == 1.0 and cp_cover([], [], 100) == 1.0
    assert cp_f1([50], [52], 100) == 1.0 and cp_f1([50], [], 100) == pytest.approx(2 / 3)
    assert cp_cover([50], [], 100) == pytest.approx(0.5)
    series = changepoint_series(per_family=4, seed=1)
    assert len(series) == 20 and all(len(s["y"]) >= 100 for s in series)
    assert {s["family"] for s in series if s["cps"]} == {"steptime", "trend", "seasonal", "ar1"}


@pytest.mark.parametrize("seed", range(4))
def test_one_fault_that_wanders_is_one_regression_and_one_recovery(seed):
    """A foreign process on a rank's core (tests/test_ddp_real.py) makes the step time wander between
    levels, each far above the baseline: +50 %, +30 %, +55 %, +35 %, +50 %, then the fault ends. Each dip
    and rise passes the tests against its neighbour segment, but it is one fault: one regression, and one
    recovery when the level is back near the baseline (hysteresis), marked as undoing it; nothing found
    late about the steps in between."""
    rng = np.random.default_rng(700 + seed)
    lv = np.repeat([1.0, 1.5, 1.3, 1.55, 1.35, 1.5, 1.0], [120, 30, 25, 30, 25, 30, 150])
    alerts = feed(ChangePoint(), blocks(job_noise(rng, len(lv), spikes=False) * lv, seed=seed, block_size=5))
    assert [(a.kind, a.step_first) for a in alerts] == [("regression", 120), ("recovery", 260)], \
        [(a.kind, a.step_first, a.step_detected) for a in alerts]
    assert alerts[1].evidence["transient"]["regression_step"] == 120


@pytest.mark.parametrize("seed", range(4))
def test_a_fault_that_grows_is_reported_at_each_material_rise(seed):
    """Hysteresis holds back the wandering, not a job that really gets slower again: +30 %, then +30 %
    more, then back: two regressions and the recovery."""
    rng = np.random.default_rng(800 + seed)
    lv = np.repeat([1.0, 1.3, 1.7, 1.0], [120, 60, 60, 100])
    alerts = feed(ChangePoint(), blocks(job_noise(rng, len(lv), spikes=False) * lv, seed=seed, block_size=5))
    assert [a.kind for a in alerts] == ["regression", "regression", "recovery"], \
        [(a.kind, a.step_first, a.step_detected) for a in alerts]
    assert [abs(a.step_first - s) <= 3 for a, s in zip(alerts, (120, 180, 240))] == [True] * 3


@pytest.mark.parametrize("seed", range(4))
def test_a_clear_shift_is_decided_on_its_fourth_step_whatever_the_batching(seed):
    """Decided per step (``every`` = 1, ``min_size`` = 4): a 15 % shift in 2-3 % noise is confirmed on
    the 4th step of the new level, 3 steps after it started, in 1-step and in 5-step blocks alike (an
    agent's batching delays the alert's emission, not the step it was decided at)."""
    rng = np.random.default_rng(900 + seed)
    f = job_noise(rng, 300, spikes=False)
    f[150:] *= 1.15
    got = []
    for bs in (1, 5, 7):
        alerts = feed(ChangePoint(), blocks(f, seed=seed, block_size=bs))
        assert [(a.kind, a.step_first) for a in alerts] == [("regression", 150)]
        got.append(alerts[0].step_detected)
    assert got == [153, 153, 153]

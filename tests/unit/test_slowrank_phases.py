"""slow_rank's per-phase sequential tests on the independent producer's telemetry
(:mod:`stepwatch.devtools.scenarios_indep`: Student-t(3) compute noise, a gamma data wait of 25% sd, AR(1) drift,
checkpoints), aligned by the processor's JobState and fed to the detector in the producer's 5-step
batches: a 5% compute straggler is confirmed within 10 steps although it is only ~2.5 sd of the busy
time (4.4 sd of the compute time); 5% of the ranks slow at once are each named (the median is still
the healthy ranks', and no rank needs to be a lone outlier); clean jobs stay quiet."""
from __future__ import annotations

import numpy as np
import pytest

from stepwatch.detectors.base import StepBlock
from stepwatch.detectors.slowrank import SlowRank
from stepwatch.detectors.slowrank_stats import OWN_PHASES
from stepwatch.devtools.scenarios_indep import IndepJob, IndepScenario
from stepwatch.stream.align import JobState

pytestmark = pytest.mark.unit

FIELDS = ("step_ms", "data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms")


def feed(sc: IndepScenario, block: int = 5):
    """(alerts as (kind, status, ranks, step_first, step_detected, evidence), detector)."""
    job = IndepJob(sc)
    st = JobState(sc.job, world_size=sc.ranks, capacity=sc.steps + 8)
    st.set_topology(job.topology())
    ss, rr = np.nonzero(job.reported)
    _, blocks = st.ingest(job._steps_table(ss, rr))
    blocks += st.close_ready(force=True)
    cat = lambda f: np.concatenate([getattr(b, f) for b in blocks])  # noqa: E731
    full = StepBlock(cat("steps"), cat("t_end"), *(cat(f) for f in FIELDS))
    det, ctx, out = SlowRank(), st.context(), []
    for i in range(0, len(full.steps), block):
        b = StepBlock(full.steps[i:i + block], full.t_end[i:i + block],
                      *(getattr(full, f)[i:i + block] for f in FIELDS))
        out += [(a.kind, a.status, a.ranks, a.step_first, a.step_detected, a.evidence) for a in det.update(ctx, b)]
    return out, det


@pytest.mark.parametrize("seed", range(4))
def test_a_5pct_compute_straggler_is_confirmed_within_10_steps_by_its_compute_series(seed):
    sc = IndepScenario("p5", [dict(kind="straggler", rank=133, pct=5, start=60)], seed=111 + 1000 * seed)
    out, det = feed(sc)
    firing = [o for o in out if o[1] == "firing"]
    assert [(o[0], o[2]) for o in firing] == [("slow_rank", [133])], firing
    kind, _, _, first, detected, ev = firing[0]
    assert detected - 60 <= 10 and 50 <= first <= 66
    assert ev["fired_by"] == "accumulation" and ev["tested_series"] == "compute_ms"
    # the busy time's noise is several phases' noise: the compute series is the quieter one
    sig = dict(zip(("busy_ms",) + OWN_PHASES, [det._sigma, *det._sigma_p[1:]]))
    assert sig["compute_ms"] < 0.7 * sig["busy_ms"]
    # each series has its own threshold, all from the job's own null law
    assert np.isfinite(det._h[0]).all() and (det._h[0] > 3.0).all()


@pytest.mark.parametrize("seed", range(2))
def test_five_percent_of_the_ranks_slow_at_once_are_each_named(seed):
    ranks = list(range(3, 256, 19))[:13]                       # 13 of 256 ranks on 13 nodes, 5% slow
    sc = IndepScenario("many", [dict(kind="straggler", rank=r, pct=5, start=60) for r in ranks], seed=311 + seed)
    out, _ = feed(sc)
    firing = [o for o in out if o[1] == "firing"]
    named = {r for o in firing for r in o[2]}
    assert named == set(ranks), (sorted(named), ranks)
    first_seen = {}
    for o in firing:
        for r in o[2]:
            first_seen.setdefault(r, o[4])
    assert max(first_seen.values()) - 60 <= 14


@pytest.mark.parametrize("seed,pp", [(0, 1), (1, 1), (2, 4)])
def test_clean_independent_jobs_give_no_straggler(seed, pp):
    out, det = feed(IndepScenario("clean", [], seed=101 + 977 * seed, pp=pp))
    assert out == []
    assert det._cs_ready

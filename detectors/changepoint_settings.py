"""The change-point detector's settings (:class:`stepwatch.detectors.changepoint.ChangePoint`), declared once
(:mod:`stepwatch.detectors.settings`): its signature, ``stepwatch config defaults``, the docs' table and a
reload's validation all read this tuple."""
from __future__ import annotations

from .cpsearch import PENALTY_C
from .settings import Setting

SETTINGS = (
    Setting("window", 200, 10, 100000, "steps", "steps kept (bounded memory: a few (window,) and (window, 7) "
            "arrays); at least 4 x min_size", live=False),
    Setting("every", 1, 1, 100000, "steps", "run the search when the step number enters a new multiple of "
            "``every`` (and at the end of a block of several steps); 1: decide per step"),
    Setting("min_size", 4, 1, 10000, "steps", "minimum segment length in steps (also the reporting tolerance): "
            "smooth // 2 + 2, the shortest segment no burst that the median pre-filter lets through can fill; "
            "a change is decided 3 steps after it starts at the earliest; at least 2", live=False),
    Setting("min_effect", 0.05, 0.0, 10.0, "share", "minimum relative change of the median step time"),
    Setting("min_t", 5.0, 0.0, None, "standard errors", "minimum shift in units of its standard error"),
    Setting("decide_steps", 24, 0, 100000, "steps", "a slowdown first confirmed more than this many steps after "
            "its first step is a level that wandered there, not a step change: held (known, never reported). At "
            "min_t 5 a persistent shift of 1 sd of the noise is confirmed within 25 steps; one that took longer "
            "is smaller than the noise or came slowly (real runs: 1.2-sd comm and compute 'regressions' decided "
            "19-95 steps after they began on clean jobs). 0: off"),
    Setting("penalty_c", PENALTY_C, 0.0, None, "", "penalty constant of :func:`find` (``c * sigma^2 * log n``)"),
    Setting("smooth", 5, 1, 1001, "steps", "running-median width of :func:`find` (removes checkpoint spikes)",
            live=False),
    Setting("phase_sample", 256, 1, None, "ranks", "ranks sampled (evenly strided) for the phase medians used "
            "in attribution", live=False),
    Setting("critical_pct", 10.0, 0.0, 100.0, "%", "regressions costing more than this (% step time) are "
            "``critical``"),
    Setting("defer_stragglers", True, unit="switch", meaning="leave changes caused by a few slow ranks to "
            "``slow_rank`` (see above)"),
    Setting("recovery_needs_regression", True, unit="switch", meaning="a ``recovery`` is alerted only when it undoes a "
            "reported regression (among the last 8 remembered and not matched by a recovery): its series, or the "
            "job's step time, back within a third of that regression's shift of where it was. A job that gets "
            "faster with none (the machine's other processes settling after start-up; seen on real gloo DDP ranks "
            "20-80 steps in), or a phase that shrinks a little while the fault goes on, undoes no fault; its "
            "break stays known, never reported later"),
    Setting("floor_share", 0.5, 0.0, 1.0, "share", "the 25th percentile must move by this share of the median's "
            "effect (0: off)"),
    Setting("persist", 0.8, 0.0, 1.0, "share", "share of each segment's steps that must lie on its side of the "
            "midpoint (0.5 .. 1)"),
    Setting("phases", True, unit="switch", meaning="also watch each phase's job-level series (see above)"),
    Setting("phase_min_effect", 0.10, 0.0, 10.0, "share", "minimum relative change of a phase (against the "
            "lower of the two levels)"),
    Setting("phase_min_share", 0.002, 0.0, 1.0, "share of the step", "minimum change of a phase as a share of "
            "the median step time (materiality: 2 ms of a 1 s step; a phase is judged on its own effect, see "
            "phase_min_effect, against an upper bound of its noise, see _sigma_upper)"),
    Setting("phase_small_share", 0.01, 0.0, 1.0, "share of the step", "a phase change below this share of the "
            "step time (one that barely moves the throughput) is material only when the phase itself at least "
            "doubled or halved (``phase_small_effect``): GC that tripled is a leak worth naming at 0.3% of the "
            "step; a sub-millisecond data wait that wanders by 30-50% on a busy host (seen on real gloo ranks) "
            "is not"),
    Setting("phase_small_effect", 1.0, 0.0, 100.0, "share", "the relative effect a phase change below "
            "``phase_small_share`` needs"),
    Setting("min_steps", 40, 1, 100000, "steps", "steps the window must hold before a change is judged (a noise "
            "estimate needs them)", live=False),
    Setting("warmup", 10, 0, 100000, "steps", "the job's first steps seen are left out of every series: "
            "allocator growth, autotuning, compilation, DDP's bucket rebuild and a DataLoader filling its queue "
            "make them no steady state (not a \"before\" to compare with)"),
    Setting("steady", True, unit="switch", meaning="beyond that, nothing is judged until the job's step time is "
            "steady (its own stability says when: detectors.steady); the warm-up's end is a known break, and "
            "no change inside the warm-up is alerted", live=False),
    Setting("phase_min_cost", None, 0.0, 100.0, "% of the step", "a phase-led regression is alerted only when "
            "it costs at least this % of the step, or the step time's own noise before it (robust sd, % of the "
            "level) when larger (unset: half the step time's own bar, 50 x min_effect = 2.5%: on real 2-rank "
            "DDP runs of a shared host the phases wander by 2.1-2.2% of the step for tens of steps, which no "
            "one acts on; at 1% a clean run got 4 such regressions)", kind=float),
    Setting("phase_clear_sd", 5.0, 0.0, None, "noise sd", "... or, below that cost, when the phase's level moved "
            "by at least this many of its own noise sd (the long-run noise the t-test uses; not the comm wait, "
            "which a straggler moves): a clear change of what the job does (GC that tripled, host time up 40 % on every "
            "rank) however little of the step it costs; a shared host's wandering phases moved by 2-3 sd on real "
            "2-rank runs. 0: off"),
    Setting("phase_clear_min_ms", 1.0, 0.0, None, "ms", "... and by at least this much per step: about a "
            "scheduler's time slice (Linux CFS: 0.75-3 ms), what a host's scheduling does to any process (the host "
            "time of real gloo ranks moved by 0.06-0.3 ms at a few microseconds of noise)"),
    Setting("phase_step_share", 0.25, 0.0, 10.0, "share", "... and the step time carried at least this share "
            "of the phase's growth (a phase that grew while the others shrank, as when one rank's run-queue "
            "wait rises and the others wait less for it, cost the job nothing)"),
    Setting("comm_transfer", False, unit="switch", meaning="judge communication by its transfer where the "
            "producer's split cannot show it (see _transfer). Off by default: on real 2-rank gloo DDP runs the "
            "least time in collectives wandered by 2.5 ms for ~30 steps of a clean lead-in (a false "
            "communication regression in tests/test_ddp_real.py); not yet measured on a real degraded link",
            live=False),
)

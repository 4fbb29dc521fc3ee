"""The labelled scenario suite of ``stepwatch eval`` (family ``sim``): :class:`Scenario` (a simulated job
with injected faults), :data:`SCENARIOS`, and which alert kinds may report each fault kind
(:data:`COMPATIBLE`, :data:`DIAGNOSIS`), as :mod:`stepwatch.devtools.eval` scores them."""
from __future__ import annotations

from dataclasses import dataclass, field

T0_NS = 1_767_225_600_000_000_000          # 2026-01-01T00:00:00Z: fixed, so runs are reproducible



@dataclass
class Scenario:
    name: str
    faults: list[str] = field(default_factory=list)
    ranks: int = 1024
    steps: int = 240
    seed: int = 1
    pp: int = 1
    tp: int = 1
    noise: float = 0.02
    checkpoint_every: int | None = 100
    comm: bool = False
    note: str = ""
    #: in-flight states as probes' watchdogs and agents send them (devtools.siminflight.with_inflight): the
    #: stuck rank of a job-hang ("python" | "mismatch" | "sigstop"), "" for long steps only; None: none
    inflight: str | None = None
    long_steps: dict = field(default_factory=dict)     # step -> (kind, extra ms): evaluation, checkpoint

    @property
    def large(self) -> bool:
        return self.ranks >= 8192

    def simulation(self):
        from stepwatch.devtools.simulate import Simulation
        sim = Simulation(job=f"eval-{self.name}", ranks=self.ranks, steps=self.steps, seed=self.seed,
                         pp=self.pp, tp=self.tp, noise=self.noise, checkpoint_every=self.checkpoint_every,
                         faults=list(self.faults), t0_ns=T0_NS, comm=self.comm)
        if self.inflight is not None:
            from stepwatch.devtools.siminflight import setup_inflight
            setup_inflight(sim, self.inflight or None, self.long_steps)
        return sim


def _suite() -> list[Scenario]:
    S = Scenario
    return [
        S("clean", [], seed=11, note="Student-t(3) compute noise, data blips, checkpoint every 100 steps"),
        S("clean-noisy-ckpt10", [], seed=12, noise=0.04, checkpoint_every=10,
          note="2x noise, a checkpoint spike every 10 steps (must be reported as cadence, not alarmed)"),
        S("clean-pp4", [], seed=13, pp=4, tp=2, note="4 pipeline stages, the last 15% busier"),
        S("slow-3pct", ["slow-rank:rank=77,pct=3,start=60"], seed=21),
        S("slow-5pct", ["slow-rank:rank=300,pct=5,start=60"], seed=22),
        S("slow-10pct", ["slow-rank:rank=613,pct=10,start=60"], seed=23),
        S("slow-30pct", ["slow-rank:rank=5,pct=30,start=60,end=160"], seed=24, note="ends at 160: resolves"),
        S("intermittent", ["slow-rank:rank=402,pct=30,start=60,every=3"], seed=25, note="slow 1 step in 3"),
        S("two-stragglers", ["slow-rank:rank=100,pct=20,start=60", "slow-rank:rank=900,pct=12,start=100"],
          seed=26),
        S("pp-stage-slow", ["slow-rank:rank=40,pct=10,start=60"], seed=27, pp=4, tp=2,
          note="rank 40 in the lightest stage; stage 3 is 15% busier by design"),
        S("gc-storm-rank", ["gc-storm:rank=511,pct=20,start=60"], seed=28),
        S("gc-jitter", ["gc-jitter:start=60,pct=25"], seed=29, note="unsynchronised gen-2 GC pauses"),
        S("data-stall", ["data-stall:start=60,pct=30"], seed=30, note="DataLoader stalls on ~25% of steps"),
        S("cpu-contention", ["cpu-contention:rank=212,pct=25,start=60"], seed=31),
        S("comm-dp-group", ["comm-slow:rank=3,pct=15,start=60"], seed=32, tp=8, comm=True,
          note="one of 8 DP groups (128 ranks, one per node)"),
        S("regress-recover-io", ["regression:start=80,end=170,pct=15,cause=io"], seed=33),
        S("regress-comm", ["regression:start=100,pct=10,cause=communication"], seed=34),
        S("regress-cpu", ["regression:start=100,pct=10,cause=cpu"], seed=35),
        S("rank-hang", ["rank-hang:rank=333,start=120"], seed=36),
        S("job-hang", ["job-hang:rank=77,start=150"], seed=37, steps=240,
          note="rank 77 stops first; the rest block two steps later; host samples go on"),
        S("job-hang-all", ["job-hang:start=150"], seed=38, note="every rank stops at once"),
        S("clean-16k", [], ranks=16384, steps=160, seed=41),
        S("slow-5pct-16k", ["slow-rank:rank=12345,pct=5,start=60"], ranks=16384, steps=160, seed=42),
        S("cpu-contention-16k", ["cpu-contention:rank=8000,pct=20,start=60"], ranks=16384, steps=160, seed=43),
        # efficiency analyses: each judged also on its diagnosis (kind and remedy text)
        S("small-messages", ["small-messages:start=0,pct=10"], seed=51, steps=120, comm=True,
          note="gradient all-reduce in 2,048 calls of ~1 MiB per step, no tensor fusion"),
        S("slow-link", ["slow-link:rank=5,pct=60,start=40"], seed=52, steps=120, tp=8, comm=True,
          note="one of 8 DP groups (128 ranks, one per node) at 40% of its link bandwidth"),
        S("dataloader-starved", ["dataloader-starved:start=0,pct=25"], seed=53, steps=120,
          note="prefetch queue empty, data wait 25% of every step"),
        # hang localization from in-flight states: every rank stops at the same step
        S("hang-python", ["job-hang:rank=77,start=150"], seed=61, inflight="python",
          note="rank 77 stuck in a Python function, the rest in all_reduce; all finished the same step"),
        S("hang-mismatch", ["job-hang:rank=500,start=150"], seed=62, inflight="mismatch",
          note="rank 500 in broadcast where the rest call all_reduce"),
        S("hang-sigstop", ["job-hang:rank=901,start=150"], seed=63, inflight="sigstop",
          note="rank 901 stopped (SIGSTOP): only its agent says so"),
        S("clean-eval-ckpt", [], seed=64, inflight="",
          long_steps={60: ("eval", 90_000.0), 120: ("checkpoint", 150_000.0), 180: ("eval", 90_000.0)},
          note="90 s evaluation steps and a 150 s checkpoint step (the hang threshold is 30 s)"),
    ]


SCENARIOS: list[Scenario] = _suite()

#: alert kinds that can report each fault kind (job-scope variants of gc-storm / data-stall included).
#: ``mfu_regression`` reports what ``regression`` reports (with constant tokens per step an MFU drop is a
#: step-time rise); ``dataloader_starved`` reports an I/O regression (the prefetch queue runs empty).
COMPATIBLE = {
    "slow-rank": {"slow_rank", "slow_node", "slow_group", "jitter"},
    "gc-storm": {"slow_rank", "slow_node", "jitter", "regression", "recovery", "mfu_regression"},
    "cpu-contention": {"slow_node", "slow_rank", "jitter"},
    "comm-slow": {"slow_group", "slow_rank", "jitter", "comm_slow_link"},
    "regression": {"regression", "recovery", "jitter", "mfu_regression", "dataloader_starved"},
    "gc-jitter": {"jitter"},
    "data-stall": {"jitter", "slow_rank", "regression", "recovery", "mfu_regression", "dataloader_starved"},
    "rank-hang": {"rank_stall", "node_stall"},
    "job-hang": {"job_hang", "rank_stall", "node_stall"},
    "small-messages": {"comm_small_messages", "regression", "mfu_regression"},
    "slow-link": {"comm_slow_link", "slow_group", "slow_rank", "jitter"},
    "dataloader-starved": {"dataloader_starved", "regression", "mfu_regression", "jitter"},
    "crash": {"rank_crash"},
}

#: faults judged also on their diagnosis: an alert of this kind must match the fault and its suggestion
#: must name the remedy (case-insensitive substring)
DIAGNOSIS = {
    "small-messages": ("comm_small_messages", "tensor fusion"),
    "slow-link": ("comm_slow_link", "check the link/nic"),
    "dataloader-starved": ("dataloader_starved", "num_workers"),
}

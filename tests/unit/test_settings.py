"""Settings declared once (stepwatch.detectors.settings): each detector's ``SETTINGS`` and the processor's
(stepwatch.stream.processor_settings) make the constructor's signature and checks, the class docstring,
`stepwatch config defaults`, the docs table and what a reload does with a change."""
from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

from stepwatch import config as swconfig
from stepwatch import configfile
from stepwatch.detectors.commbw import CommBandwidth
from stepwatch.detectors.mfu import Mfu
from stepwatch.detectors.registry import REGISTRY
from stepwatch.detectors.slowrank import SlowRank
from stepwatch.kafkaio import KafkaSettings
from stepwatch.stream.processor import Processor
from testkit import ROOT, make_block, make_ctx

pytestmark = pytest.mark.unit


def _declared():
    return [(name, cls, st) for name, cls in REGISTRY.items() for st in cls.SETTINGS]


def test_one_declaration_gives_the_signature_docstring_and_defaults_line():
    text = swconfig.defaults_text()
    for name, cls, st in _declared():
        p = inspect.signature(cls).parameters[st.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == st.default, (name, st.name)
        assert f"{st.name}={st.default!r}" in cls.__doc__ and st.meaning[:40] in cls.__doc__, (name, st.name)
        sec = text[text.index(f"[detectors.{name}]"):]
        line = next(ln for ln in sec.splitlines() if re.match(rf"^#? ?{st.name} =", ln))
        assert st.meaning in line and ("live" in line) == st.live, line
        if st.lo is not None or st.hi is not None:
            assert f"valid {st.valid}" in line, line
    assert "valid 1 .. 1000" in next(ln for ln in text.splitlines() if ln.startswith("k = 5 "))


def test_the_docs_table_is_the_declarations():
    """docs/configuration.md carries `stepwatch config defaults --markdown` between its markers."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    table = page.split("<!-- settings:begin -->\n", 1)[1].split("<!-- settings:end -->", 1)[0]
    assert table.strip() == swconfig.defaults_markdown().strip()
    k = SlowRank.SETTINGS[0]
    assert f"| `k` | 5 | {k.valid} | steps | live | {k.meaning.replace('``', '`')} |" in table


def test_a_value_out_of_range_names_the_field_and_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"slow_rank\.k: 2000 is out of range \(valid: 1 \.\. 1000\)"):
        SlowRank(k=2000)
    with pytest.raises(ValueError, match=r"slow_rank\.n: must be a whole number in 1 \.\. 1000, not 2\.5"):
        SlowRank(n=2.5)
    with pytest.raises(ValueError, match=r"slow_rank\.kk: unknown setting \(known: k, n,"):
        SlowRank(kk=2)
    with pytest.raises(ValueError, match=r"comm_bw\.link_gbps\.nvlink: must be a number > 0, not -1"):
        CommBandwidth(link_gbps={"nvlink": -1})
    with pytest.raises(ValueError, match=r"processor\.flush_interval_s: must be a number in 0\.05 \.\. 3600\.0, "
                                         r"not 'fast'"):
        Processor(KafkaSettings(), tmp_path, create_topics=False, profiling=None, flush_interval_s="fast")
    with pytest.raises(configfile.ConfigError, match=r"detectors\.comm_bw\.max_due: 0 is out of range"):
        swconfig.loads(b"[detectors.comm_bw]\nmax_due = 0\n")


def _slow_rank_with_state() -> SlowRank:
    rng = np.random.default_rng(0)
    d, ctx = SlowRank(), make_ctx(16)
    compute = 80.0 * (1 + 0.01 * rng.standard_normal((60, 16)))
    compute[30:, 3] *= 1.3
    d.update(ctx, make_block(np.arange(60), compute))
    return d


def test_a_live_change_keeps_the_detectors_state_a_sizing_one_rebuilds():
    d = _slow_rank_with_state()
    pos, cs, flags = d._pos, d._cs.copy(), d._flag.copy()
    assert pos == 60 and flags.any()
    same = swconfig.retune(d, SlowRank, {}, {"k": 3, "z_min": 3.0})
    assert same is d and (d.k, d.z_min) == (3, 3.0) and d.settings["k"] == 3
    assert d._pos == pos and np.array_equal(d._cs, cs) and np.array_equal(d._flag, flags)   # state kept
    fresh = swconfig.retune(d, SlowRank, {"k": 3, "z_min": 3.0}, {"k": 3, "z_min": 3.0, "n": 20})
    assert fresh is not d and fresh.n == 20 and fresh.k == 3 and fresh._R == -1                # not live
    with pytest.raises(ValueError, match="k <= n"):                                              # cross-check
        swconfig.retune(d, SlowRank, {}, {"k": 14})
    assert d.k == 3 and d.settings["k"] == 3                                                     # unchanged


def test_a_live_change_keeps_state_the_old_diff_replaced():
    """Comparing two throwaway detectors replaced every attribute without an ``==`` (the comm_bw
    episodes, mfu's change-point detector): a live change lost their state. Now only settings and what
    derives from them change."""
    c = CommBandwidth()
    c._eps.open["slow_link:3"] = ["an open alert", 0]
    steady = c._steady
    assert swconfig.retune(c, CommBandwidth, {}, {"every": 5, "slow_ratio": 0.4}) is c
    assert c.every == 5 and c._eps.open == {"slow_link:3": ["an open alert", 0]} and c._steady is steady
    m = Mfu()
    cp = m._cp
    cp._n = 7                                             # steps it has seen
    assert swconfig.retune(m, Mfu, {}, {"min_effect": 0.1}) is m
    assert m._cp is cp and cp._n == 7 and cp.min_effect == 0.1 and cp.phase_min_cost == 5.0   # derived again


def test_a_reload_puts_the_processors_limits_in_force_new_jobs_get_the_others(tmp_path):
    p = Processor(KafkaSettings(), tmp_path, create_topics=False, profiling=None, flush_interval_s=0.5)
    old = p._job("before")
    assert (p.flush_interval_s, p.lateness_ns, old.state.capacity) == (0.5, 10_000_000_000, 128)
    cfg = swconfig.loads(b"[processor]\nflush_interval_s = 2.0\nlateness_s = 3.0\nwindow_steps = 64\n")
    swconfig.apply(p, cfg)
    assert p.flush_interval_s == 2.0 and p.lateness_ns == 3_000_000_000 and p.window_steps == 64
    new = p._job("after")
    assert new.state.capacity == 64 and new.state.lateness_ns == 3_000_000_000
    assert old.state.capacity == 128 and old.state.lateness_ns == 10_000_000_000     # a running job's ring stays

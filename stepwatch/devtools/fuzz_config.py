"""Fuzzing the processor's configuration loader (:func:`stepwatch.config.loads`, what SIGHUP and the
ConfigMap watch read) with ``hypothesis``: ``stepwatch bench fuzz --boundary config-file``.

Inputs: ``n/20`` (at least 500) TOML documents drawn by :func:`config_strategy` (the real sections and
settings, unknown ones, and values of every TOML type: huge, negative, NaN/inf numbers, hex ints of
thousands of digits, unicode and control characters, arrays and inline tables nested past the limit),
the rest mutations of those: the byte-level ones of :func:`stepwatch.devtools.fuzz_targets.mutate` and
the config-specific ones of :func:`mutate_config` (truncation, as a reader sees a file mid-rewrite;
deep nesting; 4,300+-digit integers; random unicode and invalid UTF-8; emptying). A crash is any
exception other than :class:`~stepwatch.configfile.ConfigError` (goal 0); a hang an input over ``HANG_S``.
Every 500th input goes through a real file (:func:`stepwatch.config.load`).
"""
from __future__ import annotations

import os
import tempfile
import time

HANG_S = 1.0

#: a valid configuration: the seed of the mutations
VALID = b"""[processor]
flush_interval_s = 0.5
max_buffer_rows = 100000
idle_close_s = 5.0

[detectors.stall]
hang_s = 60
[detectors.jitter]
enabled = false
[detectors.slow_rank]
k = 3
n = 8
[detectors.mfu]
peak_tflops = {a100 = 312.0, "h100/bf16" = 989}

[profiling]
enabled = true
steps = 10
[profiling.on]
slow_rank = "torch"

[[jobs]]
match = "llama-*"
[jobs.detectors.stall]
hang_s = 300
"""


def config_strategy():
    """TOML text built from the real layout with hostile keys and values (bytes, 0)."""
    from hypothesis import strategies as st

    from stepwatch import config as c
    from stepwatch.detectors.registry import REGISTRY, settings_of
    keys = {n: list(settings_of(cls)) + ["enabled"] for n, cls in REGISTRY.items()}
    num = st.one_of(
        st.integers(-3, 10**6).map(str), st.floats(allow_nan=True, allow_infinity=True).map(
            lambda f: "nan" if f != f else ("inf" if f == float("inf") else ("-inf" if f == -float("inf") else repr(f)))),
        st.sampled_from(["0", "-0", "+1", "1_000", "0x7fffffffffffffff", "0o777", "0b1", "1e308", "1e-320",
                         "9" * 40, "9" * 41, "1" + "0" * 4300, "0x" + "f" * 3000, "2.5", "1.0", "-1"]))
    text = st.text(max_size=40).map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"')
    raw = st.text(max_size=20)                                    # not escaped: often not TOML
    scalar = st.one_of(num, text, st.sampled_from(["true", "false", "1979-05-27T07:32:00Z", "'/dev/zero'",
                                                    "'/nonexistent'", "''", "'torch'", "'gdb'"]), raw)

    def nest(d: int, inner: str, table: bool) -> str:
        return ("{a = " * d + inner + "}" * d) if table else ("[" * d + inner + "]" * d)

    value = st.one_of(scalar, st.lists(scalar, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
                      st.tuples(st.integers(1, 60), scalar, st.booleans()).map(lambda t: nest(*t)))
    sec_names = st.one_of(st.sampled_from(["processor", "profiling", "profiling.on"] +
                                          [f"detectors.{n}" for n in REGISTRY] + ["jobs.detectors.stall"]),
                          st.text(max_size=10).map(repr))

    @st.composite
    def doc(draw):
        lines = []
        for _ in range(draw(st.integers(0, 6))):
            sec = draw(sec_names)
            lines.append(draw(st.sampled_from(["[{}]", "[[{}]]"])).format(sec) if sec != "jobs.detectors.stall"
                         else "[[jobs]]\nmatch = " + draw(st.one_of(text, value)) + "\n[jobs.detectors.stall]")
            det = sec.split(".")[-1]
            names = keys.get(det) or list(c.PROCESSOR) + list(c.PROFILING) + ["enabled", "slow_rank"]
            for _ in range(draw(st.integers(0, 5))):
                k = draw(st.one_of(st.sampled_from(names), st.text(max_size=8).map(repr)))
                lines.append(f"{k} = {draw(value)}")
        return ("\n".join(lines) + draw(st.sampled_from(["\n", "", "\r\n"]))).encode("utf-8", "surrogatepass"), 0

    return doc()


def mutate_config(data: bytes, rng) -> bytes:
    """One config-specific mutation: truncated (a file mid-rewrite), emptied, a deep nest or a long
    number inserted at a line's value, random unicode or invalid UTF-8 inserted."""
    op = rng.randrange(6)
    n = len(data)
    if op == 0:
        return data[:rng.randint(0, n)]
    if op == 1:
        return rng.choice([b"", b"\n", b"   \n\t\n", b"\xef\xbb\xbf"])
    i = data.find(b"= ", rng.randint(0, max(n - 1, 0)))
    i = (i + 2) if i >= 0 else n
    if op == 2:
        d = rng.choice([33, 100, 300, 1000, 5000])
        ins = (b"[" * d + b"1" + b"]" * d) if rng.random() < 0.5 else (b"{a=" * d + b"1" + b"}" * d)
    elif op == 3:
        ins = rng.choice([b"1", b"-", b"0x", b"9"]) + b"7" * rng.choice([41, 4300, 4301, 10000, 100000])
    elif op == 4:
        ins = "".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0x80, 0x3000),
                                      rng.randrange(0x10000, 0x10ffff), rng.randrange(0, 0x20)]))
                      for _ in range(rng.randint(1, 20))).encode("utf-8", "surrogatepass")
    else:
        ins = bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randint(1, 4)))
    return data[:i] + ins + data[i:]


def fuzz_config(n: int, seed: int = 0) -> dict:
    """Fuzz the configuration loader with ``n`` inputs; see the module doc."""
    import random

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from stepwatch import config as c
    from stepwatch.configfile import MAX_MESSAGE, ConfigError
    from stepwatch.devtools.fuzz_targets import mutate
    c.loads(VALID)                                    # (the seed is valid; also imports the detectors)
    d = tempfile.mkdtemp(prefix="sw-fuzz-cfg-")
    path = os.path.join(d, "config.toml")
    st_ = {"tried": 0, "crashes": 0, "hangs": 0, "examples": [], "accepted": 0, "refused": 0, "via_file": 0}

    def one(data: bytes):
        st_["tried"] += 1
        t0 = time.perf_counter()
        try:
            if st_["tried"] % 500 == 0:
                with open(path, "wb") as f:
                    f.write(data)
                st_["via_file"] += 1
                c.load(path)
            else:
                c.loads(data, path)
            st_["accepted"] += 1
        except ConfigError as e:
            st_["refused"] += 1
            if len(str(e)) > MAX_MESSAGE:
                st_["crashes"] += 1
                st_["examples"].append(f"message of {len(str(e))} characters")
        except BaseException as e:  # noqa: BLE001 - that is what we count (RecursionError, MemoryError...)
            if isinstance(e, KeyboardInterrupt):
                raise
            st_["crashes"] += 1
            if len(st_["examples"]) < 5:
                st_["examples"].append(f"{type(e).__name__}: {str(e)[:200]}")
        if time.perf_counter() - t0 > HANG_S:
            st_["hangs"] += 1

    corpus: list[bytes] = [VALID]
    k = min(n, max(500, n // 20))

    @hseed(seed)
    @settings(max_examples=k, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(config_strategy())
    def run(x):
        if len(corpus) < 5000:
            corpus.append(x[0])
        one(x[0])

    t0 = time.perf_counter()
    try:
        run()
        structured = st_["tried"]
        rng = random.Random(seed)
        pairs = [(x, 0) for x in corpus]
        while st_["tried"] < n:
            base = VALID if rng.random() < 0.5 else rng.choice(corpus)
            one(mutate(base, rng, pairs) if rng.random() < 0.5 else mutate_config(base, rng))
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)
    secs = time.perf_counter() - t0
    return {"boundary": "configuration loader", "tried": st_["tried"], "structured": structured,
            "mutated": st_["tried"] - structured, "crashes": st_["crashes"], "hangs": st_["hangs"],
            "seconds": round(secs, 2), "per_s": round(st_["tried"] / max(secs, 1e-9)), "examples": st_["examples"],
            "accepted": st_["accepted"], "refused": st_["refused"], "via_file": st_["via_file"]}


__all__ = ["fuzz_config", "config_strategy", "mutate_config", "VALID"]

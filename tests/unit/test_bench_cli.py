"""``stepwatch bench NAME``: one subcommand per benchmark, each with its own options and defaults; the
forms the docs, the Makefile and the tests use parse to the values the benchmarks read, and each form
runs its own benchmark (the benchmarks themselves are replaced here: they take minutes)."""
from __future__ import annotations

import importlib
import re

import pytest

from stepwatch.cli import build_parser, main

pytestmark = pytest.mark.unit


BENCHES = ("ingest", "query", "scale", "detectors", "changepoint", "overhead", "profiling", "gpu", "fuzz", "hostile")


def _exit(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_bench_ingest_help_shows_its_options_and_no_other_benchs(capsys):
    code, out, _ = _exit(["bench", "ingest", "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: stepwatch bench ingest")
    for opt, default in (("--ranks", "16384"), ("--steps", "60"), ("--lag-seconds", "30"),
                         ("--rows-per-message", "4096"), ("--burst-jobs", "1000")):
        assert re.search(rf"{opt} \S+\s+[^\n]*(\n\s+[^\n-][^\n]*)*\(default {default}\)", out), (opt, out)
    assert "--data-dir" in out
    for other in ("--prof-ranks", "--agent-seconds", "--agent-ranks", "--inputs", "--boundary", "--messages",
                  "--kind", "--jobs", "--drain", "--json", "--skip-probe", "--seconds", "--idle-exit"):
        assert other not in out, other


def test_bench_help_lists_every_benchmark_on_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")                  # a plain terminal's width
    code, out, _ = _exit(["bench", "--help"], capsys)
    assert code == 0
    listing = out.split("\nbenchmarks:\n", 1)[1].splitlines()[1:]     # after the line of choices
    # one line each, name then its summary: no name on a line of its own, no continuation lines
    assert [ln.split()[0] for ln in listing if ln.strip()] == list(BENCHES), listing
    assert all(re.fullmatch(r"    \w+ +\S.{10,}", ln) for ln in listing if ln.strip()), listing


def test_an_option_of_another_bench_is_refused_naming_it_and_its_bench(capsys, monkeypatch):
    bench = importlib.import_module("stepwatch.devtools.bench")
    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda a: ran.append(a) or 0)
    code, _, err = _exit(["bench", "ingest", "--prof-ranks", "3", "--agent-seconds=2"], capsys)
    assert code == 2 and not ran
    assert "stepwatch bench ingest: error: unrecognized arguments: --prof-ranks 3 --agent-seconds=2" in err
    assert "--prof-ranks is an option of bench profiling" in err
    assert "--agent-seconds is an option of bench overhead" in err
    code, _, err = _exit(["bench", "detectors", "--bogus"], capsys)
    assert code == 2 and "unrecognized arguments: --bogus" in err and "bench detectors --help" in err
    # the old flat form with the option before the name: said where it goes
    code, _, err = _exit(["bench", "--ranks=5", "ingest"], capsys)
    assert code == 2 and not ran and "--ranks goes after the benchmark's name: stepwatch bench ingest --ranks" in err


def test_fuzz_names_an_unknown_boundary(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "fuzz", "--boundary", "no-such", "--inputs", "1"])
    assert "--boundary 'no-such'" in str(e.value.code) and "kafka-message" in str(e.value.code)


#: (argv as the docs/Makefile/tests write it, values the bench reads, module, function it runs)
FORMS = [
    (["bench", "ingest"], dict(ranks=16384, steps=60, lag_seconds=30, rows_per_message=4096, burst_jobs=1000,
                               data_dir=None), "stepwatch.devtools.bench", "run_bench"),
    (["bench", "query", "--ranks", "16384", "--seconds", "3600"], dict(ranks=16384, seconds=3600, data_dir=None),
     "stepwatch.devtools.bench", "run_query_bench"),
    (["bench", "query"], dict(ranks=16384, seconds=3600), "stepwatch.devtools.bench", "run_query_bench"),
    (["bench", "scale", "--ranks", "64", "--seconds", "5", "--drain", "30", "--data-dir", "d", "--json", "o"],
     dict(ranks=64, seconds=5, drain=30.0, data_dir="d", json="o", rows_per_message=4096),
     "stepwatch.devtools.bench_scale", "run_scale_bench"),
    (["bench", "scale"], dict(ranks=16384, seconds=300, drain=60.0, json=None),
     "stepwatch.devtools.bench_scale", "run_scale_bench"),
    (["bench", "detectors", "--ranks", "100000"], dict(ranks=100000, bench_steps=200),
     "stepwatch.devtools.eval", "run_detector_bench"),
    (["bench", "changepoint"], dict(cp_series=48, cp_seed=2024), "stepwatch.devtools.bench", "run_changepoint_bench"),
    (["bench", "overhead", "--skip-probe", "--agent-seconds", "20"],
     dict(skip_probe=True, skip_agent=False, agent_seconds=20.0, agent_ranks=8, rounds=80, block_steps=100,
          agent_step_ms=100.0, no_broker=False), "stepwatch.devtools.bench_overhead", "run_overhead_bench"),
    (["bench", "profiling"], dict(prof_ranks=4, prof_steps=10, prof_step_ms=50.0, prof_extra_ms=20.0, data_dir=None),
     "stepwatch.devtools.bench_profiling", "run_profiling_bench"),
    (["bench", "profiling", "--prof-ranks", "2", "--steps", "5"], dict(prof_ranks=2, prof_steps=5),
     "stepwatch.devtools.bench_profiling", "run_profiling_bench"),
    (["bench", "fuzz", "--boundary", "config-file", "--inputs", "1000"], dict(boundary="config-file", inputs=1000,
                                                                              seed=0),
     "stepwatch.devtools.fuzz", "run_fuzz"),
    (["bench", "hostile"], dict(kind="messages", messages=10_000, idle_exit=30.0, data_dir=None),
     "stepwatch.devtools.hostile", "run_hostile_bench"),
    (["bench", "hostile", "--kind", "jobs"], dict(jobs=20_000, baseline_jobs=1000, job_rounds=3, max_jobs=None,
                                                  idle_exit=30.0, data_dir=None),
     "stepwatch.devtools.hostile_jobs", "run_jobs_bench"),
]


@pytest.mark.parametrize("argv,values,module,fn", FORMS, ids=[" ".join(f[0][1:]) for f in FORMS])
def test_each_form_parses_to_what_its_bench_reads_and_runs_that_bench(argv, values, module, fn, monkeypatch):
    a = build_parser().parse_args(argv)
    assert {k: getattr(a, k) for k in values} == values
    ran = []
    monkeypatch.setattr(importlib.import_module(module), fn, lambda ns: ran.append(ns) or 0)
    assert a.func(a) == 0 and ran == [a]


def test_bench_gpu_needs_neither_duckdb_nor_the_processors_packages():
    """A GPU machine's training image has torch and the agent's packages, not DuckDB: `stepwatch bench gpu`
    builds its own command line (the whole one imports the processor's modules)."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['duckdb'] = None; sys.modules['ruptures'] = None; "
            "from stepwatch.cli import main; sys.exit(main(['-v', 'bench', 'gpu', '--help']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--gpt-steps" in r.stdout and "--jobs" in r.stdout and "stepwatch bench gpu" in r.stdout


def test_bench_gpu_judges_a_crash_job_by_its_failing_launcher_and_no_other_by_it():
    # the H200 run of 2026-11-28: `bench gpu --jobs ...,crash-r1` said "every job ran: false" because the crash
    # job's launcher exits 1, which is what that job is for
    from stepwatch.devtools.bench_gpu import job_ended_as_it_should
    assert job_ended_as_it_should("g-crash-r1", 1) and not job_ended_as_it_should("g-crash-r1", 0)
    assert not job_ended_as_it_should("g-crash-r1", 124)                  # a timeout is no crash it meant
    assert job_ended_as_it_should("g-clean-gloo-2", 0) and not job_ended_as_it_should("g-sleep-r1", 1)


def test_bench_gpu_runs_as_a_module_where_no_entry_point_is_installed():
    # a lent GPU machine has the checkout on PYTHONPATH, not installed: `stepwatch bench gpu` finds no plug-in
    # there (the 2026-11-28 H200 run), `python -m stepwatch.devtools.bench_gpu` runs the same check
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "stepwatch.devtools.bench_gpu", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--no-gpt" in r.stdout and "--jobs" in r.stdout, r.stderr[-2000:]

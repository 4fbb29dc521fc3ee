"""Development tools, kept out of the product's import path: the cluster simulator (``simulate``, ``simsend``),
the benchmarks (``bench``, ``bench_scale``, ``bench_overhead``, ``bench_profiling``), the demo
(``demo``, ``demo_train``), the labelled evaluation (``eval``, ``scenarios_indep``), the fuzzing and hostile
generators (``fuzz``, ``fuzz_targets``, ``hostile``) and the embedded Kafka-protocol broker (``broker``).

No product module (the probe, the agent, the stream processor, the detectors, the store, the dashboards,
the ``stepwatch`` command's own ``stepwatch/cli.py``) imports this package (an import-linter contract in
pyproject.toml checks it, with no exception). ``stepwatch demo``, ``broker``, ``simulate``, ``eval`` and
``bench`` are plug-ins: entry points of the group ``stepwatch.commands`` (pyproject.toml; :mod:`.commands`,
:mod:`.evalcli`, :mod:`.benchcli`) that ``stepwatch.cli`` finds in the installed metadata and loads for their
own command only.

Every module here is reached from one of those commands (tests/unit/test_layout.py): a script that only
tests, docs or a one-off measurement runs lives in the repository's ``tools/`` (not installed) or ``tests/``.
"""

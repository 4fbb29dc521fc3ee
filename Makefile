# Two entry points that do all the set-up on a fresh machine (Python 3.11 + make).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install clean bench

$(STAMP): pyproject.toml setup.py $(wildcard agents/probe/_probefast*)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[all,test]'    # (plain `pip install .` is the probe alone)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/stepwatch demo

# Two steps, both must pass (a step that collects nothing exits 5: a failure too). First the fast one:
# tests/unit and tests/integration (real servers on loopback), in two pytest-xdist workers (a module stays in
# one); then tests/realrun, the real training
# runs and measured timings, serially and on their own so that no other test loads the machine under them.
test: $(STAMP)
	BIN=$(BIN) .ci/lint-imports    # the layers (import-linter contracts in pyproject.toml)
	$(BIN)/python -m pytest -q --durations=25 -n 2 --dist loadfile -m "unit or integration" tests/unit tests/integration; fast=$$?; \
	$(BIN)/python -m pytest -q --durations=15 -m realrun tests/realrun; real=$$?; \
	echo "make test: unit+integration step exit $$fast, realrun step exit $$real"; [ $$fast = 0 ] && [ $$real = 0 ]

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 -m "(unit or integration) and not slow" tests

bench: $(STAMP)
	$(BIN)/stepwatch bench ingest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

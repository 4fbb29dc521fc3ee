# Two entry points that do all the set-up on a fresh machine (Python 3.11 + make).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml setup.py $(wildcard agents/probe/_probefast*)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[all,test]'    # (plain `pip install .` is the probe alone)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/stepwatch demo

test: $(STAMP)
	BIN=$(BIN) .ci/lint-imports    # the layers (import-linter contracts in pyproject.toml)
	$(BIN)/python -m pytest -q --durations=25 tests

bench: $(STAMP)
	$(BIN)/stepwatch bench ingest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

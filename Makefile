# Everything runs from the project's own virtual environment, created on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/deepseek3_tiny.yaml
ARGS ?= --reference

.PHONY: setup test train bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q tests
	$(PY) -m pytest -q benchmarks --benchmark-disable

train: setup
	$(VENV)/bin/gradpool train --config $(CONFIG) $(ARGS)

bench: setup
	$(VENV)/bin/gradpool bench --out bench-results.json

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks msrun-logs

# Everything runs from the project's own virtual environment, created on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/deepseek3_tiny.yaml
ARGS ?= --reference

.PHONY: setup test train bench clean mutation mindformers

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

setup: $(VENV)/.installed

# mindformers 2.1.0 asks for a MindSpore that is not published: installed without its
# dependencies, plus the packages its imports need (docs/mindformers.md).
$(VENV)/.mindformers: $(VENV)/.installed tests/mindformers/requirements.txt
	$(PY) -m pip install -q --no-deps mindformers==2.1.0
	$(PY) -m pip install -q -r tests/mindformers/requirements.txt
	touch $@

# Two pytest workers, a test file each at a time: an msrun launch spends seconds waiting (cluster
# start-up and teardown) while the other worker's tests use the cores (docs/testing.md).
# What needs mindformers (its install and its own training on msrun ranks take minutes) is
# `make mindformers`; here those tests skip, saying so.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile tests --ignore=tests/mindformers
	$(PY) -m pytest -q benchmarks --benchmark-disable

# mindformers 2.1.0 on gradpool (docs/mindformers.md): every name it imports from hyper_parallel,
# its ParallelDims meshes, its grad norm on fully_shard's DTensors, and its own FSDP training
# in-process at world size 1, then one msrun launch at 2 ranks and one at 4.
# tests/mindformers runs in a process of its own: its CPU stand-ins must be in place before
# mindformers' modules are first imported.
MINDFORMERS_TESTS = tests/test_mindformers_surface.py tests/test_device_mesh.py \
	tests/test_mesh_meta_distributed.py tests/test_mindformers_norm_distributed.py
mindformers: $(VENV)/.mindformers
	$(PY) -m pytest -q -n 2 --dist loadfile $(MINDFORMERS_TESTS)
	$(PY) -m pytest -q tests/mindformers

train: setup
	$(VENV)/bin/gradpool train --config $(CONFIG) $(ARGS)

bench: setup
	$(VENV)/bin/gradpool bench --out bench-results.json

# Mutation testing of the core modules (gradpool/{layout,pool,pack,reducer,dtypes}.py) against the
# fast world-1 tests, configured in pyproject.toml [tool.mutmut]. Not part of `make test`: it is
# CPU-heavy (33 min for 783 of the 1,865 mutants on 2 cores, 2 jobs: ~80 min from scratch). Runs
# in a copy of the tree ($(MUTATION_DIR)), so mutmut's mutants/ stays out of the work tree;
# mutmut keeps its results there. Without
# MUTANTS it runs only mutants with no verdict yet (new, or in a function whose code changed); a
# changed test body resets nothing, and a new function has no tests mapped until the stats are
# collected again (rm $(MUTATION_DIR)/mutants/mutmut-stats.json), so rm -rf the directory for a
# fresh run. MUTANTS names mutants (or fnmatch patterns) and reruns those whatever their verdict,
# e.g. `make mutation MUTANTS='gradpool.layout.*'` for one module; the survivors are listed at
# the end and the counts are in $(MUTATION_DIR)/mutants/mutmut-cicd-stats.json.
MUTATION_DIR ?= /tmp/gradpool-mutation
MUTANTS ?=
MUTATION_JOBS ?= 2

mutation: setup
	mkdir -p $(MUTATION_DIR)
	cp -r gradpool hyper_parallel tests configs pyproject.toml $(MUTATION_DIR)/
	cd $(MUTATION_DIR) && $(abspath $(PY)) -m mutmut run --max-children $(MUTATION_JOBS) $(MUTANTS)
	cd $(MUTATION_DIR) && $(abspath $(PY)) -m mutmut export-cicd-stats
	cd $(MUTATION_DIR) && $(abspath $(PY)) -m mutmut results
	cat $(MUTATION_DIR)/mutants/mutmut-cicd-stats.json

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks msrun-logs

# dsa-aot: `make prebuild` compiles every kernel variant into the cache; `make test` runs the suite.
# Both bootstrap ./.venv from nothing on first use.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST_ARGS ?=
BIN        := $(VENV)/bin
STAMP      := $(VENV)/.dsa-aot-installed

.PHONY: venv prebuild test test-gpu bench compat clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[build,test,remote,signing]'
	touch $@

prebuild: $(STAMP)
	$(BIN)/dsa-aot prebuild --jobs $(JOBS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/bench_sparse_mla.py --out bench/results/h200.json

compat: $(STAMP)
	$(BIN)/python tools/compat.py --jobs $(JOBS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# ftcompile: `make demo` runs the guided tour, `make test` the test suite.
# Both create .venv (if missing) and install the project into it first.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Installed once per change of pyproject.toml; delete the stamp to force a reinstall.
STAMP  := $(VENV)/.ftcompile-installed
# Only this exact torch is served from the local package mirror as a CPU build;
# an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
PYTEST_WORKERS ?= 2

.PHONY: help setup demo test test-all test-slow example clean

help:
	@echo "make demo        set up .venv; compile gpt2-tiny into a package, verify it, train it on 2 processes"
	@echo "make test        set up .venv and run the test suite without tests marked slow (what CI runs; pytest, $(PYTEST_WORKERS) workers)"
	@echo "make test-all    every test, slow ones included"
	@echo "make test-slow   only the tests marked slow (the long architecture and strategy sweeps)"
	@echo "make example     regenerate examples/gpt2-tiny-mixed (the committed generated package)"
	@echo "make setup       only create .venv and install ftcompile into it"
	@echo "make clean       remove caches and demo output (keeps .venv)"

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[partition,plot,test]'
	@if command -v mpicc >/dev/null 2>&1; then $(BIN)/python -m pip install --quiet 'mpi4py>=3.1'; \
	 else echo "note: no MPI compiler (mpicc): the MPI transport is off (apt install openmpi-bin libopenmpi-dev)"; fi
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ftcompile demo
	$(BIN)/ftcompile verify out/demo/plan
	$(BIN)/ftcompile run out/demo/plan --nproc 2 --schedule 1f1b --steps 8 --data text

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m slow

example: $(STAMP)
	$(BIN)/ftcompile compile gpt2-tiny --attention eager --cluster 2xcpu --gpus 4 --replicas 1 --strategy mixed -q -o examples/gpt2-tiny-mixed
	$(BIN)/ftcompile verify examples/gpt2-tiny-mixed

clean:
	rm -rf .pytest_cache .ftcompile-cache out/demo
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

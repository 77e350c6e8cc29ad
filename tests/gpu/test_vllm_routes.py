"""GPU only (skipped without CUDA; not yet run on a GPU): vLLM's own routed-experts output
(`routing.engine_routes=vllm`, enable_return_routed_experts) against the router callback (`hook`) on the
same tiny Qwen3-MoE, prompts and greedy decoding: the same experts at every input position of every row.

    .venv/bin/python -m pytest -q tests/gpu/test_vllm_routes.py
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

PROMPTS = [[1, 5, 6, 14, 11], [1, 43, 21, 19], [1, 7, 7, 30, 22, 9, 12]]


def _routes(model_dir, native: bool):
    from megatron_sparse_rl.config.rollout import RolloutConfig, SamplingConfig
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.rollout.routes import EngineRouteCapture
    from megatron_sparse_rl.rollout.routes_vllm import VLLMRouteOutput

    cfg = RolloutConfig(max_model_len=256, max_num_seqs=8, dtype="float32", gpu_memory_utilization=0.3)
    vllm_cpu.apply()
    with RolloutEngine(model_dir, cfg, extensions=[VLLMRouteOutput() if native else EngineRouteCapture()]) as engine:
        batch = engine.generate(PROMPTS, SamplingConfig(n=1, temperature=0.0, max_tokens=12))
    return batch.responses(), batch.features.routed_experts


def test_vllm_routes_equal_the_router_callback(tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM (scripts/gpu_check.sh's GPU machine has none)")
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = build_tiny_hf_model(tmp_path / "m", seed=0)
    tokens, native = _routes(model_dir, native=True)
    want_tokens, hooked = _routes(model_dir, native=False)
    assert tokens == want_tokens
    assert native.layers == hooked.layers and torch.equal(native.offsets, hooked.offsets)
    assert torch.equal(native.token_hash, hooked.token_hash)
    assert torch.equal(native.indices, hooked.indices)

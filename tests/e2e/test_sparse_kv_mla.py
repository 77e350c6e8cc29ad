"""Sparse KV on the multi-head latent attention cache inside real vLLM (CPU_MLA, tiny DeepSeek-V3, fp32), against
dense vLLM and a transformers reference.

vLLM's MLA cache holds one latent row [c_kv, k_pe] (512 + 64) per token and layer, shared by every head, in
16-token blocks; the engine keeps one set of rows per layer. Checks:
- a budget the generation never reaches gives the dense engine's tokens and logprobs;
- StreamingLLM keeps exactly the sinks and the recent window (from the rule), one set per layer ([L, 1, budget]);
- the engine's sparse logprobs equal a transformers forward whose attention (every head) drops the same entries at
  the same steps (StreamingLLM: mask from the rule; R-KV, SnapKV, H2O: mask from the engine's kv_keep record);
- R-KV and SnapKV keep what kv/latent.py `select_latent` picks from the reference's own latents (kv_a_layernorm's
  output), rotated rope keys, queries and W_UK (kv_b_proj): the absorbed-query scores of the engine are checked
  against transformers' non-absorbed attention inputs;
- vLLM's blocks in use stay bounded while dense grows; the worker's timing counts the scheduler's compactions;
- layouts the latent compaction cannot run are refused before vLLM starts.
Run: .venv/bin/python -m pytest -q tests/e2e/test_sparse_kv_mla.py
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig, SamplingConfig
from megatron_sparse_rl.kv.engine_extension import sparse_kv_extensions, sparse_kv_stats, sparse_kv_timing
from megatron_sparse_rl.rollout.block_usage import BlockUsageProbe
from tests.e2e.test_sparse_kv import hf_masked_logprobs, mask_from_keeps, row_tokens, rule_compactions

pytestmark = pytest.mark.e2e

ATOL = 1e-4  # fp32 engine vs transformers with the same rows dropped (the MLA engine itself is ~1e-5 from HF)
PROMPTS = [[1] + [5 + (7 * i + 3 * j) % 30 for j in range(17 + 4 * i)] for i in range(3)]
LAYERS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    return build_tiny_deepseek(tmp_path_factory.mktemp("sparse_kv_mla") / "yarn", seed=0, rope="yarn")


@contextlib.contextmanager
def engine(model_dir, kv: KVConfig, **cfg):
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    vllm_cpu.apply()
    e = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=8, kv_cache_gb=1, kv=kv, **cfg),
                      extensions=sparse_kv_extensions(kv))
    e._sampling_params = lambda s, i, **extra: RolloutEngine._sampling_params(e, s, i, ignore_eos=True, **extra)
    try:
        assert e.uses_mla
        yield e
    finally:
        e.shutdown()


def sampling(max_tokens, n=1, seed=11):
    return SamplingConfig(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed)


def test_budget_never_reached_equals_dense(model_dir):
    s = sampling(24, n=2)
    with engine(model_dir, KVConfig()) as dense:
        ref = dense.generate(PROMPTS[:2], s)
    with engine(model_dir, KVConfig(policy="rkv", budget=128, interval=16, window=8)) as sparse:
        got = sparse.generate(PROMPTS[:2], s)
        assert sparse_kv_stats(sparse)["compactions"] == 0
    assert torch.equal(got.response_ids, ref.response_ids)
    assert torch.equal(got.rollout_logprobs, ref.rollout_logprobs)


def test_streamingllm_keeps_sinks_and_window_and_matches_transformers(model_dir):
    kv = KVConfig(policy="streamingllm", budget=24, interval=8, sinks=4, record_keep=True)
    with engine(model_dir, kv) as e:
        batch = e.generate(PROMPTS, sampling(48))
    worst = 0.0
    for i, rec in enumerate(batch.features.kv_keep):
        p = int(batch.prompt_lens[i])
        assert list(rec.lengths) == rule_compactions(p, 48, kv.budget, kv.interval)
        for tc, kept in zip(rec.lengths, rec.kept):
            assert tuple(kept.shape) == (LAYERS, 1, kv.budget)  # one row set per layer, shared by the heads
            want = list(range(kv.sinks)) + list(range(tc - kv.budget + kv.sinks, tc))
            assert all(row == want for row in kept.reshape(-1, kv.budget).tolist()), tc
        tokens = row_tokens(batch, i)
        mask = mask_from_keeps(len(tokens), LAYERS, 1, [(tc, k.tolist()) for tc, k in zip(rec.lengths, rec.kept)])
        ref = hf_masked_logprobs(model_dir, tokens, mask)[p - 1:]
        worst = max(worst, (batch.rollout_logprobs[i, :48] - ref).abs().max().item())
    print(f"streamingllm on MLA: max |engine - HF masked| = {worst:.2e}")
    assert worst <= ATOL


@pytest.mark.parametrize("policy", ["rkv", "snapkv", "h2o"])
def test_score_policy_matches_transformers_with_its_record(model_dir, policy):
    kv = KVConfig(policy=policy, budget=24, interval=8, window=6, record_keep=True)
    with engine(model_dir, kv) as e:
        batch = e.generate(PROMPTS, sampling(40))
        t, stats = sparse_kv_timing(e), sparse_kv_stats(e)
        # the worker ran every compaction the scheduler ordered, and timed its parts
        assert t["compactions"] == stats["compactions"] == sum(r.num_compactions for r in batch.features.kv_keep) > 0
        assert t["compact_s"] >= t["score_s"] + t["copy_s"] and t["score_s"] > 0 and t["capture_s"] > 0
        assert sparse_kv_timing(e)["compactions"] == 0  # taken: reset
    worst = 0.0
    for i, rec in enumerate(batch.features.kv_keep):
        p, tokens = int(batch.prompt_lens[i]), row_tokens(batch, i)
        assert list(rec.lengths) == rule_compactions(p, 40, kv.budget, kv.interval) and rec.lengths
        events = [(tc, kept.tolist()) for tc, kept in zip(rec.lengths, rec.kept)]
        for tc, kept in events:  # budget distinct earlier positions per layer, the recent window included
            for li in range(LAYERS):
                k = kept[li][0]
                assert len(set(k)) == kv.budget and max(k) < tc and set(range(tc - kv.window, tc)) <= set(k)
        qk, latents = {}, {}
        ref = hf_masked_logprobs(model_dir, tokens, mask_from_keeps(len(tokens), LAYERS, 1, events), qk, latents)
        worst = max(worst, (batch.rollout_logprobs[i, :40] - ref[p - 1:]).abs().max().item())
        if policy != "h2o":
            assert_latent_keep_sets(model_dir, policy, kv, events, qk, latents)
    print(f"{policy} on MLA: max |engine - HF masked with its kv_keep| = {worst:.2e}")
    assert worst <= ATOL


def assert_latent_keep_sets(model_dir, policy, kv, events, qk, latents):
    """At each compaction, select_latent on the reference's rows (c_kv from kv_a_layernorm, the rotated rope key
    from the keys transformers attends with) of the entries the engine held, with the last `window` queries and
    kv_b_proj's W_UK, picks the positions the engine recorded."""
    from safetensors.torch import load_file

    from megatron_sparse_rl.kv.latent import select_latent
    from megatron_sparse_rl.models.tiny_families import deepseek_config_kwargs

    c = deepseek_config_kwargs()
    heads, nope, v, lora = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    weights = load_file(model_dir / "model.safetensors")
    scale = _scaling(model_dir)
    prev = None
    for tc, kept in events:
        for li, (q, k) in qk.items():
            held = sorted(set(range(tc)) if prev is None else set(prev[li][0]) | set(range(prev_tc, tc)))
            w_uk = weights[f"model.layers.{li}.self_attn.kv_b_proj.weight"].view(heads, nope + v, lora)[:, :nope]
            window = q[:, tc - kv.window: tc]
            keep = select_latent(policy, latents[li][held], k[0, held, nope:], kv, q_nope=window[..., :nope],
                                 q_pe=window[..., nope:], w_uk=w_uk, scale=scale)
            assert [held[j] for j in keep.tolist()] == kept[li][0], (policy, tc, li)
        prev, prev_tc = kept, tc


def _scaling(model_dir) -> float:
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    return DeepseekV3Attention(AutoConfig.from_pretrained(model_dir), layer_idx=0).scaling


def test_blocks_in_use_bounded_while_dense_grows(model_dir):
    s = sampling(96)
    with engine(model_dir, KVConfig()) as dense, BlockUsageProbe(dense) as dense_probe:
        dense.generate(PROMPTS, s)
    kv = KVConfig(policy="streamingllm", budget=32, interval=16)
    with engine(model_dir, kv) as sparse, BlockUsageProbe(sparse) as probe:
        batch = sparse.generate(PROMPTS, s)
    per_req = -(-(kv.budget + kv.interval) // 16)  # the worst case: budget + interval stored rows, 16-row blocks
    print(f"MLA peak blocks: sparse {probe.peak_blocks} dense {dense_probe.peak_blocks}")
    assert (batch.response_lens == 96).all()
    assert probe.peak_blocks <= len(PROMPTS) * per_req < dense_probe.peak_blocks
    assert dense_probe.peak_blocks >= sum(-(-(len(p) + 96 - 1) // 16) for p in PROMPTS)


@pytest.mark.parametrize("cfg, message", [
    ({"kv": KVConfig(policy="rkv", budget=32, block_size=32)}, "runs 16-token blocks only"),
    ({"kv": KVConfig(policy="rkv", budget=32), "tensor_parallel_size": 2}, "runs on single-rank engines"),
])
def test_layouts_the_latent_compaction_cannot_run_are_refused(model_dir, cfg, message):
    from megatron_sparse_rl.rollout import RolloutEngine

    with pytest.raises(ValueError, match=message):
        RolloutEngine(model_dir, RolloutConfig(max_model_len=256, kv_cache_gb=1, **cfg))

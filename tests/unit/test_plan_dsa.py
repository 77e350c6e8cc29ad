"""`msrl plan` for DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5; issue 33 item 5): the indexer's
parameters, its key cache beside the MLA latent, the indexer replay record's host memory, all computed here by
hand for one layer from the config values and scaled to the model, and the config refusals."""
from __future__ import annotations

import json
import re

import pytest

from megatron_sparse_rl.planner import (PlanOptions, indexer_record, load_shape, plan_layout, rollout_plan,
                                        sync_volume)
from megatron_sparse_rl.planner.memory import GiB
from megatron_sparse_rl.planner.shapes import ASSETS, shape_from_config
from megatron_sparse_rl.planner.sync import engine_rank_bytes
from megatron_sparse_rl.tools import cli

# The config values the hand computations use (release config.json values, bundled in assets/model_configs/):
# hidden, layers, q_lora_rank, index_n_heads, index_head_dim, index_topk.
DSA = {"deepseek-v3.2": dict(h=7168, layers=61, q_lora=1536, heads=64, dim=128, topk=2048),
       "glm-5": dict(h=6144, layers=78, q_lora=2048, heads=32, dim=128, topk=2048)}


def indexer_params_by_hand(m: dict) -> int:
    # wq_b [heads * dim, q_lora] + wk [dim, h] + k_norm (LayerNorm weight and bias) + weights_proj [heads, h]
    return m["q_lora"] * m["heads"] * m["dim"] + m["h"] * m["dim"] + 2 * m["dim"] + m["h"] * m["heads"]


def glm5_params_by_hand() -> int:
    # 78 layers (3 dense of ffn 12288, 75 MoE: 256 routed + 1 shared expert of 3 x 6144 x 2048), MLA with q_lora 2048,
    # kv_lora 512, rope 64, nope 192, v 256, 64 heads; router weight + correction bias; untied 154880-token embedding
    # and head; the final norm; the indexer on every layer.
    h, e = 6144, 3 * 6144 * 2048
    attn = h * 2048 + 2048 + 2048 * 64 * 256 + h * 576 + 512 + 512 * 64 * (192 + 256) + 64 * 256 * h + 2 * h
    moe_layer = attn + 257 * e + 256 * h + 256
    dense_layer = attn + 3 * h * 12288
    return 75 * moe_layer + 3 * dense_layer + 2 * 154880 * h + h + 78 * indexer_params_by_hand(DSA["glm-5"])


@pytest.mark.parametrize("name", sorted(DSA))
def test_one_layer_by_hand(name):
    """One layer: the indexer's parameters, the bytes a token leaves in the engine's cache (bf16 latent row + the
    indexer key as vLLM stores it: 128 fp8 values and one fp32 scale), the replay record's bytes per token (2048
    positions, uint16 up to 65,536 tokens). The planner's model-wide numbers are these times the layers."""
    m, s = DSA[name], load_shape(name)
    one_layer_params = indexer_params_by_hand(m)
    assert s.indexer_params == one_layer_params
    assert one_layer_params == {"deepseek-v3.2": 13_959_424, "glm-5": 9_371_904}[name]

    latent_bf16 = (512 + 64) * 2                  # kv_lora_rank + qk_rope_head_dim, bf16
    latent_fp8 = 512 + 512 // 128 * 4 + 64 * 2    # vLLM fp8_ds_mla: fp8 latent, 4 fp32 scales, bf16 rope key = 656
    indexer_key = 128 + 4                         # 128 fp8 e4m3 + one fp32 scale
    r = rollout_plan(s, gpu_mem_gib=141, engine_gpus=32, seq_len=65536, budget=2048, interval=128)
    assert r.kv_bytes_per_token == m["layers"] * (latent_bf16 + indexer_key) == m["layers"] * 1284
    r8 = rollout_plan(s, gpu_mem_gib=141, engine_gpus=32, seq_len=65536, budget=2048, interval=128, kv_bytes=1)
    assert r8.kv_bytes_per_token == m["layers"] * (latent_fp8 + indexer_key) == m["layers"] * 788

    record_layer = 2048 * 2  # top-2048 positions, uint16 (positions 0 .. 65535)
    rec = indexer_record(s, layout=(8, 1, 32), gpus=256, seq_len=65536, batch=1024)
    assert rec.layer_bytes_per_token == record_layer and rec.bytes_per_token == m["layers"] * record_layer
    longer = indexer_record(s, layout=(8, 1, 32), gpus=256, seq_len=65537, batch=1024)
    assert longer.layer_bytes_per_token == 2048 * 4  # position 65536 needs int32


def test_total_parameters_by_hand():
    """DeepSeek-V3.2 is DeepSeek-V3 plus 61 indexers; GLM-5 counted tensor by tensor. Published: GLM-5 744B total,
    40B active (GLM-5 technical report, as quoted by public summaries; not re-checked here): its active count
    matches without the embedding and output layer (2 x 154880 x 6144 = 1.90B)."""
    v3, v32 = load_shape("deepseek-v3"), load_shape("deepseek-v3.2")
    assert v32.total_params() == v3.total_params() + 61 * indexer_params_by_hand(DSA["deepseek-v3.2"])
    glm = load_shape("glm-5")
    assert glm.total_params() == glm5_params_by_hand() == pytest.approx(744e9, rel=0.001)
    assert glm.active_params() - 2 * 154880 * 6144 == pytest.approx(40e9, rel=0.01)


def test_learner_holds_the_indexer_whole_on_every_tp_rank():
    """Megatron builds the indexer's projections `duplicated`: at tp 8 each rank holds all 61 of them, so DeepSeek-V3.2
    costs DeepSeek-V3's memory plus 61 indexers x (2 B weights + 4 B fp32 grads + 12 B / dp optimizer)."""
    opts = PlanOptions(gpus=256, gpus_per_node=8, gpu_mem_gib=141, seq_len=8192)
    base, dsa = plan_layout(load_shape("deepseek-v3"), 8, 1, 128, opts), plan_layout(load_shape("deepseek-v3.2"), 8, 1,
                                                                                     128, opts)
    idx = 61 * indexer_params_by_hand(DSA["deepseek-v3.2"])
    assert dsa.weights_gib - base.weights_gib == pytest.approx(2 * idx / GiB)
    assert dsa.grads_gib - base.grads_gib == pytest.approx(4 * idx / GiB)
    assert dsa.optimizer_gib - base.optimizer_gib == pytest.approx(12 * idx / 32 / GiB)  # dp = 256 / 8
    # full recompute keeps one layer's indexer activations per token, whole on every TP rank: q 64 x 128, k 128 and
    # 64 head weights in bf16, 2048 int64 top-k indices
    indexer_act = 2 * (64 * 128 + 128 + 64) + 8 * 2048
    assert dsa.activations_gib - base.activations_gib == pytest.approx(8192 * indexer_act / GiB)


def test_replay_record_per_rank_by_hand():
    """GLM-5 at tp8 pp2 ep64 on 256 GPUs: dp 16, so 1024 sequences per step are 64 per rank; its stage runs 39 of the
    78 indexer layers; 64K tokens, 2048 uint16 positions each."""
    rec = indexer_record(load_shape("glm-5"), layout=(8, 2, 64), gpus=256, seq_len=65536, batch=1024)
    assert rec.sequences_per_rank == 64 and rec.stage_layers == 39
    assert rec.rank_bytes == 64 * 65536 * 39 * 2048 * 2 == 670_014_898_176
    assert indexer_record(load_shape("deepseek-v3"), layout=(8, 1, 32), gpus=256, seq_len=65536, batch=8) is None


def test_engine_replicates_the_indexer():
    """vLLM keeps the indexer whole on every engine GPU: its weights per GPU and every rank's sync slice carry all 78
    indexers, the rest is split as for DeepSeek-V3-shaped MLA models."""
    s, idx = load_shape("glm-5"), 78 * indexer_params_by_hand(DSA["glm-5"])
    r = rollout_plan(s, gpu_mem_gib=141, engine_gpus=32, seq_len=8192, budget=2048, interval=128)
    assert r.weights_gib_per_gpu == pytest.approx(2 * ((glm5_params_by_hand() - idx) / 32 + idx) / GiB)
    base = shape_from_config({**json.loads((ASSETS / "glm-5.json").read_text()), "architectures":
                              ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "glm-5 as DeepSeek-V3")
    assert [a - b for a, b in zip(engine_rank_bytes(s, 4, 2), engine_rank_bytes(base, 4, 2))] == [2 * idx] * 4
    v = sync_volume(s, layout=(8, 2, 64), learner_gpus=256, gpus_per_node=8, engine_gpus=4, engines=1, weight_bytes=2)
    assert v.model_bytes == 2 * glm5_params_by_hand()


def test_cli_prints_the_dsa_numbers(capsys):
    for name, argv in (("deepseek-v3.2", ()), ("glm-5", ("--kv-dtype", "fp8"))):
        m = DSA[name]
        assert cli.main(["plan", name, "--nodes", "32", "--gpu-mem", "141", "--seq-len", "65536", *argv]) == 0
        out = capsys.readouterr().out
        row = "656 B (one MLA latent row as vLLM's fp8_ds_mla" if argv else "576 values (one MLA latent row) x 2 B"
        per_token = m["layers"] * (656 if argv else 1152) + m["layers"] * 132
        assert (f"KV per token and GPU: {m['layers']} layers x ({row}") in out and f"= {per_token} bytes" in out
        assert "132 B DSA indexer key, fp8 with its fp32 scale" in out
        assert f"per token, {m['layers']} layers: {m['layers'] * 4096:,} B" in out
        assert "NOT RUNNABLE on a DSA engine" in out and "training adapter" not in out
        assert f"{indexer_params_by_hand(m):,} parameters per layer" in out


def test_cli_refuses_a_rollout_batch_below_1(capsys):
    assert cli.main(["plan", "glm-5", "--nodes", "32", "--gpu-mem", "141", "--rollout-batch", "0"]) == 2
    assert "--rollout-batch must be >= 1 (got 0)" in capsys.readouterr().err


def dsa_config(**changes) -> dict:
    return json.loads((ASSETS / "glm-5.json").read_text()) | changes


@pytest.mark.parametrize("changes, error, message", [
    (dict(index_topk=0), ValueError, "config.json index_topk must be a positive integer for GlmMoeDsaForCausalLM"),
    (dict(index_n_heads=None), ValueError, "index_n_heads must be a positive integer"),
    (dict(model_type="deepseek_v3"), ValueError, "model_type 'deepseek_v3' (expected 'glm_moe_dsa')"),
    (dict(index_head_dim=32), ValueError, "index_head_dim must be a power of two (the Hadamard rotation) above "
                                          "qk_rope_head_dim 64 (got 32)"),
    (dict(index_topk_freq=3), NotImplementedError, "reuse another layer's top-k (GLM-5.2 index sharing"),
    (dict(indexer_types=["full", "shared"] * 39), NotImplementedError, "layers [1, 3, 5"),
])
def test_bad_dsa_configs_are_refused_naming_the_key(changes, error, message):
    with pytest.raises(error, match=re.escape(message)):
        shape_from_config(dsa_config(**changes), "glm-5")

"""`msrl plan --lora-rank`: adapter counts by hand (r * (in + out) per adapted linear, per routed expert), LoRA
learner memory by hand (bf16 frozen base; fp32 adapter weights, gradients and Adam m, v), the fewest GPUs LoRA and
full RL fit on, and the refusals.

    .venv/bin/python -m pytest -q tests/unit/test_plan_lora.py
"""
from __future__ import annotations

import json
import math
import re

import pytest

from megatron_sparse_rl.lora import adapter_params, resolve_targets, target_names
from megatron_sparse_rl.planner import PlanOptions, load_shape, plan_layout, rank_layouts
from megatron_sparse_rl.planner.memory import GiB
from megatron_sparse_rl.planner.shapes import shape_from_config
from megatron_sparse_rl.tools import cli

R = 4


def _qwen3_moe():
    """2 MoE layers, hidden 64, 4 heads / 2 KV heads of 16, 8 experts of width 32 (no dense MLP, no shared expert)."""
    return shape_from_config({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1000, "tie_word_embeddings": False})


def _deepseek():
    """3 layers (the first dense), hidden 64, MLA with q_lora 24, kv_lora 16, 4 heads of nope 32 + rope 8, v 32;
    dense MLP 64, one shared expert of 32, 8 routed experts of 32."""
    from megatron_sparse_rl.models.tiny_families import deepseek_config_kwargs

    cfg = deepseek_config_kwargs(layers=3, kv_lora_rank=16, qk_rope=8)
    cfg.update(q_lora_rank=24, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    return shape_from_config(cfg)


def test_qwen3_moe_adapter_count_by_hand():
    spec = _qwen3_moe().spec
    assert target_names(spec) == ("q_proj", "k_proj", "v_proj", "o_proj", "experts")
    # per layer: q 64->64, k 64->32, v 64->32, o 64->64; each r * (in + out)
    attention = R * (64 + 64) + R * (64 + 32) + R * (64 + 32) + R * (64 + 64)
    expert = 3 * R * (64 + 32)  # gate 64->32, up 64->32, down 32->64
    count = adapter_params(spec, R, resolve_targets(("all-linear",), spec))
    assert (count.dense, count.experts) == (2 * attention, 2 * 8 * expert) == (3584, 18432)
    only_q = adapter_params(spec, R, resolve_targets(("q_proj", "o_proj"), spec))
    assert (only_q.dense, only_q.experts) == (2 * 2 * R * (64 + 64), 0)


def test_deepseek_mla_adapter_count_by_hand():
    spec = _deepseek().spec
    assert target_names(spec) == ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                                  "up_proj", "down_proj", "experts")
    attention = (R * (64 + 24)  # q_a: hidden -> q_lora
                 + R * (24 + 4 * (32 + 8))  # q_b: q_lora -> heads x (nope + rope)
                 + R * (64 + 16 + 8)  # kv_a_proj_with_mqa: hidden -> kv_lora + rope
                 + R * (16 + 4 * (32 + 32))  # kv_b: kv_lora -> heads x (nope + v)
                 + R * (4 * 32 + 64))  # o: heads x v -> hidden
    dense_mlp, shared, expert = 3 * R * (64 + 64), 3 * R * (64 + 32), 3 * R * (64 + 32)
    count = adapter_params(spec, R, resolve_targets(("all-linear",), spec))
    assert count.dense == 3 * attention + 1 * dense_mlp + 2 * shared == 13728
    assert count.experts == 2 * 8 * expert == 18432


def test_lora_memory_of_one_layout_by_hand():
    """tp2 ep2 on 4 GPUs (dp 2, expert dp 2): the base bf16, sharded as without LoRA; the adapters' A/B split follows
    the base linear (column: B split, row: A split, MLA's down projections whole), in fp32 with fp32 gradients and
    Adam m, v sharded over the data-parallel group."""
    shape = _deepseek()
    opts = PlanOptions(gpus=4, gpus_per_node=8, gpu_mem_gib=80, seq_len=256, lora_rank=R)
    p = plan_layout(shape, 2, 1, 2, opts)
    attention = (R * (64 + 24) + R * (24 + 160 / 2) + R * (64 + 24) + R * (16 + 256 / 2) + R * (128 / 2 + 64))
    dense_mlp = 2 * R * (64 + 64 / 2) + R * (64 / 2 + 64)  # gate, up column; down row
    shared = 2 * R * (64 + 32 / 2) + R * (32 / 2 + 64)
    a_dense = 3 * attention + dense_mlp + 2 * shared
    a_experts = 2 * (8 // 2) * 3 * R * (64 + 32)
    assert (a_dense, a_experts) == (9696, 9216)
    base_dense = (shape.total_params() - shape.expert_total()) / 2  # pp 1: every dense part, split by tp 2
    base_experts = shape.expert_total() / 2  # ep 2
    assert p.weights_gib == pytest.approx((2 * (base_dense + base_experts) + 4 * (a_dense + a_experts)) / GiB)
    assert p.grads_gib == pytest.approx(4 * (a_dense + a_experts) / GiB)
    assert p.optimizer_gib == pytest.approx(8 * (a_dense / 2 + a_experts / 2) / GiB)
    full = plan_layout(shape, 2, 1, 2, PlanOptions(gpus=4, gpus_per_node=8, gpu_mem_gib=80, seq_len=256))
    assert p.activations_gib == full.activations_gib and p.grads_gib < full.grads_gib


def _fewest(out: str, which: str) -> int:
    return int(re.search(rf"{which} (\d+) \(tp", out).group(1))


def test_kimi_k2_lora_fits_on_far_fewer_gpus_than_full_rl(capsys):
    assert cli.main(["plan", "kimi-k2", "--gpus", "64", "--gpu-mem", "80", "--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    shape = load_shape("kimi-k2")
    # rank 16 on every linear: 60 MoE layers x 384 experts x 3 x 16 x (7168 + 2048) on the routed experts alone
    experts = 60 * 384 * 3 * 16 * (7168 + 2048)
    assert f"{experts / 1e9:.2f}B on routed experts" in out
    lora, full = _fewest(out, "LoRA"), _fewest(out, "full RL")
    # full RL holds at least bf16 weights + fp32 gradients (6 B) of every parameter, whatever the sharding
    assert full >= 6 * shape.total_params() / ((80 - 6) * GiB)
    assert lora <= 64 and full >= 8 * lora
    # the counts are the smallest: half of each fits nothing
    half = PlanOptions(gpus=lora // 2, gpus_per_node=8, gpu_mem_gib=80, lora_rank=16)
    assert not any(p.fits for p in rank_layouts(shape, half))
    assert not any(p.fits and p.runs_here for p in rank_layouts(shape, PlanOptions(gpus=full // 2, gpu_mem_gib=80)))


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "-1"], "--lora-rank must be >= 1, or 0 for full RL (got -1)"),
    (["--lora-rank", "8", "--lora-targets", "gate_proj"],
     "--lora-targets: Qwen3MoeForCausalLM has no module 'gate_proj'; it has q_proj, k_proj, v_proj, o_proj, experts"),
])
def test_cli_refuses_bad_lora_arguments(capsys, argv, message):
    assert cli.main(["plan", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", *argv]) == 2
    out, err = capsys.readouterr()
    assert message in err and out == ""

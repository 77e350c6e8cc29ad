"""`msrl plan`: parameter counts of the bundled configs against published totals, memory arithmetic against
hand-computed values, layout ranking and the CLI."""
from __future__ import annotations

import pytest

from megatron_sparse_rl.planner import PlanOptions, bundled_models, load_shape, plan_layout, rollout_plan, weight_sync
from megatron_sparse_rl.planner.memory import GiB, rank_layouts
from tools import cli

# Published totals. Qwen3-30B-A3B: 30.5B (Qwen3 model card / technical report). Qwen3-235B-A22B: 235B (same).
# DeepSeek-V3: 671B main model, MTP module (14B) excluded (DeepSeek-V3 technical report and model card).
# Kimi-K2: 1026.5B, the parameter count the Hugging Face Hub reports for the released moonshotai/Kimi-K2-Instruct
# safetensors (as listed by a third-party mirror of the Hub's model statistics; not re-checked on the Hub here).
# Its model card rounds this to "1T"; its technical report says 1.04T (1.3% more: we do not know what it adds).
PUBLISHED = {"qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235e9, "deepseek-v3": 671e9, "kimi-k2": 1026.5e9}
# Published active parameters: 3.3B, 22B, 37B, 32.6B (Kimi-K2 technical report; the model card rounds to 32B).
ACTIVE = {"qwen3-30b-a3b": 3.3e9, "qwen3-235b-a22b": 22e9, "deepseek-v3": 37e9, "kimi-k2": 32.6e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published_total(name):
    shape = load_shape(name)
    assert shape.total_params() == pytest.approx(PUBLISHED[name], rel=0.01)
    assert shape.active_params() == pytest.approx(ACTIVE[name], rel=0.03)


def test_kimi_k2_parameter_count_by_hand():
    # 61 layers (1 dense, 60 MoE: 384 routed + 1 shared expert of 3 x 7168 x 2048), MLA attention, untied
    # 163840-token embedding and head; the sum of the public config's tensor shapes.
    h, e = 7168, 3 * 7168 * 2048
    attn = h * 1536 + 1536 + 1536 * 64 * 192 + h * 576 + 512 + 512 * 64 * 256 + 64 * 128 * h + 2 * h
    moe_layer = attn + 385 * e + 384 * h + 384  # experts, router weight and its correction bias
    dense_layer = attn + 3 * h * 18432
    total = 60 * moe_layer + dense_layer + 2 * 163840 * h + h
    assert load_shape("kimi-k2").total_params() == total == 1_026_408_232_448


def test_deepseek_shape_by_hand():
    s = load_shape("deepseek-v3")
    h = 7168
    attn = h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h + 2 * h
    assert s.attn_params == attn and s.n_moe == 58 and s.n_dense == 3
    assert s.kv_elems == 576 and s.kv_heads == 0


def test_qwen_shape_agrees_with_the_adapter_spec():
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.planner.shapes import ASSETS

    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        _, spec = load_spec(ASSETS / f"{name}.json")
        assert load_shape(name).total_params() == spec.parameter_count()


def test_bundled_models():
    assert bundled_models() == ["deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "qwen3-30b-a3b"]


def test_memory_of_one_layout_by_hand():
    s = load_shape("qwen3-30b-a3b")
    opts = PlanOptions(gpus=8, gpus_per_node=8, gpu_mem_gib=141, seq_len=4096)
    p = plan_layout(s, 1, 1, 8, opts)  # tp1 pp1 ep8: dp 8, expert dp 1
    experts = 48 * 16 * 3 * 2048 * 768
    dense = s.total_params() - s.expert_total()
    assert p.weights_gib == pytest.approx(2 * (dense + experts) / GiB)
    assert p.grads_gib == pytest.approx(4 * (dense + experts) / GiB)
    assert p.optimizer_gib == pytest.approx(12 * (dense / 8 + experts / 1) / GiB)
    assert p.fits


def test_kv_dense_vs_sparse_by_hand():
    s = load_shape("qwen3-30b-a3b")
    r = rollout_plan(s, gpu_mem_gib=80, engine_gpus=1, seq_len=32768, budget=2048, interval=128)
    per_token = 48 * 2 * 4 * 128 * 2  # layers * (K,V) * kv heads * head_dim * bf16
    assert r.dense_mib_per_seq == pytest.approx(32768 * per_token / 2 ** 20)
    assert r.sparse_mib_per_seq == pytest.approx(2176 * per_token / 2 ** 20)
    assert r.sparse_max_seqs >= 15 * r.dense_max_seqs
    sync = weight_sync(s, link_gbps=100, learner_nodes=1)
    assert sync.seconds_one_link == pytest.approx(s.total_params() * 2 * 8 / 100e9)


def test_layouts_ranked_fitting_first_with_reasons():
    s = load_shape("deepseek-v3")
    plans = rank_layouts(s, PlanOptions(gpus=64, gpus_per_node=8, gpu_mem_gib=80))
    assert not any(p.fits for p in plans)  # 671B with fp32 Adam on 64 x 80 GiB cannot fit
    assert all("GiB" in p.problems[0] for p in plans)
    plans = rank_layouts(s, PlanOptions(gpus=512, gpus_per_node=8, gpu_mem_gib=80))
    fitting = [p for p in plans if p.fits]
    assert fitting and plans[0].fits and plans[0].total_gib <= plans[0].usable_gib


def test_cli(capsys):
    assert cli.main(["plan", "kimi-k2", "--gpus", "256", "--gpu-mem", "80", "--layout", "8,8,32",
                     "--optimizer-offload"]) == 0
    out = capsys.readouterr().out
    assert "1.026T parameters" in out and "layout tp8 pp8 ep32" in out and "sparse KV" in out
    assert cli.main(["plan", "no-such-model", "--gpus", "8", "--gpu-mem", "80"]) == 2
    assert "neither a bundled config" in capsys.readouterr().err

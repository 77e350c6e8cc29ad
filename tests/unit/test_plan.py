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


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shape_agrees_with_the_adapter_spec(name):
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.planner.shapes import ASSETS

    _, spec = load_spec(ASSETS / f"{name}.json")
    assert load_shape(name).total_params() == spec.parameter_count()


def deepseek_v3_params_by_hand() -> int:
    # 61 layers (3 dense, 58 MoE: 256 routed + 1 shared expert of 3 x 7168 x 2048), MLA attention with q_lora 1536,
    # kv_lora 512, rope 64, nope 128, v 128, 128 heads; router weight + correction bias; untied 129280-token
    # embedding and head; the final norm.
    h, e = 7168, 3 * 7168 * 2048
    attn = h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h + 2 * h
    moe_layer = attn + 257 * e + 256 * h + 256
    dense_layer = attn + 3 * h * 18432
    return 58 * moe_layer + 3 * dense_layer + 2 * 129280 * h + h


def test_deepseek_v3_mla_kv_and_concurrency_by_hand():
    """MLA caches ONE latent row per token per layer (kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values), shared
    by the 128 heads and kept whole on every GPU of a TP engine: an engine holds what one of its GPUs holds."""
    s = load_shape("deepseek-v3")
    assert load_shape("deepseek-v3").total_params() == deepseek_v3_params_by_hand()
    per_token = 61 * 576 * 2  # layers x latent values x bf16 bytes = 70272, not 61 x 128 heads x 2 x 192 x 2
    gpus, seq = 32, 8192
    free = 141 * 0.9 - 2 * deepseek_v3_params_by_hand() / gpus / GiB - 4.0  # GiB/GPU left for the cache
    r = rollout_plan(s, gpu_mem_gib=141, engine_gpus=gpus, seq_len=seq, budget=2048, interval=128)
    assert r.kv_bytes_per_token == per_token == 70272 and r.mla
    assert r.kv_free_gib_per_gpu == pytest.approx(free)
    assert r.dense_mib_per_seq == pytest.approx(seq * per_token / 2 ** 20)
    assert r.dense_max_seqs == int(free * GiB // (seq * per_token)) == 156
    assert rollout_plan(s, gpu_mem_gib=141, engine_gpus=gpus, seq_len=seq, budget=2048, interval=128,
                        kv_bytes=1).kv_bytes_per_token == 61 * 576  # fp8 cache
    # the same engine over 64 GPUs: weights halve, the per-GPU KV of a sequence does not
    r64 = rollout_plan(s, gpu_mem_gib=141, engine_gpus=64, seq_len=seq, budget=2048, interval=128)
    assert r64.kv_bytes_per_token == per_token and r64.dense_max_seqs > r.dense_max_seqs


def test_cli_reports_mla_kv_per_token_and_concurrency(capsys):
    assert cli.main(["plan", "deepseek-v3", "--gpus", "256", "--gpu-mem", "141", "--seq-len", "8192",
                     "--rollout-gpus", "32", "--layout", "8,1,256"]) == 0
    out = capsys.readouterr().out
    assert "KV per token and GPU: 61 layers x 576 values (one MLA latent row) x 2 B = 70272 bytes" in out
    assert "max concurrent sequences per engine 156" in out
    assert "sparse KV on the MLA latent cache is not supported yet" in out
    assert "576 values (kv_lora_rank 512 + qk_rope_head_dim 64) shared by all 128 heads" in out


def test_mla_engine_that_holds_no_dense_sequence_is_a_problem():
    # sparse KV is not available on MLA, so an engine must hold one dense sequence
    s = load_shape("deepseek-v3")
    r = rollout_plan(s, gpu_mem_gib=141, engine_gpus=32, seq_len=2_000_000, budget=2048, interval=128)
    assert r.sparse_max_seqs > 0 and r.dense_max_seqs == 0
    assert "holds not one sequence, dense (sparse KV is not available on the MLA latent)" in r.problems[0]


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


def _plan_in(tmp_path, monkeypatch, capsys, *argv) -> tuple[int, str, str]:
    """Run `msrl plan` in an empty folder; check it wrote nothing there."""
    monkeypatch.chdir(tmp_path)
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    assert list(tmp_path.iterdir()) == []
    return code, out, err


def test_cli_exits_1_and_says_so_when_no_layout_fits(tmp_path, monkeypatch, capsys):
    # 671B parameters with fp32 Adam on GPU: 186 GiB of states per GPU on 64 x 80 GiB at best (see above).
    code, out, err = _plan_in(tmp_path, monkeypatch, capsys, "deepseek-v3", "--gpus", "64", "--gpu-mem", "80")
    assert code == 1
    assert "error: no learner layout fits deepseek-v3 on 64 x 80 GiB GPUs; the closest, tp8 pp1 ep64" in err
    assert "weights+grads+optimizer" in err and "NO:" in out  # the table is still printed, with its reasons


def test_cli_exits_1_when_the_requested_layout_does_not_fit(tmp_path, monkeypatch, capsys):
    code, _, err = _plan_in(tmp_path, monkeypatch, capsys, "qwen3-30b-a3b", "--gpus", "64", "--gpu-mem", "80",
                            "--layout", "8,8,3")
    assert code == 1
    assert "error: layout tp8 pp8 ep3 does not fit: " in err and "ep=3 must divide the experts (128)" in err
    assert "no learner layout fits" not in err  # other layouts do fit


def test_cli_exits_1_when_engine_weights_leave_no_kv_room(tmp_path, monkeypatch, capsys):
    # 671.0e9 bf16 parameters over 8 GPUs: 156.2 GiB each > 80 * 0.9 - 4 = 68 GiB usable.
    code, out, err = _plan_in(tmp_path, monkeypatch, capsys, "deepseek-v3", "--gpus", "512", "--gpu-mem", "80",
                              "--rollout-gpus", "8")
    assert code == 1
    assert ("error: rollout: the engine's weights (156.2 GiB/GPU on 8 GPU(s)) leave no KV room in the 68.0 GiB "
            "usable per GPU") in err
    assert "no learner layout fits" not in err and "inf" not in out


def test_rollout_plan_names_the_missing_kv_room():
    s = load_shape("qwen3-30b-a3b")  # 61.1 GB of bf16 weights on one 40 GiB GPU: 56.9 GiB > 40 * 0.9 - 4 = 32
    r = rollout_plan(s, gpu_mem_gib=40, engine_gpus=1, seq_len=32768, budget=2048, interval=128)
    assert not r.fits and r.kv_free_gib_per_gpu == 0 and r.sparse_max_seqs == 0
    assert "leave no KV room in the 32.0 GiB usable per GPU" in r.problems[0]
    assert rollout_plan(s, gpu_mem_gib=80, engine_gpus=1, seq_len=32768, budget=2048, interval=128).fits


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "0"], "--seq-len must be >= 1 (got 0)"),
    (["--kv-budget", "-1"], "--kv-budget must be >= 1 (got -1)"),
    (["--rollout-gpus", "0"], "--rollout-gpus must be >= 1 (got 0)"),
    (["--layout", "8,0,1"], "--layout degrees must be >= 1 (got '8,0,1')"),
    (["--layout", "8x8"], "--layout must be TP,PP,EP (got '8x8')"),
])
def test_cli_rejects_bad_arguments_before_planning(tmp_path, monkeypatch, capsys, argv, message):
    code, out, err = _plan_in(tmp_path, monkeypatch, capsys, "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", *argv)
    assert code == 2 and f"error: {message}" in err and out == ""

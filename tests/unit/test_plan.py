"""`msrl plan`: parameter counts of the bundled configs against published totals, memory arithmetic against
hand-computed values, layout ranking and the CLI."""
from __future__ import annotations

import pytest

from megatron_sparse_rl.planner import PlanOptions, bundled_models, load_shape, plan_layout, rank_layouts, rollout_plan
from megatron_sparse_rl.planner.memory import GiB
from megatron_sparse_rl.planner.ranking import shard_problems
from megatron_sparse_rl.tools import cli

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
    assert "576 values (kv_lora_rank 512 + qk_rope_head_dim 64) shared by all 128 heads" in out


def test_deepseek_v3_mla_sparse_kv_by_hand():
    """A sparse sequence keeps budget + interval latent rows per layer (16-token pages): 61 layers x 576 values x
    2 B (bf16) each, on every GPU of the engine; the concurrency it buys is counted as for per-head models."""
    s = load_shape("deepseek-v3")
    gpus, seq = 32, 32768
    free = 141 * 0.9 - 2 * deepseek_v3_params_by_hand() / gpus / GiB - 4.0
    r = rollout_plan(s, gpu_mem_gib=141, engine_gpus=gpus, seq_len=seq, budget=2048, interval=128)
    sparse_bytes = 61 * 576 * 2 * (2048 + 128)  # 2176 rows: a whole number of 16-token pages
    assert r.sparse_tokens == 2176 and r.sparse_mib_per_seq == pytest.approx(sparse_bytes / 2 ** 20)  # 145.8
    assert r.sparse_max_seqs == int(free * GiB // sparse_bytes) == 588
    assert r.dense_max_seqs == int(free * GiB // (61 * 576 * 2 * seq)) == 39
    # 32 GPUs: what the budget would buy, not what this engine runs; the fit is judged on the dense cache
    assert not r.sparse_runs and r.fits
    odd = rollout_plan(s, gpu_mem_gib=141, engine_gpus=gpus, seq_len=seq, budget=1000, interval=100)
    assert odd.sparse_mib_per_seq == pytest.approx(61 * 576 * 2 * 1104 / 2 ** 20)  # 1100 rows -> 69 pages of 16


def test_cli_flags_mla_sparse_kv_on_a_multi_gpu_engine(capsys):
    assert cli.main(["plan", "deepseek-v3", "--nodes", "32", "--gpu-mem", "141", "--seq-len", "32768",
                     "--rollout-gpus", "32"]) == 0
    out = capsys.readouterr().out
    mib = 61 * 576 * 2 * 2176 / 2 ** 20
    assert (f"sparse KV: budget 2048 + interval 128 = 2176 tokens -> {mib:.0f} MiB/sequence on each GPU; max "
            f"concurrent sequences per engine 588 ({588 / 39:.1f}x dense); what the budget would buy: NOT RUNNABLE "
            "on this 32-GPU engine") in out
    assert ("note: sparse KV on the MLA latent runs on single-rank engines only (rollout.tensor_parallel_size 1): "
            "on 32 ranks each TP rank would score the shared latent rows with its own heads only; the dense numbers "
            "decide whether this engine fits") in out
    assert "not supported yet" not in out and "runs on this single-rank engine" not in out


def _tiny_deepseek(path) -> None:
    """A 3-layer DeepSeek-V3 config.json (MLA latent 512 + 64) whose engine fits one GPU."""
    import json

    from megatron_sparse_rl.models.tiny_families import deepseek_config_kwargs

    path.mkdir()
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           **deepseek_config_kwargs(layers=3, kv_lora_rank=512, qk_rope=64)}
    (path / "config.json").write_text(json.dumps(cfg))


def test_mla_sparse_kv_on_a_single_gpu_engine_is_used_for_real(tmp_path, capsys):
    _tiny_deepseek(tmp_path / "tiny")
    assert cli.main(["plan", str(tmp_path / "tiny"), "--gpus", "1", "--gpu-mem", "80", "--seq-len", "32768"]) == 0
    out = capsys.readouterr().out
    per_token = 3 * 576 * 2  # layers x latent values x bf16
    assert f"KV per token and GPU: 3 layers x 576 values (one MLA latent row) x 2 B = {per_token} bytes" in out
    s = load_shape(str(tmp_path / "tiny"))
    free = 80 * 0.9 - 2 * s.total_params() / GiB - 4.0
    dense, sparse = int(free * GiB // (32768 * per_token)), int(free * GiB // (2176 * per_token))
    assert (f"sparse KV: budget 2048 + interval 128 = 2176 tokens -> {2176 * per_token / 2 ** 20:.0f} MiB/sequence on "
            f"each GPU; max concurrent sequences per engine {sparse} ({sparse / dense:.1f}x dense); runs on this "
            "single-rank engine") in out
    assert ("note: sparse KV on the MLA latent runs on single-rank engines only (rollout.tensor_parallel_size 1), as "
            "this one is") in out and "NOT RUNNABLE" not in out


def test_mla_engine_fit_is_judged_on_sparse_only_where_sparse_runs(tmp_path):
    # a 2M-token sequence: 2e6 x 3456 B = 6.4 GiB dense, 2176 x 3456 B = 7.2 MiB sparse, in 8 x 0.9 - 4 = 3.2 GiB
    _tiny_deepseek(tmp_path / "tiny")
    s = load_shape(str(tmp_path / "tiny"))
    kw = dict(gpu_mem_gib=8, seq_len=2_000_000, budget=2048, interval=128)
    one = rollout_plan(s, engine_gpus=1, **kw)
    assert one.sparse_runs and one.dense_max_seqs == 0 and one.sparse_max_seqs > 0 and one.fits
    two = rollout_plan(s, engine_gpus=2, **kw)
    assert not two.sparse_runs and not two.fits and two.sparse_max_seqs > 0
    assert ("holds not one sequence, dense (sparse KV on the MLA latent runs on single-rank engines only "
            "(rollout.tensor_parallel_size 1)) (2000000 tokens)") in two.problems[0]


def test_mla_engine_that_holds_no_dense_sequence_is_a_problem():
    # sparse KV on the MLA latent runs on single-rank engines only, so a 32-GPU engine must hold one dense sequence
    s = load_shape("deepseek-v3")
    r = rollout_plan(s, gpu_mem_gib=141, engine_gpus=32, seq_len=2_000_000, budget=2048, interval=128)
    assert r.sparse_max_seqs > 0 and r.dense_max_seqs == 0
    assert not r.sparse_runs
    assert "holds not one sequence, dense (sparse KV on the MLA latent runs on single-rank engines" in r.problems[0]


def test_bundled_models():
    assert bundled_models() == ["deepseek-v3", "deepseek-v3.2", "glm-5", "kimi-k2", "qwen3-235b-a22b", "qwen3-30b-a3b"]


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
    # the closest: the most sharding of the states (tp8, ep64), with cp8's shorter activations
    assert "error: no learner layout fits deepseek-v3 on 64 x 80 GiB GPUs; the closest, tp8 pp1 cp8 ep64" in err
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
    (["--margin", "1.5"], "--margin is a fraction of GPU memory in [0, 1) (got 1.5)"),
])
def test_cli_rejects_bad_arguments_before_planning(tmp_path, monkeypatch, capsys, argv, message):
    code, out, err = _plan_in(tmp_path, monkeypatch, capsys, "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", *argv)
    assert code == 2 and f"error: {message}" in err and out == ""


# --- ranking: margin, EP across nodes, published recipes, learner limits (issue 25 item 5) ---

def _qwen3_30b_tp1_pp1_ep8_gib(seq: int) -> float:
    """Learner GiB/GPU of Qwen3-30B-A3B at tp1 pp1 ep8 on 8 GPUs, fp32 grads, Adam on GPU, full recompute, by hand:
    48 MoE layers (128 experts of 3 x 2048 x 768, top-8), GQA 32 heads / 4 KV heads of 128, untied 151936 vocab."""
    h, v, layers = 2048, 151936, 48
    attn = h * 128 * (2 * 32 + 2 * 4) + 2 * h + 2 * 128  # q, k, v, o; the layer's two norms; q/k norms
    dense = layers * (attn + 128 * h) + 2 * v * h + h  # attention, router; embedding, head, final norm (one stage)
    experts = layers * (128 // 8) * 3 * h * 768
    states = 2 * (dense + experts) + 4 * (dense + experts) + 12 * (dense / 8 + experts / 1)  # dp 8, expert dp 1
    attn_act = 2 * (2 * h + 128 * (2 * 32 + 2 * 4)) + 4 * 32
    moe_act = 2 * (2 * h + 8 * (h + 3 * 768)) + 4 * 128
    acts = seq * (layers * 2 * h + attn_act + moe_act + 8 * v)  # layer inputs, one layer whole, fp32 logits + grad
    return (states + acts) / GiB


def test_a_roomy_layout_ranks_above_one_with_0_3_gib_spare(capsys):
    # the GPU is sized so that tp1 pp1 ep8 (the least model parallelism that fits) has exactly 0.3 GiB to spare
    s = load_shape("qwen3-30b-a3b")
    mem = _qwen3_30b_tp1_pp1_ep8_gib(512) + 6.0 + 0.3
    opts = PlanOptions(gpus=8, gpus_per_node=8, gpu_mem_gib=mem, seq_len=512)
    assert opts.margin == 0.10 and opts.margin_gib == pytest.approx(0.1 * mem)
    plans = rank_layouts(s, opts)
    tight = next(p for p in plans if (p.tp, p.pp, p.ep) == (1, 1, 8))
    assert tight.fits and tight.headroom_gib == pytest.approx(0.3) and not tight.roomy
    assert plans[0].roomy and plans[0].headroom_gib >= 0.1 * mem and plans[0] is not tight
    assert plans.index(tight) == sum(p.roomy and p.runs_here for p in plans)  # right after every roomy layout
    # without a margin the same layout is first: the margin is what moved it
    first = rank_layouts(s, PlanOptions(gpus=8, gpus_per_node=8, gpu_mem_gib=mem, seq_len=512, margin=0))[0]
    assert (first.tp, first.pp, first.ep) == (1, 1, 8)
    assert cli.main(["plan", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", repr(mem), "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    first = plans[0]
    assert f"fits, TIGHT: 0.3 spare < margin {0.1 * mem:.1f}" in out
    assert (f"chosen: tp{first.tp} pp{first.pp} ep{first.ep}: {first.headroom_gib:.1f} GiB to spare, keeping the "
            f"{0.1 * mem:.1f} GiB margin; this learner runs it") in out


def test_deepseek_v3_256_gpus_chooses_the_published_uneven_layout(capsys):
    """NeMo-RL's DeepSeek-V3 GRPO recipe (grpo-dapomath17k-dsv3-megatron.yaml, 32 x 8 GPUs) runs TP8 PP8 EP32 with
    uneven stages; this learner splits the 61 layers 8,8,8,8,8,7,7,7 (balanced), so the plan chooses it and names
    the split."""
    s = load_shape("deepseek-v3")
    plans = rank_layouts(s, PlanOptions(gpus=256, gpus_per_node=8, gpu_mem_gib=80))
    pub = next(p for p in plans if (p.tp, p.pp, p.ep) == (8, 8, 32))
    # by hand: the worst of 8 stages holds 8 MoE layers (attention, 1 shared expert, router + bias) and the larger
    # of embedding and head, over tp 8; 256 / 32 = 8 routed experts per layer per GPU; dp 256/64 = 4, expert dp 1
    h, v = 7168, 129280
    attn = h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h + 2 * h
    dense = (8 * attn + 8 * (3 * h * 2048 + 256 * h + 256) + v * h + h) / 8  # last stage: head + final norm
    experts = 8 * 8 * 3 * h * 2048
    states = 6 * (dense + experts) + 12 * (dense / 4 + experts)
    attn_act = 2 * (2 * h + 1536 + 576 + 128 * (2 * 192 + 2 * 128)) + 4 * 128
    moe_act = 2 * (2 * h + 8 * (h + 3 * 2048) + 3 * 2048) + 4 * 256
    acts = 32768 * (8 * 2 * h * 8 + attn_act + moe_act + 8 * v) / 8  # 8 micro-batches in flight on stage 0
    assert pub.total_gib == pytest.approx((states + acts) / GiB)
    assert pub.fits and pub.roomy and 74 - pub.total_gib >= 8.0  # usable 80 - 6, margin 10% of 80
    assert pub.ep_nodes == 32 // 8
    assert pub.learner_limits == () and pub.runs_here and pub.stages == (8, 8, 8, 8, 8, 7, 7, 7)
    assert pub.recipe.name.endswith("grpo-dapomath17k-dsv3-megatron.yaml")
    # it fits with the margin and runs here, and a published recipe's layout ranks first in its class
    assert plans[0] is pub
    assert cli.main(["plan", "deepseek-v3", "--gpus", "256", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[1:6] == ["8", "8", "1", "32", "4"])
    assert "fits" in row and "uneven stages 8*5,7*3 layers" in row and "NOT IN THIS LEARNER" not in row
    assert "published: NeMo-RL examples/configs/recipes/llm/grpo-dapomath17k-dsv3-megatron.yaml" in row
    assert ("chosen: tp8 pp8 ep32: 14.7 GiB to spare, keeping the 8.0 GiB margin; this learner runs it with uneven "
            "pipeline stages 8*5,7*3 layers (balanced)") in out


def test_ep_across_nodes_ranks_below_ep_inside_fewer_nodes():
    # Qwen3-235B-A22B on 16 x 8 GPUs at 8K: tp2 pp1 ep128 (EP over 128 / 8 = 16 nodes, tp*pp 2) fits with the
    # margin, yet ranks below every fitting layout whose EP group spans fewer nodes; first comes the published recipe's
    # tp2 pp8 ep16 (uneven stages of the 94 layers), then tp2 pp8 ep8 inside one node
    plans = rank_layouts(load_shape("qwen3-235b-a22b"), PlanOptions(gpus=128, gpus_per_node=8, gpu_mem_gib=80,
                                                                    seq_len=8192))
    wide = next(p for p in plans if (p.tp, p.pp, p.ep) == (2, 1, 128))
    assert wide.roomy and wide.runs_here and wide.ep_nodes == 16
    assert (plans[0].tp, plans[0].pp, plans[0].ep, plans[0].ep_nodes) == (2, 8, 16, 2)
    assert plans[0].stages == (12,) * 6 + (11,) * 2 and plans[0].runs_here and plans[0].recipe is not None
    assert (plans[1].tp, plans[1].pp, plans[1].ep, plans[1].ep_nodes) == (2, 8, 8, 1)
    runnable = [p.ep_nodes for p in plans if p.roomy and p.runs_here and p.recipe is None]
    assert runnable == sorted(runnable)
    # with 4 GPUs per node the same EP 32 spans 8 nodes
    assert plan_layout(load_shape("qwen3-235b-a22b"), 2, 2, 32, PlanOptions(gpus=128, gpus_per_node=4,
                                                                            gpu_mem_gib=80)).ep_nodes == 8


def test_hints_never_suggest_an_option_that_is_on(tmp_path, monkeypatch, capsys):
    # 671B on 16 x 80 GiB fits nowhere and a 2-GPU engine has no KV room: every hint that could apply is printed
    base = ["deepseek-v3", "--gpus", "16", "--gpu-mem", "80", "--rollout-gpus", "2", "--recompute", "none"]
    code, out, err = _plan_in(tmp_path, monkeypatch, capsys, *base)
    assert code == 1
    for hint in ("(--optimizer-offload)", "(--recompute full)", "(--engine-weights fp8)"):
        assert hint in out + err
    on = ["--optimizer-offload", "--recompute", "full", "--grad-dtype", "bf16", "--engine-weights", "fp8",
          "--kv-dtype", "fp8"]
    code, out, err = _plan_in(tmp_path, monkeypatch, capsys, *base, *on)
    assert code == 1 and "no candidate layout fits: add GPUs or shorten --seq-len" in out
    for hint in ("(--optimizer-offload)", "(--recompute full)", "(--grad-dtype bf16)", "(--engine-weights fp8)",
                 "(--kv-dtype fp8)"):
        assert hint not in out + err
    # the KV cache hint: an MLA engine whose room holds not one 4M-token sequence
    s = load_shape("deepseek-v3")
    kw = dict(gpu_mem_gib=141, engine_gpus=32, seq_len=4_000_000, budget=2048, interval=128)
    assert "(--kv-dtype fp8)" in rollout_plan(s, **kw).problems[0]
    assert "(--kv-dtype fp8)" not in rollout_plan(s, kv_bytes=1, **kw).problems[0]
    # bf16 grads add an fp32 copy sharded over data parallel: no help where expert dp is 1 (tp8 pp1 ep16 here)
    p = plan_layout(s, 8, 1, 16, PlanOptions(gpus=16, gpus_per_node=8, gpu_mem_gib=80))
    assert p.edp == 1 and "(--grad-dtype bf16)" not in p.problems[0] and "(--optimizer-offload)" in p.problems[0]


def _tiny_qwen3_moe(path) -> int:
    """A 2-layer Qwen3-MoE config.json; its parameter count by hand: attention (q, k, v, o of 4 heads / 2 KV heads of
    16, the layer's two norms, q/k norms), 8 experts of 3 x 64 x 32 and a router per layer, untied 100000 x 64
    embedding and head, the final norm."""
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 100000, "tie_word_embeddings": False}))
    layer = 64 * 16 * (2 * 4 + 2 * 2) + 2 * 64 + 2 * 16 + 8 * 3 * 64 * 32 + 8 * 64
    return 2 * layer + 2 * 100000 * 64 + 64


def test_small_model_counts_print_in_millions(tmp_path, capsys):
    total = _tiny_qwen3_moe(tmp_path / "tiny")
    assert total == 12_924_288
    active = total - 2 * (8 - 2) * 3 * 64 * 32  # top-2 of 8 experts per layer
    assert cli.main(["plan", str(tmp_path / "tiny"), "--gpus", "8", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert f"{total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active per token" in out  # 12.92M, 12.85M
    assert f"routed experts {2 * 8 * 3 * 64 * 32 / 1e3:.1f}K" in out  # 98.3K
    # one-GPU engines, 8 of them: each receives the whole bf16 model, 25.8 MB
    assert f"{2 * total / 1e6:.1f} MB per engine over 8 engine(s)" in out
    assert "0.00B" not in out and "0.0 GB" not in out


def test_sparse_line_states_the_real_budget_sum(capsys):
    per_token = 48 * 2 * 4 * 128 * 2  # Qwen3-30B-A3B: layers x (K, V) x KV heads x head_dim x bf16 over the engine
    assert cli.main(["plan", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    assert (f"sparse KV: budget 2048 + interval 128 = 2176 tokens, more than the 512-token sequence: no "
            f"compression, 512 tokens -> {512 * per_token / 2 ** 20:.0f} MiB/sequence") in out
    assert "= 512 tokens" not in out
    assert cli.main(["plan", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", "--seq-len", "8192"]) == 0
    assert (f"sparse KV: budget 2048 + interval 128 = 2176 tokens -> {2176 * per_token / 2 ** 20:.0f} MiB/sequence"
            in capsys.readouterr().out)


def test_engines_across_nodes_are_flagged(capsys):
    s = load_shape("qwen3-235b-a22b")
    kw = dict(gpu_mem_gib=80, seq_len=8192, budget=2048, interval=128)
    assert rollout_plan(s, engine_gpus=8, gpus_per_node=8, **kw).notes == ()
    r = rollout_plan(s, engine_gpus=16, gpus_per_node=8, **kw)
    assert r.engine_nodes == 2 and r.fits and "the engine's 16 GPUs span 2 nodes of 8" in r.notes[0]
    assert rollout_plan(s, engine_gpus=8, gpus_per_node=4, **kw).engine_nodes == 2
    assert cli.main(["plan", "qwen3-235b-a22b", "--nodes", "16", "--gpu-mem", "80", "--seq-len", "8192",
                     "--rollout-gpus", "32"]) == 0  # a flag, not a failure
    assert "note: the engine's 32 GPUs span 4 nodes of 8" in capsys.readouterr().out


def test_fp8_engine_weights_halve_engine_weight_memory(capsys):
    s = load_shape("deepseek-v3")
    kw = dict(gpu_mem_gib=141, engine_gpus=32, seq_len=8192, budget=2048, interval=128)
    bf16, fp8 = rollout_plan(s, **kw), rollout_plan(s, weight_bytes=1, **kw)
    assert bf16.weights_gib_per_gpu == pytest.approx(2 * deepseek_v3_params_by_hand() / 32 / GiB)
    assert fp8.weights_gib_per_gpu == pytest.approx(deepseek_v3_params_by_hand() / 32 / GiB)
    assert fp8.kv_free_gib_per_gpu == pytest.approx(bf16.kv_free_gib_per_gpu + fp8.weights_gib_per_gpu)
    # default engine: the smallest power of two whose weight shard takes at most half of 141 GiB:
    # bf16 1342 GB / 32 = 41.9 GB <= 75.7 GB (16: 83.9 GB does not); fp8 671 GB / 16 = 41.9 GB (8: 83.9 GB)
    assert cli.main(["plan", "deepseek-v3", "--gpus", "256", "--gpu-mem", "141", "--seq-len", "8192",
                     "--engine-weights", "fp8"]) == 0
    out = capsys.readouterr().out
    assert (f"rollout engine on 16 GPU(s): fp8 weights {deepseek_v3_params_by_hand() / 16 / GiB:.1f} GiB/GPU" in out
            and "fp8 engine weights / KV cache are projections" in out)


def test_context_parallel_is_ranked_and_chosen_where_no_cp1_layout_fits():
    """Qwen3-30B-A3B at 32K tokens on 8 x 80 GiB: no cp 1 layout fits (activations); cp 2 halves them and the
    planner picks tp4 pp1 cp2 ep8. By hand against cp 1: activations / 2 plus the gathered K and V of the whole
    sequence (2 x hidden 2048 bf16 per token, over tp 4); optimizer states unchanged (dense shards over dp * cp = 2
    either way); weights whole on each CP rank."""
    s = load_shape("qwen3-30b-a3b")
    opts = PlanOptions(gpus=8, gpus_per_node=8, gpu_mem_gib=80)
    plans = rank_layouts(s, opts)
    assert not any(p.fits for p in plans if p.cp == 1)
    best = plans[0]
    assert (best.tp, best.pp, best.cp, best.ep, best.dp) == (4, 1, 2, 8, 1) and best.fits
    assert best.name == "tp4 pp1 cp2 ep8"
    cp1 = plan_layout(s, 4, 1, 8, opts)
    assert best.activations_gib * GiB == pytest.approx(cp1.activations_gib * GiB / 2 + 32768 * 2 * 2 * 2048 / 4)
    assert (best.weights_gib, best.grads_gib) == (cp1.weights_gib, cp1.grads_gib)
    assert best.optimizer_gib == pytest.approx(cp1.optimizer_gib)
    assert shard_problems(s, 1, 1, 8, PlanOptions(gpus=16, gpu_mem_gib=80, seq_len=1000), cp=8) == [
        "cp=8: seq 1000 does not split into 2*cp=16 equal chunks"]

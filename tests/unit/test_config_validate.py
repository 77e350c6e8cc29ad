"""Cross-component checks of `validate(run, world_size)`: each bad combination fails with the promised message.

    .venv/bin/python -m pytest -q tests/unit/test_config_validate.py
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_sparse_rl.config import ConfigError, RunConfig
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.loader import from_dict, merge_overrides
from megatron_sparse_rl.validation.validate import model_spec
from megatron_sparse_rl.models.tiny_config import tiny_hf_config
from megatron_sparse_rl.models import load_spec
from megatron_sparse_rl.planner.shapes import ASSETS


def run_of(*overrides: str, tiny: bool = True) -> RunConfig:
    """A RunConfig with the tiny MoE (path that does not exist) plus `overrides`."""
    base = {"model": {"path": "/nonexistent/tiny", "tiny": {}}} if tiny else {}
    return from_dict(RunConfig, merge_overrides(base, list(overrides)))


def test_default_tiny_moe_is_valid_and_spec_comes_from_tiny():
    spec = validate(run_of(), 1, cuda=False)
    assert spec.architecture == "Qwen3MoeForCausalLM"
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 64, 4, 2, 32)
    assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size) == (4, 2, 64)


def test_world_size_defaults_to_launch_and_must_match_it():
    run = run_of("launch.nproc_per_node=2")
    validate(run, cuda=False)
    validate(run, 2, cuda=False)
    with pytest.raises(ConfigError, match=r"world size 4 != launch\.nodes \* launch\.nproc_per_node = 1 \* 2 = 2"):
        validate(run, 4, cuda=False)


def test_degrees_must_divide_the_world_size():
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by parallel\.tp \* parallel\.pp = 2 \* 1"):
        validate(run_of("parallel.tp=2", "parallel.sequence_parallel=true", "launch.nproc_per_node=3"), 3, cuda=False)
    with pytest.raises(ConfigError, match=r"not divisible by parallel\.ep \* parallel\.etp = 2 \* 1"):
        validate(run_of("parallel.ep=2", "launch.nproc_per_node=3"), 3, cuda=False)


def test_expert_tp_needs_nccl_judged_for_the_machines_that_run_the_job():
    # tiny MoE: expert FFN 64, etp 2 divides it; ep 1 x etp 2 over 2 ranks
    run = run_of("parallel.etp=2", "launch.nproc_per_node=2")
    with pytest.raises(ConfigError, match=r"parallel\.etp > 1 needs NCCL: gloo cannot do the uneven all-gather"):
        validate(run, 2, cuda=False)
    validate(run, 2, cuda=True)  # a CPU login node checking a GPU job: backend auto -> nccl there


def test_tp_must_divide_the_heads():
    run = run_of("parallel.tp=4", "parallel.sequence_parallel=true", "launch.nproc_per_node=4")
    with pytest.raises(ConfigError) as e:
        validate(run, 4, cuda=False)
    assert "parallel.tp=4 must divide the KV heads (2)" in str(e.value)
    assert "attention heads" not in str(e.value)  # 4 heads split fine over tp 4
    with pytest.raises(ConfigError) as e:
        validate(run_of("parallel.tp=4", "parallel.sequence_parallel=true", "launch.nproc_per_node=4",
                        "model.tiny.heads=6"), 4, cuda=False)
    assert "parallel.tp=4 must divide the attention heads (6)" in str(e.value)
    validate(run_of("parallel.tp=2", "parallel.sequence_parallel=true", "launch.nproc_per_node=2"), 2, cuda=False)


def test_ep_must_divide_the_experts():
    run = run_of("parallel.ep=3", "launch.nproc_per_node=3")
    with pytest.raises(ConfigError, match=r"parallel\.ep=3 must divide the expert count \(4\)"):
        validate(run, 3, cuda=False)
    validate(run_of("parallel.ep=3", "launch.nproc_per_node=3", "model.tiny.experts=6"), 3, cuda=False)


def test_ep_needs_an_moe_model():
    run = run_of("parallel.ep=2", "launch.nproc_per_node=2", "model.tiny.experts=0")
    with pytest.raises(ConfigError, match=r"parallel\.ep=2 needs an MoE model"):
        validate(run, 2, cuda=False)


def test_head_dim_must_suit_vllm_cpu_attention_without_cuda():
    run = run_of("model.tiny.head_dim=48")
    with pytest.raises(ConfigError) as e:
        validate(run, 1, cuda=False)
    assert "model.tiny.head_dim = 48 is not supported by vLLM's CPU attention" in str(e.value)
    assert "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512" in str(e.value)
    assert validate(run, 1, cuda=True).head_dim == 48


def test_model_needs_a_path_or_tiny():
    with pytest.raises(ConfigError, match=r"model\.path is empty and model\.tiny is unset"):
        validate(run_of(tiny=False), 1, cuda=False)


def test_unreachable_model_path_skips_model_checks():
    assert validate(run_of("model.tiny=null"), 1, cuda=False) is None


def test_nccl_needs_cuda():
    with pytest.raises(ConfigError, match=r"parallel\.backend='nccl' needs CUDA"):
        validate(run_of("parallel.backend=nccl"), 1, cuda=False)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_advantages_need_several_samples(estimator):
    run = run_of("rollout.sampling.n=1", f"algorithm.advantage.estimator={estimator}")
    with pytest.raises(ConfigError, match=rf"rollout\.sampling\.n must be >= 2 for algorithm\.advantage\.estimator="
                                          rf"'{estimator}'.*\(got 1\)"):
        validate(run, 1, cuda=False)


def test_greedy_sampling_gives_identical_groups():
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.temperature = 0 \(greedy\)"):
        validate(run_of("rollout.sampling.temperature=0"), 1, cuda=False)


def test_keep_sampling_mask_needs_the_recorded_mask():
    with pytest.raises(ConfigError, match=r"algorithm\.keep_sampling_mask = true needs rollout\.record_sampling_mask"):
        validate(run_of("algorithm.keep_sampling_mask=true"), 1, cuda=False)


def test_sparse_kv_budget_must_be_below_the_context():
    run = run_of("rollout.kv.policy=snapkv", "rollout.kv.budget=4096", "rollout.max_model_len=2048")
    with pytest.raises(ConfigError, match=r"rollout\.kv\.budget = 4096 must be < rollout\.max_model_len = 2048"):
        validate(run, 1, cuda=False)
    validate(run_of("rollout.kv.policy=snapkv", "rollout.kv.budget=256"), 1, cuda=False)


def test_context_must_fit_the_model_positions():
    with pytest.raises(ConfigError, match=r"rollout\.max_model_len = 4096 exceeds the model's max_position_embeddings"):
        validate(run_of("rollout.max_model_len=4096"), 1, cuda=False)


def test_rollout_tp_must_divide_the_world():
    with pytest.raises(ConfigError, match=r"rollout\.tensor_parallel_size = 2 must divide the world size 3"):
        validate(run_of("rollout.tensor_parallel_size=2", "launch.nproc_per_node=3"),
                 3, cuda=False)
    validate(run_of("rollout.tensor_parallel_size=2", "launch.nproc_per_node=2"), 2, cuda=False)  # CPU is fine


def test_every_problem_is_reported_at_once():
    run = run_of("model.tiny.head_dim=48", "rollout.sampling.n=1", "launch.nproc_per_node=2")
    with pytest.raises(ConfigError) as e:
        validate(run, 1, cuda=False)
    msg = str(e.value)
    assert msg.startswith("3 problems:")
    assert "world size 1 !=" in msg and "head_dim = 48" in msg and "rollout.sampling.n must be >= 2" in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---- the tiny spec derived without weights == the spec of a model really built by models/tiny.py -----------
TINY_CASES = {
    "moe": {"arch": "qwen3_moe", "hidden": 96, "layers": 3, "heads": 8, "kv_heads": 4, "head_dim": 64,
            "experts": 6, "topk": 3, "moe_ffn": 48, "ffn": 80, "seed": 1},
    "dense": {"arch": "qwen3", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 1, "head_dim": 32,
              "experts": 0, "topk": 2, "moe_ffn": 64, "ffn": 96, "seed": 0},
    # DeepSeek-V3 (MLA): the model.tiny defaults (YaRN RoPE, full query projection, no expert groups) ...
    "mla": {"arch": "deepseek_v3"},
    # ... and every MLA field moved: low-rank queries, 2 shared experts, group-limited routing, default RoPE
    "mla_grouped": {"arch": "deepseek_v3", "hidden": 48, "layers": 3, "heads": 2, "experts": 8, "topk": 2,
                    "moe_ffn": 16, "ffn": 40, "q_lora_rank": 24, "qk_nope_head_dim": 16, "v_head_dim": 24,
                    "first_k_dense": 1, "shared_experts": 2, "n_group": 2, "topk_group": 1, "rope_type": "default",
                    "init_std": 0.02, "seed": 3},
}
# The same DeepSeek models as keyword arguments of build_tiny_deepseek, written out by hand (its own names).
DEEPSEEK_BUILDS = {
    "mla": dict(hidden=64, layers=2, heads=4, experts=4, topk=2, moe_ffn=64, ffn=128, kv_lora_rank=512,
                q_lora_rank=None, qk_nope=32, qk_rope=64, v_head=32, first_k_dense=1, shared=1, n_group=1,
                topk_group=1, rope="yarn", init_std=0.2, seed=0),
    "mla_grouped": dict(hidden=48, layers=3, heads=2, experts=8, topk=2, moe_ffn=16, ffn=40, kv_lora_rank=512,
                        q_lora_rank=24, qk_nope=16, qk_rope=64, v_head=24, first_k_dense=1, shared=2, n_group=2,
                        topk_group=1, rope="default", init_std=0.02, seed=3),
}


@pytest.fixture(scope="module")
def built_models(tmp_path_factory):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny_deepseek(root / name, **DEEPSEEK_BUILDS[name]) if name in DEEPSEEK_BUILDS
            else build_tiny_hf_model(root / name, **kw) for name, kw in TINY_CASES.items()}


@pytest.mark.parametrize("name", list(TINY_CASES))
def test_tiny_spec_matches_a_built_model(built_models, name):
    from safetensors.torch import load_file

    run = run_of(*(f"model.tiny.{k}={v}" for k, v in TINY_CASES[name].items()))
    derived = model_spec(run)
    _, built = load_spec(built_models[name])
    assert derived == built
    numel = sum(t.numel() for t in load_file(str(built_models[name] / "model.safetensors")).values())
    assert derived.parameter_count() == numel
    hf = json.loads((built_models[name] / "config.json").read_text())
    assert hf["architectures"] == tiny_hf_config(run.model.tiny)["architectures"]


@pytest.mark.parametrize("name", list(DEEPSEEK_BUILDS))
def test_tiny_deepseek_is_built_with_the_fields_it_names(name):
    """training/context.py builds model.tiny with build_tiny_deepseek(**tiny_fields(tiny)): these are the
    builder's arguments written out by hand above."""
    from megatron_sparse_rl.models.tiny_config import tiny_fields

    tiny = run_of(*(f"model.tiny.{k}={v}" for k, v in TINY_CASES[name].items())).model.tiny
    assert tiny_fields(tiny) == DEEPSEEK_BUILDS[name]


def test_config_json_at_model_path_wins_over_tiny(built_models):
    path = built_models["moe"]
    spec = validate(run_of(f"model.path={path}"), 1, cuda=False)  # tiny says 4 experts, head_dim 32
    assert (spec.num_experts, spec.head_dim, spec.num_layers) == (6, 64, 3)
    with pytest.raises(ConfigError, match=r"parallel\.ep=4 must divide the expert count \(6\)"):
        validate(run_of(f"model.path={path}", "parallel.ep=4", "launch.nproc_per_node=4"), 4, cuda=False)


def test_unreadable_config_json_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"model\.path=.*cannot read the model architecture: unsupported architecture "
                                          r"'GPT2LMHeadModel'; supported:"):
        validate(run_of(f"model.path={tmp_path}"), 1, cuda=False)


def test_broken_config_json_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model\.path=.*cannot read the model architecture: .*not valid JSON"):
        validate(run_of(f"model.path={tmp_path}"), 1, cuda=False)


# ---- multi-head latent attention (DeepSeek-V3 / Kimi-K2) ---------------------------------------------------
def mla_run(*overrides: str) -> RunConfig:
    return run_of("model.tiny.arch=deepseek_v3", *overrides)


def asset_model(tmp_path, name: str, **changes) -> Path:
    """A model directory holding only the bundled config.json of `name` (changed by `changes`)."""
    cfg = json.loads((ASSETS / f"{name}.json").read_text()) | changes
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_tiny_deepseek_is_valid_on_cpu():
    spec = validate(mla_run(), 1, cuda=False)
    assert spec.architecture == "DeepseekV3ForCausalLM" and (spec.kv_lora_rank, spec.qk_rope_head_dim) == (512, 64)
    assert spec.latent_width == 576 and spec.moe_layers == (False, True)


def test_tiny_mla_defaults_are_the_latent_vllm_cpu_runs():
    from megatron_sparse_rl.config.schema import TinyModelConfig
    from megatron_sparse_rl.models.tiny_families import MLA_CPU_LATENT

    tiny = TinyModelConfig(arch="deepseek_v3")
    assert (tiny.kv_lora_rank, tiny.qk_rope_head_dim) == MLA_CPU_LATENT


@pytest.mark.parametrize("field, value, latent", [("kv_lora_rank", 256, "256 + 64 = 320"),
                                                  ("qk_rope_head_dim", 32, "512 + 32 = 544")])
def test_mla_latent_must_suit_vllm_cpu_mla_without_cuda(field, value, latent):
    run = mla_run(f"model.tiny.{field}={value}")
    with pytest.raises(ConfigError) as e:
        validate(run, 1, cuda=False)
    assert str(e.value) == (f"model.tiny.kv_lora_rank + model.tiny.qk_rope_head_dim = {latent} (the MLA latent) is "
                            "not supported by vLLM's CPU MLA decode (no CUDA here); allowed: kv_lora_rank 512 + "
                            "qk_rope_head_dim 64 = 576")
    assert validate(run, 1, cuda=True).latent_width == sum(int(x) for x in latent.split(" = ")[0].split(" + "))


def test_mla_latent_of_a_config_json_is_named_as_the_model_s(tmp_path):
    path = asset_model(tmp_path, "deepseek-v3", kv_lora_rank=256)
    with pytest.raises(ConfigError, match=r"^the model's kv_lora_rank \+ qk_rope_head_dim = 256 \+ 64 = 320 \(the MLA "
                                          r"latent\) is not supported by vLLM's CPU MLA decode"):
        validate(run_of(f"model.path={path}"), 1, cuda=False)


def test_cpu_head_dim_check_does_not_apply_to_mla():
    # nope 40 + rope 64 = 104: not a CPU attention head size, but MLA caches the 576-wide latent, not heads
    spec = validate(mla_run("model.tiny.qk_nope_head_dim=40"), 1, cuda=False)
    assert spec.head_dim == 104


@pytest.mark.parametrize("policy", ["rkv", "snapkv", "h2o", "streamingllm"])
@pytest.mark.parametrize("cuda", [False, True])
def test_sparse_kv_on_mla_needs_a_single_rank_engine(policy, cuda):
    validate(mla_run(f"rollout.kv.policy={policy}", "rollout.kv.budget=256"), 1, cuda=cuda)
    with pytest.raises(ConfigError, match=rf"^rollout\.kv\.policy = '{policy}' with rollout\.tensor_parallel_size = 2: "
                                          r"sparse KV on the MLA latent cache runs on single-rank engines "
                                          r"\(DeepseekV3ForCausalLM uses multi-head latent attention"):
        validate(mla_run(f"rollout.kv.policy={policy}", "rollout.kv.budget=256", "rollout.tensor_parallel_size=2"), 2,
                 cuda=cuda)
    validate(mla_run("rollout.tensor_parallel_size=2"), 2, cuda=cuda)  # dense MLA engines: any width
    validate(run_of(f"rollout.kv.policy={policy}", "rollout.kv.budget=256", "rollout.tensor_parallel_size=2"), 2,
             cuda=cuda)  # Qwen3-MoE: per-head caches split by head


def test_mla_block_size_on_cpu_is_16():
    with pytest.raises(ConfigError, match=r"^rollout\.kv\.block_size = 32: vLLM's CPU MLA backend runs 16-token blocks"):
        validate(mla_run("rollout.kv.block_size=32"), 1, cuda=False)
    validate(mla_run("rollout.kv.block_size=16"), 1, cuda=False)
    validate(mla_run("rollout.kv.block_size=32"), 1, cuda=True)


def test_routing_the_learner_cannot_build_is_refused_at_validate():
    # 8 experts in 2 groups, top-4 from 1 group: Megatron scores a group by its top-(4 // 1) experts, HF by its top-2
    run = mla_run("model.tiny.experts=8", "model.tiny.topk=4", "model.tiny.n_group=2")
    with pytest.raises(ConfigError, match=r"^model\.tiny: the learner cannot build this DeepseekV3ForCausalLM: "
                                          r"group-limited routing needs num_experts_per_tok // topk_group == 2"):
        validate(run, 1, cuda=False)
    validate(mla_run("model.tiny.experts=8", "model.tiny.topk=4", "model.tiny.n_group=2", "model.tiny.topk_group=2"),
             1, cuda=False)
    with pytest.raises(ConfigError, match=r"n_group=3 must divide n_routed_experts=8"):
        validate(mla_run("model.tiny.experts=8", "model.tiny.n_group=3"), 1, cuda=False)


def test_mla_layout_is_checked_against_heads_and_experts():
    run = mla_run("parallel.tp=8", "parallel.sequence_parallel=true", "parallel.ep=8", "launch.nproc_per_node=8")
    with pytest.raises(ConfigError) as e:
        validate(run, 8, cuda=False)
    assert "parallel.tp=8 must divide the attention heads (4)" in str(e.value)
    assert "parallel.ep=8 must divide the expert count (4)" in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (("model.tiny.kv_heads=4",), "model.tiny.kv_heads applies to model.tiny.arch 'qwen3_moe' or 'qwen3' only, not "
                                 "'deepseek_v3': remove it or leave its default 2 (got 4)"),
    (("model.tiny.arch=qwen3_moe", "model.tiny.n_group=2"),
     "model.tiny.n_group applies to model.tiny.arch 'deepseek_v3' only, not 'qwen3_moe': remove it or leave its "
     "default 1 (got 2)"),
    (("model.tiny.arch=qwen3", "model.tiny.q_lora_rank=32"),
     "model.tiny.q_lora_rank applies to model.tiny.arch 'deepseek_v3' only, not 'qwen3': remove it or leave its "
     "default null (got 32)"),
    (("model.tiny.experts=0",), "model.tiny.experts must be >= 1 for arch 'deepseek_v3' (got 0)"),
    (("model.tiny.qk_rope_head_dim=63",), "model.tiny.qk_rope_head_dim must be even: RoPE rotates pairs (got 63)"),
    (("model.tiny.first_k_dense=3",), "model.tiny.first_k_dense must be in [0, layers=2] (got 3)"),
    (("model.tiny.topk_group=2",), "model.tiny.topk_group must be <= n_group=1 (got 2)"),
])
def test_tiny_fields_of_the_other_arch_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        mla_run(*overrides)
    assert message in str(e.value)


def test_bundled_deepseek_and_kimi_configs_validate_with_cuda(tmp_path):
    for name, tp, ep in (("deepseek-v3", 8, 256), ("kimi-k2", 8, 128)):
        (tmp_path / name).mkdir()
        path = asset_model(tmp_path / name, name)
        run = run_of(f"model.path={path}", f"parallel.tp={tp}", "parallel.sequence_parallel=true",
                     f"parallel.ep={ep}", "launch.nproc_per_node=8", "launch.nodes=64", tiny=False)
        spec = validate(run, 512, cuda=True)
        assert spec.latent_width == 576 and spec.num_layers == 61
        validate(run_of(f"model.path={path}", "rollout.kv.policy=rkv", tiny=False), 1, cuda=True)
        with pytest.raises(ConfigError, match=r"rollout\.kv\.policy = 'rkv' with rollout\.tensor_parallel_size = 8: "
                                              r"sparse KV on the MLA latent cache runs on single-rank engines"):
            validate(run_of(f"model.path={path}", "rollout.kv.policy=rkv", "rollout.tensor_parallel_size=8",
                            tiny=False), 8, cuda=True)


# ---- rollout.max_model_len from the model ------------------------------------------------------------------
def model_with_positions(tmp_path, positions: int) -> Path:
    """A model directory whose config.json is the default tiny MoE's with `positions` max_position_embeddings."""
    from megatron_sparse_rl.config.schema import TinyModelConfig

    cfg = tiny_hf_config(TinyModelConfig()) | {"max_position_embeddings": positions}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_max_model_len_defaults_to_the_tiny_model_positions():
    from megatron_sparse_rl.validation.resolve import describe_max_model_len, resolve

    run = run_of()
    assert run.rollout.max_model_len is None
    spec = validate(run, 1, cuda=False)
    assert resolve(run, spec).rollout.max_model_len == 2048  # the tiny builder's max_position_embeddings
    assert describe_max_model_len(run.rollout, spec) == "2048 (the model's max_position_embeddings)"
    assert resolve(run, None) is run  # the model unknown here: left to the engine


def test_max_model_len_from_a_model_with_4096_positions_capped_by_the_config(tmp_path):
    from megatron_sparse_rl.validation.resolve import describe_max_model_len, resolve

    path = model_with_positions(tmp_path, 4096)
    run = run_of(f"model.path={path}")
    spec = validate(run, 1, cuda=False)
    assert resolve(run, spec).rollout.max_model_len == 4096
    capped = run_of(f"model.path={path}", "rollout.max_model_len=1024")
    assert resolve(capped, validate(capped, 1, cuda=False)).rollout.max_model_len == 1024
    assert describe_max_model_len(capped.rollout, spec) == "1024 (set)"
    with pytest.raises(ConfigError, match=r"^rollout\.max_model_len = 8192 exceeds the model's max_position_embeddings "
                                          r"\(4096\); leave it unset \(null\) to use the model's$"):
        validate(run_of(f"model.path={path}", "rollout.max_model_len=8192"), 1, cuda=False)


def test_max_model_len_is_capped_to_what_the_kv_cache_holds(tmp_path):
    """Qwen3-30B-A3B: 40,960 positions; 48 layers x K and V x 4 KV heads x head_dim 128, float32 = 196,608 bytes a
    token; 1 GiB holds 42 whole 128-token blocks, less the one vLLM's block pool holds back: 41 x 128 = 5248 tokens.
    bfloat16 over engine TP 4 (one KV head per rank): 24,576 bytes, 340 blocks: the model's positions are the
    limit."""
    from megatron_sparse_rl.validation.resolve import describe_max_model_len, max_model_len

    path = asset_model(tmp_path, "qwen3-30b-a3b")
    run = run_of(f"model.path={path}", tiny=False)
    spec = validate(run, 1, cuda=True)
    assert spec.max_position_embeddings == 40960
    assert max_model_len(run.rollout, spec) == (2**30 // (128 * 48 * 2 * 4 * 128 * 4) - 1) * 128 == 5248
    assert describe_max_model_len(run.rollout, spec) == (
        "5248 (the longest sequence rollout.kv_cache_gb = 1 GiB holds on one engine rank at 196,608 bytes per token; "
        "the model's max_position_embeddings is 40960)")
    assert max_model_len(run_of(f"model.path={path}", "rollout.kv_cache_gb=2", tiny=False).rollout, spec) == 84 * 128
    wide = run_of(f"model.path={path}", "rollout.dtype=bfloat16", "rollout.tensor_parallel_size=4", tiny=False)
    assert max_model_len(wide.rollout, spec) == 40960
    gpu_sized = run_of(f"model.path={path}", "rollout.kv_cache_gb=null", tiny=False)
    assert max_model_len(gpu_sized.rollout, spec) == 40960  # vLLM sizes the cache: the model's positions
    # DeepSeek-V3 (MLA): one 576-wide latent row per token and layer, 61 layers, float32
    (tmp_path / "ds").mkdir()
    ds = asset_model(tmp_path / "ds", "deepseek-v3")
    run = run_of(f"model.path={ds}", tiny=False)
    assert max_model_len(run.rollout, validate(run, 1, cuda=True)) == (2**30 // (128 * 61 * 576 * 4) - 1) * 128 == 7424


def test_max_tokens_is_checked_against_the_resolved_max_model_len(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.sampling\.max_tokens must be < rollout\.max_model_len \(got 2048 "
                                          r">= 2048; rollout\.max_model_len unset: the model's "
                                          r"max_position_embeddings\): lower rollout\.sampling\.max_tokens$"):
        validate(run_of("rollout.sampling.max_tokens=2048"), 1, cuda=False)
    validate(run_of("rollout.sampling.max_tokens=2047"), 1, cuda=False)
    path = asset_model(tmp_path, "qwen3-30b-a3b")
    with pytest.raises(ConfigError, match=r"got 6000 >= 5248; rollout\.max_model_len unset: the longest sequence "
                                          r"rollout\.kv_cache_gb = 1 GiB holds .*: set rollout\.max_model_len, lower "
                                          r"rollout\.sampling\.max_tokens, or raise rollout\.kv_cache_gb$"):
        validate(run_of(f"model.path={path}", "rollout.sampling.max_tokens=6000", tiny=False), 1, cuda=True)


def test_kv_budget_is_checked_against_the_resolved_max_model_len():
    with pytest.raises(ConfigError, match=r"^rollout\.kv\.budget = 2048 must be < rollout\.max_model_len = 2048 "
                                          r"\(unset: the model's max_position_embeddings\), or "
                                          r"rollout\.kv\.policy='snapkv' never compresses$"):
        validate(run_of("rollout.kv.policy=snapkv", "rollout.kv.budget=2048"), 1, cuda=False)
    validate(run_of("rollout.kv.policy=snapkv", "rollout.kv.budget=1024"), 1, cuda=False)
    # the model unknown here (no config.json, no model.tiny) and max_model_len unset: nothing to check against
    validate(run_of("model.tiny=null", "rollout.kv.policy=snapkv", "rollout.kv.budget=100000"), 1, cuda=False)


def test_an_engine_outside_a_run_resolves_max_model_len_from_its_model_dir(tmp_path):
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.validation.resolve import resolve_rollout

    path = model_with_positions(tmp_path, 4096)
    assert resolve_rollout(RolloutConfig(), path).max_model_len == 4096
    assert resolve_rollout(RolloutConfig(max_model_len=256), tmp_path / "missing").max_model_len == 256


def test_world_size_alone_needs_no_launch_shape():
    """`msrl validate --world-size N` (or a bare torchrun of N ranks) with launch.* at its defaults."""
    spec = validate(run_of("parallel.ep=2"), 2, cuda=False)
    assert spec.num_experts == 4
    with pytest.raises(ConfigError, match=r"parallel\.ep=3 must divide the expert count \(4\)"):
        validate(run_of("parallel.ep=3"), 3, cuda=False)
    with pytest.raises(ConfigError, match=r"world size 2 != launch\.nodes \* launch\.nproc_per_node = 1 \* 4 = 4"):
        validate(run_of("launch.nproc_per_node=4"), 2, cuda=False)  # a launch shape set: it must agree


@pytest.mark.parametrize("name, arch", [("deepseek-v3.2", "DeepseekV32ForCausalLM"),
                                        ("glm-5", "GlmMoeDsaForCausalLM")])
def test_dsa_model_has_no_rollout_engine_without_cuda(tmp_path, name, arch):
    path = asset_model(tmp_path, name)
    with pytest.raises(ConfigError) as e:
        validate(run_of(f"model.path={path}"), 1, cuda=False)
    assert (f"the model's architecture {arch} uses DeepSeek Sparse Attention (an indexer choosing index_topk = 2048 "
            "tokens per query), which vLLM cannot serve on CPU") in str(e.value)
    assert "allowed without CUDA: DeepseekV3ForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM" in str(e.value)
    assert validate(run_of(f"model.path={path}"), 1, cuda=True).architecture == arch  # a GPU engine may serve it
    with pytest.raises(ConfigError, match=r"^rollout\.kv\.policy = 'rkv': sparse KV does not run on a DeepSeek Sparse "
                                          rf"Attention model \({arch}: its attention already reads index_topk = 2048"):
        validate(run_of(f"model.path={path}", "rollout.kv.policy=rkv", "rollout.kv.budget=256"), 1, cuda=True)

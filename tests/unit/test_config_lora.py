"""`model.lora` (config/lora.py): off by default; its fields refused at load with the field named and what is allowed;
a target module the model lacks refused at validate, listing the modules the model has. Validate accepts a run with
adapters at tp = pp = cp = 1 (any data and expert parallel size, colocated or disaggregated, any engine precision) and
refuses, naming the fields, what the learner cannot train: routed-expert targets, tp/pp/cp > 1, the DSA indexer loss.

    .venv/bin/python -m pytest -q tests/unit/test_config_lora.py
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sparse_rl.config import ConfigError, load_config
from megatron_sparse_rl.validation.validate import validate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ATTENTION = "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"
EXPERTS = "model.lora.target_modules: adapters on routed experts ('experts', which 'all-linear' includes"


def _problems(config, *overrides: str, world: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(config, overrides), world, cuda=False)
    return str(e.value)


def test_off_by_default():
    run = load_config(CONFIGS / "tiny_moe.yaml")
    assert run.model.lora is None
    validate(run, 1, cuda=False)  # no LoRA problem


def test_peft_defaults_and_scale():
    lora = load_config(CONFIGS / "tiny_moe.yaml", ["model.lora={}"]).model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (8, 8.0, 0.0, ("all-linear",))
    lora = load_config(CONFIGS / "tiny_moe.yaml", ["model.lora.rank=8", "model.lora.alpha=32"]).model.lora
    assert lora.scale == 32 / 8


@pytest.mark.parametrize("override, message", [
    ("model.lora.rank=0", "model.lora.rank must be an integer in [1, 65536] (got 0)"),
    ("model.lora.rank=-4", "model.lora.rank must be an integer in [1, 65536] (got -4)"),
    ("model.lora.rank=70000", "model.lora.rank must be an integer in [1, 65536] (got 70000)"),
    ("model.lora.alpha=0", "model.lora.alpha must be a finite number > 0 (got 0.0)"),
    ("model.lora.alpha=-16", "model.lora.alpha must be a finite number > 0 (got -16.0)"),
    ("model.lora.alpha=.nan", "model.lora.alpha must be a finite number > 0 (got nan)"),
    ("model.lora.dropout=1.0", "model.lora.dropout must be in [0, 1) (got 1.0)"),
    ("model.lora.dropout=-0.1", "model.lora.dropout must be in [0, 1) (got -0.1)"),
    ("model.lora.target_modules=[]", "model.lora.target_modules must name at least one module (or 'all-linear')"),
    ("model.lora.target_modules=[q_proj,q_proj]", "model.lora.target_modules names ['q_proj'] more than once"),
])
def test_bad_fields_are_refused_at_load_naming_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "tiny_moe.yaml", [override])
    assert message in str(e.value)


def test_a_rank_that_is_not_an_integer_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "tiny_moe.yaml", ["model.lora.rank=1.5"])
    assert "model.lora.rank" in str(e.value)


def test_a_target_the_model_lacks_is_refused_listing_what_it_has():
    # the tiny Qwen3-MoE: every layer MoE, no shared expert, so no gate_proj; attention q/k/v/o and routed experts
    text = _problems(CONFIGS / "tiny_moe.yaml", "model.lora.target_modules=[q_proj,gate_proj,kv_b_proj]")
    assert text == ("model.lora.target_modules: Qwen3MoeForCausalLM has no module 'gate_proj', 'kv_b_proj'; it has "
                    "q_proj, k_proj, v_proj, o_proj, experts (or 'all-linear' for all of them)")


def test_mla_targets_are_the_deepseek_modules():
    # the tiny DeepSeek-V3: MLA projections, a dense first layer and shared experts (gate/up/down_proj)
    run = load_config(CONFIGS / "tiny_deepseek_v3.yaml",
                      ["model.lora.target_modules=[kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,down_proj]"])
    assert validate(run, 1, cuda=False).architecture == "DeepseekV3ForCausalLM"
    text = _problems(CONFIGS / "tiny_deepseek_v3.yaml", "model.lora.target_modules=[k_proj]")
    assert "DeepseekV3ForCausalLM has no module 'k_proj'; it has " in text and "kv_b_proj" in text


@pytest.mark.parametrize("overrides, world", [
    ((ATTENTION,), 1),
    ((ATTENTION, "model.lora.rank=16", "model.lora.alpha=32", "model.lora.dropout=0.1"), 1),
    ((ATTENTION, "launch.nproc_per_node=2", "launch.rollout_ranks=1"), 2),  # disaggregated: one learner rank
    ((ATTENTION,), 2),  # data parallel 2
    ((ATTENTION, "parallel.ep=2"), 2),  # data parallel 2, the routed experts split over 2
    ((ATTENTION, "launch.nproc_per_node=3", "launch.rollout_ranks=1"), 3),  # two learner ranks, one rollout rank
    ((ATTENTION, "rollout.quantization=fp8"), 1),  # the probe compares against the merged weights, FP8 round trip
    ((ATTENTION, "parallel.tp=2", "parallel.sequence_parallel=true"), 2),  # the A/B split follows the base's
    ((ATTENTION, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"), 4),
    ((ATTENTION, "parallel.pp=2"), 2),  # each stage adapts its own layers
])
def test_a_lora_run_validates(overrides, world):
    run = load_config(CONFIGS / "tiny_moe.yaml", list(overrides))
    assert validate(run, world, cuda=False).architecture == "Qwen3MoeForCausalLM"
    assert run.model.lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("targets", ["[experts]", "[all-linear]", "[q_proj,experts]"])
def test_routed_expert_targets_are_refused_naming_the_field(targets):
    # all-linear on an MoE model includes the routed experts (PEFT's default; this section's default too)
    text = _problems(CONFIGS / "tiny_moe.yaml", f"model.lora.target_modules={targets}")
    assert text.startswith(EXPERTS) and "name the attention, dense MLP and shared-expert modules instead" in text
    assert _problems(CONFIGS / "tiny_moe.yaml", "model.lora={}").startswith(EXPERTS)


@pytest.mark.parametrize("overrides, world, message", [
    (("parallel.tp=2", "parallel.sequence_parallel=true", "model.lora.dropout=0.1"), 2,
     "model.lora.dropout must be 0 at parallel.tp > 1 (got dropout 0.1, tp 2)"),
    (("parallel.cp=2",), 2, "model.lora needs parallel.cp = 1 (got 2): adapters under context parallel are untested"),
])
def test_cp_above_one_and_dropout_at_tp2_are_refused_naming_the_fields(overrides, world, message):
    text = _problems(CONFIGS / "tiny_moe.yaml", ATTENTION, *overrides, world=world)
    assert text.startswith(message)  # the one problem
    assert "model.lora.target_modules" not in text  # the targets are fine: only the layout is refused


def test_the_dsa_indexer_loss_is_refused_with_lora(tmp_path):
    from tests.unit.test_config_validate import asset_model

    path = asset_model(tmp_path, "deepseek-v3.2")
    overrides = [f"model.path={path}", "model.tiny=null", "model.dsa_indexer_loss_coeff=0.1",
                 "model.lora.target_modules=[q_b_proj,kv_b_proj]"]
    with pytest.raises(ConfigError) as e:
        validate(load_config(CONFIGS / "tiny_moe.yaml", overrides), 1, cuda=True)
    assert str(e.value) == ("model.dsa_indexer_loss_coeff = 0.1 with model.lora: the indexer loss trains the DSA "
                            "indexer, which LoRA freezes with the rest of the base; set model.dsa_indexer_loss_coeff "
                            "= 0 or leave model.lora unset")

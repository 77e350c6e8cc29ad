"""Mixtral and DeepSeek-V3 adapters: their tensor maps cover every tensor of a tiny checkpoint saved by
transformers exactly once, the config mappings, and clear errors for variants they do not support."""
import json

import pytest
import torch
from safetensors import safe_open

from megatron_sparse_rl.models import ADAPTERS, get_adapter, load_spec
from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek, build_tiny_mixtral


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return build_tiny_mixtral(tmp_path_factory.mktemp("mx"), layers=2, experts=4)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return build_tiny_deepseek(tmp_path_factory.mktemp("ds"), layers=3, first_k_dense=1)


def _hf_names(d):
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("which", ["mixtral", "deepseek"])
def test_tensor_maps_cover_every_tensor_once(which, request):
    d = request.getfixturevalue(f"{which}_dir")
    adapter, spec = load_spec(d)
    maps = adapter.tensor_maps(spec)
    hf = [n for tm in maps for n in tm.hf]
    assert len(hf) == len(set(hf)), "an HF tensor is mapped twice"
    assert set(hf) == _hf_names(d)
    mcore = [tm.mcore for tm in maps]
    assert len(mcore) == len(set(mcore))


def test_registry_uses_exact_architecture_strings():
    assert {"MixtralForCausalLM", "DeepseekV3ForCausalLM"} <= set(ADAPTERS)
    with pytest.raises(ValueError, match="unsupported architecture"):
        get_adapter({"architectures": ["MixtralForCausalLMv2"]})


def test_mixtral_spec(mixtral_dir):
    _, spec = load_spec(mixtral_dir)
    assert spec.moe_layers == (True, True) and spec.num_experts == 4 and spec.moe_topk == 2
    assert spec.norm_topk_prob and not spec.qk_norm and spec.rope_theta == 1e6
    assert spec.moe_ffn_hidden_size == 64 and spec.shared_expert_ffn_hidden_size == 0


def test_mixtral_expert_names(mixtral_dir):
    adapter, spec = load_spec(mixtral_dir)
    fc1 = {tm.mcore: tm for tm in adapter.tensor_maps(spec)}["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert fc1.kind == "glu" and fc1.hf == ("model.layers.1.block_sparse_moe.experts.2.w1.weight",
                                            "model.layers.1.block_sparse_moe.experts.2.w3.weight")


def _cfg(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    return cfg


def test_mixtral_unsupported_variants(mixtral_dir):
    adapter = ADAPTERS["MixtralForCausalLM"]()
    with pytest.raises(NotImplementedError, match="sliding_window=4096"):
        adapter.spec_from_hf(_cfg(mixtral_dir, sliding_window=4096))
    with pytest.raises(NotImplementedError, match="gelu"):
        adapter.spec_from_hf(_cfg(mixtral_dir, hidden_act="gelu"))
    with pytest.raises(NotImplementedError, match="yarn"):
        adapter.spec_from_hf(_cfg(mixtral_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}))
    cfg = _cfg(mixtral_dir)
    del cfg["num_local_experts"]
    with pytest.raises(ValueError, match="MixtralForCausalLM.*num_local_experts"):
        adapter.spec_from_hf(cfg)
    with pytest.raises(ValueError, match="MixtralForCausalLM.*qwen3_moe"):
        adapter.spec_from_hf(_cfg(mixtral_dir, model_type="qwen3_moe"))


def test_deepseek_spec_and_router_mapping(deepseek_dir):
    adapter, spec = load_spec(deepseek_dir)
    assert spec.moe_layers == (False, True, True)
    assert spec.shared_expert_ffn_hidden_size == 32 and spec.ffn_hidden_size == 64
    kw = adapter.moe_kwargs(spec)
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_topk_scaling_factor"] == 2.5
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"]) == (2, 1)
    names = {tm.mcore: tm.hf for tm in adapter.tensor_maps(spec)}
    assert names["decoder.layers.1.mlp.router.expert_bias"] == ("model.layers.1.mlp.gate.e_score_correction_bias",)
    assert names["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"] == (
        "model.layers.2.mlp.shared_experts.gate_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight")
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names


def test_deepseek_mla_config_and_kimi_k2(deepseek_dir):
    adapter, spec = load_spec(deepseek_dir)
    kw = adapter.config_kwargs(spec, tp=1, pp=1, ep=1, etp=1, sequence_parallel=False, dtype=torch.float32,
                               recompute=False, aux_loss_coeff=0.0)
    assert kw["multi_latent_attention"] and kw["qk_layernorm"]
    assert (kw["kv_lora_rank"], kw["qk_pos_emb_head_dim"], kw["qk_head_dim"], kw["v_head_dim"]) == (512, 64, 32, 32)
    assert kw["q_lora_rank"] is None and spec.latent_width == 576
    assert (kw["rope_type"], kw["rotary_scaling_factor"], kw["mscale_all_dim"]) == ("yarn", 4.0, 1.0)
    kimi = adapter.spec_from_hf(_cfg(deepseek_dir, model_type="kimi_k2"))
    assert kimi == spec
    with pytest.raises(ValueError, match="model_type 'qwen3_moe'"):
        adapter.spec_from_hf(_cfg(deepseek_dir, model_type="qwen3_moe"))
    with pytest.raises(NotImplementedError, match="rope_interleave"):
        adapter.spec_from_hf(_cfg(deepseek_dir, rope_interleave=False))
    with pytest.raises(NotImplementedError, match="rope type 'llama3'"):
        adapter.spec_from_hf(_cfg(deepseek_dir, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}))
    with pytest.raises(NotImplementedError, match="moe_layer_freq=2"):
        adapter.spec_from_hf(_cfg(deepseek_dir, moe_layer_freq=2))
    mtp = adapter.spec_from_hf(_cfg(deepseek_dir, num_nextn_predict_layers=1))
    assert mtp.mtp_layers == 1
    assert adapter.mtp_layer_names(mtp, ["model.layers.2.mlp.gate.weight", "model.layers.3.eh_proj.weight",
                                         "model.norm.weight"]) == ["model.layers.3.eh_proj.weight"]


def test_deepseek_unsupported_variants(deepseek_dir):
    adapter, spec = load_spec(deepseek_dir)
    with pytest.raises(NotImplementedError, match="norm_topk_prob"):
        adapter.moe_kwargs(adapter.spec_from_hf(_cfg(deepseek_dir, norm_topk_prob=False)))
    with pytest.raises(NotImplementedError, match="topk_group"):
        adapter.moe_kwargs(adapter.spec_from_hf(_cfg(deepseek_dir, n_group=4, topk_group=2, num_experts_per_tok=2)))
    cfg = _cfg(deepseek_dir)
    del cfg["kv_lora_rank"]
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM.*kv_lora_rank"):
        adapter.spec_from_hf(cfg)

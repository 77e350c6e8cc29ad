"""Mixtral and DeepSeek-V3-style adapters against HF transformers: Mixtral logprobs at TP1 and EP2 within 1e-4
(fp32) and bit-exact HF -> mcore -> HF round trips; the DeepSeek MoE block (sigmoid group-limited router with
e_score_correction_bias, routed scaling, shared experts) built from `DeepseekV3Adapter.moe_kwargs` against HF's
`DeepseekV3MoE` (the whole DeepSeek-V3 model: tests/distributed/test_deepseek.py)."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek, build_tiny_mixtral
from tests import learner_workers as W
from tests.distributed.test_learner import hf_reference
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return str(build_tiny_mixtral(tmp_path_factory.mktemp("mixtral") / "hf", seed=7))


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tp,ep,world", [(1, 1, 1), (1, 2, 2)], ids=["tp1", "ep2"])
def test_mixtral_logprobs_match_hf_transformers(mixtral_dir, tokens, tp, ep, world):
    ref_lp, ref_ent = hf_reference(mixtral_dir, tokens)
    for lp, ent in run_distributed(W.logprobs_worker, world, args=(mixtral_dir, tokens, tp, ep)):
        assert (lp.double() - ref_lp).abs().max() < 1e-4
        assert (ent.double() - ref_ent).abs().max() < 1e-4


def roundtrip_worker(rank, world, hf, root, ep):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf, f"{root}/mc_ep{ep}", tp=1, ep=ep)
    mcore_to_hf(f"{root}/mc_ep{ep}", f"{root}/hf_ep{ep}", ep=ep)


@pytest.mark.parametrize("ep", [1, 2])
def test_mixtral_roundtrip_is_bit_exact(mixtral_dir, tmp_path, ep):
    run_distributed(roundtrip_worker, ep, args=(mixtral_dir, str(tmp_path), ep), timeout=300)
    a, b = load_file(f"{mixtral_dir}/model.safetensors"), {}
    for f in Path(tmp_path, f"hf_ep{ep}").glob("*.safetensors"):
        b.update(load_file(str(f)))
    assert sorted(a) == sorted(b)
    assert any(".block_sparse_moe.experts.3.w3.weight" in n for n in b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def deepseek_moe_worker(rank, world, model_dir, layer):
    """Output of Megatron's MoELayer (config from the adapter, weights through its tensor maps) and of HF's
    DeepseekV3MoE on the same random input."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module
    from safetensors.torch import load_file as load
    from transformers import AutoModelForCausalLM

    from megatron_sparse_rl.config.schema import ParallelConfig
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.models.tensor_map import to_mcore
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    ParallelLayout.from_config(ParallelConfig(tp=1, ep=1, pp=1), 1).initialize()
    adapter, spec = load_spec(model_dir)
    config = TransformerConfig(
        num_layers=1, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        ffn_hidden_size=spec.ffn_hidden_size, num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, moe_router_dtype="fp32", moe_router_load_balancing_type="none",
        use_cpu_initialization=True, bias_activation_fusion=False, moe_permute_fusion=False,
        gradient_accumulation_fusion=False, **adapter.moe_kwargs(spec))
    moe = build_module(get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=False)
                       .submodules.mlp, config=config)
    hf_tensors = load(f"{model_dir}/model.safetensors")
    prefix = f"decoder.layers.{layer}.mlp."
    state = {tm.mcore[len(prefix):]: to_mcore(tm, [hf_tensors[n] for n in tm.hf], spec)
             for tm in adapter.tensor_maps(spec) if tm.mcore.startswith(prefix)}
    own = {k for k in moe.state_dict() if not k.endswith("_extra_state") and "local_tokens_per_expert" not in k}
    assert own == set(state), own ^ set(state)
    moe.load_state_dict(state, strict=False)
    x = torch.randn(5, 3, spec.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = moe(x)[0]
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).model.layers[layer].mlp
        ref = hf(x.transpose(0, 1).contiguous()).transpose(0, 1)
        shared_only = hf.shared_experts(x)
    return ours, ref, shared_only


def test_deepseek_moe_block_matches_hf(tmp_path):
    model_dir = str(build_tiny_deepseek(tmp_path / "ds", seed=3))
    ours, ref, shared_only = run_distributed(deepseek_moe_worker, 1, args=(model_dir, 1))[0]
    assert (ours - ref).abs().max() < 1e-5
    assert (ref - shared_only).abs().max() > 1e-2, "routed experts must contribute for the test to mean anything"

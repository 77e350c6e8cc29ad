"""LoRA in the learner at TP1, TP2 and PP2 (lora/layers.py) against Hugging Face PEFT on transformers' tiny models: the same
adapters (random A and B, so every part of the update is non-zero) give the same logprobs and the same gradient of
every adapter within 1e-4. Attention (Qwen3-MoE: q/k/v fused in linear_qkv with grouped KV heads, o_proj), the dense
MLP (Qwen3: gate/up fused in linear_fc1, down_proj) and MLA with a dense layer and shared experts (DeepSeek-V3). The
optimizer holds the adapters only; a step leaves every base parameter as it was and moves every adapter. At TP2
(with and without sequence parallel, and TP2 x EP2 on the MoE) and at PP2 the same logprobs and gathered gradients, the merged
tensors a weight sync sends, and an adapter checkpoint saved there (whole values) that resumes exactly.

    .venv/bin/python -m pytest -q tests/distributed/test_lora.py
"""
import pytest
import torch

from megatron_sparse_rl.config.lora import LoraConfig
from tests.lora_workers import lora_key, lora_learner_worker
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed
peft = pytest.importorskip("peft", reason="Hugging Face PEFT is the reference: pip install -e .[test]")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _build(kind: str, path, layers: int = 2):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    if kind == "deepseek_v3":
        return str(build_tiny_deepseek(path, seed=3, layers=2))  # layer 0 dense, layer 1 MoE with a shared expert
    return str(build_tiny_hf_model(path, arch=kind, seed=3, layers=layers))


def _peft_lora(model, targets: tuple[str, ...], lora: LoraConfig):
    """Every nn.Linear named in `targets` wrapped in PEFT's own LoRA layer (peft.tuners.lora.Linear). Not through
    get_peft_model: on transformers 5 MoE models (DeepSeek-V3, Qwen2-MoE) PEFT 0.21 remaps gate_proj/up_proj/down_proj
    onto the fused routed experts and leaves the dense MLP and the shared experts out."""
    from peft.tuners.lora import Linear

    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout)
    for name, module in list(model.named_modules()):
        parent, _, leaf = name.rpartition(".")
        if leaf in targets and isinstance(module, torch.nn.Linear):
            setattr(model.get_submodule(parent), leaf, Linear(module, "default", config, r=lora.rank,
                                                              lora_alpha=lora.alpha))
    return model


def _randomize(model, seed: int) -> dict:
    """Random A and B in every PEFT adapter; returns them by lora_key."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            out[lora_key(name)] = p.detach().clone()
    return out


@pytest.mark.parametrize("kind, targets, adapted", [
    ("qwen3_moe", ATTENTION, 2 * 4),  # 2 layers x q, k, v, o
    ("qwen3", ATTENTION + MLP, 2 * 7),
    ("deepseek_v3", ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj") + MLP, 2 * 4 + 3 + 3),
])
def test_tp1_logprobs_and_adapter_gradients_match_peft(tmp_path, kind, targets, adapted):
    from transformers import AutoModelForCausalLM

    model_dir = _build(kind, tmp_path / "hf")
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=targets)
    model = _peft_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), targets, lora)
    adapters = _randomize(model, seed=0)
    assert len(adapters) == 2 * adapted  # A and B of each adapted linear
    tokens = torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(model(tokens).logits[:, :-1].double(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    (-logp.sum() / logp.numel()).backward()  # the SFT loss over every next token
    ref_grads = {lora_key(n): p.grad for n, p in model.named_parameters() if "lora_" in n}

    out = run_distributed(lora_learner_worker, 1, args=(model_dir, tokens, lora, adapters))[0]

    assert (out["logprobs"].double() - logp.detach()).abs().max() < 1e-4
    assert set(out["grads"]) == set(ref_grads)
    for key, ref in ref_grads.items():
        assert ref.abs().max() > 1e-6, key  # a gradient that is there to compare
        assert (out["grads"][key] - ref).abs().max() < 1e-4, key
    assert out["held_are_adapters"] and out["held"] == len(adapters)
    assert out["base_requires_grad"] == [] and out["base_changed"] == []
    assert out["adapters_unchanged"] == []


def _reference(model_dir, targets, lora, tokens):
    """PEFT's logprobs of `tokens` and every adapter's gradient of the summed-logprob SFT loss, random adapters."""
    from transformers import AutoModelForCausalLM

    model = _peft_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), targets, lora)
    adapters = _randomize(model, seed=0)
    logp = torch.log_softmax(model(tokens).logits[:, :-1].double(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    (-logp.sum() / logp.numel()).backward()
    return adapters, logp.detach(), {lora_key(n): p.grad for n, p in model.named_parameters() if "lora_" in n}


def _merged_reference(model_dir, adapters, scale) -> dict[str, torch.Tensor]:
    """W + scale x B A in float64 for every adapted Hugging Face weight, from the base's safetensors."""
    from pathlib import Path

    from safetensors.torch import load_file

    base = {k: v for f in Path(model_dir).glob("*.safetensors") for k, v in load_file(str(f)).items()}
    out = {}
    for (layer, shared, module, ab), a in adapters.items():
        if ab != "A":
            continue
        b = adapters[(layer, shared, module, "B")]
        name = next(k for k in base if f"layers.{layer}." in k and k.endswith(f".{module}.weight")
                    and ("shared_expert" in k) == shared)
        out[name] = base[name].double() + scale * b.double() @ a.double()
    return out


@pytest.mark.parametrize("kind, targets, tp, ep, pp, sp, world, vpp", [
    ("qwen3", ATTENTION + MLP, 2, 1, 1, False, 2, 1),  # q/k/v, o, gate/up, down split over 2 tp ranks
    ("qwen3_moe", ATTENTION, 2, 2, 1, True, 4, 1),  # tp 2 x ep 2 (data parallel 2), sequence parallel as MoE needs
    ("deepseek_v3", ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj") + MLP, 2, 1, 1, True, 2, 1),  # + shared
    ("qwen3", ATTENTION + MLP, 1, 1, 2, False, 2, 1),  # pp 2: each stage adapts its own layer
    ("qwen3", ATTENTION + MLP, 1, 1, 2, False, 2, 2),  # pp 2 x vpp 2: 4 layers, two model chunks per rank
])
def test_tp2_pp2_logprobs_gradients_sync_and_checkpoint_match_peft(tmp_path, kind, targets, tp, ep, pp, sp, world,
                                                                    vpp):
    """At tp 2 (sequence parallel on and off), at pp 2 and at pp 2 x vpp 2 (an interleaved pipeline: each rank holds
    two model chunks): logprobs and every adapter gradient (gathered whole; each stage its own layers') against PEFT
    within 1e-4; the merged tensors a sync sends against W + scale B A (float64, 1e-5); an adapter checkpoint saved at
    tp 2 holds the whole tp-1 values; a resume there continues exactly."""
    from safetensors.torch import load_file

    from megatron_sparse_rl.lora.checkpoint import WEIGHTS
    from tests.lora_workers import lora_tp_worker

    model_dir = _build(kind, tmp_path / "hf", layers=2 * pp * vpp if vpp > 1 else 2)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=targets)
    tokens = torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(0))
    adapters, logp, ref_grads = _reference(model_dir, targets, lora, tokens)

    outs = run_distributed(lora_tp_worker, world, args=(model_dir, tokens, lora, adapters, tp, ep, sp,
                                                            tmp_path / "ad", pp, vpp))

    assert set().union(*(out["grads"] for out in outs)) == set(ref_grads)  # the stages' adapters: all of them
    for out in outs:  # every rank: tp ranks, stages and data-parallel ranks alike
        assert (out["logprobs"].double() - logp).abs().max() < 1e-4
        assert out["count"] == sum(adapters[k].numel() for k in out["grads"])
        assert pp == 1 or 0 < len(out["grads"]) < len(ref_grads)
        for key in out["grads"]:
            ref = ref_grads[key]
            assert ref.abs().max() > 1e-6, key
            assert (out["grads"][key] - ref).abs().max() < 1e-4, key
        assert (out["saved_logprobs"] - out["loaded_logprobs"]).abs().max() == 0
        for key, value in out["after_step"].items():
            assert torch.equal(out["after_resume"][key], value), key
    merged = _merged_reference(model_dir, adapters, lora.scale)
    for out in (outs[0], outs[-1]):  # pp 2: merged on the adapters' stage, then sent to the other
        assert merged.keys() <= out["sent"].keys()
        for name, ref in merged.items():
            assert (out["sent"][name].double() - ref).abs().max() < 1e-5, name
    saved = load_file(str(tmp_path / "ad" / "start" / WEIGHTS))
    assert len(saved) == len(adapters)
    for key, value in saved.items():
        assert torch.equal(value, adapters[lora_key(key.replace(".weight", ".default.weight"))]), key

"""The merge arithmetic of `msrl convert merge-lora` (lora/merge.py merged_weight) against PEFT's own LoRA Linear
`merge()` (what `merge_and_unload` runs per layer), bit for bit: fp32 base with fp32 adapters, bf16 base with fp32
adapters (PEFT keeps adapters in fp32), bf16 base with bf16 adapters (PEFT upcasts on CPU). And the adapter_config
fields the merge refuses, each named.

    .venv/bin/python -m pytest -q tests/unit/test_lora_merge.py
"""
from pathlib import Path

import pytest
import torch

from megatron_sparse_rl.lora.merge import merge_scale, merged_weight

peft = pytest.importorskip("peft", reason="Hugging Face PEFT is the reference: pip install -e .[test]")


@pytest.mark.parametrize("base_dtype, adapter_dtype", [(torch.float32, torch.float32),
                                                       (torch.bfloat16, torch.float32),
                                                       (torch.bfloat16, torch.bfloat16)])
def test_merged_weight_equals_peft_merge_bit_for_bit(base_dtype, adapter_dtype):
    from peft.tuners.lora import Linear

    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(48, 40, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(40, 48, generator=g))
    base = base.to(base_dtype)
    config = peft.LoraConfig(r=4, lora_alpha=12)
    layer = Linear(base, "default", config, r=4, lora_alpha=12)
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.randn(4, 48, generator=g))
        layer.lora_B["default"].weight.copy_(torch.randn(40, 4, generator=g))
    layer.lora_A["default"].to(adapter_dtype)
    layer.lora_B["default"].to(adapter_dtype)
    w = base.weight.detach().clone()
    a, b = layer.lora_A["default"].weight.detach().clone(), layer.lora_B["default"].weight.detach().clone()
    layer.merge()
    ours = merged_weight(w, a, b, 12 / 4)
    assert ours.dtype == base_dtype
    assert not torch.equal(ours, w)
    assert torch.equal(ours, layer.base_layer.weight.detach())


@pytest.mark.parametrize("field, value, message", [
    ("peft_type", "IA3", "peft_type must be 'LORA'"),
    ("use_dora", True, "use_dora must be False"),
    ("use_rslora", True, "use_rslora must be False"),
    ("fan_in_fan_out", True, "fan_in_fan_out must be False"),
    ("bias", "all", "bias must be 'none'"),
    ("rank_pattern", {"q_proj": 8}, "rank_pattern must be empty"),
    ("r", 0, "r must be an integer >= 1"),
    ("lora_alpha", -1, "lora_alpha a number > 0"),
])
def test_merge_refuses_what_it_does_not_implement(field, value, message):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    assert merge_scale(config, Path("a/adapter_config.json")) == 2.0
    with pytest.raises(ValueError, match=f"a/adapter_config.json: .*{message}"):
        merge_scale({**config, field: value}, Path("a/adapter_config.json"))

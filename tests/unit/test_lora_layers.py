"""lora/layers.py without a model: the fused linear_qkv delta laid out by hand (q heads of each KV group, then its k
and v head), untargeted parts zero, and the refusals (dropout at tp > 1, routed experts).

    .venv/bin/python -m pytest -q tests/unit/test_lora_layers.py
"""
from __future__ import annotations

import pytest
import torch

from megatron_sparse_rl.config.lora import LoraConfig
from megatron_sparse_rl.lora.layers import LoraParams, attach_lora
from megatron_sparse_rl.models import get_adapter

CFG = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 6, "num_hidden_layers": 1, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 2, "intermediate_size": 8, "moe_intermediate_size": 4,
       "num_experts": 2, "num_experts_per_tok": 1, "vocab_size": 16}


def _qkv():
    adapter = get_adapter(CFG)
    spec = adapter.spec_from_hf(CFG)
    tm = next(t for t in adapter.tensor_maps(spec) if t.mcore.endswith("linear_qkv.weight"))
    return adapter, spec, tm


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj"), ("q_proj",)])
def test_qkv_delta_is_laid_out_as_megatron_fuses_q_k_v(targets):
    _, spec, tm = _qkv()
    lora = LoraParams(tm, targets, rank=3, scale=2.5, dropout=0.0, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in targets:
            lora.B[name].copy_(torch.randn(lora.B[name].shape, generator=g))
    w = {name: (lora.B[name] @ lora.A[name]).detach() if name in targets else torch.zeros(n, 6)
         for name, n in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4))}
    hd, q_per_group = 2, 2
    rows = []
    for group in range(2):  # Megatron's linear_qkv: per KV group, its q heads, then its k head, then its v head
        rows += [w["q_proj"][group * q_per_group * hd:(group + 1) * q_per_group * hd],
                 w["k_proj"][group * hd:(group + 1) * hd], w["v_proj"][group * hd:(group + 1) * hd]]
    fused = torch.cat(rows)
    x = torch.randn(5, 2, 6, generator=g)
    torch.testing.assert_close(lora.delta(x, spec), 2.5 * x @ fused.T, rtol=1e-6, atol=1e-6)
    assert set(lora.A) == set(targets) and lora.A["q_proj"].shape == (3, 6) and lora.B["q_proj"].shape == (8, 3)


def test_b_starts_at_zero_and_a_as_peft_initialises_it():
    _, _, tm = _qkv()
    lora = LoraParams(tm, ("q_proj",), rank=4, scale=1.0, dropout=0.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(lora.B["q_proj"], torch.zeros(8, 4))
    a = lora.A["q_proj"].detach()
    assert a.abs().max() <= 6 ** -0.5 and a.std() > 0.1  # kaiming_uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))


@pytest.mark.parametrize("tp, pp, targets, dropout, message", [
    (2, 1, ("q_proj",), 0.1, "model.lora.dropout must be 0 at parallel.tp > 1 (got dropout 0.1, tp 2)"),
    (1, 1, ("experts",), 0.0,
     "model.lora.target_modules: adapters on routed experts ('experts', which 'all-linear' includes"),
    (1, 1, ("all-linear",), 0.0, "model.lora.target_modules: adapters on routed experts"),
    (1, 1, ("gate_proj",), 0.0, "model.lora.target_modules: Qwen3MoeForCausalLM has no module 'gate_proj'"),
])
def test_refusals_name_the_field(tp, pp, targets, dropout, message):
    adapter, spec, _ = _qkv()
    with pytest.raises(ValueError) as e:
        attach_lora(torch.nn.Linear(1, 1), adapter, spec, LoraConfig(target_modules=targets, dropout=dropout), tp=tp,
                    pp=pp, seed=0)
    assert message in str(e.value)

"""learner.kernels resolution and refusals (models/kernels.py), and the no-host-sync grad-norm bodies the CUDA learner
without Transformer Engine uses (patches/megatron_cpu.py), against plain torch formulas.
Run: .venv/bin/python -m pytest -q tests/unit/test_kernels.py
"""
import pytest
import torch

from megatron_sparse_rl.config import RunConfig, from_dict
from megatron_sparse_rl.config.loader import ConfigError
from megatron_sparse_rl.models import kernels


def test_choices_resolve_per_device():
    assert kernels.resolve("local", "cuda") == "local" and kernels.resolve("fast", "cpu") == "fast"
    assert kernels.resolve("auto", "cpu") == kernels.AUTO["cpu"] and kernels.resolve("auto", "cuda") == kernels.AUTO["cuda"]
    assert kernels.config_kwargs("fast", cuda=False) == {} and kernels.config_kwargs("local", cuda=True) == {}
    assert kernels.config_kwargs("fast", cuda=True) == {"bias_activation_fusion": True, "bias_dropout_fusion": True}


def test_unknown_choice_is_refused_listing_the_choices():
    with pytest.raises(ConfigError, match="learner.kernels: 'grouped' is not allowed; choose one of 'auto', 'local', 'fast'"):
        from_dict(RunConfig, {"learner": {"kernels": "grouped"}})
    with pytest.raises(ValueError, match=r"learner.kernels must be one of \['auto', 'local', 'fast'\]"):
        kernels.resolve("grouped", "cpu")
    assert from_dict(RunConfig, {"learner": {"kernels": "local"}}).learner.kernels == "local"


def test_grouped_experts_refuse_what_they_do_not_compute():
    from types import SimpleNamespace

    from megatron_sparse_rl.models.grouped_experts import check_grouped_config

    ok = dict(add_bias_linear=False, gated_linear_unit=True, fp8=None, fp4=None, use_te_activation_func=False,
              moe_apply_probs_on_input=False, params_dtype=torch.float32, expert_tensor_parallel_size=1,
              hidden_size=64, moe_ffn_hidden_size=32)
    check_grouped_config(SimpleNamespace(**ok))
    with pytest.raises(ValueError, match="expert linear biases"):
        check_grouped_config(SimpleNamespace(**{**ok, "add_bias_linear": True}))
    with pytest.raises(ValueError, match="hidden size 66 .* multiple of 16"):
        check_grouped_config(SimpleNamespace(**{**ok, "hidden_size": 66}))


def test_foreach_grad_norm_and_scale_match_plain_torch():
    from megatron_sparse_rl.patches.megatron_cpu import _foreach_l2_norm, _foreach_scale

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.randn(2, 2, 2, generator=g)]
    norm, _ = _foreach_l2_norm(2048, None, [grads], False)
    want = torch.cat([t.reshape(-1) for t in grads]).double().norm()
    assert norm.shape == (1,) and abs(float(norm) - float(want)) < 1e-6
    scaled = [t.clone() for t in grads]
    _foreach_scale(2048, None, [scaled, scaled], 0.25)
    assert all(torch.equal(a, b * 0.25) for a, b in zip(scaled, grads))
    copies = [torch.empty_like(t) for t in grads]
    _foreach_scale(2048, None, [grads, copies], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(copies, grads))


@pytest.mark.parametrize("dv", [16, 8], ids=["equal_width", "mla_narrow_value"])
def test_sdpa_sparse_attention_within_1e6_of_megatrons(dv):
    """DSA's sparse attention (models/dsa_attention.py) against Megatron-Core's `unfused_dsa_fn` in fp32, output and
    the query/key/value gradients: random top-k picks per query (some above the query, which the causal mask drops;
    query 0 can only read itself) over 9 positions, 2 rows, 3 heads."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    from megatron_sparse_rl.models import dsa_attention

    megatron_fn = dsa_attention.install().megatron_fn  # Megatron's own function, wherever the entry now stands
    g = torch.Generator().manual_seed(5)
    sq, b, heads, d, topk = 9, 2, 3, 16, 4
    q, k = torch.randn(sq, b, heads, d, generator=g), torch.randn(sq, b, heads, d, generator=g)
    v = torch.randn(sq, b, heads, dv, generator=g)
    pos = torch.arange(sq)
    picks = torch.stack([torch.randperm(sq, generator=g)[:topk] for _ in range(b * sq)]).view(b, sq, topk)
    picks[:, :, 0] = pos  # a query always reads itself (its indexer's only finite score at position 0)
    results = []
    for fn in (megatron_fn, dsa_attention.sdpa_sparse_attention):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*inputs, picks, 0.25)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), [t.grad for t in inputs]))
    (y0, g0), (y1, g1) = results
    assert y0.shape == y1.shape == (sq, b, heads * dv)
    assert (y0 - y1).abs().max() <= 1e-6
    for a, c in zip(g0, g1):
        assert (a - c).abs().max() <= 1e-6
    assert dsa.unfused_dsa_fn is dsa_attention.ENTRY


def test_the_dsa_entry_shows_the_attended_indices_and_dispatches_per_kernel_choice():
    """The entry in Megatron's place calls a pending observer once with the indices, then Megatron's function, or
    the SDPA one inside a SDPADSAttention forward (the context flag)."""
    from megatron_sparse_rl.models import dsa_attention

    entry = dsa_attention.install()
    calls = []
    saved = entry.megatron_fn
    entry.megatron_fn = lambda *a: calls.append("megatron")
    try:
        seen = []
        entry.pending = seen.append
        entry(None, None, None, "indices", 1.0)
        entry(None, None, None, "again", 1.0)
        assert seen == ["indices"] and calls == ["megatron", "megatron"] and entry.pending is None
        token = dsa_attention._SDPA.set(True)
        try:
            q = torch.randn(3, 1, 1, 4)
            out = entry(q, q, q, torch.tensor([[[0], [1], [2]]]), 0.5)
        finally:
            dsa_attention._SDPA.reset(token)
        assert calls == ["megatron", "megatron"] and torch.allclose(out, q.reshape(3, 1, 4))  # each reads itself
    finally:
        entry.megatron_fn = saved


def test_fast_puts_sdpa_sparse_attention_in_dsa_layers():
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_sparse_rl.models.dsa_attention import SDPADSAttention

    core = ModuleSpec(module=DSAttention)
    layer = ModuleSpec(module=None, submodules=type("S", (), {})())
    layer.submodules.self_attention = ModuleSpec(module=None, submodules=type("A", (), {})())
    layer.submodules.self_attention.submodules.core_attention = core
    layer.submodules.mlp = ModuleSpec(module=None)
    block = type("B", (), {"layer_specs": [layer]})()
    kernels.apply(block, "fast", config=None)
    assert core.module is SDPADSAttention

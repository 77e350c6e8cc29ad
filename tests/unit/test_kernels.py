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

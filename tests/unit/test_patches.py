"""Each Megatron-Core CPU shim: applied, it makes the upstream code path work on the host and computes the
same thing as an independent reference."""
import pytest
import torch

from megatron_sparse_rl.patches import megatron_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims are a no-op with CUDA")


@pytest.fixture(scope="module", autouse=True)
def applied():
    megatron_cpu.apply()


def test_apply_is_idempotent_and_version_checked(monkeypatch):
    megatron_cpu.apply()  # a second call changes nothing and does not raise
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.0.1")
    monkeypatch.setattr(megatron_cpu, "_APPLIED", set())
    with pytest.raises(RuntimeError, match="written for megatron-core 0.16.1, found 0.0.1"):
        megatron_cpu.apply()


def test_current_device_is_host():
    assert torch.cuda.current_device() == torch.device("cpu")


def test_rng_tracker_forks_named_cpu_states():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("a", 123)
    outside = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside), "fork must restore the default state"
    expected = torch.rand(3, generator=torch.Generator().manual_seed(123))
    assert torch.equal(first, expected)
    with tracker.fork("a"):
        second = torch.rand(3)
    gen = torch.Generator().manual_seed(123)
    torch.rand(3, generator=gen)
    assert torch.equal(second, torch.rand(3, generator=gen)), "the named state must advance across forks"
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("b", 123)


def test_causal_mask_on_host():
    from megatron.core.fusions import fused_softmax

    mask = fused_softmax.get_default_causal_mask(4)
    assert mask.device.type == "cpu"
    assert torch.equal(mask, torch.ones(4, 4).triu(1).bool())


def test_host_grad_norm_and_clip_match_torch():
    from megatron.core.optimizer import clip_grads

    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    expected = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm, _ = clip_grads.l2_norm_impl(0, None, [[p.grad for p in params]], False)
    assert torch.allclose(norm, expected.reshape(1))
    grads = [p.grad.clone() for p in params]
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=0.5, total_norm=float(expected))
    for p, g in zip(params, grads):
        assert torch.allclose(p.grad, g * 0.5 / (float(expected) + 1e-6))


def test_host_torch_routes_cuda_factories():
    from megatron.core.optimizer import optimizer as moptimizer

    t = moptimizer.torch.tensor([1.0], device="cuda")
    assert t.device.type == "cpu"
    assert moptimizer.torch.float32 is torch.float32


def test_torch_norm_accepts_sequence_parallel_and_marks_weights():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            sequence_parallel=True, tensor_model_parallel_size=2, use_cpu_initialization=True)
    norm = WrappedTorchNorm(cfg, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(p.sequence_parallel for p in norm.parameters())
    x = torch.randn(3, 8)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(norm(x), ref, atol=1e-6)


def test_te_general_gemm_defined():
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None


def test_activation_recompute_matches_plain_backward():
    from megatron.core import tensor_parallel

    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)

    def block(inp):
        return torch.tanh(inp @ w)

    block(x).sum().backward()
    ref_w, ref_x = w.grad.clone(), x.grad.clone()
    w.grad, x.grad = None, None
    tensor_parallel.checkpoint(block, False, x).sum().backward()
    assert torch.allclose(w.grad, ref_w) and torch.allclose(x.grad, ref_x)

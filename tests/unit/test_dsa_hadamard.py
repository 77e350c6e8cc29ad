"""patches/megatron_dsa_hadamard.py: the torch fast Walsh-Hadamard transform against a float64 reference built here
from the Sylvester Hadamard matrix (Kronecker products of [[1, 1], [1, -1]]), and the patched Megatron-Core 0.16.1
DSA `rotate_activation` (fp32 on CPU, bf16) against the same reference."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_sparse_rl.patches import megatron_dsa_hadamard as shim

SIZES = [2 ** k for k in range(9)]  # 1 .. 256


def sylvester(n: int) -> torch.Tensor:
    """H_n in float64: H_1 = [1], H_2m = H_2 (x) H_m (Sylvester's order, as scipy.linalg.hadamard)."""
    h, h2 = torch.ones(1, 1, dtype=torch.float64), torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h2, h)
    return h


def reference(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale * x @ H^T over the last dim, in float64 (H is symmetric)."""
    return (x.to(torch.float64) @ sylvester(x.shape[-1]).T) * scale


@pytest.fixture
def dsa(monkeypatch):
    """Megatron's dsa module with its two globals restored after the test (apply() rebinds them)."""
    from megatron.core.transformer.experimental_attention_variant import dsa as module

    monkeypatch.setattr(module, "hadamard_transform", module.hadamard_transform)
    monkeypatch.setattr(module, "rotate_activation", module.rotate_activation)
    return module


def test_sylvester_matrix_is_a_hadamard_matrix():
    h = sylvester(16)
    assert torch.equal(h @ h.T, 16 * torch.eye(16, dtype=torch.float64))
    assert torch.equal(h[1], torch.tensor([1.0, -1.0] * 8, dtype=torch.float64))  # Sylvester, not Walsh order


@pytest.mark.parametrize("n", SIZES)
def test_exact_against_the_float64_reference(n):
    """fp32: the float64 transform rounded once (bit-equal); leading dims of any shape; scale as given."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, 2, 5, n, generator=g)
    for scale in (1.0, n ** -0.5, 0.3):
        out = shim.hadamard_transform(x, scale=scale)
        assert out.dtype == torch.float32 and out.shape == x.shape
        assert torch.equal(out, reference(x, scale).to(torch.float32))
    assert torch.equal(shim.hadamard_transform(x[0, 0, 0]), reference(x[0, 0, 0]).to(torch.float32))  # 1-D


@pytest.mark.parametrize("n", [8, 128, 256])
def test_bf16_within_bf16_rounding(n):
    x = torch.randn(4, 7, n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    ref = reference(x, n ** -0.5)
    out = shim.hadamard_transform(x, scale=n ** -0.5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.to(torch.bfloat16))  # the float64 result rounded once
    # and so within half a bf16 ulp (2^-8 relative) of it
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-30).all()


def test_gradient_is_the_transform_of_the_output_gradient():
    x = torch.randn(3, 64, requires_grad=True, dtype=torch.float32)
    w = torch.randn(3, 64)
    (shim.hadamard_transform(x, scale=0.125) * w).sum().backward()
    assert torch.allclose(x.grad.double(), reference(w, 0.125), rtol=0, atol=1e-6)


@pytest.mark.parametrize("n", [3, 6, 100, 129])
def test_non_power_of_two_is_refused_naming_the_size(n):
    with pytest.raises(ValueError, match=rf"last dimension must be a power of two \(got {n}; shape \(2, {n}\)\)"):
        shim.hadamard_transform(torch.zeros(2, n))


def test_other_dtypes_are_refused():
    with pytest.raises(TypeError, match="got torch.float64"):
        shim.hadamard_transform(torch.zeros(4, dtype=torch.float64))


def test_fast_hadamard_transform_is_not_installed_here():
    """This machine runs the shim's transform: the package is absent, so Megatron bound None (its import failed)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    assert importlib.util.find_spec("fast_hadamard_transform") is None
    assert dsa.hadamard_transform is None or dsa.hadamard_transform is shim.hadamard_transform


def test_patched_megatron_rotate_activation_gives_the_reference(dsa):
    x = torch.randn(5, 2, 4, 128, generator=torch.Generator().manual_seed(0))  # [s, b, heads, index_head_dim]
    if not getattr(dsa.rotate_activation, "msrl_dsa_hadamard", False):  # megatron_cpu.apply() may have run already
        with pytest.raises(AssertionError, match="only support bf16"):
            dsa.rotate_activation(x)  # upstream, before apply(): bf16 only
    shim.apply()
    assert dsa.hadamard_transform is shim.hadamard_transform
    assert torch.equal(dsa.rotate_activation(x), reference(x, 128 ** -0.5).to(torch.float32))
    xb = x.to(torch.bfloat16)
    assert torch.equal(dsa.rotate_activation(xb), reference(xb, 128 ** -0.5).to(torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16 input .* got torch.float16 on cpu"):
        dsa.rotate_activation(x.half())


def test_apply_is_idempotent(dsa):
    shim.apply()
    first = (dsa.hadamard_transform, dsa.rotate_activation)
    shim.apply()
    assert (dsa.hadamard_transform, dsa.rotate_activation) == first


def test_an_installed_package_is_left_in_place(dsa):
    """Where Megatron imported fast_hadamard_transform, apply() keeps that binding, and the patched rotate_activation
    calls it for non-CPU tensors (a meta tensor stands in for a CUDA one here)."""
    calls = []

    def package(x, scale):
        calls.append((x.dtype, x.device.type, scale))
        return x

    dsa.hadamard_transform = package
    shim.apply()
    assert dsa.hadamard_transform is package
    dsa.rotate_activation(torch.empty(3, 64, dtype=torch.bfloat16, device="meta"))
    assert calls == [(torch.bfloat16, "meta", 64 ** -0.5)]
    with pytest.raises(TypeError, match="got torch.float32 on meta"):  # fp32 stays CPU-only
        dsa.rotate_activation(torch.empty(3, 64, device="meta"))
    dsa.rotate_activation(torch.zeros(3, 64))  # a CPU tensor: the torch transform, not the CUDA-only package
    assert len(calls) == 1


def test_version_is_checked(dsa, monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match="written for megatron-core 0.16.1, found 0.17.0"):
        shim.apply()


def test_the_cpu_entry_point_applies_it(dsa):
    """Entry points call megatron_cpu.apply() on a machine without CUDA; it installs this shim too."""
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    assert dsa.rotate_activation.msrl_dsa_hadamard and dsa.hadamard_transform is shim.hadamard_transform

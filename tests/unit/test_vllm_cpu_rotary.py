"""patches/vllm_cpu_rotary.py: vLLM 0.32's CPU rotary op against a float64 RoPE written here.

Unpatched, the CPU kernel rotates a 3-D [tokens, heads > 1, rot_dim] query wrongly (the gap); patched, 3-D inputs
(contiguous, or the strided q_pe slice DeepSeek attention passes) equal the reference and are rotated in place as
the kernel does, and 2-D inputs still take the kernel. The e2e proof on a model is tests/e2e/test_rollout_mla.py
(rope "default").
    .venv/bin/python -m pytest -q tests/unit/test_vllm_cpu_rotary.py
"""
import pytest
import torch

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rotary kernel runs on the CPU platform")

T, HEADS, ROT, BASE = 7, 4, 64, 10000.0


def reference(x: torch.Tensor, positions: torch.Tensor, neox: bool) -> torch.Tensor:
    """RoPE in float64: GPT-J style rotates pairs (2i, 2i+1), NeoX style pairs (i, i + rot/2)."""
    x = x.double()
    inv_freq = BASE ** (-torch.arange(0, ROT, 2, dtype=torch.float64) / ROT)
    angle = positions.double()[:, None] * inv_freq[None]  # [T, rot/2]
    shape = (-1,) + (1,) * (x.dim() - 2) + (ROT // 2,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    if neox:
        a, b = x[..., :ROT // 2], x[..., ROT // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)


@pytest.fixture(scope="module")
def patch():
    from megatron_sparse_rl.patches import vllm_cpu_rotary

    was = vllm_cpu_rotary.is_applied()
    vllm_cpu_rotary.revert()
    yield vllm_cpu_rotary
    (vllm_cpu_rotary.apply if was else vllm_cpu_rotary.revert)()


def _rope(neox: bool):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        return RotaryEmbedding(ROT, ROT, 2048, BASE, neox, torch.float32)


def _err(got, want):
    return (got.double() - want).abs().max().item()


@pytest.mark.parametrize("neox", [False, True])
def test_3d_multi_head_inputs_are_wrong_unpatched_and_right_patched(patch, neox):
    rope, positions = _rope(neox), torch.arange(3, 3 + T)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(T, HEADS, ROT, generator=g), torch.randn(T, 1, ROT, generator=g)
    want_q, want_k = reference(q, positions, neox), reference(k, positions, neox)

    patch.revert()
    got_q, _ = rope.forward_cpu(positions, q.clone(), k.clone())
    flat_q, flat_k = rope.forward_cpu(positions, q.clone().view(T, -1), k.clone().view(T, -1))
    assert _err(got_q, want_q) > 0.1, "the gap this patch covers: the kernel's 3-D multi-head rotation is wrong"
    assert _err(flat_q.view(T, HEADS, ROT), want_q) < 1e-5 and _err(flat_k.view(T, 1, ROT), want_k) < 1e-5

    assert patch.apply() and patch.apply() and patch.is_applied()  # idempotent
    q3, k3 = q.clone(), k.clone()
    got_q, got_k = rope.forward_cpu(positions, q3, k3)
    assert _err(got_q, want_q) < 1e-5 and _err(got_k, want_k) < 1e-5
    assert torch.equal(q3, got_q) and torch.equal(k3, got_k), "rotated in place, as the kernel is"


def test_strided_q_pe_slice_is_rotated_in_place(patch):
    """DeepSeek's q_pe is q[..., nope:] of a [tokens, heads, nope + rope] tensor, k_pe a [tokens, 1, rope] slice."""
    patch.apply()
    rope, positions = _rope(False), torch.arange(T)
    g = torch.Generator().manual_seed(1)
    q, latent = torch.randn(T, HEADS, 32 + ROT, generator=g), torch.randn(T, 1, 512 + ROT, generator=g)
    q0, latent0 = q.clone(), latent.clone()
    q_pe, k_pe = rope.forward_cpu(positions, q[..., 32:], latent[..., 512:])
    assert _err(q_pe, reference(q0[..., 32:], positions, False)) < 1e-5
    assert _err(k_pe, reference(latent0[..., 512:], positions, False)) < 1e-5
    assert torch.equal(q[..., 32:], q_pe) and torch.equal(q[..., :32], q0[..., :32])
    assert torch.equal(latent[..., 512:], k_pe) and torch.equal(latent[..., :512], latent0[..., :512])


def test_2d_inputs_still_take_the_kernel(patch, monkeypatch):
    patch.apply()
    rope, positions = _rope(False), torch.arange(T)
    calls = []
    native = type(rope).forward_native
    monkeypatch.setattr(type(rope), "forward_native", lambda self, *a: calls.append(1) or native(self, *a))
    q, k = torch.randn(T, HEADS * ROT), torch.randn(T, ROT)
    got_q, got_k = rope.forward_cpu(positions, q.clone(), k.clone())
    assert calls == []
    assert _err(got_q.view(T, HEADS, ROT), reference(q.view(T, HEADS, ROT), positions, False)) < 1e-5
    assert _err(got_k, reference(k, positions, False)) < 1e-5


def test_version_checked(patch, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.0.1")
    with pytest.raises(RuntimeError, match="written for vllm 0.32.0 \\(found 0.0.1\\)"):
        patch.apply()

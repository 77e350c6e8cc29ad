"""A CPU path for the Hadamard rotation of Megatron-Core 0.16.1's DSA indexer (DeepSeek Sparse Attention, issue 33).

The gap: `megatron/core/transformer/experimental_attention_variant/dsa.py` rotates the indexer's q and k with
`rotate_activation(x)`, which (1) calls `fast_hadamard_transform.hadamard_transform(x, scale=x.size(-1) ** -0.5)`,
a CUDA-only package the module imports at import time, binding `dsa.hadamard_transform = None` when it is missing
(then `assert hadamard_transform is not None` fails), and (2) asserts `x.dtype == torch.bfloat16`, so an fp32 CPU
learner cannot run the indexer even with a transform.

What `apply()` changes, and nothing else:
1. Only where the package is absent (`dsa.hadamard_transform is None`, Megatron's own import result), it binds
   `dsa.hadamard_transform` to `hadamard_transform` below: a torch fast Walsh-Hadamard transform (log2(n) butterfly
   stages, O(n log n), any leading dims, the package's `scale` argument). With the package installed that binding
   is left as Megatron made it.
2. It replaces `dsa.rotate_activation` (looked up as a module global by `DSAIndexer.forward_with_scores`) by one
   with the same scale that lifts the bf16-only assertion for float32 on CPU: bf16 anywhere and float32 on CPU are
   accepted, any other dtype/device raises TypeError naming both. CPU tensors always go through the torch transform
   (the package's kernel is CUDA-only); other tensors through `dsa.hadamard_transform` (the package where it is
   installed, else the torch transform).

The torch transform computes in float64 and rounds once to the input dtype, so its output is the float64
Walsh-Hadamard transform (Sylvester order, as scipy.linalg.hadamard and the package) correctly rounded; it is
differentiable by autograd (the transpose of a symmetric H is H). Unlike the package, which zero-pads to the next
power of two, a last dimension that is not a power of two is refused, naming it (DSA's index_head_dim is 128).

`apply()` checks the Megatron-Core version it was written for, is idempotent, and is called by entry points
(`megatron_cpu.apply()` on a machine without CUDA), never at import.
"""
from __future__ import annotations

import torch

MEGATRON_VERSION = "0.16.1"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes of `hadamard_transform` (the package's: fp32, fp16, bf16)."""


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`scale * x @ H_n` over the last dimension n (a power of two; H_n the Sylvester Hadamard matrix, symmetric),
    for any leading dims, returned in x's dtype: computed in float64, rounded once."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_transform: the last dimension must be a power of two (got {n}; shape "
                         f"{tuple(x.shape)})")
    if x.dtype not in DTYPES:
        raise TypeError(f"hadamard_transform takes {', '.join(map(str, DTYPES))} (got {x.dtype})")
    y = x.to(torch.float64).reshape(-1, n)
    h = 1
    while h < n:  # stage h: in every block of 2h, (a, b) -> (a + b, a - b) for the halves a and b
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * scale).to(x.dtype)


def _check(dsa) -> None:
    import megatron.core

    if megatron.core.__version__ != MEGATRON_VERSION:
        raise RuntimeError(f"megatron_sparse_rl's DSA Hadamard shim was written for megatron-core {MEGATRON_VERSION}, "
                           f"found {megatron.core.__version__}; install megatron-core=={MEGATRON_VERSION}")
    missing = [name for name in ("rotate_activation", "hadamard_transform") if not hasattr(dsa, name)]
    if missing:
        raise RuntimeError(f"megatron.core.transformer.experimental_attention_variant.dsa lacks {', '.join(missing)}, "
                           f"which the DSA Hadamard shim replaces (written for megatron-core {MEGATRON_VERSION})")


def _rotate_activation_of(dsa):
    """dsa.rotate_activation with bf16 anywhere and float32 on CPU (module docstring, item 2)."""

    def rotate_activation(x: torch.Tensor) -> torch.Tensor:
        """Hadamard rotation of the DSA indexer's q / k: scale x.size(-1) ** -0.5, as Megatron-Core 0.16.1's."""
        cpu = x.device.type == "cpu"
        if not (x.dtype == torch.bfloat16 or (cpu and x.dtype == torch.float32)):
            raise TypeError(f"rotate_activation takes bfloat16 input (float32 too on CPU: "
                            f"megatron_sparse_rl.patches.megatron_dsa_hadamard), got {x.dtype} on {x.device}")
        transform = hadamard_transform if cpu else dsa.hadamard_transform
        if transform is None:  # apply() binds one wherever the package is absent: only reached if it was undone
            raise ImportError("fast_hadamard_transform is not installed and the DSA Hadamard shim is not applied")
        return transform(x, scale=x.size(-1) ** -0.5)

    rotate_activation.msrl_dsa_hadamard = True
    return rotate_activation


def apply() -> None:
    """Install the shim into Megatron's dsa module (module docstring); idempotent, version-checked."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    _check(dsa)
    if dsa.hadamard_transform is None:  # Megatron's `from fast_hadamard_transform import ...` failed
        dsa.hadamard_transform = hadamard_transform
    if not getattr(dsa.rotate_activation, "msrl_dsa_hadamard", False):
        dsa.rotate_activation = _rotate_activation_of(dsa)

"""Shims that let Megatron-Core 0.16.1's multi-latent attention (MLA, DeepSeek-V3 / Kimi-K2) run on the local
(torch) layer spec, without Transformer Engine. Needed wherever TE is absent (the CPU machine); with TE present
Megatron's TE spec is used and nothing here is installed.

1. `multi_latent_attention.HAVE_TE`: without TE, `megatron.core.extensions.transformer_engine` still imports (its
   TE names bound to a stand-in), so the MLA module believes TE is present and `isinstance(..., TELinear)` on the
   output projection raises TypeError. Tell that module the truth.
2. The local `DotProductAttention` rejects the `k_channels` / `v_channels` MLA passes to its core attention (the
   query/key head is nope + rope wide, the value head `v_head_dim` wide). Accept them: the output width is
   `v_channels` per head. (The softmax scale is always passed by MLA, so the key width needs no other use.)

`apply()` is idempotent and checks the Megatron version; `megatron_cpu.apply()` calls it when TE is absent.
"""
from __future__ import annotations

import functools

MEGATRON_VERSION = "0.16.1"
_APPLIED: set[str] = set()


def _check_version() -> None:
    import megatron.core

    if megatron.core.__version__ != MEGATRON_VERSION:
        raise RuntimeError(f"megatron_sparse_rl's MLA shims were written for megatron-core {MEGATRON_VERSION}, "
                           f"found {megatron.core.__version__}; install megatron-core=={MEGATRON_VERSION}")


def patch_mla_have_te() -> None:
    """Item 1 of the module docstring."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def patch_dot_product_attention_channels() -> None:
    """Item 2 of the module docstring."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    if "channels" in _APPLIED:
        return
    original = DotProductAttention.__init__

    @functools.wraps(original)
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:
            heads = self.num_attention_heads_per_partition
            self.hidden_size_per_partition = v_channels * heads
            self.hidden_size_per_attention_head = divide(self.hidden_size_per_partition, heads)

    DotProductAttention.__init__ = __init__
    _APPLIED.add("channels")


def apply() -> None:
    """Install both shims (idempotent)."""
    _check_version()
    patch_mla_have_te()
    patch_dot_product_attention_channels()

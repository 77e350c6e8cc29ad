"""The sparse attention of DeepSeek Sparse Attention layers, one entry point for both kernel choices.

Megatron-Core 0.16.1's `DSAttention.forward` runs its indexer, then the module function `unfused_dsa_fn(query, key,
value, topk_indices, softmax_scale)`: every query attends the `index_topk` keys its indexer picked, under the causal
mask, through a materialised [b, heads, sq, sk] fp32 score matrix. `install()` (once per process) puts `ENTRY` in
that function's place:
- inside a `SDPADSAttention` forward (learner.kernels = fast, models/kernels.py), `sdpa_sparse_attention` computes
  the same attention with one `scaled_dot_product_attention` call and a boolean mask (the picked keys, causal);
- elsewhere (learner.kernels = local) Megatron's own function runs unchanged;
- either way, a pending observer (learner/indexer_replay.py: which indices the attention read) sees `topk_indices`
  first.

    from megatron_sparse_rl.models import dsa_attention
    dsa_attention.install()
    dsa_attention.ENTRY.pending = lambda attended: ...     # called once, by the next sparse attention
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable

import torch
import torch.nn.functional as F

MEGATRON_VERSION = "0.16.1"
_SDPA = contextvars.ContextVar("msrl_dsa_sdpa", default=False)


def sdpa_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, topk_indices: torch.Tensor,
                          softmax_scale: float) -> torch.Tensor:
    """Megatron's `unfused_dsa_fn` through `scaled_dot_product_attention`: query [sq, b, heads, d], key [sk, b,
    heads, d], value [sk, b, heads, dv], topk_indices [b, sq, k] (key positions; picks above the query are dropped
    by the causal mask, as there) -> [sq, b, heads * dv]. The flash kernels want one head width, so MLA's narrower
    value is zero-padded and the output sliced back."""
    sq, b, heads, _ = query.shape
    sk, dv = key.shape[0], value.shape[-1]
    picked = torch.zeros(b, sq, sk, dtype=torch.bool, device=query.device)
    picked.scatter_(-1, topk_indices, True)
    causal = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()
    allowed = (picked & causal)[:, None]  # [b, 1, sq, sk], True = attend
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale)
    return out[..., :dv].permute(2, 0, 1, 3).reshape(sq, b, heads * dv)


class _Entry:
    """What stands in Megatron's `unfused_dsa_fn` (module docstring)."""

    def __init__(self, megatron_fn: Callable):
        self.megatron_fn = megatron_fn
        self.pending: Callable[[torch.Tensor], None] | None = None
        """Called with the next call's `topk_indices`, then cleared."""

    def __call__(self, query, key, value, topk_indices, softmax_scale):
        seen, self.pending = self.pending, None
        if seen is not None:
            seen(topk_indices)
        fn = sdpa_sparse_attention if _SDPA.get() else self.megatron_fn
        return fn(query, key, value, topk_indices, softmax_scale)


ENTRY: _Entry | None = None


def install() -> _Entry:
    """Put `ENTRY` in place of Megatron's `unfused_dsa_fn` (once per process) and return it."""
    global ENTRY
    from megatron.core.transformer.experimental_attention_variant import dsa

    if ENTRY is None:
        fn = getattr(dsa, "unfused_dsa_fn", None)
        if fn is None:
            raise ImportError("megatron.core...experimental_attention_variant.dsa.unfused_dsa_fn is missing: the DSA "
                              f"attention entry was written for Megatron-Core {MEGATRON_VERSION}")
        ENTRY = _Entry(fn)
    dsa.unfused_dsa_fn = ENTRY
    return ENTRY


def _dsattention():
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    return DSAttention


class SDPADSAttention(_dsattention()):
    """Megatron's `DSAttention` (same constructor, parameters and indexer) whose sparse attention is
    `sdpa_sparse_attention`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        install()

    def forward(self, *args, **kwargs):
        token = _SDPA.set(True)
        try:
            return super().forward(*args, **kwargs)
        finally:
            _SDPA.reset(token)

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
At context parallelism (parallel.cp > 1) `SDPADSAttention` all-gathers K/V over the context-parallel group and calls
`ENTRY` with this rank's query positions (`rows`), which always runs `sdpa_sparse_attention` (models/dsa_context.py
has the indexer's side).

    from megatron_sparse_rl.models import dsa_attention
    dsa_attention.install()
    dsa_attention.ENTRY.pending = lambda attended: ...     # called once, by the next sparse attention
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_sparse_rl.models.dsa_context import context_parallel_indexer_kl
from megatron_sparse_rl.parallel.context import GatherSequence, blocked_keys, cp_positions

MEGATRON_VERSION = "0.16.1"
_SDPA = contextvars.ContextVar("msrl_dsa_sdpa", default=False)


def sdpa_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, topk_indices: torch.Tensor,
                          softmax_scale: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron's `unfused_dsa_fn` through `scaled_dot_product_attention`: query [sq, b, heads, d], key [sk, b,
    heads, d], value [sk, b, heads, dv], topk_indices [b, sq, k] (key positions; picks above the query are dropped
    by the causal mask, as there) -> [sq, b, heads * dv]. `rows` [sq]: the queries' positions among the keys (context
    parallelism); None: 0..sq-1. The flash kernels want one head width, so MLA's narrower value is zero-padded and
    the output sliced back."""
    sq, b, heads, _ = query.shape
    sk, dv = key.shape[0], value.shape[-1]
    picked = torch.zeros(b, sq, sk, dtype=torch.bool, device=query.device)
    picked.scatter_(-1, topk_indices, True)
    if rows is None:
        causal = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()
    else:
        causal = ~blocked_keys(rows, sk)
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

    def __call__(self, query, key, value, topk_indices, softmax_scale, rows=None):
        seen, self.pending = self.pending, None
        if seen is not None:
            seen(topk_indices)
        if rows is not None:  # context parallelism: this rank's query positions among every key (SDPADSAttention)
            return sdpa_sparse_attention(query, key, value, topk_indices, softmax_scale, rows)
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
    `sdpa_sparse_attention`. At context_parallel_size > 1 (its indexer a models/dsa_context.py
    `ContextParallelIndexer`) the forward is `_context_parallel`: K/V all-gathered over the context-parallel group."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        install()
        self.cp_group = self.indexer.pg_collection.cp if self.config.context_parallel_size > 1 else None
        if self.cp_group is not None and getattr(self.indexer, "cp_group", None) is None:
            raise ValueError("SDPADSAttention at context_parallel_size > 1 needs models/dsa_context.py's "
                             f"ContextParallelIndexer (got {type(self.indexer).__name__})")

    def forward(self, query, key, value, attention_mask, x, qr, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, indexer_loss_positions: int | None = None):
        """Megatron's; `indexer_loss_positions` (cp > 1, learner/dsa_indexer_loss.py hands it in): the micro-batch
        width whose positions the indexer KL averages (None: every position run)."""
        token = _SDPA.set(True)
        try:
            if self.cp_group is None:
                return super().forward(query, key, value, attention_mask, x, qr, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            if packed_seq_params is not None or attention_mask is not None or attention_bias is not None:
                raise NotImplementedError("DSA attention at context_parallel_size > 1 takes no packed sequences, "
                                          "attention mask or bias (causal only)")
            return self._context_parallel(query, key, value, x.detach(), qr.detach(), indexer_loss_positions)
        finally:
            _SDPA.reset(token)

    def _context_parallel(self, query, key, value, x, qr, positions: int | None):
        """This rank's query rows [sq, b, heads, d] (global positions `rows`) against every rank's keys, gathered in
        sequence order; the indexer's top-k over them; the KL loss attached as Megatron does (models/dsa_context.py)."""
        from megatron.core.transformer.experimental_attention_variant import dsa

        group = self.cp_group
        key = GatherSequence.apply(key, group, 0, True)  # backward: summed over the group, this rank's positions kept
        value = GatherSequence.apply(value, group, 0, True)
        rows = cp_positions(key.shape[0], group.size(), group.rank(), query.device)
        mask = torch.zeros(rows.numel(), key.shape[0], device=query.device)
        mask = mask.masked_fill(blocked_keys(rows, key.shape[0]), float("-inf"))
        index_scores, topk_indices = self.indexer.forward_with_scores(x, qr, mask=mask)
        output = ENTRY(query, key, value, topk_indices, self.softmax_scale, rows=rows)
        coeff = getattr(self.config, "dsa_indexer_loss_coeff", 0.0)
        if not (self.training and torch.is_grad_enabled() and coeff > 0):
            return output  # Megatron adds coeff x KL (0 here) whenever it trains; its gradient is zero
        if getattr(self.config, "dsa_indexer_use_sparse_loss", False):
            raise NotImplementedError("dsa_indexer_use_sparse_loss at context_parallel_size > 1")
        loss = coeff * context_parallel_indexer_kl(index_scores, query.detach(), key.detach(), self.softmax_scale,
                                                   rows, positions, group, self.indexer.pg_collection.tp)
        dsa.DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss=loss, layer_number=self.layer_number,
                                                             num_layers=self.config.num_layers)
        return dsa.DSAIndexerLossAutoScaler.apply(output, loss)

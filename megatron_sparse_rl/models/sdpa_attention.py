"""`SDPAttention`: Megatron's local `DotProductAttention` computed by `torch.nn.functional.scaled_dot_product_attention`
instead of a materialised s x s softmax, the `fast` choice of `learner.kernels` (models/kernels.py).

It subclasses `DotProductAttention` (same constructor, attributes, sharded state dict and call), so everything
that finds or hooks Megatron's local core attention keeps working: the per-layer, per-KV-head sparse-KV keep-set
masks (learner/attention_mask.py swaps the mask argument in a forward pre-hook), padding (right padding under the
causal mask), multi-latent attention (MLA passes `k_channels` / `v_channels`) and grouped-query heads.

Masks follow Megatron's convention (bool, True = masked out, [b, 1 or heads, sq, sk]); without one the layer's
causal mask type becomes `is_causal`. Which kernel runs (torch 2.13):
- CPU: the flash kernel, with `is_causal` and with a boolean mask (keep sets) alike; MLA's narrower value head is
  zero-padded to the query/key width first (the output is sliced back), since every flash kernel wants one width.
- CUDA: flash (FlashAttention-2) for the causal case without a mask in bf16; an explicit mask (keep sets) rules
  flash out, and the memory-efficient (cutlass) kernel runs, which takes boolean masks; fp32 runs the
  memory-efficient kernel too. Neither materialises the s x s scores.
A query row whose mask hides every key gets 0 here and the mean of the values in the local kernel; no real keep set
makes such a row (a token always sees itself), and padding rows see causally.

Context parallelism (parallel.cp > 1; Megatron-Core's own `DotProductAttention` asserts cp == 1, which this module
steps around by building its parent with a cp-1 view of the config): this rank's queries are two of the 2 x cp
load-balanced chunks of every sequence (chunks r and 2cp - 1 - r, Megatron's `get_batch_on_this_cp_rank`, applied by
the learner; RoPE already rotated them at their global positions). `_global_keys` all-gathers K/V over the
context-parallel group into sequence order (parallel/context.py `GatherSequence`: the backward sums the K/V
gradients over the group and keeps this rank's positions) and gives the causal mask of this rank's global query
positions against every key position; a mask that comes in (per-layer keep sets, learner/attention_mask.py) already
holds this rank's query rows against every key column. The one SDPA call below then runs unchanged, and padding
(the learner right-pads to a multiple of 2 x cp) stays behind every real query under the causal mask. One attention
module serves both. With Transformer Engine (GPU) the spec keeps TE's attention, which runs its own CP.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

from megatron_sparse_rl.parallel.context import GatherSequence, blocked_keys, cp_positions


def _dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


def check_sdpa_config(config) -> None:
    """ValueError naming the setting when `config`'s attention is not what `SDPAttention` computes."""
    problems = [name for name, bad in (
        ("apply_query_key_layer_scaling", config.apply_query_key_layer_scaling),
        (f"softmax_type {config.softmax_type!r}", config.softmax_type != "vanilla"),
        ("sliding-window attention (window_size)", config.window_size is not None),
    ) if bad]
    if problems:
        raise ValueError(f"learner.kernels: fast runs core attention through scaled_dot_product_attention, which "
                         f"does not support {', '.join(problems)}; use learner.kernels: local")


class SDPAttention(_dot_product_attention()):
    """`DotProductAttention` whose forward is one `scaled_dot_product_attention` call (module docstring)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        check_sdpa_config(config)
        parent_config = config
        if config.context_parallel_size > 1:  # the parent asserts cp == 1; this module does the CP itself
            parent_config = copy.copy(config)
            parent_config.context_parallel_size = 1
        super().__init__(parent_config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        self.config = config
        self.cp_group = getattr(self.pg_collection, "cp", None) if config.context_parallel_size > 1 else None
        if config.context_parallel_size > 1 and self.cp_group is None:
            raise ValueError("SDPAttention at context_parallel_size > 1 needs the context-parallel group in its "
                             "pg_collection")
        if v_channels is not None:  # MLA: the output is v_channels wide per head
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
            self.hidden_size_per_attention_head = v_channels

    def _global_keys(self, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, is_causal: bool):
        """The keys and values this rank's queries attend ([b, groups, sk, d]) and the mask between them. The
        context-parallel seam (module docstring); without context parallelism, the local ones unchanged."""
        if self.cp_group is None:
            return key, value, mask, is_causal
        key = GatherSequence.apply(key, self.cp_group, 2, True)
        value = GatherSequence.apply(value, self.cp_group, 2, True)
        if mask is None and is_causal:  # this rank's global query positions against every key position
            width = key.shape[2]
            mask = blocked_keys(cp_positions(width, self.cp_group.size(), self.cp_group.rank(), key.device), width)
            mask = mask[None, None]
        elif mask is not None and mask.shape[-1] != key.shape[2]:
            raise ValueError(f"at context_parallel_size > 1 an attention mask must cover every key position "
                             f"({key.shape[2]}), got {tuple(mask.shape)}")
        return key, value, mask, False

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """[sq, b, heads, d] query, [sk, b, groups, d] key / value, Megatron's bool mask or None -> [sq, b, heads * dv]."""
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention takes neither packed sequences nor an attention bias")
        sq, b, heads, _ = query.shape
        dv = value.shape[-1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        if dv < q.shape[-1]:  # MLA: flash kernels want one head width
            v = F.pad(v, (0, q.shape[-1] - dv))
        is_causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1
        k, v, mask, is_causal = self._global_keys(k, v, attention_mask, is_causal)
        dropout = self.attention_dropout.p if self.training else 0.0
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout and not self.config.sequence_parallel \
            else contextlib.nullcontext()
        with rng:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if mask is None else ~mask, dropout_p=dropout, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return out[..., :dv].permute(2, 0, 1, 3).reshape(sq, b, heads * dv)


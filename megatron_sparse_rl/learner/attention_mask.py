"""`LayerAttentionMasks`: a different attention mask per layer and per KV head inside Megatron's forward.

Megatron passes one attention mask to every layer. Replaying what a sparse (fixed-budget) KV cache kept
needs one per layer and KV head (`KVKeepRecord.attention_mask`), so the Learner passes the micro-batch's
whole per-layer mask as the `attention_mask` argument of its forward (Megatron hands it unchanged to every
layer's core attention), and a forward pre-hook on each local core-attention module replaces it with that
layer's slice. The mask travels with the call; the hooks hold no state:

    LayerAttentionMasks(model, tp_rank)               # once, by the Learner: hooks live with the model
    model(inputs, positions, blocked)                 # bool [b, layers, kv_heads, s, s], True = masked out
    model(inputs, positions, None)                    # Megatron's own causal mask (the hooks pass it through)

Heads: query head h of KV group g = h // (heads / kv_heads) (Megatron's GQA expansion); under tensor
parallelism this rank holds KV groups [tp_rank * g_local, (tp_rank + 1) * g_local). A mask with ONE KV head
applies to every query head on every rank: multi-head latent attention (DeepSeek-V3 / Kimi-K2), whose engine
keeps one set of latent rows per layer for all heads, records it that way. Layers: the global
index `layer_number - 1` (pipeline offsets included). Context parallelism (parallel.cp > 1): the Learner passes
the rows of this rank's query positions only ([b, layers, kv_heads, s / cp, s]: key positions stay global), which
`SDPAttention` applies against the K/V it gathers. Only Megatron's local (torch) DotProductAttention and its
subclasses are supported (learner.kernels fast: models/sdpa_attention.py, which hands the mask to SDPA): they take
any boolean mask; TE kernels take no per-head mask.
"""
from __future__ import annotations

import torch

_PER_LAYER = 5  # [b, layers, kv_heads, s, s]; Megatron's own masks have 4 dimensions


def hook_core_attention(model: torch.nn.Module, hook, *, what: str) -> list:
    """Register `hook` as a forward pre-hook (with kwargs) on every local core-attention module of `model`
    (Megatron's DotProductAttention and its subclasses); returns the handles. `what` names the caller's feature in
    the errors: TransformerEngine attention is refused, and so is a model without a local core attention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    handles = []
    for module in model.modules():
        if type(module).__name__ == "TEDotProductAttention":
            raise NotImplementedError(f"{what} needs Megatron's local DotProductAttention (TransformerEngine "
                                      f"attention takes no per-head mask and exposes no queries and keys)")
        if isinstance(module, DotProductAttention):
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    if not handles:
        raise ValueError(f"{what}: no DotProductAttention module found in the model")
    return handles


class LayerAttentionMasks:
    def __init__(self, model: torch.nn.Module, tp_rank: int):
        self._tp_rank = tp_rank
        self._handles = hook_core_attention(model, self._hook, what="per-layer attention masks")

    def _hook(self, module, args, kwargs):
        positional = len(args) > 3
        mask = args[3] if positional else kwargs.get("attention_mask")
        if mask is None or mask.dim() != _PER_LAYER:
            return None
        query = args[0]
        local = self._local(mask, module)  # [b, np_local, s (this rank's queries), s], True = masked out
        if local.shape[-2] != query.shape[0]:
            raise ValueError(f"attention mask covers {local.shape[-2]} positions, the forward has {query.shape[0]}")
        local = local.to(query.device)
        if positional:
            args = (*args[:3], local, *args[4:])
        else:
            kwargs = {**kwargs, "attention_mask": local}
        return args, kwargs

    def _local(self, mask: torch.Tensor, module) -> torch.Tensor:
        """[b, layers, kv_heads, s, s] -> this layer's and this TP rank's query heads [b, np_local, s, s]."""
        layer = module.layer_number - 1
        if layer >= mask.shape[1]:
            raise ValueError(f"attention mask must be [batch, layers, kv_heads, seq, seq] covering layer {layer} "
                             f"(got shape {tuple(mask.shape)})")
        heads = module.num_attention_heads_per_partition
        if mask.shape[2] == 1:  # one keep set for every head: MLA's shared latent rows (or a single KV head)
            return mask[:, layer, :1].expand(-1, heads, -1, -1)
        groups = module.num_query_groups_per_partition
        first = self._tp_rank * groups
        if mask.shape[2] < first + groups:
            raise ValueError(f"attention mask has {mask.shape[2]} KV heads; this rank needs KV heads "
                             f"{first}..{first + groups - 1}")
        per_group = heads // groups
        return mask[:, layer, first:first + groups].repeat_interleave(per_group, dim=1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def pad_causal(allowed: torch.Tensor, length: int) -> torch.Tensor:
    """Extend a [..., s, s] visibility mask to [..., length, length]; the added positions see causally."""
    s = allowed.shape[-1]
    if length == s:
        return allowed
    pos = torch.arange(length)
    out = (pos[None, :] <= pos[:, None]).expand(*allowed.shape[:-2], length, length).clone()
    out[..., :s, :s] = allowed
    return out

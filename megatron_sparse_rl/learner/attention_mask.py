"""`LayerAttentionMasks`: a different attention mask per layer and per KV head inside Megatron's forward.

Megatron passes one attention mask to every layer. Replaying what a sparse (fixed-budget) KV cache kept
needs one per layer and KV head (`KVKeepRecord.attention_mask`), so this object puts a forward pre-hook
on each local core-attention module that swaps in its layer's slice for the current micro-batch:

    masks = LayerAttentionMasks(model, tp_rank)       # owned by the Learner, hooks live with the model
    masks.current = allowed[index]                    # bool [b, layers, kv_heads, s, s], True = may attend
    ...forward...
    masks.current = None                              # back to Megatron's own causal mask

Heads: query head h of KV group g = h // (heads / kv_heads) (Megatron's GQA expansion); under tensor
parallelism this rank holds KV groups [tp_rank * g_local, (tp_rank + 1) * g_local). Layers: the global
index `layer_number - 1` (pipeline offsets included). Only Megatron's local (torch) DotProductAttention is
supported: it applies any boolean mask through `masked_fill`; fused/TE kernels take no per-head mask.
"""
from __future__ import annotations

import torch


class LayerAttentionMasks:
    def __init__(self, model: torch.nn.Module, tp_rank: int):
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        self.current: torch.Tensor | None = None
        self._tp_rank = tp_rank
        self._handles = []
        for module in model.modules():
            if type(module).__name__ == "TEDotProductAttention":
                raise NotImplementedError("per-layer attention masks need Megatron's local DotProductAttention "
                                          "(TransformerEngine attention takes no per-head mask)")
            if isinstance(module, DotProductAttention):
                self._handles.append(module.register_forward_pre_hook(self._hook, with_kwargs=True))
        if not self._handles:
            raise ValueError("no DotProductAttention module found in the model")

    def _hook(self, module, args, kwargs):
        if self.current is None:
            return None
        query = args[0]
        local = self._local(self.current, module)  # [b, np_local, s, s], True = may attend
        if local.shape[-1] != query.shape[0]:
            raise ValueError(f"attention mask covers {local.shape[-1]} positions, the forward has {query.shape[0]}")
        blocked = ~local.to(query.device)  # Megatron's convention: True = masked out
        if len(args) > 3:
            args = (*args[:3], blocked, *args[4:])
        else:
            kwargs = {**kwargs, "attention_mask": blocked}
        return args, kwargs

    def _local(self, allowed: torch.Tensor, module) -> torch.Tensor:
        """[b, layers, kv_heads, s, s] -> this layer's and this TP rank's query heads [b, np_local, s, s]."""
        layer = module.layer_number - 1
        if allowed.dim() != 5 or layer >= allowed.shape[1]:
            raise ValueError(f"attention mask must be [batch, layers, kv_heads, seq, seq] covering layer {layer} "
                             f"(got shape {tuple(allowed.shape)})")
        groups = module.num_query_groups_per_partition
        first = self._tp_rank * groups
        if allowed.shape[2] < first + groups:
            raise ValueError(f"attention mask has {allowed.shape[2]} KV heads; this rank needs KV heads "
                             f"{first}..{first + groups - 1}")
        per_group = module.num_attention_heads_per_partition // groups
        return allowed[:, layer, first:first + groups].repeat_interleave(per_group, dim=1)

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

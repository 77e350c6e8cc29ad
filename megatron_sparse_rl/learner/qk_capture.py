"""`QueryKeyCapture`: each layer's post-RoPE queries and keys from a learner forward, for the duration of one call.

A forward pre-hook on every core-attention module (Megatron's local DotProductAttention and its subclasses, as
learner/attention_mask.py hooks them) copies the `query` [s, b, heads, dim] and `key` [s, b, kv_heads, dim] it is
called with (RoPE applied, GQA not yet expanded), so a caller can run a policy on them
(training/sft_kv.py: sparsity-aware SFT):

    with QueryKeyCapture(learner.model) as capture:     # hooks live only inside the block
        learner.forward_logprobs(tokens)                 # no `lengths`: micro-batches are consecutive rows
    queries, keys = capture.layers()                     # [layers] of [B, heads, S, dim] / [B, kv_heads, S, dim]

The micro-batches' captures are joined in call order along the batch, so the call must run its rows in order at one
width (forward_logprobs without `lengths`) on one rank holding every head and layer: tensor, context and pipeline
parallelism 1 (validate refuses trainer.sft.kv_keep otherwise; `layers` checks the layers and the row count).
"""
from __future__ import annotations

import torch

from megatron_sparse_rl.learner.attention_mask import hook_core_attention


class QueryKeyCapture:
    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._handles = []
        self._calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __enter__(self) -> "QueryKeyCapture":
        self._handles = hook_core_attention(self._model, self._hook, what="QueryKeyCapture")
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, module, args, kwargs):
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        layer = module.layer_number - 1
        # [s, b, h, d] -> [b, h, s, d], off the autograd graph
        self._calls.setdefault(layer, []).append((query.detach().permute(1, 2, 0, 3).float().cpu(),
                                                  key.detach().permute(1, 2, 0, 3).float().cpu()))
        return None

    def layers(self, rows: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(queries, keys): one [B, heads, S, dim] / [B, kv_heads, S, dim] tensor per layer, layer order."""
        if not self._calls:
            raise RuntimeError("QueryKeyCapture saw no attention call")
        layers = sorted(self._calls)
        if layers != list(range(len(layers))):
            raise RuntimeError(f"QueryKeyCapture saw layers {layers}: every layer must run on this rank (pp = 1)")
        queries = [torch.cat([q for q, _ in self._calls[i]]) for i in layers]
        keys = [torch.cat([k for _, k in self._calls[i]]) for i in layers]
        if rows is not None and any(q.shape[0] != rows for q in queries):
            raise RuntimeError(f"QueryKeyCapture: captured {[q.shape[0] for q in queries]} rows per layer, the call "
                               f"had {rows} (run forward_logprobs without lengths, at pipeline parallelism 1)")
        return queries, keys

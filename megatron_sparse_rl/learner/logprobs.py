"""Token log-probabilities and entropy from vocab-parallel logits (no full-vocabulary gather under TP).

Logits are [..., vocab / tp] on each tensor-parallel rank. Log-probabilities go through Megatron's
`vocab_parallel_cross_entropy` (differentiable, custom backward); entropy is a metric and is computed
without gradient from three all-reduces (max, sum of exp, sum of p * logit).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, tp_group, chunk: int = 4096) -> torch.Tensor:
    """Entropy of softmax(logits) over the full vocabulary; logits [..., V/tp] -> [...]. fp32."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk):
        part = flat[start:start + chunk].float()
        m = part.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        e = torch.exp(part - m.unsqueeze(-1))
        s = e.sum(-1)
        pl = (e * part).sum(-1)
        both = torch.stack([s, pl])
        dist.all_reduce(both, group=tp_group)
        s, pl = both
        out[start:start + chunk] = m + torch.log(s) - pl / s
    return out.reshape(logits.shape[:-1])


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits / temperature)[target] over the full (TP-split) vocabulary; [b, s, V/tp] -> [b, s].
    `allowed`: optional bool [b, s, V/tp] (this rank's vocabulary slice): the softmax is restricted to the True
    ids (keep-sampling-mask); consumed (negated in place).

    Differentiable. Does not modify `logits`.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / temperature if temperature != 1.0 else logits.float().clone()
    if allowed is not None:  # in place on the copy: no second logits-sized tensor
        scaled = scaled.masked_fill_(allowed.logical_not_(), float("-inf"))
    # Megatron's kernel works in place on its input, hence the copy above.
    return -vocab_parallel_cross_entropy(scaled, targets)

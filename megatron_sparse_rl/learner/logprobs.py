"""Token log-probabilities and entropy from vocab-parallel logits (no full-vocabulary gather under TP).

Logits are [..., vocab / tp] on each tensor-parallel rank. Log-probabilities go through Megatron's
`vocab_parallel_cross_entropy` (differentiable, custom backward); entropy is a metric and is computed
without gradient from three all-reduces (max, sum of exp, sum of p * logit).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sparse_rl.parallel.context import GatherSequence, gather_sequence, split_sequence


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


def context_parallel_scores(logits: torch.Tensor, targets: torch.Tensor, length: int, groups, temperature: float,
                            allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) [b, length] at context parallelism: `logits` [b, W / cp, V/tp] hold this rank's positions
    (Megatron's load-balanced split) of the padded width W, `targets` [b, W] the next token of every position,
    `allowed` [b, length, V/tp] the sampling support or None. Each rank scores its own positions, then the group's
    pieces are gathered into sequence order, so every rank of the group holds the whole logprobs and entropy and
    computes the same loss from them (every aggregation and per-sequence sum sees whole sequences). The logprobs'
    gather keeps each rank's own positions of the gradient in the backward; the context-parallel gradient
    all-reduce sums the ranks."""
    cp, width = groups.cp, targets.shape[1]
    if allowed is not None:
        allowed = torch.nn.functional.pad(allowed, (0, 0, 0, width - length), value=True)  # padding: any id
        allowed = split_sequence(allowed, cp, 1).to(logits.device)
    local = vocab_parallel_logprobs(logits, split_sequence(targets, cp, 1).contiguous(), temperature, allowed)
    logprobs = GatherSequence.apply(local, cp, 1, False)[:, :length]
    entropy = gather_sequence(vocab_parallel_entropy(logits, groups.tp), cp, 1)[:, :length]
    return logprobs, entropy

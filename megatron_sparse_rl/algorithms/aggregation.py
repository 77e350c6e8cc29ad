"""Masked reductions and loss aggregation that add up exactly across micro-batches and DP ranks.

A loss over a batch is `sum(per-row contributions) / normalizer`, where the normalizer is computed
once from the FULL batch's (kept) mask: the global token count for `token_mean`, the global count of
sequences with at least one valid token for the two `seq_mean_*` modes. Because every row's
contribution depends on that row only, summing the losses of micro-batches (and of data-parallel
ranks, e.g. with gradients all-reduced by SUM) gives exactly the full-batch loss and gradient.

    norm = loss_normalizer(mask, "token_mean")                # whole batch on one rank
    norm = loss_normalizer(local_mask, "token_mean", group=dp) # all-reduced over the DP group
"""
from __future__ import annotations

import torch
import torch.distributed as dist

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise KeyError(f"unknown aggregation {mode!r}; choices: {list(AGGREGATIONS)}")


def global_sum(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of `x` over the ranks of `group` (the local value when `group` is None). No grad."""
    if group is None:
        return x
    x = x.detach().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def loss_normalizer(mask: torch.Tensor, mode: str, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Normalizer for `aggregate`: token count (token_mean) or count of non-empty sequences.

    mask: [batch, tokens] bool/0-1, the mask the loss will use (response mask AND corrections' keep).
    Pass the full batch's mask (before splitting into micro-batches), or the rank-local mask with the
    data-parallel `group` so the counts are summed over ranks. Returns a float scalar tensor.
    """
    _check_mode(mode)
    mask = mask.bool()
    count = mask.sum() if mode == "token_mean" else mask.any(dim=-1).sum()
    return global_sum(count.to(torch.float32), group)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where `mask`; masked entries (even inf/NaN) contribute exactly 0."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask`; 0 (not NaN) when the mask is empty."""
    mask = mask.bool()
    return masked_sum(values, mask) / mask.sum().clamp(min=1).to(values.dtype)


def masked_max(values: torch.Tensor, mask: torch.Tensor, empty: float = 0.0) -> torch.Tensor:
    """Max of `values` where `mask`; `empty` when the mask is empty."""
    fill = torch.full((), empty, dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return fill
    mask = mask.bool()
    out = torch.where(mask, values, torch.full_like(fill, float("-inf"))).max()
    return torch.where(mask.any(), out, fill)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: torch.Tensor | float,
              counted: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token values [batch, tokens] to this micro-batch's share of the batch loss.

    token_mean:          sum_{i,t} m v / normalizer                      (normalizer = global token count)
    seq_mean_token_mean: sum_i (sum_t m v / sum_t c) / normalizer        (normalizer = global seq count)
    seq_mean_token_sum:  sum_{i,t} m v / normalizer                      (normalizer = global seq count)
    c = `counted` [batch, tokens], the tokens each sequence's mean divides by (default: `mask`); a superset of
    the mask keeps tokens that add nothing in the denominator (algorithm.loss.dropped_tokens_in_denominator,
    with the normalizer taken over the same `counted`). A normalizer of 0 (everything masked) is treated as 1,
    so the loss is 0, never NaN.
    """
    _check_mode(mode)
    mask = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    masked = torch.where(mask, values, zero)
    if mode == "seq_mean_token_mean":
        per_seq_count = (mask if counted is None else counted.bool()).sum(dim=-1)
        per_seq = masked.sum(dim=-1) / per_seq_count.clamp(min=1).to(values.dtype)
        total = per_seq.sum()
    else:
        total = masked.sum()
    if isinstance(normalizer, torch.Tensor):
        return total / normalizer.to(values.dtype).clamp(min=1)
    return total / max(float(normalizer), 1.0)

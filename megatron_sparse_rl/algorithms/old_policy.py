"""pi_old from the inference engine: the mean in probability space of n re-scorings of a sampled sequence.

An MoE engine's logprobs are noisy (batch composition changes kernels and, through ties, expert choices), so
one scoring is a noisy estimate of pi_old. KAT-Coder's estimator (from the stability survey) averages n
scorings of the same sequence with the same weights in probability space:

    log pi_old(y_t) = log( (1/n) sum_j exp(lp_j(y_t)) ) = logsumexp_j lp_j(y_t) - log n

    old, metrics = engine_mean_logprobs(scorings, mask)   # scorings [n, B, T], mask [B, T]

Pure tensor math, no grad, no host sync; metrics are scalar tensors.
"""
from __future__ import annotations

import math

import torch

from megatron_sparse_rl.algorithms.aggregation import masked_max, masked_mean


@torch.no_grad()
def engine_mean_logprobs(scorings: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(log of the mean probability over the n scorings [B, T], spread metrics).

    scorings: float [n, B, T] logprobs of the same tokens from n engine scorings (any finite values where mask
    is false are ignored; they come back as 0). mask: bool [B, T], the scored response tokens.
    Metrics: `old_logprobs/rescore_std` (mean over tokens of the std of the n logprobs, 0 for n = 1),
    `old_logprobs/rescore_range_max` (largest max - min over tokens).
    """
    if scorings.dim() != 3 or scorings.shape[1:] != mask.shape:
        raise ValueError(f"scorings must be [n, B, T] with [B, T] = mask's {tuple(mask.shape)} "
                         f"(got {tuple(scorings.shape)})")
    n = scorings.shape[0]
    mask = mask.bool()
    x = scorings.to(torch.float64)
    old = (torch.logsumexp(x, dim=0) - math.log(n)).to(scorings.dtype)
    zero = torch.zeros((), dtype=scorings.dtype)
    old = torch.where(mask, old, zero)
    std = x.std(dim=0, unbiased=False).to(scorings.dtype)
    spread = (x.amax(dim=0) - x.amin(dim=0)).to(scorings.dtype)
    metrics = {"old_logprobs/rescore_std": masked_mean(std, mask),
               "old_logprobs/rescore_range_max": masked_max(spread, mask)}
    return old, metrics

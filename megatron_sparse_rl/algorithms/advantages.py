"""Group-relative advantages: GRPO (with or without std division, Dr.GRPO) and leave-one-out (RLOO).

Inputs are flat: rewards [n] and group_ids [n] (arbitrary integers, not necessarily contiguous or
sorted; samples of one prompt share an id). Outputs are advantages [n], one per sequence (broadcast
over tokens by the losses). A group whose rewards are all equal, or a group of one, gets exactly 0.

Papers: GRPO arXiv 2402.03300, Dr.GRPO 2503.20783, RLOO 2402.14740.
"""
from __future__ import annotations

import torch

from megatron_sparse_rl.config.algorithm import AdvantageConfig


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense index 0..G-1 per sample, and G."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample group size, group sum, and whether the sample's group has a single reward value."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards and group_ids must both be [n] (got {tuple(rewards.shape)} and "
                         f"{tuple(group_ids.shape)})")
    index, groups = _group_index(group_ids)
    count = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, index,
                                                                                    torch.ones_like(rewards))
    total = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, index, rewards)
    high = torch.full((groups,), float("-inf"), dtype=rewards.dtype, device=rewards.device)
    low = torch.full((groups,), float("inf"), dtype=rewards.dtype, device=rewards.device)
    high = high.scatter_reduce(0, index, rewards, reduce="amax")
    low = low.scatter_reduce(0, index, rewards, reduce="amin")
    constant = (high == low)[index]
    return index, count, total, constant


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_by_std: bool = True,
                    std_unbiased: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (R_i - mean_G R) / (std_G R + eps); without std division when `scale_by_std` is False.

    rewards: [n] float; group_ids: [n] int. Returns [n] in the rewards' dtype.
    """
    index, count, total, constant = _group_stats(rewards, group_ids)
    centred = rewards - (total / count)[index]
    if scale_by_std:
        sq = torch.zeros_like(count).index_add_(0, index, centred * centred)
        dof = (count - 1).clamp(min=1) if std_unbiased else count
        std = (sq / dof).sqrt()[index]
        centred = centred / (std + eps)
    # exactly zero, not rounding noise divided by eps, when every reward of the group is the same
    return torch.where(constant, torch.zeros_like(centred), centred)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = R_i - (sum_G R - R_i) / (G - 1): the mean of the other samples as the baseline; 0 if G = 1."""
    index, count, total, constant = _group_stats(rewards, group_ids)
    size = count[index]
    adv = rewards - (total[index] - rewards) / (size - 1).clamp(min=1)
    return torch.where(constant | (size < 2), torch.zeros_like(adv), adv)


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, cfg: AdvantageConfig) -> torch.Tensor:
    """Advantages [n] for the configured estimator."""
    if cfg.estimator == "grpo":
        return grpo_advantages(rewards, group_ids, scale_by_std=cfg.scale_by_std, std_unbiased=cfg.std_unbiased,
                               eps=cfg.eps)
    if cfg.estimator == "rloo":
        return rloo_advantages(rewards, group_ids)
    raise KeyError(f"unknown advantage estimator {cfg.estimator!r}; choices: ['grpo', 'rloo']")

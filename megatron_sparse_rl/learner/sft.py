"""Supervised fine-tuning loss: masked token cross-entropy normalised by the GLOBAL count of target tokens,
so micro-batches and data-parallel ranks sum to the full-batch mean."""
from __future__ import annotations

import torch


def make_sft_loss(loss_mask: torch.Tensor, num_global_tokens: int | float):
    """Loss function for `Learner.train_step`: loss_mask [B, S-1] (1 on target tokens) of this rank's batch."""
    denom = max(float(num_global_tokens), 1.0)

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, index: torch.Tensor):
        mask = loss_mask[index].to(logprobs.device, logprobs.dtype)
        nll = -(logprobs * mask).sum() / denom
        return nll, {"tokens": mask.sum().detach()}

    return loss_fn

"""`LearnerBatch`: a rollout batch in the learner's token layout, every per-token field shifted once.

    view = LearnerBatch.from_rollout(batch, pad_id)   # tokens [B, T]; every per-token field [B, T-1]

`tokens` [B, T] is prompt + response, right-padded; the learner's outputs are [B, T-1], where column t scores token
t + 1. A rollout batch keeps its per-token fields per response token, [B, R] (rollout/batch.py `RolloutBatch`);
`from_rollout` places column r of row i at column prompt_lens[i] - 1 + r, here and nowhere else. What is not per
token (rewards, groups, routes, indexer rows, keep records, the sampling support) is read from `rollout`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sparse_rl.rollout.batch import RolloutBatch


@dataclass(frozen=True)
class LearnerBatch:
    """One rank's rollout batch as the learner reads it (`from_rollout`)."""

    rollout: RolloutBatch
    tokens: torch.Tensor
    """int64 [B, T]: prompt + response, right-padded with the pad id."""
    lengths: torch.Tensor
    """int64 [B]: real tokens per row (prompt + response)."""
    loss_mask: torch.Tensor
    """bool [B, T-1]: the model's tokens, which the loss, the corrections and the mismatch metrics read: every
    response token, or those `RolloutBatch.loss_mask` marks (episodes)."""
    rollout_logprobs: torch.Tensor
    """float32 [B, T-1]: the sampler's logprob mu of each response token (0 elsewhere)."""
    env_tokens: torch.Tensor | None = None
    """bool [B, T-1]: the environment's tokens inside the response (episodes with a loss mask), else None."""
    rescored_logprobs: torch.Tensor | None = None
    """float32 [S, B, T-1]: the engine's S re-scorings of each response token (algorithm.old_logprobs =
    engine_mean), else None."""
    token_version: torch.Tensor | None = None
    """float32 [B, T-1]: the weight version that sampled each response token (asynchronous RL), else None."""

    @classmethod
    def from_rollout(cls, batch: RolloutBatch, pad_id: int) -> LearnerBatch:
        tokens, _, response_positions = batch.sequences(pad_id)
        shape = (tokens.shape[0], tokens.shape[1] - 1)

        def shifted(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else _shifted(batch, values, shape)

        mask = response_positions[:, 1:]
        env = None
        if batch.loss_mask is not None:  # episodes: the environment's tokens stay in `tokens`, out of the loss
            mask = shifted(batch.loss_mask) > 0
            env = shifted(batch.response_mask & ~batch.loss_mask) > 0
        rescored = batch.rescored_logprobs
        if rescored is not None:
            rescored = torch.stack([shifted(rescored[:, j]) for j in range(rescored.shape[1])])
        return cls(batch, tokens, batch.prompt_lens + batch.response_mask.sum(dim=1), mask,
                   shifted(batch.rollout_logprobs), env_tokens=env, rescored_logprobs=rescored,
                   token_version=shifted(batch.token_version))


def _shifted(batch: RolloutBatch, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Per-response-token `values` [B, R] placed in the learner's layout `shape` [B, T-1] as float32 (0 elsewhere)."""
    out = torch.zeros(shape, dtype=torch.float32)
    rows, cols = torch.nonzero(batch.response_mask, as_tuple=True)
    out[rows, batch.prompt_lens[rows] - 1 + cols] = values[rows, cols].float()
    return out

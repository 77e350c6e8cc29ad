"""Metrics of rollouts generated with a sparse (fixed-budget) KV cache.

Learner column t scores token t + 1 with the query at position t; in the engine that query attended to
the compressed cache iff t >= the sample's first compaction length. Splitting the k1 mismatch
(log mu - log pi_old, the learner being dense) at that point separates what compression added from the
engine-vs-learner numerics present before it:
  kv/k1_after_compression - kv/k1_before_compression = compression-induced logprob delta.
"""
from __future__ import annotations

import torch

from megatron_sparse_rl.rollout.batch import RolloutBatch


def kv_metrics(batch: RolloutBatch, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
               mask: torch.Tensor, budget: int) -> dict[str, float]:
    """Retention, compaction and preemption rates and the k1 mismatch before/after the first compaction."""
    records = batch.kv_keep
    if records is None:
        raise ValueError("rollout.kv.policy is set but the rollout batch carries no kv_keep records")
    lengths = (batch.prompt_lens + batch.response_mask.sum(dim=1)).tolist()
    first = torch.tensor([r.lengths[0] if r.lengths else 10**9 for r in records])
    cols = torch.arange(mask.shape[1])[None, :]
    after = mask.bool() & (cols >= first[:, None])
    before = mask.bool() & ~after
    k1 = (rollout_logprobs - old_logprobs).double()

    def mean(sel: torch.Tensor) -> float:
        return float(k1[sel].mean()) if sel.any() else 0.0

    retention = [min(1.0, (budget + n - r.lengths[-1]) / n) if r.lengths else 1.0 for r, n in zip(records, lengths)]
    k1_before, k1_after = mean(before), mean(after)
    return {
        "kv/compressed_frac": sum(bool(r.lengths) for r in records) / len(records),
        "kv/compactions_per_sample": sum(len(r.lengths) for r in records) / len(records),
        "kv/retention": sum(retention) / len(retention),
        "kv/preempted_frac": sum(r.preempted for r in records) / len(records),
        "kv/tokens_after_compression_frac": float(after.sum()) / max(float(mask.sum()), 1.0),
        "kv/k1_before_compression": k1_before,
        "kv/k1_after_compression": k1_after,
        "kv/compression_logprob_delta": k1_after - k1_before if after.any() else 0.0,
    }

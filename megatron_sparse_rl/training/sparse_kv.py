"""Metrics of rollouts generated with a sparse (fixed-budget) KV cache.

Learner column t scores token t + 1 with the query at position t; in the engine that query attended to
the compressed cache iff t >= the sample's first compaction length (in a multi-turn episode, not on the queries a
later turn's dense prefill computed: `KVKeepRecord.compressed_queries`). Splitting the k1 mismatch
(log mu - log pi_old, the learner being dense) at that point separates what compression added from the
engine-vs-learner numerics present before it:
  kv/k1_after_compression - kv/k1_before_compression = compression-induced logprob delta.
With `rollout.kv.record_keep` the learner also recomputes pi_sparse exactly (the engine's kept KV as a
per-layer, per-head attention mask), which splits the mismatch after compression without that estimate:
  kv/k1_after_compression = kv/k1_sparse_numerics (log mu - log pi_sparse: engine vs learner kernels)
                          + kv/k1_sparse_compression (log pi_sparse - log pi_old: what the dropped KV changed).
A compressed sample that vLLM preempted was recomputed densely from its tokens and went on sampling from a cache
that is neither its compressed one nor a dense one: `drop_preempted` takes it out of the loss (training/update.py
`prepare` applies it to every batch that carries keep records).
"""
from __future__ import annotations

import torch

from megatron_sparse_rl.kv.record import batch_replays
from megatron_sparse_rl.learner.extras import ForwardExtras
from megatron_sparse_rl.rollout.batch import RolloutBatch


def sparse_logprobs(learner, batch: RolloutBatch, tokens: torch.Tensor,
                    sampling_support=None) -> torch.Tensor | None:
    """pi_sparse [B, T-1]: the learner's logprobs under what the engine's sparse cache kept (None when no
    sample was compacted), renormalised over `sampling_support` when given, like pi_old. One forward for
    single-turn rollouts; an episode batch takes one per compacted turn (+ a causal one), each scoring the columns
    it replays exactly (kv/record.py `batch_replays`). Needs the full records (`rollout.kv.record_keep`)."""
    replays = batch_replays(batch.features.kv_keep, tokens.shape[1] - 1)
    if not replays:
        return None
    lengths = batch.prompt_lens + batch.response_mask.sum(dim=1)
    out = None
    for allowed, columns in replays:
        extras = ForwardExtras(sampling_support=sampling_support, attention_mask=allowed)
        logprobs = learner.forward_logprobs(tokens, lengths=lengths, extras=extras)["logprobs"]
        out = logprobs if out is None else torch.where(columns.to(logprobs.device), logprobs, out)
    return out


def kv_metrics(batch: RolloutBatch, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
               mask: torch.Tensor, budget: int, sparse: torch.Tensor | None = None) -> dict[str, float]:
    """Retention, compaction and preemption rates and the k1 mismatch before/after the first compaction;
    with `sparse` (pi_sparse recomputed by the learner) the exact split of the mismatch after it.
    `kv/retention`: mean over samples of the share of the final sequence's KV the cache holds at its end (budget + the
    tokens after the last compaction, over the length; 1 for a sample never compacted); `kv/saved_frac` = 1 - that,
    the KV saved; `kv/budget`: the budget the batch was sampled at (`budget`)."""
    records = batch.features.kv_keep
    if records is None:
        raise ValueError("rollout.kv.policy is set but the rollout batch carries no kv_keep records")
    lengths = (batch.prompt_lens + batch.response_mask.sum(dim=1)).tolist()
    compressed = torch.stack([r.compressed_queries(mask.shape[1]) for r in records])
    after = mask.bool() & compressed
    before = mask.bool() & ~after

    def mean(delta: torch.Tensor, sel: torch.Tensor) -> float:
        return float(delta.double()[sel].mean()) if sel.any() else 0.0

    retention = [min(1.0, (budget + n - r.lengths[-1]) / n) if r.lengths else 1.0 for r, n in zip(records, lengths)]
    k1 = rollout_logprobs - old_logprobs
    k1_before, k1_after = mean(k1, before), mean(k1, after)
    split = {}
    if sparse is not None:
        split = {"kv/k1_sparse_numerics": mean(rollout_logprobs - sparse, after),
                 "kv/k1_sparse_compression": mean(sparse - old_logprobs, after)}
    return {
        **split,
        "kv/budget": float(budget),
        "kv/saved_frac": 1.0 - sum(retention) / len(retention),
        "kv/compressed_frac": sum(bool(r.lengths) for r in records) / len(records),
        "kv/compactions_per_sample": sum(len(r.lengths) for r in records) / len(records),
        "kv/retention": sum(retention) / len(retention),
        "kv/preempted_frac": sum(r.preempted for r in records) / len(records),
        "kv/tokens_after_compression_frac": float(after.sum()) / max(float(mask.sum()), 1.0),
        "kv/k1_before_compression": k1_before,
        "kv/k1_after_compression": k1_after,
        "kv/compression_logprob_delta": k1_after - k1_before if after.any() else 0.0,
    }


def drop_preempted(mask: torch.Tensor, records) -> tuple[torch.Tensor, float]:
    """(`mask` [B, T-1] with the rows of preempted compressed samples cleared, their share of the rows). Their
    advantage still entered their group's baseline; only their own tokens stop training."""
    flagged = torch.tensor([bool(r.preempted) for r in records], dtype=torch.bool)
    if len(flagged) != mask.shape[0]:
        raise ValueError(f"{len(flagged)} keep records for {mask.shape[0]} rows")
    return mask & ~flagged[:, None], float(flagged.float().mean()) if len(flagged) else 0.0

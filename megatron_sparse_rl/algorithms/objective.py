"""The RL objective of one micro-batch, composed over tensors: the policy loss with its corrections' weights, the
corrections that read the current policy (OPSM, TIS with ratio pi_theta), and the KL term.

    x = ObjectiveInputs(mask, counted, old, rollout, loss_mask, advantages, weights, ref_logprobs=ref)
    loss, sums = rl_objective(logprobs, entropy, x, cfg, normalizer)
    total = sums_a + sums_b                # micro-batches, updates: sums add
    total.all_reduce(dp_group).means()     # {"loss/clip_frac": ..., "train/tokens": ..., "opsm/masked_seq_frac": ...}

Every tensor is one micro-batch's rows in the learner's layout ([b, T-1]; `advantages` [b]) on the device of
`logprobs`. `ObjectiveSums` carries the micro-batch's metrics as sums: each per-token mean times the tokens it
averages over, and the counts, so that micro-batches, updates and data-parallel ranks reduce by adding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_sparse_rl.algorithms.aggregation import global_sum
from megatron_sparse_rl.algorithms.corrections import correction_inputs, opsm_keep, tis_correction
from megatron_sparse_rl.algorithms.kl import kl_loss
from megatron_sparse_rl.algorithms.losses import policy_loss
from megatron_sparse_rl.config.algorithm import AlgorithmConfig, CorrectionsConfig


@dataclass(frozen=True)
class ObjectiveInputs:
    """What the objective reads besides the current policy's logprobs and entropy."""

    mask: torch.Tensor
    """bool: the tokens trained (after the rollout-time corrections)."""
    counted: torch.Tensor
    """bool: the tokens the loss's denominators count (algorithm.loss.dropped_tokens_in_denominator)."""
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    loss_mask: torch.Tensor
    """bool: the model's tokens, before corrections (OPSM's per-sequence mean reads it)."""
    advantages: torch.Tensor
    weights: torch.Tensor
    """The rollout-time correction weights."""
    ref_logprobs: torch.Tensor | None = None
    """The reference model's logprobs (algorithm.kl.coef > 0), else None."""


@dataclass(frozen=True, slots=True)
class ObjectiveSums:
    """The objective's metrics as sums (tensors or floats): `weighted[k]` = the per-token mean of metric k times
    `counts["n"]`, the tokens trained; `counts`: n, and with OPSM opsm/masked_seqs and opsm/seqs (sequences)."""

    weighted: dict[str, Any]
    counts: dict[str, Any]

    def __add__(self, other: "ObjectiveSums") -> "ObjectiveSums":
        if set(self.weighted) != set(other.weighted) or set(self.counts) != set(other.counts):
            raise ValueError(f"cannot add the objective's sums of different metrics: {sorted(self.weighted)} + "
                             f"{sorted(self.counts)} vs {sorted(other.weighted)} + {sorted(other.counts)}")
        return ObjectiveSums({k: v + other.weighted[k] for k, v in self.weighted.items()},
                             {k: v + other.counts[k] for k, v in self.counts.items()})

    def all_reduce(self, group) -> "ObjectiveSums":
        """Summed over the ranks of `group` (None: as they are), as host floats."""
        weighted, counts = sorted(self.weighted), sorted(self.counts)
        values = torch.tensor([float(self.weighted[k]) for k in weighted] + [float(self.counts[k]) for k in counts],
                              dtype=torch.float64)
        values = global_sum(values, group).tolist()
        return ObjectiveSums(dict(zip(weighted, values)), dict(zip(counts, values[len(weighted):])))

    def means(self) -> dict[str, float]:
        """The step's metrics: loss/<k> = the token mean of each metric, train/tokens = n, and with OPSM
        opsm/masked_seq_frac = the share of sequences its rule dropped."""
        n = float(self.counts.get("n", 0.0))
        out = {f"loss/{k}": float(v) / max(n, 1.0) for k, v in self.weighted.items()}
        out["train/tokens"] = n
        if "opsm/seqs" in self.counts:
            out["opsm/masked_seq_frac"] = float(self.counts["opsm/masked_seqs"]) / max(float(self.counts["opsm/seqs"]), 1.0)
        return out


def current_tis(cfg: CorrectionsConfig) -> bool:
    """TIS with ratio pi_theta: its factor uses the current policy, so it runs here rather than at rollout time."""
    return cfg.tis.enabled and cfg.tis.ratio == "pi_theta"


def rl_objective(logprobs: torch.Tensor, entropy: torch.Tensor, x: ObjectiveInputs, cfg: AlgorithmConfig,
                 normalizer: torch.Tensor) -> tuple[torch.Tensor, ObjectiveSums]:
    """(loss, sums). With OPSM on, the sequences its rule drops under the current (detached) logprobs
    leave the policy term (not the KL term, which DeepSeek-V3.2 keeps outside the mask); `normalizer` (from the whole
    mini-batch) still counts them. With TIS ratio pi_theta, its factor min(rho_t, C / r_t) multiplies the policy
    term's weights only; the KL term keeps the rollout-time weights (algorithm.kl.correction_weights; off: none).
    The sums (detached): each metric's mean over the kept tokens times their count `n`, and the counts."""
    opsm, mask, counts = cfg.corrections.opsm, x.mask, {}
    weights, extra = x.weights, {}
    if opsm.enabled:
        keep = opsm_keep(opsm, x.rollout_logprobs, logprobs, x.loss_mask, x.advantages)
        seqs = mask.any(dim=-1)
        counts = {"opsm/masked_seqs": (seqs & ~keep.squeeze(-1)).sum().float(), "opsm/seqs": seqs.sum().float()}
        mask = mask & keep
    if current_tis(cfg.corrections):
        inputs, _ = correction_inputs(x.old_logprobs, x.rollout_logprobs, mask, logprobs=logprobs)
        current = tis_correction(cfg.corrections.tis, inputs)
        weights, extra = weights * current.weights.to(weights.dtype), current.metrics
    loss, metrics = policy_loss(logprobs, x.old_logprobs, x.advantages, mask, cfg=cfg.loss, normalizer=normalizer,
                                weights=weights, entropy=entropy, counted=x.counted)
    metrics = {**metrics, **extra}
    if x.ref_logprobs is not None:
        kl, kl_metrics = kl_loss(logprobs, x.ref_logprobs, x.mask, cfg=cfg.kl, aggregation=cfg.loss.aggregation,
                                 normalizer=normalizer, old_logprobs=x.old_logprobs,
                                 weights=x.weights if cfg.kl.correction_weights else None, counted=x.counted)
        loss = loss + kl
        metrics = {**metrics, **kl_metrics}
    n = mask.sum().float()
    return loss, ObjectiveSums({k: v.detach().float() * n for k, v in metrics.items()}, {**counts, "n": n})

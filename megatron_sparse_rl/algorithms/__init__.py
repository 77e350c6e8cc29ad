"""RL algorithms as pure tensor math (no Megatron, no vLLM): advantages, policy losses, corrections for
the sampler/learner mismatch, KL estimators, keep-sampling-mask and mismatch metrics.

A training step on one batch (padded [batch, tokens] tensors):

    adv = compute_advantages(rewards, group_ids, cfg=cfg.advantage)
    corr = apply_corrections(cfg.corrections, old_logprobs, rollout_logprobs, mask, advantages=adv)
    train_mask = mask & corr.keep
    norm = loss_normalizer(train_mask, cfg.loss.aggregation)       # full batch, or group=dp
    for mb in micro_batches:                                         # losses of micro-batches add up
        loss, metrics = policy_loss(lp[mb], old_logprobs[mb], adv[mb], train_mask[mb],
                                    cfg=cfg.loss, normalizer=norm, weights=corr.weights[mb])
"""
from megatron_sparse_rl.algorithms.advantages import compute_advantages, grpo_advantages, rloo_advantages
from megatron_sparse_rl.algorithms.aggregation import (
    AGGREGATIONS, aggregate, global_sum, loss_normalizer, masked_max, masked_mean, masked_sum,
)
from megatron_sparse_rl.algorithms.corrections import (
    CORRECTIONS, CorrectionInputs, CorrectionResult, apply_corrections, batch_skip_correction,
    correction_inputs, geo_rs_correction, icepop_correction, mis_correction, opsm_correction, opsm_keep,
    sparse_rl_correction, tis_correction, veto_correction,
)
from megatron_sparse_rl.algorithms.kl import (
    KL_ESTIMATORS, k3_from_log_ratio, kl_k1, kl_k2, kl_k3, kl_loss, unbiased_kl,
)
from megatron_sparse_rl.algorithms.losses import (
    POLICY_LOSSES, cispo_loss, dapo_loss, dual_clip_loss, get_policy_loss, grpo_loss, gspo_loss, gspo_token_loss,
    policy_loss,
)
from megatron_sparse_rl.algorithms.metrics import mismatch_metrics, routing_attribution, tail_metrics
from megatron_sparse_rl.algorithms.old_policy import engine_mean_logprobs
from megatron_sparse_rl.algorithms.sampling_mask import keep_set_to_mask, masked_log_softmax, masked_token_logprobs

__all__ = [
    "AGGREGATIONS", "CORRECTIONS", "CorrectionInputs", "CorrectionResult", "KL_ESTIMATORS", "POLICY_LOSSES",
    "aggregate", "apply_corrections", "batch_skip_correction", "cispo_loss", "compute_advantages",
    "correction_inputs", "dapo_loss", "dual_clip_loss", "engine_mean_logprobs", "geo_rs_correction", "get_policy_loss", "global_sum",
    "grpo_advantages", "grpo_loss", "gspo_loss", "gspo_token_loss", "icepop_correction", "k3_from_log_ratio",
    "keep_set_to_mask", "kl_k1", "kl_k2", "kl_k3", "kl_loss", "loss_normalizer", "masked_log_softmax", "masked_max",
    "masked_mean",
    "masked_sum", "masked_token_logprobs", "mis_correction", "mismatch_metrics", "opsm_correction", "opsm_keep",
    "policy_loss", "rloo_advantages", "routing_attribution", "sparse_rl_correction", "tail_metrics", "tis_correction",
    "unbiased_kl", "veto_correction",
]

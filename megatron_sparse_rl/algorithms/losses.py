"""Policy losses: PPO-clip family (GRPO, DAPO, dual-clip), GSPO, GSPO-token and CISPO, and their registry.

Every loss has the same signature and is a pure function (no host sync, metrics stay tensors):

    loss, metrics = fn(logprobs, old_logprobs, advantages, mask, *, cfg, normalizer, weights=None, entropy=None,
                       counted=None)

Shapes: logprobs, old_logprobs, mask, weights, entropy: [batch, tokens], right-padded, `mask` true on
response tokens to train on (response mask AND the corrections' keep mask). advantages: [batch]
(one per sequence) or [batch, tokens]. normalizer: from `aggregation.loss_normalizer` on the full
batch's mask for `cfg.aggregation`, so micro-batch and DP-rank losses sum to the full-batch loss.
weights: correction coefficients (no grad), applied outside the clip: l_t = w_t * surrogate_t.
counted: [batch, tokens] bool, a superset of `mask` whose extra tokens add 0 but count in each sequence's token
count under seq_mean_token_mean (`aggregation.aggregate`; algorithm.loss.dropped_tokens_in_denominator); None: mask.
cfg: `LossConfig`; clip bounds come from `cfg.clip_bounds(name)` of the loss actually called.

Papers: GRPO arXiv 2402.03300, DAPO 2503.14476, dual-clip PPO 1912.09729, GSPO 2507.18071,
CISPO (MiniMax-M1) 2506.13585.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_sparse_rl.algorithms.aggregation import aggregate, masked_max, masked_mean
from megatron_sparse_rl.algorithms.kl import k3_from_log_ratio
from megatron_sparse_rl.config.algorithm import LossConfig

Metrics = dict[str, torch.Tensor]
PolicyLoss = Callable[..., tuple[torch.Tensor, Metrics]]

# exp() of a larger log-ratio overflows float32; the clip makes such tokens irrelevant anyway. Applied to each
# token's log r_t in the PPO family and CISPO, and to GSPO's sequence mean (never to the tokens inside it).
_LOG_RATIO_CLAMP = 20.0


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    return advantages.to(like.dtype).expand_as(like)


def _inputs(logprobs, old_logprobs, advantages, mask, weights):
    """(mask, unclamped log r_t, token advantages, weights), each [batch, tokens] and 0 off the mask (padding
    may hold inf/NaN: never used). Callers clamp the log-ratio where they exponentiate it."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(mask, logprobs - old_logprobs, zero)
    adv = torch.where(mask, _token_advantages(advantages, logprobs), zero)
    w = torch.ones_like(logprobs) if weights is None else torch.where(mask, weights.to(logprobs.dtype), zero)
    return mask, log_ratio, adv, w.detach()


def _clamped(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _clip_surrogate(ratio, adv, low, high, dual_c=None):
    """PPO token loss -min(r A, clip(r) A) (and the dual-clip cap -c A for A < 0), with clip masks."""
    clipped = ratio.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(-ratio * adv, -clipped * adv)
    clip_low = (ratio < 1.0 - low) & (adv < 0)
    clip_high = (ratio > 1.0 + high) & (adv > 0)
    dual = torch.zeros_like(clip_low)
    if dual_c is not None:
        dual = (adv < 0) & (-ratio * adv > -dual_c * adv)
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_c * adv), loss)
    return loss, clip_low, clip_high, dual


def _metrics(ratio, log_ratio, mask, clip_low, clip_high, entropy, dual=None) -> Metrics:
    with torch.no_grad():
        m = {
            "clip_frac_low": masked_mean(clip_low.to(ratio.dtype), mask),
            "clip_frac_high": masked_mean(clip_high.to(ratio.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": masked_max(ratio, mask),
            # samples come from pi_old: k1 = log(pi_old / pi_theta), k3 = r - 1 - log r.
            "kl_k1": masked_mean(-log_ratio, mask),
            "kl_k3": masked_mean(k3_from_log_ratio(log_ratio), mask),
        }
        if dual is not None:
            m["dual_clip_frac"] = masked_mean(dual.to(ratio.dtype), mask)
        if entropy is not None:
            m["entropy"] = masked_mean(entropy.to(ratio.dtype), mask)
    return m


def _ppo_family(name, logprobs, old_logprobs, advantages, mask, cfg, normalizer, weights, entropy, counted,
                dual_c=None):
    low, high = cfg.clip_bounds(name)
    mask, log_ratio, adv, w = _inputs(logprobs, old_logprobs, advantages, mask, weights)
    log_ratio = _clamped(log_ratio)
    ratio = torch.exp(log_ratio)
    token_loss, clip_low, clip_high, dual = _clip_surrogate(ratio, adv, low, high, dual_c)
    loss = aggregate(w * token_loss, mask, cfg.aggregation, normalizer, counted)
    metrics = _metrics(ratio, log_ratio, mask, clip_low, clip_high, entropy, dual if dual_c is not None else None)
    return loss, metrics


def grpo_loss(logprobs, old_logprobs, advantages, mask, *, cfg: LossConfig, normalizer, weights=None, entropy=None,
              counted=None):
    """GRPO/PPO token clip: l_t = -w_t min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A), r_t = pi_theta/pi_old.

    No cap for A < 0: the term grows with r_t (verl's default PPO loss caps it at -3 A: that is `dual_clip`)."""
    return _ppo_family("grpo", logprobs, old_logprobs, advantages, mask, cfg, normalizer, weights, entropy, counted)


def dapo_loss(logprobs, old_logprobs, advantages, mask, *, cfg: LossConfig, normalizer, weights=None, entropy=None,
              counted=None):
    """DAPO clip-higher: the GRPO surrogate with a wider upper bound (default eps_high 0.28)."""
    return _ppo_family("dapo", logprobs, old_logprobs, advantages, mask, cfg, normalizer, weights, entropy, counted)


def dual_clip_loss(logprobs, old_logprobs, advantages, mask, *, cfg: LossConfig, normalizer, weights=None,
                   entropy=None, counted=None):
    """Dual-clip PPO: the GRPO surrogate, and for A < 0 additionally min(., -c A) (c = cfg.dual_clip_c)."""
    return _ppo_family("dual_clip", logprobs, old_logprobs, advantages, mask, cfg, normalizer, weights, entropy,
                       counted, dual_c=cfg.dual_clip_c)


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = (1/|y_i|) sum_t log r_t per sequence, [batch, 1], from the UNclamped token log-ratios
    [batch, tokens] (0 off the mask); only the mean is clamped to +-20 (exp stays finite). 0 for an empty row."""
    length = mask.sum(dim=-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
    return _clamped(log_ratio.sum(dim=-1, keepdim=True) / length)


def _gspo_family(name, logprobs, old_logprobs, advantages, mask, cfg, normalizer, weights, entropy, counted,
                 per_token):
    low, high = cfg.clip_bounds(name)
    mask, log_ratio, adv, w = _inputs(logprobs, old_logprobs, advantages, mask, weights)
    seq_log_ratio = _sequence_log_ratio(log_ratio, mask)
    if per_token:
        # s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]: value s_i, gradient s_i * grad log pi_theta(y_t).
        seq_log_ratio = seq_log_ratio.detach() + log_ratio - log_ratio.detach()
    ratio = torch.exp(seq_log_ratio).expand_as(log_ratio)
    token_loss, clip_low, clip_high, _ = _clip_surrogate(ratio, adv, low, high)
    loss = aggregate(w * token_loss, mask, cfg.aggregation, normalizer, counted)
    token_log_ratio = _clamped(log_ratio.detach())  # token ratio metrics only
    metrics = _metrics(torch.exp(token_log_ratio), token_log_ratio, mask, clip_low, clip_high, entropy)
    with torch.no_grad():
        metrics["seq_ratio_mean"] = masked_mean(ratio, mask)
    return loss, metrics


def gspo_loss(logprobs, old_logprobs, advantages, mask, *, cfg: LossConfig, normalizer, weights=None, entropy=None,
              counted=None):
    """GSPO: s_i = exp(mean_t log r_t); l = -w_t min(s_i A, clip(s_i, 1-eps_l, 1+eps_r) A) on every token.

    With `seq_mean_token_mean` this is the paper's J = mean_i min(s_i A_i, clip(s_i) A_i).
    Clip metrics count tokens of clipped sequences.
    """
    return _gspo_family("gspo", logprobs, old_logprobs, advantages, mask, cfg, normalizer, weights, entropy, counted,
                        False)


def gspo_token_loss(logprobs, old_logprobs, advantages, mask, *, cfg: LossConfig, normalizer, weights=None,
                    entropy=None, counted=None):
    """GSPO-token: s_{i,t} = sg[s_i] pi_theta(y_t)/sg[pi_theta(y_t)] with per-token advantages.

    Equal to GSPO in value and gradient when A is constant over each sequence.
    """
    return _gspo_family("gspo_token", logprobs, old_logprobs, advantages, mask, cfg, normalizer, weights, entropy,
                        counted, True)


def cispo_loss(logprobs, old_logprobs, advantages, mask, *, cfg: LossConfig, normalizer, weights=None, entropy=None,
               counted=None):
    """CISPO: gradient of -w_t sg[clip(r_t, 1-eps_low, 1+eps_high)] A log pi_theta(y_t); no token loses its gradient.

    Written as l_t = -w_t sg[clip(r_t)/r_t] r_t A so the value is the clipped-IS surrogate -w clip(r) A
    while the gradient is -w clip(r) A grad log pi_theta.
    """
    low, high = cfg.clip_bounds("cispo")
    mask, log_ratio, adv, w = _inputs(logprobs, old_logprobs, advantages, mask, weights)
    log_ratio = _clamped(log_ratio)
    ratio = torch.exp(log_ratio)
    coef = (ratio.clamp(1.0 - low, 1.0 + high) / ratio).detach()
    loss = aggregate(-w * coef * ratio * adv, mask, cfg.aggregation, normalizer, counted)
    metrics = _metrics(ratio, log_ratio, mask, ratio < 1.0 - low, ratio > 1.0 + high, entropy)
    return loss, metrics


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "grpo": grpo_loss,
    "dapo": dapo_loss,
    "dual_clip": dual_clip_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "cispo": cispo_loss,
}


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered under `name`; KeyError listing the choices otherwise."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown policy loss {name!r}; choices: {sorted(POLICY_LOSSES)}") from None


def policy_loss(logprobs, old_logprobs, advantages, mask, *, cfg: LossConfig, normalizer, weights=None,
                entropy=None, counted=None) -> tuple[torch.Tensor, Metrics]:
    """Dispatch to the loss named by `cfg.name`."""
    fn = get_policy_loss(cfg.name)
    return fn(logprobs, old_logprobs, advantages, mask, cfg=cfg, normalizer=normalizer, weights=weights,
              entropy=entropy, counted=counted)

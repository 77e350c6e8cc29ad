"""KL estimators (k1, k2, k3), the off-policy unbiased KL of DeepSeek-V3.2, and the KL-to-reference loss.

All estimators take per-token log-probabilities of the SAMPLED tokens and return per-token values
[batch, tokens]; tokens are assumed drawn from p (the policy being penalised), q the reference:
    k1 = log p - log q                      (unbiased, high variance, can be negative)
    k2 = (log p - log q)^2 / 2              (biased, low variance)
    k3 = q/p - log(q/p) - 1                 (unbiased, low variance, >= 0)
    unbiased off-policy (samples from pi_old): D = (pi_theta / pi_old) * k3(pi_theta, pi_ref)
Log-ratios are clamped to [-20, 20] before exp() so a stray token cannot overflow. Every k3 in the package (the
KL-to-reference term, the policy-loss metric, the mismatch metrics) is `k3_from_log_ratio`: exp(x) - 1 - x written
so that rounding cannot make it negative (a Taylor series for small |x|, expm1(x) - x otherwise, floored at 0).
Reference: J. Schulman, "Approximating KL divergence" (2020); DeepSeek-V3.2 arXiv 2512.02556.
"""
from __future__ import annotations

import math

import torch

from megatron_sparse_rl.algorithms.aggregation import aggregate, masked_mean
from megatron_sparse_rl.config.algorithm import KLConfig

_CLAMP = 20.0


def kl_k1(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log q."""
    return logp - logq


def kl_k2(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """k2 = (log p - log q)^2 / 2."""
    return 0.5 * (logp - logq).clamp(-_CLAMP, _CLAMP) ** 2


# Below this |x| the series x^2/2! + ... + x^10/10! is used: its truncation error at 0.1 is ~5e-18 relative, and
# expm1(x) - x above it loses at most a factor 2/|x| = 20 of the dtype's precision to cancellation.
_SERIES_BELOW = 0.1
_SERIES_TERMS = 10


def k3_from_log_ratio(x: torch.Tensor) -> torch.Tensor:
    """k3 = exp(x) - 1 - x (>= 0), x = log(q/p) already clamped; same dtype as x, differentiable.

    exp(x) - x - 1 in float32 rounds to as much as +-1e-7 for |x| < 1e-4, where the true value is below 5e-9, so
    means of it printed negative; the series and expm1 keep the relative precision, and the floor at 0 covers
    expm1's last-ulp error (the exact value is >= 0 for every x)."""
    poly = torch.full_like(x, 1.0 / math.factorial(_SERIES_TERMS))
    for n in range(_SERIES_TERMS - 1, 1, -1):  # Horner: sum_{n=2}^{10} x^n / n!
        poly = poly * x + 1.0 / math.factorial(n)
    series = poly * x * x
    return torch.where(x.abs() < _SERIES_BELOW, series, torch.expm1(x) - x).clamp_min(0.0)


def kl_k3(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """k3 = q/p - log(q/p) - 1 (>= 0)."""
    return k3_from_log_ratio((logq - logp).clamp(-_CLAMP, _CLAMP))


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def unbiased_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """D_t = (pi_theta/pi_old) (pi_ref/pi_theta - log(pi_ref/pi_theta) - 1); grad flows through both factors."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-_CLAMP, _CLAMP))
    return ratio * kl_k3(logprobs, ref_logprobs)


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, *, cfg: KLConfig,
            aggregation: str, normalizer: torch.Tensor | float, old_logprobs: torch.Tensor | None = None,
            weights: torch.Tensor | None = None,
            counted: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """coef * aggregate(KL_t), to be added to the policy loss (same aggregation and normalizer).

    logprobs, ref_logprobs, mask, old_logprobs, weights, counted: [batch, tokens]. `old_logprobs` is required
    when cfg.use_unbiased. cfg.clamp caps each token's k3 (or unbiased) estimate from above (k3 >= 0 already).
    `weights` multiply the per-token estimate when given (the trainer passes the correction weights only when
    cfg.correction_weights). `counted`: see `aggregate`. Metrics: "kl_ref" (masked mean of the per-token
    estimate, capped and weighted as in the loss, no grad).
    """
    mask = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    lp = torch.where(mask, logprobs, zero)
    ref = torch.where(mask, ref_logprobs.to(logprobs.dtype), zero)
    if cfg.use_unbiased:
        if old_logprobs is None:
            raise ValueError("algorithm.kl.use_unbiased is set but kl_loss got no old_logprobs")
        per_token = unbiased_kl(lp, torch.where(mask, old_logprobs.to(lp.dtype), zero), ref)
    else:
        per_token = KL_ESTIMATORS[cfg.estimator](lp, ref)
    if cfg.clamp is not None:
        per_token = per_token.clamp(max=cfg.clamp)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = cfg.coef * aggregate(per_token, mask, aggregation, normalizer, counted)
    return loss, {"kl_ref": masked_mean(per_token.detach(), mask)}

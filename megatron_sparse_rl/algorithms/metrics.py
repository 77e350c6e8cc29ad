"""Mismatch metrics between the sampler mu and the learner's old policy pi_old (log every step).

rho_t = pi_old / mu on valid tokens (response mask, finite logprobs). All outputs are scalar tensors
(no host sync):
    k1 ("vllm-kl") = mean(log mu - log pi_old)      k3 = mean(rho - log rho - 1)
    ppl_old = exp(-mean log pi_old)                  ppl_rollout = exp(-mean log mu)
    chi2 = mean(rho^2) - 1                           max_abs_log_rho
    nonfinite_tokens (count), masked_frac (response tokens not kept, when `keep` is given)
Fractions rejected/vetoed/clipped come from `apply_corrections` and the policy-loss metrics.
"""
from __future__ import annotations

import torch

from megatron_sparse_rl.algorithms.aggregation import masked_max, masked_mean

_CLAMP = 20.0


@torch.no_grad()
def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                     keep: torch.Tensor | None = None, prefix: str = "mismatch/") -> dict[str, torch.Tensor]:
    """Metrics of the mu/pi_old mismatch; inputs [batch, tokens], `keep` the corrections' keep mask."""
    mask = mask.bool()
    finite = torch.isfinite(old_logprobs) & torch.isfinite(rollout_logprobs)
    valid = mask & finite
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    old = torch.where(valid, old_logprobs, zero)
    mu = torch.where(valid, rollout_logprobs, zero)
    log_rho = (old - mu).clamp(-_CLAMP, _CLAMP)
    rho = torch.exp(log_rho)
    out = {
        "k1": masked_mean(mu - old, valid),
        "k3": masked_mean(rho - log_rho - 1.0, valid),
        "ppl_old": torch.exp(-masked_mean(old, valid)),
        "ppl_rollout": torch.exp(-masked_mean(mu, valid)),
        "chi2": masked_mean(rho * rho, valid) - torch.where(valid.any(), 1.0, 0.0),
        "max_abs_log_rho": masked_max(log_rho.abs(), valid),
        "nonfinite_tokens": (mask & ~finite).sum().to(old.dtype),
    }
    if keep is not None:
        out["masked_frac"] = masked_mean((mask & ~keep.bool()).to(old.dtype), mask)
    return {prefix + k: v for k, v in out.items()}

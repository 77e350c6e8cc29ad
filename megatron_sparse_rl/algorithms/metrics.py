"""Mismatch metrics between the sampler mu and the learner's old policy pi_old (log every step).

rho_t = pi_old / mu on valid tokens (response mask, finite logprobs). All outputs are scalar tensors
(no host sync without a process group):
    k1 ("vllm-kl") = mean(log mu - log pi_old)      k3 = mean(rho - log rho - 1) (>= 0: kl.k3_from_log_ratio)
    ppl_old = exp(-mean log pi_old)                  ppl_rollout = exp(-mean log mu)
    chi2 = mean(rho^2) - 1                           max_abs_log_rho
    nonfinite_tokens (count), masked_frac (response tokens not kept, when `keep` is given)
Fractions rejected/vetoed/clipped come from `apply_corrections` and the policy-loss metrics. With a process
`group` (data parallel) the means are over every rank's tokens: sums and counts are all-reduced, then divided.

`tail_metrics` reports the low tail that means hide: percentiles of rho_t and of each sequence's sum of log rho_t,
and the fractions of tokens with rho_t below 0.5 and 1e-4 (exact over the DP group: the values are gathered).

`routing_attribution` splits off the part of the mismatch that MoE routing explains: k1/k3 of mu against
pi_old computed with the engine's routes replayed and with the learner's own routes (docs/routing.md).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_sparse_rl.algorithms.aggregation import masked_max, masked_sum
from megatron_sparse_rl.algorithms.kl import k3_from_log_ratio

_CLAMP = 20.0


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _log_rho(old: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    return (old - mu).clamp(-_CLAMP, _CLAMP)


@torch.no_grad()
def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                     keep: torch.Tensor | None = None, prefix: str = "mismatch/",
                     group=None) -> dict[str, torch.Tensor]:
    """Metrics of the mu/pi_old mismatch; inputs [batch, tokens], `keep` the corrections' keep mask; `group`: the
    data-parallel group to take the means over (every rank of it must call)."""
    mask = mask.bool()
    finite = torch.isfinite(old_logprobs) & torch.isfinite(rollout_logprobs)
    valid = mask & finite
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    old = torch.where(valid, old_logprobs, zero)
    mu = torch.where(valid, rollout_logprobs, zero)
    log_rho = _log_rho(old, mu)
    rho = torch.exp(log_rho)
    not_kept = mask & ~keep.bool() if keep is not None else torch.zeros_like(mask)
    counts = (m.sum().to(old.dtype) for m in (valid, mask & ~finite, not_kept, mask))
    sums = torch.stack([masked_sum(mu - old, valid), masked_sum(k3_from_log_ratio(log_rho), valid), old.sum(),
                        mu.sum(), masked_sum(rho * rho, valid), *counts])
    k1, k3, lp_old, lp_mu, rho2, n_valid, nonfinite, n_not_kept, n_mask = _all_reduce(sums, group).unbind()
    n = n_valid.clamp(min=1)
    out = {
        "k1": k1 / n,
        "k3": k3 / n,
        "ppl_old": torch.exp(-lp_old / n),
        "ppl_rollout": torch.exp(-lp_mu / n),
        "chi2": rho2 / n - torch.where(n_valid > 0, 1.0, 0.0),
        "max_abs_log_rho": _all_reduce(masked_max(log_rho.abs(), valid), group, dist.ReduceOp.MAX),
        "nonfinite_tokens": nonfinite,
    }
    if keep is not None:
        out["masked_frac"] = n_not_kept / n_mask.clamp(min=1)
    return {prefix + k: v for k, v in out.items()}


TAIL_PERCENTILES = (1, 5, 50)
"""The percentiles `tail_metrics` reports (`mismatch/rho_p5` ...)."""
TAIL_THRESHOLDS = (("0.5", 0.5), ("1e-4", 1e-4))
"""(name, value): `tail_metrics`: the fraction of the tokens with rho_t below each (`mismatch/rho_below_0.5_frac`)."""


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """The 1-D `x` of every rank of `group`, concatenated and padded with +inf (`x` itself without a group). The
    ranks may hold different counts, so each pads to the largest: one host sync for that count."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    world = dist.get_world_size(group)
    count = torch.tensor([x.numel()], dtype=torch.int64, device=x.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    padded = torch.full((int(count),), math.inf, dtype=x.dtype, device=x.device)
    padded[:x.numel()] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)


def _percentiles(values: torch.Tensor, qs, empty: float) -> torch.Tensor:
    """Percentiles `qs` (0-100) of the finite entries of 1-D `values` (the others +inf) by linear interpolation
    between order statistics (numpy's default, "linear"): sorted[(n-1) q/100], interpolated; `empty` for each when
    there is none. Sorting, not torch.quantile (which refuses more than 2**24 values); no host sync."""
    v = values.sort().values
    n = torch.isfinite(v).sum()
    q = torch.tensor(qs, dtype=v.dtype, device=v.device) / 100
    pos = q * (n - 1).clamp(min=0)
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (n - 1).clamp(min=0))
    lo_v, hi_v = v[lo], v[hi]
    interp = lo_v + (hi_v - lo_v) * (pos - lo)
    return torch.where(n > 0, interp, torch.full_like(interp, empty))


@torch.no_grad()
def tail_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                 group=None, prefix: str = "mismatch/") -> dict[str, torch.Tensor]:
    """The low tail of the mu/pi_old agreement (float64 scalars), which k1/k3 (means) hide.

    old_logprobs, rollout_logprobs, mask: [B, T]; over the valid tokens (mask and both logprobs finite):
      rho_p{1,5,50}         percentiles of rho_t = exp(clamp(log pi_old - log mu, -20, 20)) (sparse_rl's xi_t);
      seq_log_rho_p{1,5,50} percentiles over the sequences with a valid token of sum_t (log pi_old - log mu)
                            (unclamped): the log of the sequence's importance ratio;
      rho_below_{0.5,1e-4}_frac  fraction of the tokens with rho_t below 0.5 / 1e-4 (compared in log space).
    Percentiles interpolate linearly between order statistics (numpy's default). With no valid token: rho
    percentiles 1, sum percentiles 0, fractions 0 (no mismatch measured, as k1 = 0 then).
    DP (`group`, every rank of it must call): percentiles of the ranks cannot be averaged, so every rank's
    per-token and per-sequence log-ratios (float64, padded with +inf) are all-gathered and the percentiles taken
    over the whole batch exactly; one host sync (the largest rank's size, to pad to). Without a group nothing
    leaves the device. Sparrow (arXiv 2606.08446, as the issue cites it) reports training stable while the 5th
    percentile of per-token agreement stays >= 0.86: that is `rho_p5`.
    """
    valid = mask.bool() & torch.isfinite(old_logprobs) & torch.isfinite(rollout_logprobs)
    log_rho = torch.where(valid, old_logprobs.double() - rollout_logprobs.double(), 0.0)
    seq_sums = torch.where(valid.any(dim=-1), log_rho.sum(dim=-1), math.inf)
    tokens = _gather(torch.where(valid, log_rho, math.inf).flatten(), group)
    seqs = _gather(seq_sums.flatten(), group)
    rho = torch.where(torch.isfinite(tokens), torch.exp(tokens.clamp(-_CLAMP, _CLAMP)), math.inf)
    out = {}
    for q, v in zip(TAIL_PERCENTILES, _percentiles(rho, TAIL_PERCENTILES, 1.0).unbind()):
        out[f"rho_p{q}"] = v
    for q, v in zip(TAIL_PERCENTILES, _percentiles(seqs, TAIL_PERCENTILES, 0.0).unbind()):
        out[f"seq_log_rho_p{q}"] = v
    n = torch.isfinite(tokens).sum().clamp(min=1).double()
    for name, threshold in TAIL_THRESHOLDS:
        out[f"rho_below_{name}_frac"] = (tokens < math.log(threshold)).sum().double() / n
    return {prefix + k: v for k, v in out.items()}


@torch.no_grad()
def routing_attribution(engine_routes: torch.Tensor, learner_routes: torch.Tensor, rollout_logprobs: torch.Tensor,
                        mask: torch.Tensor, *, group=None, prefix: str = "mismatch/") -> dict[str, torch.Tensor]:
    """The share of the mu / pi_old mismatch that MoE routing explains (float64 scalars).

    engine_routes, learner_routes: [B, T] pi_old logprobs of the same tokens from two learner forwards, one
    replaying the engine's routes, one routing with the learner's own routers; rollout_logprobs: [B, T] mu;
    mask: [B, T] the response tokens. Over the tokens finite in all three (summed over `group`'s ranks, every
    rank of it must call): k1_* = mean(log mu - log pi_old), k3_* = mean(rho - log rho - 1) for each pi_old, and
    routing_share = (k3_learner_routes - k3_engine_routes) / k3_learner_routes: the fraction of k3 that goes
    away when the learner runs the experts the engine ran (0 when k3_learner_routes is 0; negative when
    replaying makes it worse, e.g. when routing explains nothing and the difference is noise).
    """
    mu, pis = rollout_logprobs.double(), (engine_routes.double(), learner_routes.double())
    valid = mask.bool() & torch.isfinite(mu) & torch.isfinite(pis[0]) & torch.isfinite(pis[1])
    sums = [valid.sum().double()]
    for pi in pis:
        log_rho = _log_rho(pi, mu)
        sums += [masked_sum(mu - pi, valid), masked_sum(k3_from_log_ratio(log_rho), valid)]
    n, k1_e, k3_e, k1_l, k3_l = _all_reduce(torch.stack(sums), group).unbind()
    n = n.clamp(min=1)
    k3_e, k3_l = k3_e / n, k3_l / n
    share = torch.where(k3_l > 0, (k3_l - k3_e) / k3_l.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
    out = {"k1_engine_routes": k1_e / n, "k3_engine_routes": k3_e, "k1_learner_routes": k1_l / n,
           "k3_learner_routes": k3_l, "routing_share": share}
    return {prefix + k: v for k, v in out.items()}

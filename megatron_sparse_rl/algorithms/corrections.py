"""Corrections for the sampler/learner mismatch (mu != pi_old): TIS, MIS, Geo-RS, veto, IcePop, OPSM,
Sparse-RL and the batch-skip rule, composable through `apply_corrections`.

rho_t = pi_old(y_t) / mu(y_t) with mu the rollout engine's probabilities. Each correction returns token
weights (applied outside the policy-loss clip) and a keep mask; `apply_corrections` multiplies the
weights and ANDs the keep masks of the enabled ones. Run it on the full batch (or pass the DP `group`)
before splitting into micro-batches, then train with `mask & keep`, normalise with
`loss_normalizer(mask & keep, mode)` so rejected tokens leave the denominators (or, with
algorithm.loss.dropped_tokens_in_denominator, over `valid` and pass it as the losses' `counted`), and pass
`weights`:

    corr = apply_corrections(cfg.corrections, old_logprobs, rollout_logprobs, mask, advantages=adv)

OPSM's rule, and TIS with `ratio: pi_theta` (MiniRL's weight min(pi_theta/mu, C)), are defined with the CURRENT
pi_theta, so the trainer does not run them here: it evaluates them inside every update micro-batch's loss
(training/update.py); `apply_corrections(..., logprobs=)` evaluates the same rules for callers that hold current
logprobs (pi_old stands in when they are absent).

Rollout logprobs that are inf/NaN (engine glitches) are masked out and counted, never propagated.
Everything here runs without grad and without host syncs; metrics are scalar tensors.

Papers/notes: TIS and MIS/Geo-RS (Yao et al., Liu et al. blog posts), IcePop arXiv 2510.18855,
OPSM (DeepSeek-V3.2) 2512.02556, Sparse-RL 2601.10079; formulas in shared/references.md.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from megatron_sparse_rl.algorithms.aggregation import global_sum, masked_mean
# the PPO losses' clamp of log r_t: tis ratio pi_theta must divide by the r_t those losses multiply by
from megatron_sparse_rl.algorithms.losses import _LOG_RATIO_CLAMP as _PPO_LOG_RATIO_CLAMP
from megatron_sparse_rl.config.algorithm import (
    BatchSkipConfig, CorrectionsConfig, GeoRSConfig, IcePopConfig, MISConfig, OPSMConfig, SparseRLConfig,
    TISConfig, VetoConfig,
)

Metrics = dict[str, torch.Tensor]
# sums of log rho over a long response can overflow exp(); bounds are compared in log space instead.
_LOG_CLAMP = 20.0


class CorrectionInputs(NamedTuple):
    """What every correction sees. All [batch, tokens] unless noted; invalid positions hold 0."""

    log_rho: torch.Tensor
    """log pi_old - log mu on valid tokens."""
    mask: torch.Tensor
    """bool: response tokens with finite logprobs."""
    drift: torch.Tensor
    """log mu - log pi_theta (pi_old when no current logprobs were given), for OPSM."""
    seq_advantages: torch.Tensor | None
    """[batch] advantage per sequence, or None."""
    group: dist.ProcessGroup | None
    """DP group for batch-wide statistics (None: this batch is the whole batch)."""


class CorrectionResult(NamedTuple):
    weights: torch.Tensor
    """[batch, tokens] float, 0 where not kept."""
    keep: torch.Tensor
    """[batch, tokens] bool, already ANDed with the response mask."""
    metrics: Metrics
    """Scalar tensors."""
    valid: torch.Tensor | None = None
    """[batch, tokens] bool: the response tokens with finite logprobs, before any correction drops one (set by
    `apply_corrections`; the loss normaliser's mask under algorithm.loss.dropped_tokens_in_denominator)."""


def _seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum(dim=-1, keepdim=True)


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _seq_sum(x, mask) / mask.sum(dim=-1, keepdim=True).clamp(min=1).to(x.dtype)


def _frac(event: torch.Tensor, population: torch.Tensor) -> torch.Tensor:
    return masked_mean(event.float(), population)


def _seq_rejected_frac(seq_keep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of non-empty sequences dropped; seq_keep [batch, 1] bool."""
    seqs = mask.any(dim=-1)
    return _frac(seqs & ~seq_keep.squeeze(-1), seqs)


def _in_log_bounds(log_x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return (log_x >= math.log(low)) & (log_x <= math.log(high))


def tis_correction(cfg: TISConfig, x: CorrectionInputs) -> CorrectionResult:
    """TIS: w_t = min(rho_t, C) (token) or min(prod_t rho_t, C) (sequence); nothing is dropped.

    cfg.ratio = pi_theta (token level; MiniRL): w_t = min(rho_t, C / r_t), r_t = pi_theta/pi_old of the current
    (detached) logprobs with log r_t clamped to +-20 as the PPO losses clamp it, so that w_t r_t = min(pi_theta/mu,
    C). pi_theta comes from `drift` (log mu - log pi_theta): pi_old stands in without current logprobs (r_t = 1).
    `tis/truncated_frac` counts the tokens where the cap binds (rho_t > C, or pi_theta/mu > C)."""
    log_cap = math.log(cfg.cap)
    if cfg.ratio == "pi_theta":
        log_r = (-x.drift - x.log_rho).clamp(-_PPO_LOG_RATIO_CLAMP, _PPO_LOG_RATIO_CLAMP)  # log pi_theta/pi_old
        truncated = x.log_rho + log_r > log_cap
        weights = torch.exp(torch.minimum(x.log_rho, log_cap - log_r))
    else:
        log_rho = x.log_rho if cfg.level == "token" else _seq_sum(x.log_rho, x.mask).expand_as(x.log_rho)
        truncated = log_rho > log_cap
        weights = torch.exp(log_rho.clamp(max=log_cap))
    metrics = {"tis/truncated_frac": _frac(truncated, x.mask), "tis/weight_mean": masked_mean(weights, x.mask)}
    return CorrectionResult(weights, x.mask, metrics)


def mis_correction(cfg: MISConfig, x: CorrectionInputs) -> CorrectionResult:
    """MIS/rejection: keep a token (or the whole sequence on prod_t rho_t) iff low <= rho <= high."""
    if cfg.level == "token":
        log_rho = x.log_rho
        keep = x.mask & _in_log_bounds(log_rho, cfg.low, cfg.high)
        metrics = {"mis/rejected_token_frac": _frac(x.mask & ~keep, x.mask)}
    else:
        log_rho = _seq_sum(x.log_rho, x.mask)
        seq_keep = _in_log_bounds(log_rho, cfg.low, cfg.high)
        keep = x.mask & seq_keep
        metrics = {"mis/rejected_seq_frac": _seq_rejected_frac(seq_keep, x.mask)}
    weights = torch.exp(log_rho.clamp(-_LOG_CLAMP, _LOG_CLAMP)).expand_as(x.log_rho) if cfg.reweight \
        else torch.ones_like(x.log_rho)
    return CorrectionResult(weights * keep, keep, metrics)


def geo_rs_correction(cfg: GeoRSConfig, x: CorrectionInputs) -> CorrectionResult:
    """Geo-RS: keep sequence i iff low <= exp(mean_t log rho_t) <= high."""
    seq_keep = _in_log_bounds(_seq_mean(x.log_rho, x.mask), cfg.low, cfg.high)
    keep = x.mask & seq_keep
    return CorrectionResult(keep.to(x.log_rho.dtype), keep,
                            {"geo_rs/rejected_seq_frac": _seq_rejected_frac(seq_keep, x.mask)})


def veto_correction(cfg: VetoConfig, x: CorrectionInputs) -> CorrectionResult:
    """Veto: drop sequence i if any valid token has rho_t < threshold."""
    seq_keep = ~(x.mask & (x.log_rho < math.log(cfg.threshold))).any(dim=-1, keepdim=True)
    keep = x.mask & seq_keep
    return CorrectionResult(keep.to(x.log_rho.dtype), keep,
                            {"veto/vetoed_seq_frac": _seq_rejected_frac(seq_keep, x.mask)})


def icepop_correction(cfg: IcePopConfig, x: CorrectionInputs) -> CorrectionResult:
    """IcePop: M(rho_t) = rho_t if alpha <= rho_t <= beta else 0 (token dropped)."""
    keep = x.mask & _in_log_bounds(x.log_rho, cfg.alpha, cfg.beta)
    # exp only where kept: a dropped token's rho may overflow, and inf * 0 would leave NaN in its weight
    weights = torch.exp(torch.where(keep, x.log_rho, torch.zeros_like(x.log_rho))) * keep
    return CorrectionResult(weights, keep, {"icepop/masked_token_frac": _frac(x.mask & ~keep, x.mask)})


def _opsm_rule(cfg: OPSMConfig, drift: torch.Tensor, mask: torch.Tensor, seq_advantages: torch.Tensor) -> torch.Tensor:
    """The OPSM rule, bool [batch, 1]: False where A_i < 0 and mean_t drift > delta; drift = log mu - log
    pi_theta [batch, tokens] (0 off `mask`), seq_advantages [batch]."""
    drifted = _seq_mean(drift, mask) > cfg.delta
    return ~(drifted & (seq_advantages.unsqueeze(-1) < 0))


def opsm_keep(cfg: OPSMConfig, rollout_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor,
              seq_advantages: torch.Tensor) -> torch.Tensor:
    """OPSM keep per sequence, bool [batch, 1] (DeepSeek-V3.2): False when A_i < 0 and
    (1/|y_i|) sum_t (log mu - log pi_theta) > delta.

    rollout_logprobs (mu), logprobs (current pi_theta, used detached), mask: [batch, tokens], the mean over
    the response tokens of `mask` with finite logprobs (other positions may hold inf/NaN); seq_advantages
    [batch]. The trainer calls it in every update micro-batch's loss (training/update.py)."""
    valid = mask.bool() & torch.isfinite(rollout_logprobs) & torch.isfinite(logprobs)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    drift = torch.where(valid, rollout_logprobs.to(logprobs.dtype) - logprobs.detach(), zero)
    return _opsm_rule(cfg, drift, valid, seq_advantages)


def opsm_correction(cfg: OPSMConfig, x: CorrectionInputs) -> CorrectionResult:
    """OPSM: drop sequence i when A_i < 0 and mean_t (log mu - log pi_theta) > delta (see `opsm_keep`)."""
    if x.seq_advantages is None:
        raise ValueError("algorithm.corrections.opsm is enabled but apply_corrections got no advantages")
    seq_keep = _opsm_rule(cfg, x.drift, x.mask, x.seq_advantages)
    keep = x.mask & seq_keep
    return CorrectionResult(keep.to(x.log_rho.dtype), keep,
                            {"opsm/masked_seq_frac": _seq_rejected_frac(seq_keep, x.mask)})


def sparse_rl_correction(cfg: SparseRLConfig, x: CorrectionInputs) -> CorrectionResult:
    """Sparse-RL: xi_t = exp(clamp(log pi_old - log mu, -20, 20)); a sequence with any xi_t < eps gets
    weight 0; optionally tokens outside [token_low, token_high] too; w_t = min(xi_t, cap), rescaled to
    mean 1 over the kept tokens of the (global) batch."""
    xi = torch.exp(x.log_rho.clamp(-cfg.log_clamp, cfg.log_clamp))
    seq_keep = ~(x.mask & (xi < cfg.eps)).any(dim=-1, keepdim=True)
    keep = x.mask & seq_keep
    if cfg.token_reject:
        keep = keep & (xi >= cfg.token_low) & (xi <= cfg.token_high)
    weights = xi.clamp(max=cfg.weight_cap) * keep
    metrics = {
        "sparse_rl/rejected_seq_frac": _seq_rejected_frac(seq_keep, x.mask),
        "sparse_rl/rejected_token_frac": _frac(x.mask & ~keep, x.mask),
        "sparse_rl/raw_weight_mean": masked_mean(weights, keep),
    }
    if cfg.normalize:
        total = global_sum(weights.sum(), x.group)
        count = global_sum(keep.sum().to(weights.dtype), x.group)
        mean = torch.where(count > 0, total / count.clamp(min=1), torch.ones_like(total))
        weights = weights / mean.clamp(min=torch.finfo(weights.dtype).tiny)
    return CorrectionResult(weights, keep, metrics)


def batch_skip_correction(cfg: BatchSkipConfig, x: CorrectionInputs) -> CorrectionResult:
    """Batch skip: drop every token when k1 = mean(log mu - log pi_old) over the batch exceeds max_k1."""
    k1 = global_sum(torch.where(x.mask, -x.log_rho, torch.zeros_like(x.log_rho)).sum(), x.group) \
        / global_sum(x.mask.sum().to(x.log_rho.dtype), x.group).clamp(min=1)
    skip = k1 > cfg.max_k1
    keep = x.mask & ~skip
    return CorrectionResult(keep.to(x.log_rho.dtype), keep, {"batch_skip/k1": k1, "batch_skip/skipped": skip.float()})


CORRECTIONS: dict[str, Callable[..., CorrectionResult]] = {
    "tis": tis_correction,
    "mis": mis_correction,
    "geo_rs": geo_rs_correction,
    "veto": veto_correction,
    "icepop": icepop_correction,
    "opsm": opsm_correction,
    "sparse_rl": sparse_rl_correction,
    "batch_skip": batch_skip_correction,
}


def correction_inputs(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                      advantages: torch.Tensor | None = None, logprobs: torch.Tensor | None = None,
                      group: dist.ProcessGroup | None = None) -> tuple[CorrectionInputs, torch.Tensor]:
    """Sanitised inputs and the bool mask of response tokens dropped for a non-finite logprob."""
    mask = mask.bool()
    finite = torch.isfinite(old_logprobs) & torch.isfinite(rollout_logprobs)
    if logprobs is not None:
        finite = finite & torch.isfinite(logprobs)
    valid = mask & finite
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    log_rho = torch.where(valid, old_logprobs - rollout_logprobs, zero)
    current = old_logprobs if logprobs is None else logprobs.detach()
    drift = torch.where(valid, rollout_logprobs - current, zero)
    seq_adv = None
    if advantages is not None:
        seq_adv = advantages if advantages.dim() == 1 else _seq_mean(advantages, valid).squeeze(-1)
    return CorrectionInputs(log_rho, valid, drift, seq_adv, group), mask & ~finite


@torch.no_grad()
def apply_corrections(cfg: CorrectionsConfig, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                      mask: torch.Tensor, *, advantages: torch.Tensor | None = None,
                      logprobs: torch.Tensor | None = None,
                      group: dist.ProcessGroup | None = None) -> CorrectionResult:
    """Run every enabled correction of `cfg` and combine them (weights multiply, keep masks AND).

    old_logprobs, rollout_logprobs, mask: [batch, tokens]; advantages: [batch] or [batch, tokens]
    (needed by OPSM); logprobs: current pi_theta for OPSM (pi_old is used when absent);
    group: DP group so Sparse-RL's mean-1 normalisation and the batch-skip k1 cover the global batch.
    With nothing enabled: weights 1 and keep = mask minus the non-finite tokens.
    """
    x, nonfinite = correction_inputs(old_logprobs, rollout_logprobs, mask, advantages=advantages,
                                     logprobs=logprobs, group=group)
    weights = torch.ones_like(x.log_rho)
    keep = x.mask
    metrics: Metrics = {"corrections/nonfinite_tokens": nonfinite.sum().float()}
    for name, fn in CORRECTIONS.items():
        sub = getattr(cfg, name)
        if not sub.enabled:
            continue
        result = fn(sub, x)
        weights = weights * result.weights
        keep = keep & result.keep
        metrics.update(result.metrics)
    response = mask.bool()
    metrics["corrections/kept_token_frac"] = _frac(keep, response)
    metrics["corrections/kept_seq_frac"] = _frac(keep.any(dim=-1), response.any(dim=-1))
    metrics["corrections/all_rejected"] = (~keep.any()).float()
    metrics["corrections/weight_mean"] = masked_mean(weights, keep)
    return CorrectionResult(weights * keep, keep, metrics, x.mask)

"""The engine-vs-learner check after a weight sync: the engines' prompt logprobs of a fixed probe against the
learner's own `forward_logprobs` (an independent implementation), one comparison wherever the engines are.

    diff = verify_logprobs(learner, engine, probe_tokens, tol=1e-4)           # this rank's own engine
    diff = compare_engines(learner, probe_tokens, tol, engine_logprobs)       # any engines: rows -> {who: logprobs}
    metrics = probe_metrics(learner, probe_tokens, tol, engine_logprobs, weights)   # under the engines' format

Every learner rank calls them (the learner forward is collective); a rank that compares nothing passes
`engine` / `engine_logprobs` None and gets None. Above `tol` they raise WeightSyncError naming the engine. When the
learner itself is at fault (its weights, or its probe logprobs, are not finite: the training diverged), every rank
raises NonFiniteError saying so instead: that is not a bad weight sync.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_sparse_rl.learner.finite import NonFiniteError, nonfinite_parameters, weights_message
from megatron_sparse_rl.weight_sync.engine_weights import EngineWeights
from megatron_sparse_rl.weight_sync.export import WeightSyncError

EngineLogprobs = Callable[[list[list[int]]], dict[str, torch.Tensor]]
"""Probe rows -> {which engine (e.g. "rank 0", "rollout rank 2"): its prompt logprobs, float [B, S-1]}."""


def _probe_rows(tokens) -> torch.Tensor:
    rows = torch.as_tensor(tokens, dtype=torch.long)
    if rows.dim() == 1:
        rows = rows[None]
    if rows.dim() != 2 or rows.shape[1] < 2:
        raise ValueError(f"probe tokens must be [B, S] with S >= 2, unpadded (got shape {tuple(rows.shape)})")
    return rows


def _learner_probe(learner, rows: torch.Tensor) -> torch.Tensor:
    """The learner's logprobs of the probe at temperature 1 (the engines' prompt logprobs are of the raw logits,
    whatever the training temperature), float32; raises NonFiniteError on every rank when they are not finite."""
    with learner.scoring_temperature(1.0):
        ours = learner.forward_logprobs(rows)["logprobs"].float()
    if not torch.isfinite(ours).all():  # the same on every rank: all of them raise
        _learner_not_finite(learner, "")
    return ours


def _against(learner, ours: torch.Tensor, rows: torch.Tensor, tol: float, engine_logprobs: EngineLogprobs, *,
             bound: str = "max") -> tuple[float, float]:
    """(max, mean) |engine - learner| over the probe, the worst engine's each; raises WeightSyncError naming the first
    engine whose `bound` statistic ("max" or "mean") exceeds `tol`."""
    worst = [0.0, 0.0]
    for who, theirs in engine_logprobs(rows.tolist()).items():
        gap = (theirs.float() - ours).abs()
        stats = {"max": gap.max().item(), "mean": gap.mean().item()}
        diff = stats[bound]
        if not diff <= tol:
            said = f"by {diff:.3e} ({bound} over the probe's tokens)" if bound == "mean" else f"by {diff:.3e}"
            _learner_not_finite(learner, f"{who}: engine logprobs differ from the learner's {said} on the probe, "
                                         "but ")
            raise WeightSyncError(f"{who}: engine logprobs differ from the learner's {said} on the probe "
                                  f"(tolerance {tol:.1e}): the weight sync moved wrong weights")
        worst = [max(worst[0], stats["max"]), max(worst[1], stats["mean"])]
    return worst[0], worst[1]


def compare_engines(learner, tokens, tol: float, engine_logprobs: EngineLogprobs | None) -> float | None:
    """Max |engine prompt logprob - learner logprob| on the probe `tokens` ([B, S] or [S], no padding) over
    every engine `engine_logprobs` scores; None when it is None (this rank only joins the learner forward).

    The learner scores at temperature 1 here, whatever its training temperature (the engines' prompt logprobs
    are of the raw logits). Raises WeightSyncError naming the first engine whose difference exceeds `tol`."""
    rows = _probe_rows(tokens)
    ours = _learner_probe(learner, rows)
    return None if engine_logprobs is None else _against(learner, ours, rows, tol, engine_logprobs)[0]


def probe_metrics(learner, tokens, tol: float, engine_logprobs: EngineLogprobs | None,
                  weights: EngineWeights | None = None) -> dict[str, float]:
    """`compare_engines` under the engines' weight format: with `weights` other than the learner's own precision
    (a bf16 engine, FP8 weights) the learner's reference holds the engines' weights (`EngineWeights.held_by`), and
    the logprob effect of that rounding itself is measured on the same probe (learner with vs without it):

        sync/probe_max_abs_diff          max |engine - learner holding the engine's weights| (this rank's engines)
        sync/probe_mean_abs_diff         its mean over the probe's tokens
        sync/weight_format_max_abs_diff  max |learner holding the engine's weights - learner| (every rank)
        sync/weight_format_mean_abs_diff its mean over the probe's tokens

    `tol` bounds the max for an engine computing in float32 (FP8 weights included: it holds exactly the learner's
    reference weights) and the MEAN for a bf16 engine: a bf16 MoE engine's routers pick other experts than the fp32
    learner's on some tokens (about one token-layer in six on the tiny MoE), and one flip moves that token's
    logprob by up to ~0.5, so the max says nothing about the weights there, while wrong weights move every token.

    Every learner rank calls it (collectives); a rank comparing no engine gets the last two only."""
    rows = _probe_rows(tokens)
    if weights is None or weights == EngineWeights():
        diff = compare_engines(learner, rows, tol, engine_logprobs)
        return {} if diff is None else {"sync/probe_max_abs_diff": diff}
    plain = _learner_probe(learner, rows)
    with weights.held_by(learner):
        held = _learner_probe(learner, rows)
    effect = (held - plain).abs()
    out = {"sync/weight_format_max_abs_diff": effect.max().item(),
           "sync/weight_format_mean_abs_diff": effect.mean().item()}
    if engine_logprobs is not None:
        bound = "max" if weights.dtype == torch.float32 else "mean"
        out["sync/probe_max_abs_diff"], out["sync/probe_mean_abs_diff"] = _against(learner, held, rows, tol,
                                                                                   engine_logprobs, bound=bound)
    return out


def _learner_not_finite(learner, prefix: str) -> None:
    """Raise NonFiniteError when the learner's weights (or, they being finite, its probe logprobs; `prefix` empty)
    are not finite; return when the learner is fine."""
    model = getattr(learner, "model", None)  # a stand-in learner (tests) has only forward_logprobs
    found = nonfinite_parameters(model) if model is not None else []
    if not found and prefix:
        return
    cause = weights_message(found) if found else ("the learner's probe logprobs are not finite (its weights are, "
                                                  "but its forward overflows)")
    raise NonFiniteError(f"weight-sync probe: {prefix}{cause}; the training diverged, the weight sync is not at "
                         "fault. Lower the learning rate (learner.optimizer.lr, trainer.sft.lr)")


def own_engine(engine) -> EngineLogprobs:
    """This rank's own `engine` as an EngineLogprobs, named by the global rank."""
    who = f"rank {dist.get_rank() if dist.is_initialized() else 0}"
    return lambda rows: {who: torch.stack(engine.prompt_logprobs(rows))}


def verify_logprobs(learner, engine, tokens, tol: float) -> float | None:
    """`compare_engines` with this rank's own engine (None: compare nothing), named by the global rank."""
    return compare_engines(learner, tokens, tol, None if engine is None else own_engine(engine))

"""The learner side of one RL step: the rollout in the learner's token layout (training/learner_batch.py
`LearnerBatch`), the old logprobs from their source (`OLD_LOGPROB_SOURCES`, keyed by algorithm.old_logprobs),
advantages and off-policy corrections, and the policy-gradient updates.

    prep = prepare(learner, batch, cfg, pad_id=pad, dp_group=dp)   # final: every mask applied, every per-token tensor
    metrics = update(learner, prep, cfg, updates=2, dp_group=dp)

Layout: `tokens` [B, T] is prompt + response, right-padded; learner outputs [B, T-1] where column t scores
token t + 1; `mask` [B, T-1] marks the scored response tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_sparse_rl.algorithms import (
    apply_corrections, compute_advantages, loss_normalizer, mismatch_metrics, routing_attribution,
    tail_metrics,
)
from megatron_sparse_rl.algorithms.corrections import opsm_keep
from megatron_sparse_rl.algorithms.objective import ObjectiveInputs, ObjectiveSums, current_tis, rl_objective
from megatron_sparse_rl.algorithms.old_policy import engine_mean_logprobs
from megatron_sparse_rl.config.algorithm import AlgorithmConfig, CorrectionsConfig
from megatron_sparse_rl.learner.extras import ForwardExtras
from megatron_sparse_rl.moe.indexer_storage import IndexerRecord
from megatron_sparse_rl.learner.routing import RoutingResult
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.training.learner_batch import LearnerBatch
from megatron_sparse_rl.training.sparse_kv import drop_preempted


@dataclass(frozen=True)
class PreparedBatch:
    """One rank's batch as the updates and the step's metrics read it (`prepare`'s result, final: nobody changes a
    mask after it), every per-token tensor in the learner's shifted layout [B, T-1]."""

    tokens: torch.Tensor
    """int [B, T]: prompt + response, right-padded."""
    mask: torch.Tensor
    """bool [B, T-1]: response tokens kept for training (after the corrections and the preempted-sample drop)."""
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    """float [B] per-sequence advantages."""
    weights: torch.Tensor
    """float [B, T-1] correction weights (applied outside the clip)."""
    metrics: dict[str, float]
    lengths: torch.Tensor | None = None
    """int [B] real token counts (routing replay)."""
    routes: Any = None
    """moe.RouteStore the updates replay (R2: recorded in the old-logprob forward; R3: the engine's)."""
    ref_logprobs: torch.Tensor | None = None
    """[B, T-1] logprobs of the reference (initial) model, for the KL term."""
    loss_mask: torch.Tensor | None = None
    """bool [B, T-1]: the model's tokens (`LearnerBatch.loss_mask`: every response token of a single-turn sample),
    before corrections."""
    sampling_support: Any = None
    """rollout.sampling_mask.SamplingSupport the learner renormalises over (algorithm.keep_sampling_mask)."""
    token_version: torch.Tensor | None = None
    """float [B, T-1]: the weight version that sampled each response token (RolloutBatch.token_version), or None."""
    counted: torch.Tensor | None = None
    """bool [B, T-1]: the tokens the loss's denominators count (algorithm.loss.dropped_tokens_in_denominator: every
    finite response token, the corrections' drops included; off: `mask`); None means `mask`."""
    learner_routes: Any = None
    """moe.RouteStore: the routes pi_old's routers chose themselves in the learner's old-logprob forward (off/R2: the
    routes it ran; R3 with routing.record_stats: their own top-k beside the replay), which every update's own routes
    are compared with (routing/drift/...); None without that forward."""
    indexer_record: IndexerRecord | None = None
    """The indexer top-k recorded in the learner's old forward (indices [B, T-1, DSA layers, index_topk] and each
    row's token hash), which every update attends (routing.indexer_replay = R2; learner/indexer_replay.py); None
    otherwise."""


def tool_split_metrics(view: LearnerBatch, old_lp: torch.Tensor, *, group=None) -> dict[str, float]:
    """Episodes: the mu / pi_old mismatch (k1, k3) of the model's tokens before the first environment token of their
    row (`mismatch/k1_before_tool`) and after it (`mismatch/k1_after_tool`), where a tool's output the model never
    generated precedes them. `old_lp` [B, T-1] in the learner's layout."""
    mask = view.loss_mask
    after = mask & (view.env_tokens.cumsum(dim=1) > 0)
    out = {}
    for name, part in (("before_tool", mask & ~after), ("after_tool", after)):
        m = mismatch_metrics(old_lp, view.rollout_logprobs, part, group=group)
        out.update({f"mismatch/k1_{name}": m["mismatch/k1"], f"mismatch/k3_{name}": m["mismatch/k3"]})
    return _scalar_metrics(out)


@dataclass(frozen=True)
class OldPolicyInputs:
    """What a pi_old source reads: the batch in the learner's layout."""

    batch: LearnerBatch
    support: Any
    """The sampling support pi_old is renormalised over (`sampling_keep`), or None."""
    dp_group: Any = None
    """The data-parallel group the step's metrics are global over."""


OldPolicy = Callable[[Any, OldPolicyInputs], tuple[torch.Tensor, Any, dict[str, float]]]
"""(learner, inputs) -> (pi_old [B, T-1], the routing outcome the updates replay, metrics)."""


def _learner_recompute(learner, x: OldPolicyInputs):
    """The learner's dense recompute (R2 records its routes, R3 replays the engine's; DSA with
    routing.indexer_replay = R2 records the indexers' top-k, R3 replays the engine's, padded to the call's width
    like the routes' tokens); with routing.attribute_mismatch a second forward routed the other way
    (`_routing_attribution`)."""
    routing, view, records = learner.routing, x.batch, x.batch.rollout.features
    request = routing.old_forward(records.routed_experts) if routing else None
    engine_indices = None if records.indexer_record is None else records.indexer_record.padded(view.tokens.shape[1] - 1)
    indexer = learner.indexer.old_forward(engine_indices) if learner.indexer else None
    out = learner.forward_logprobs(view.tokens, lengths=view.lengths,
                                   extras=ForwardExtras(sampling_support=x.support, routes=request, indexer=indexer))
    old = routing.after_old_forward(out.get("routing"), records.routed_experts) if routing else None
    metrics = {"old_logprobs/learner_forwards": 1.0}
    if indexer is not None:
        replayed, indexer_metrics = learner.indexer.after_old_forward(out["indexer"], engine_indices)
        old = replace(old or RoutingResult(), indexer=replayed)
        metrics.update(indexer_metrics)
    if routing and routing.cfg.attribute_mismatch:
        metrics.update(_routing_attribution(learner, x, out["logprobs"]))
    return out["logprobs"], old, metrics


def _routing_attribution(learner, x: OldPolicyInputs, old_lp: torch.Tensor) -> dict[str, float]:
    """routing.attribute_mismatch: pi_old again over the same tokens, routed the other way (off/R2: the engine's
    routes replayed; R3: the learner's own), and the mismatch of mu against both (global over x.dp_group)."""
    routing, view = learner.routing, x.batch
    other_routes = routing.counterfactual(view.rollout.features.routed_experts)
    extras = ForwardExtras(sampling_support=x.support, routes=other_routes)
    other = learner.forward_logprobs(view.tokens, lengths=view.lengths, extras=extras)["logprobs"]
    engine, own = (old_lp, other) if routing.old_forward_replays_engine else (other, old_lp)
    return _scalar_metrics(routing_attribution(engine, own, view.rollout_logprobs, view.loss_mask, group=x.dp_group))


def _no_learner_forward(learner, x: OldPolicyInputs):
    if learner.indexer is not None and learner.indexer.mode != "none":
        raise ValueError(f"routing.indexer_replay = {learner.indexer.mode!r} records (R2) or replays (R3) the "
                         "indexers' top-k in the learner's old-policy forward, which this algorithm.old_logprobs "
                         "source skips; use 'learner'")
    routing = learner.routing
    return routing.without_old_forward(x.batch.rollout.features.routed_experts) if routing else None


def _sampler(learner, x: OldPolicyInputs):
    """The sampler's own logprobs mu (no learner forward)."""
    return x.batch.rollout_logprobs.clone(), _no_learner_forward(learner, x), {"old_logprobs/learner_forwards": 0.0}


def _engine_mean(learner, x: OldPolicyInputs):
    """logsumexp of the engine's n re-scorings minus log n (no learner forward)."""
    view, old = x.batch, _no_learner_forward(learner, x)
    if view.rescored_logprobs is None:
        raise ValueError("algorithm.old_logprobs = engine_mean but the rollout batch carries no engine re-scorings "
                         "(RolloutBatch.rescored_logprobs); the rollout step must ask the engine for them")
    old_lp, spread = engine_mean_logprobs(view.rescored_logprobs, view.loss_mask)
    return old_lp, old, {"old_logprobs/learner_forwards": 0.0, **_scalar_metrics(spread)}


@dataclass(frozen=True)
class OldLogprobSource:
    """One value of algorithm.old_logprobs: how pi_old is computed, and what the rollout brings for it."""

    old_policy: OldPolicy
    rescores: bool = False
    """The engine re-scores every sampled sequence algorithm.old_logprobs_samples times (rescored_logprobs)."""

    def rescorings(self, cfg: AlgorithmConfig) -> int:
        """The re-scorings per sequence the rollout asks the engine for."""
        return cfg.old_logprobs_samples if self.rescores else 0


OLD_LOGPROB_SOURCES: dict[str, OldLogprobSource] = {
    "learner": OldLogprobSource(_learner_recompute),
    "engine": OldLogprobSource(_sampler),
    "engine_mean": OldLogprobSource(_engine_mean, rescores=True),
}
"""algorithm.old_logprobs (config/algorithm.py `OldLogprobsSource`) -> its source; `old_logprobs/learner_forwards`
counts the learner recompute (1 or 0 per step)."""


def old_logprob_source(cfg: AlgorithmConfig) -> OldLogprobSource:
    """The source algorithm.old_logprobs names; KeyError listing the choices otherwise."""
    try:
        return OLD_LOGPROB_SOURCES[cfg.old_logprobs]
    except KeyError:
        raise KeyError(f"unknown algorithm.old_logprobs {cfg.old_logprobs!r}; "
                       f"choices: {sorted(OLD_LOGPROB_SOURCES)}") from None


def _scalar_metrics(metrics: dict[str, torch.Tensor], prefix: str = "") -> dict[str, float]:
    return {prefix + k: float(v) for k, v in metrics.items()}


def sampling_keep(batch: RolloutBatch, cfg: AlgorithmConfig):
    """The sampling support the learner renormalises over, or None when algorithm.keep_sampling_mask is off."""
    if not cfg.keep_sampling_mask:
        return None
    if batch.features.sampling_mask is None:
        raise ValueError("algorithm.keep_sampling_mask = true but the rollout batch carries no sampling mask "
                         "(set rollout.record_sampling_mask = true)")
    return batch.features.sampling_mask


def _support_metrics(keep) -> dict[str, float]:
    counts = torch.cat([c.float() for c in keep.counts]) if len(keep) else torch.zeros(0)
    truncated = counts[counts > 0]
    return {"sampling_mask/truncated_frac": float(len(truncated)) / max(len(counts), 1),
            "sampling_mask/kept_ids_mean": float(truncated.mean()) if len(truncated) else 0.0}


def _rollout_time(cfg: CorrectionsConfig) -> CorrectionsConfig:
    """The corrections applied once at rollout time: all enabled ones but OPSM and TIS with ratio pi_theta, whose
    rules use the current pi_theta and so run in every update's loss (`make_loss`)."""
    if cfg.opsm.enabled:
        cfg = replace(cfg, opsm=replace(cfg.opsm, enabled=False))
    return replace(cfg, tis=replace(cfg.tis, enabled=False)) if current_tis(cfg) else cfg


def _opsm_frac_at_old(cfg: CorrectionsConfig, rollout_lp, old_lp, mask, advantages) -> float:
    """Fraction of non-empty sequences OPSM would mask with pi_theta = pi_old (a rollout-time diagnostic; the
    mask the updates apply is reported by `update` as `opsm/masked_seq_frac`)."""
    seqs = mask.any(dim=-1)
    masked = seqs & ~opsm_keep(cfg.opsm, rollout_lp, old_lp, mask, advantages).squeeze(-1)
    return float(masked.sum()) / max(int(seqs.sum()), 1)


def prepare(learner, batch: RolloutBatch, cfg: AlgorithmConfig, *, pad_id: int, dp_group,
            reference=None) -> PreparedBatch:
    """Old logprobs (from algorithm.old_logprobs' source), advantages, corrections and every mask for this rank's
    rollout batch; the result is final. With the learner's routing (`learner.routing`) the old forward records (R2)
    or replays the engine's (R3) routes; with algorithm.keep_sampling_mask, pi_old (and later pi_theta) is
    renormalised over the sampler's support. A batch with sparse-KV keep records (rollout.kv.policy) leaves its
    preempted compressed samples out of the loss (training/sparse_kv.py `drop_preempted`)."""
    if batch.reward is None:
        raise ValueError("the rollout batch has no rewards; score it before the update")
    view = LearnerBatch.from_rollout(batch, pad_id)
    tokens, mask, rollout_lp, lengths = view.tokens, view.loss_mask, view.rollout_logprobs, view.lengths
    support = sampling_keep(batch, cfg)
    old_lp, old, source_metrics = old_logprob_source(cfg).old_policy(learner, OldPolicyInputs(view, support, dp_group))
    advantages = compute_advantages(batch.reward.float(), batch.group_ids, cfg=cfg.advantage)
    corr = apply_corrections(_rollout_time(cfg.corrections), old_lp, rollout_lp, mask, advantages=advantages,
                             group=dp_group)
    metrics = _scalar_metrics({**mismatch_metrics(old_lp, rollout_lp, mask, group=dp_group),
                               **tail_metrics(old_lp, rollout_lp, mask, group=dp_group)})
    if batch.loss_mask is not None:
        metrics.update(tool_split_metrics(view, old_lp, group=dp_group))
    metrics.update(source_metrics)
    if cfg.corrections.opsm.enabled:
        metrics["opsm/masked_seq_frac_at_pi_old"] = _opsm_frac_at_old(cfg.corrections, rollout_lp, old_lp, mask,
                                                                      advantages)
    metrics.update(_scalar_metrics(corr.metrics))
    if old:
        metrics.update(_scalar_metrics(old.metrics))
    if support is not None:
        metrics.update(_support_metrics(support))
    ref_lp = None
    if cfg.kl.coef > 0:
        if reference is None:
            raise ValueError("algorithm.kl.coef > 0 needs reference logprobs, but no reference model was built")
        ref_lp = reference.forward_logprobs(tokens, lengths=lengths)["logprobs"]
    keep = mask & corr.keep
    counted = mask & corr.valid if cfg.loss.dropped_tokens_in_denominator else keep
    if batch.features.kv_keep is not None:
        keep, metrics["kv/preempted_dropped_frac"] = drop_preempted(keep, batch.features.kv_keep)
        counted, _ = drop_preempted(counted, batch.features.kv_keep)
    return PreparedBatch(tokens, keep, old_lp, rollout_lp, advantages, corr.weights, metrics,
                         lengths=lengths, routes=old.routes if old else None, ref_logprobs=ref_lp,
                         loss_mask=mask, sampling_support=support, token_version=view.token_version,
                         counted=counted,
                         learner_routes=old.learner_routes if old else None,
                         indexer_record=old.indexer if old else None)


def update(learner, prep: PreparedBatch, cfg: AlgorithmConfig, *, updates: int, dp_group) -> dict[str, float]:
    """`updates` optimizer steps over equal row slices of the batch; losses are normalised by the global
    (all data-parallel ranks) token or sequence count of each mini-batch. Returns mean metrics. With the
    learner's routing, every update forward (and recompute backward) replays `prep.routes`, and with
    routing.record_stats each update's own routes of its rows are compared with `prep.learner_routes` of the same
    rows (`_routing_over_updates`). OPSM (algorithm.corrections.opsm) is applied here, in every micro-batch's loss
    with the current policy (`make_loss`), and reported as `opsm/masked_seq_frac`."""
    sums, totals, routed = None, dict.fromkeys(_LEARNER_SUMS, 0.0), []
    rows = torch.arange(prep.tokens.shape[0])
    counted = prep.counted if prep.counted is not None else prep.mask
    for chunk in rows.chunk(updates):
        norm = loss_normalizer(counted[chunk], cfg.loss.aggregation, group=dp_group)
        loss_fn = make_loss(prep, chunk, cfg, norm)
        request = None
        if learner.routing:
            request = learner.routing.update(_rows_of(prep.routes, chunk), _rows_of(prep.learner_routes, chunk))
        indexer = None
        if learner.indexer:
            indexer = learner.indexer.update(_rows_of(prep.indexer_record, chunk))
        support = _rows_of(prep.sampling_support, chunk)
        out = learner.train_step(prep.tokens[chunk], loss_fn, lengths=prep.lengths[chunk],
                                 extras=ForwardExtras(sampling_support=support, routes=request, indexer=indexer))
        sums = out[OBJECTIVE] if sums is None else sums + out[OBJECTIVE]
        totals = {k: v + out[k] for k, v in totals.items()}
        routed.append({k: float(v) for k, v in out.items() if k.startswith(("routing/", "indexer/"))})
    return {**reduce_metrics(sums, totals, updates, dp_group), **_routing_over_updates(routed)}


def _rows_of(per_row, chunk: torch.Tensor):
    """Rows `chunk` of a per-row extra (RouteStore, SamplingSupport), or None."""
    return per_row.select(chunk) if per_row is not None else None


def _routing_over_updates(per_update: list[dict[str, float]]) -> dict[str, float]:
    """The updates' routing metrics as the step logs them: the expert drift (routing/drift/layer{L},
    routing/drift_mean, routing/drift_token_fraction; each update's already global over the data-parallel ranks)
    averaged over the updates, and routing/drift_last, the last update's drift_mean (the furthest pi_theta gets from
    pi_old in the step); indexer/flip_rate... (DSA indexer replay, global) averaged over the updates; the rest
    (routing/replay_applied_fraction) as the last update left it."""
    out: dict[str, float] = {}
    for metrics in per_update:
        out.update(metrics)
    for k in out:
        if k.startswith("indexer/"):
            out[k] = sum(m[k] for m in per_update) / len(per_update)
    drifts = [m for m in per_update if "routing/drift_mean" in m]
    if drifts:
        for k in drifts[0]:
            if k.startswith("routing/drift"):
                out[k] = sum(m[k] for m in drifts) / len(drifts)
        out["routing/drift_last"] = drifts[-1]["routing/drift_mean"]
    return out


OBJECTIVE = "objective"
"""The key of the objective's `ObjectiveSums` among a train step's metrics."""
_LEARNER_SUMS = ("loss", "grad_norm", "lr")
"""What the learner's train_step adds to every step's metrics (summed over the updates)."""


def make_loss(prep: PreparedBatch, chunk: torch.Tensor, cfg: AlgorithmConfig, norm: torch.Tensor):
    """learner.train_step's loss for the mini-batch rows `chunk`: loss_fn(logprobs [b, T-1], entropy [b, T-1],
    index [b] rows of the chunk) -> (loss, {OBJECTIVE: sums}): the objective (algorithms/objective.py `rl_objective`)
    of those rows, its metrics as `ObjectiveSums` (the learner adds them over micro-batches); `norm` comes from the
    whole mini-batch's mask."""
    rows = {"mask": prep.mask, "counted": prep.counted if prep.counted is not None else prep.mask,
            "old_logprobs": prep.old_logprobs, "rollout_logprobs": prep.rollout_logprobs,
            "loss_mask": prep.loss_mask if prep.loss_mask is not None else prep.mask,
            "advantages": prep.advantages, "weights": prep.weights, "ref_logprobs": prep.ref_logprobs}
    rows = {k: None if v is None else v[chunk] for k, v in rows.items()}

    def loss_fn(logprobs, entropy, index):
        dev = logprobs.device
        x = ObjectiveInputs(**{k: None if v is None else v[index].to(dev) for k, v in rows.items()})
        loss, sums = rl_objective(logprobs, entropy, x, cfg, norm)
        return loss, {OBJECTIVE: sums}

    return loss_fn


def reduce_metrics(sums: ObjectiveSums, totals: dict[str, float], updates: int, dp_group) -> dict[str, float]:
    """The step's loss metrics over `updates` updates and the data-parallel ranks: the objective's token means
    (`ObjectiveSums.means`), loss/value (the updates' mean of the loss, each rank's a share of the global one, so
    summed over the ranks), and the mean grad norm and learning rate."""
    learner = {f"learner/{k}": totals[k] for k in _LEARNER_SUMS}  # summed with the objective's: one all-reduce
    reduced = ObjectiveSums(sums.weighted, {**sums.counts, **learner}).all_reduce(dp_group)
    counts = dict(reduced.counts)
    loss, grad_norm, lr = (counts.pop(key) for key in learner)
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    return {**ObjectiveSums(reduced.weighted, counts).means(), "loss/value": loss / updates,
            "train/grad_norm": grad_norm / (updates * dp), "train/lr": lr / (updates * dp)}

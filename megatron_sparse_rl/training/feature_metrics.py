"""What the features riding on the rollouts measure at each RL step, on the learner's side: one hook per feature,
chosen at set-up from the run's config (`feature_hooks`), each called with the step's prepared batch (`StepView`).
The step adds what they return and never asks which features are on.

    hooks = feature_hooks(run)    # trainer.max_staleness: StalenessMetrics; rollout.kv: SparseKVMetrics
    metrics = feature_metrics(hooks, learner, StepView(batch, prep, version=3, kv_budget=None, dp_group=dp))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from megatron_sparse_rl.algorithms.aggregation import global_sum
from megatron_sparse_rl.config.rollout import KVConfig
from megatron_sparse_rl.config.schema import RunConfig
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.training.sparse_kv import kv_metrics, sparse_logprobs

if TYPE_CHECKING:
    from megatron_sparse_rl.training.update import PreparedBatch


@dataclass(frozen=True, slots=True)
class StepView:
    """One RL step's batch as the feature hooks read it."""

    batch: RolloutBatch
    prep: "PreparedBatch"
    version: int
    """The learner's weight version: RL steps trained so far."""
    kv_budget: int | None
    """The sparse-KV budget the batch was sampled at (None: rollout.kv.budget)."""
    dp_group: Any
    """The data-parallel group the metrics are global over (None: one rank)."""


class FeatureHook(Protocol):
    def __call__(self, learner, step: StepView) -> dict[str, float]: ...


@dataclass(frozen=True, slots=True)
class StalenessMetrics:
    """Asynchronous RL (trainer.max_staleness > 0), global over data-parallel ranks: how many weight versions behind
    the step's version the batch's tokens were sampled (mean, max, share of stale tokens) and the k1 mismatch
    (log mu - log pi_old) of fresh and of stale tokens. `mismatch/k1_staleness` = stale share x (k1 stale - k1 fresh)
    estimates the staleness term of the split log mu - log pi_old = numerics + compression + staleness, taking the
    fresh tokens' k1 as the rest's."""

    def __call__(self, learner, step: StepView) -> dict[str, float]:
        prep = step.prep
        if prep.token_version is None:
            raise ValueError("trainer.max_staleness > 0 needs RolloutBatch.token_version from the engines")
        mask = prep.loss_mask.bool()
        lag = (step.version - prep.token_version.double())[mask]
        k1 = (prep.rollout_logprobs - prep.old_logprobs).double()[mask]
        stale = lag > 0
        sums = torch.tensor([float(mask.sum()), float(lag.sum()), float(stale.sum()), float(k1[~stale].sum()),
                             float(k1[stale].sum())], dtype=torch.float64)
        n, lag_sum, n_stale, k1_fresh, k1_stale = global_sum(sums, step.dp_group).tolist()
        lag_max = torch.tensor([float(lag.max()) if lag.numel() else 0.0], dtype=torch.float64)
        if step.dp_group is not None:
            dist.all_reduce(lag_max, op=dist.ReduceOp.MAX, group=step.dp_group)
        fresh_mean = k1_fresh / max(n - n_stale, 1.0)
        stale_mean = k1_stale / n_stale if n_stale else fresh_mean
        return {"async/staleness_mean": lag_sum / max(n, 1.0), "async/staleness_max": float(lag_max),
                "async/stale_frac": n_stale / max(n, 1.0), "mismatch/k1_fresh": fresh_mean,
                "mismatch/k1_stale": stale_mean,
                "mismatch/k1_staleness": n_stale / max(n, 1.0) * (stale_mean - fresh_mean)}


@dataclass(frozen=True, slots=True)
class SparseKVMetrics:
    """Sparse-KV rollouts (rollout.kv.policy set): training/sparse_kv.py `kv_metrics`, and with
    rollout.kv.record_keep pi_sparse recomputed by the learner under the engine's keep sets (`sparse_logprobs`)."""

    kv: KVConfig

    def __call__(self, learner, step: StepView) -> dict[str, float]:
        batch, prep = step.batch, step.prep
        sparse = sparse_logprobs(learner, batch, prep.tokens, prep.sampling_support) if self.kv.record_keep else None
        budget = self.kv.budget if step.kv_budget is None else step.kv_budget
        return kv_metrics(batch, prep.old_logprobs, prep.rollout_logprobs, prep.loss_mask, budget, sparse=sparse)


def feature_hooks(run: RunConfig) -> tuple[FeatureHook, ...]:
    """The hooks of the features this run has on."""
    hooks: list[FeatureHook] = []
    if run.trainer.max_staleness:
        hooks.append(StalenessMetrics())
    if run.rollout.kv.policy != "none":
        hooks.append(SparseKVMetrics(run.rollout.kv))
    return tuple(hooks)


def feature_metrics(hooks: tuple[FeatureHook, ...], learner, step: StepView) -> dict[str, float]:
    """Every hook's metrics, in one dict."""
    return {k: v for hook in hooks for k, v in hook(learner, step).items()}

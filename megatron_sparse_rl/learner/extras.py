"""`ForwardExtras`: what one Learner call takes besides its tokens, as one frozen argument.

    extras = ForwardExtras(sampling_support=batch.features.sampling_mask,       # keep-sampling-mask
                           attention_mask=batch_attention_mask(batch.features.kv_keep, T - 1),  # sparse-KV pi_sparse
                           routes=RouteRequest(replay=routes),                # MoE routing replay (R2/R3)
                           indexer=IndexerRequest(replay=record))             # DSA indexer replay (R2)
    out = learner.forward_logprobs(tokens, lengths=lengths, extras=extras)
    metrics = learner.train_step(tokens[rows], loss_fn, lengths=lengths[rows], extras=extras.select(rows))

Every extra is optional and describes the call's rows (row i of each extra is row i of `tokens`). The learner
applies each one for the duration of that call only (learner/learner.py): the sampling support in its scoring,
the attention mask as the micro-batch's argument to Megatron's forward, the routes through the routing state
the learner owns (learner/routing.py), the indexer's selection through its indexer state
(learner/indexer_replay.py). Nothing is left on the learner or on a module between calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_sparse_rl.rollout.sampling_mask import SamplingSupport
    from megatron_sparse_rl.moe.storage import RouteStore
    from megatron_sparse_rl.learner.indexer_replay import IndexerRequest


def _rows(index) -> torch.Tensor:
    return torch.as_tensor(index, dtype=torch.long).reshape(-1)


@dataclass(kw_only=True, frozen=True, slots=True)
class RouteRequest:
    """What the MoE routers do in one call. Needs a Learner built with `routing` (its routers then carry
    Megatron's RouterReplay); see learner/routing.py for the per-rank layout and the checks."""

    replay: RouteStore | None = None
    """Routes to replay, one sequence per row: a row of n real tokens has routes for its n - 1 input positions
    (uint8/uint16 [n - 1, MoE layers, top-k] each). Replayed in the forward and in every activation-recompute
    backward; after the call every router token must have run the replayed experts
    (`routing/replay_applied_fraction` == 1). Missing, misshapen or other tokens' routes raise RoutingError
    before the forward."""
    record: bool = False
    """Record the learner's own routes of the rows (`RoutingResult.learner_routes`): what its routers choose
    themselves; under `replay`, their own top-k of the same scores beside the replayed map (statistics). Returned
    by `forward_logprobs`; `train_step` returns no routes, so there it needs `compare_with`."""
    compare_with: RouteStore | None = None
    """Routes of the same rows to compare the call's own routes (`record`, required) with: per MoE layer the
    fraction of tokens whose top-k set differs, as the call's `routing/drift/...` metrics, global over the
    data-parallel ranks (every rank's call must have it). An RL update passes the old-logprob forward's own routes:
    the expert drift pi_old -> pi_theta (learner/routing.py `LearnerRouting.update`)."""
    lengths: torch.Tensor | None = None
    """int [B] real tokens of each row (>= 2), which bound the routes; None: the call's `lengths`, or without
    them every row's full width."""

    def __post_init__(self):
        if self.replay is None and not self.record:
            raise ValueError("RouteRequest asks for nothing: give routes to replay or record=True")
        if self.compare_with is not None and not self.record:
            raise ValueError("RouteRequest.compare_with compares the call's own routes: it needs record=True")

    def select(self, index) -> RouteRequest:
        """The request for rows `index` of the call's rows."""
        rows = _rows(index)
        return RouteRequest(replay=None if self.replay is None else self.replay.select(rows), record=self.record,
                            compare_with=None if self.compare_with is None else self.compare_with.select(rows),
                            lengths=None if self.lengths is None else torch.as_tensor(self.lengths)[rows])


@dataclass(kw_only=True, frozen=True, slots=True)
class ForwardExtras:
    """Per-call inputs of `Learner.forward_logprobs` / `Learner.train_step` (module docstring)."""

    sampling_support: SamplingSupport | None = None
    """Keep-sampling-mask (algorithm.keep_sampling_mask): per row, the ids the sampler could draw at each
    response token (rollout.sampling_mask.SamplingSupport; anything with len() = rows and
    `local_mask(rows, length, vocab_start, vocab_end)` -> bool [rows, length, vocab slice]). The logprobs are
    renormalised over those ids; the entropy stays the unrestricted policy's."""
    attention_mask: torch.Tensor | None = None
    """bool [B, layers, kv_heads, S-1, S-1]: True where query t may attend key s, per layer and KV head (e.g.
    what a sparse KV cache kept: kv.record.batch_attention_mask); None = causal. Needs Megatron's local
    attention (learner/attention_mask.py)."""
    routes: RouteRequest | None = None
    """MoE routing replay / recording for this call (RouteRequest); None = the routers route themselves."""
    indexer: IndexerRequest | None = None
    """DSA indexer replay / recording for this call (learner/indexer_replay.py IndexerRequest); None = every
    DSA layer attends its indexer's own top-k."""

    def select(self, index) -> ForwardExtras:
        """The extras of rows `index` of the call's rows (e.g. one update's mini-batch)."""
        rows = _rows(index)
        return ForwardExtras(
            sampling_support=None if self.sampling_support is None else self.sampling_support.select(rows),
            attention_mask=None if self.attention_mask is None else self.attention_mask[rows],
            routes=None if self.routes is None else self.routes.select(rows),
            indexer=None if self.indexer is None else self.indexer.select(rows))


NO_EXTRAS = ForwardExtras()

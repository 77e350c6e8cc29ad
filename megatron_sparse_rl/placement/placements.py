"""Where the rollout engines are, as one object built at set-up (training/context.py `build_context`); the
training steps call it and never ask which one they have (README.md, "Layout": seams between components).

    out = placement.generate(work)              # work(engine, dp_rank) -> this rank's data share's result
    out = placement.sample(requests, finish)    # finish(batch of requests[d], d) of this rank's share d
    for s in placement.steps_ahead(step, last):  # asynchronous RL: the steps to hand over (up to `depth` ahead)
        placement.sample_ahead(requests, finish)  # sample step s while the learner trains; queued here
    stats = placement.sync(learner, bucket_mb=256, version=v)   # weights as version v (while sampling ahead: in
                                                # flight); a LoRA learner's adapted tensors alone once the engines
                                                # hold a full set (weight_sync/scope.py)
    ahead = placement.take_ahead()              # the oldest batch queued (AheadBatch: finish(batch, dp_rank) of
                                                # this rank's share, the engines' times); None when none is
    metrics = placement.verify(learner, probe, tol)  # the probe's sync/... metrics (weight_sync/verify.py)
    placement.shutdown()                         # idempotent; on every way out of the learner loop

Every learner rank calls every method in the same order (they run collectives). `work` is called with an
engine and a data-parallel rank d; it must depend on d (prompts `examples[d::dp]`, seeds from d) and not on
which rank runs it, so the three placements give the same results:

- `Colocated`: every rank owns a whole engine (rollout.tensor_parallel_size 1); the first rank of each
  tensor/pipeline-parallel group runs `work` for its own share and hands the result to its TP/PP peers
  (they train on the same rows).
- `ColocatedSharedEngine`: an engine spans t consecutive ranks (vLLM's external_launcher); every rank of it
  runs `work` for the shares of all its ranks, the same calls in the same order (vLLM needs every rank of an
  engine in each call), and keeps its own.
- `Disaggregated`: the engines live on the rollout ranks (placement/disaggregated.py); learner rank 0 runs
  `work` for every share through them and broadcasts the results over the learner ranks. It alone samples ahead
  (`sample_ahead`, trainer.max_staleness k > 0, docs/async.md): config validation refuses the others. It queues up
  to k batches (k = 1: a queue of depth one), the rollout ranks sample them one after another without waiting for
  the syncs, and `take_ahead` collects the oldest.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch.distributed as dist

from megatron_sparse_rl.placement.rollout import RolloutRequest
from megatron_sparse_rl.weight_sync.engine_weights import EngineWeights
from megatron_sparse_rl.weight_sync.scope import EngineWeightState

T = TypeVar("T")
Work = Callable[[Any, int], T]
"""(engine, data-parallel rank) -> that share's result (a rollout batch, an accuracy sum, ...)."""


Finish = Callable[[Any, int], Any]
"""finish(batch of share d, d) -> that share's result (on the rank that runs the engines)."""


@dataclass(frozen=True)
class AheadBatch:
    """A rollout sampled ahead (asynchronous RL, trainer.max_staleness k > 0), queued by the placement from
    `sample_ahead` to `take_ahead`, which collects it."""

    finish: Finish
    requests: list[RolloutRequest]
    """What was asked per share, to sample it again (trainer.stale_policy recompute)."""
    result: Any = None
    """This rank's share's finish(...), once collected."""
    engine_s: dict[str, float] | None = None
    """The engines' seconds once collected: generate_s (sampling), wait_s (idle before the batch began), load_s,
    in_flight (1 when the weights arrived between engine steps)."""
    learner_wait_s: float = 0.0
    """How long the learner waited for the batch (collecting and finishing it)."""


class Placement:
    """The interface the steps use. `pad_id` pads learner token rows as the engines pad theirs; `weights` is the
    engines' precision and weight format (rollout.dtype, rollout.quantization), applied by `sync` and `verify`."""

    pad_id: int
    weights: EngineWeights = EngineWeights()
    depth: int = 0
    """The asynchronous window: how many batches it samples ahead of the one being trained (trainer.max_staleness;
    0: none, the synchronous loop)."""
    _handed: int = -1
    """The last step handed over (sampled now or ahead)."""
    engine_state: EngineWeightState
    """Whether the engines hold a full set of the learner's weights: what `sync` sends (weight_sync/scope.py)."""

    def generate(self, work: Work) -> T:
        raise NotImplementedError

    def steps_ahead(self, step: int, last: int) -> range:
        """The steps to hand over with `sample_ahead` now that step `step` is trained (its batch collected or sampled
        now): each step once, up to `depth` past `step`, none past `last`. Empty when the placement does not sample
        ahead (depth 0)."""
        start, stop = max(self._handed, step) + 1, min(step + self.depth, last) + 1
        self._handed = max(self._handed, step, stop - 1)
        return range(start, stop)

    def sample(self, requests: list[RolloutRequest], finish: Finish) -> Any:
        """Run requests[d] (data-parallel share d) on the engines now, re-scorings included: this rank's share's
        finish(batch, d)."""
        return self.generate(lambda engine, d: finish(requests[d].run(engine), d))

    def sync(self, learner, *, bucket_mb: float, version: int = 0):
        """Learner weights -> the engines (checksummed), which then hold weight version `version` (the RL steps
        trained; RolloutBatch.token_version); returns weight_sync's `SyncStats` (`full_bytes`: what a full sync
        moves). While the engines sample ahead (`sample_ahead`) the weights reach them in flight. What is sent is
        decided by `engine_state` (weight_sync/scope.py): everything until the engines hold a full set, then a LoRA
        learner's adapted tensors alone."""
        return self.engine_state.sync(learner, lambda only: self._send(learner, bucket_mb=bucket_mb, version=version,
                                                                       only=only))

    def _send(self, learner, *, bucket_mb: float, version: int, only: frozenset[str] | None):
        """Send the learner's weights (`only`: those HF tensors alone) to the engines as weight version `version`."""
        raise NotImplementedError

    def sample_ahead(self, requests: list[RolloutRequest], finish: Finish) -> None:
        """Start sampling requests[d] (data-parallel share d) and return at once; the placement queues the batch
        (`AheadBatch`). The syncs reach the engines while they sample; `take_ahead` collects it. Every learner rank
        calls it."""
        raise NotImplementedError(f"{type(self).__name__} does not sample ahead: asynchronous RL "
                                  "(trainer.max_staleness > 0) needs the disaggregated placement")

    def take_ahead(self) -> AheadBatch | None:
        """The oldest batch sampled ahead, collected (it waits for it), handed over once; None when none is queued."""
        return None

    def verify(self, learner, tokens, tol: float) -> dict[str, float]:
        """The probe's metrics (weight_sync/verify.py `probe_metrics`): max |engine - learner| prompt logprobs over
        the engines this rank compares (absent when it compares none), the learner holding the engines' weights;
        raises WeightSyncError above `tol` naming the engine."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class Colocated(Placement):
    """Every learner rank owns a whole engine in its own process; `model_parallel` = tp * pp * cp of the learner (the
    ranks of `groups.model_parallel`, which share one data-parallel rank's batch)."""

    def __init__(self, engine, groups, model_parallel: int, *, weights: EngineWeights = EngineWeights()):
        self.engine, self.groups, self.model_parallel = engine, groups, model_parallel
        self.pad_id, self.weights = engine.pad_id, weights
        self.engine_state = EngineWeightState()  # the engine was just started: it holds none of the learner's weights

    def _from_leader(self, obj):
        """The model-parallel group's first rank's `obj` on every rank of the group."""
        if self.model_parallel == 1:
            return obj
        holder = [obj]
        src = dist.get_process_group_ranks(self.groups.model_parallel)[0]
        dist.broadcast_object_list(holder, src=src, group=self.groups.model_parallel)
        return holder[0]

    def generate(self, work: Work) -> T:
        leader = self.groups.tp_rank == 0 and self.groups.pp_rank == 0 and self.groups.cp_rank == 0
        return self._from_leader(work(self.engine, self.groups.dp_rank) if leader else None)

    def _send(self, learner, *, bucket_mb: float, version: int, only: frozenset[str] | None):
        from megatron_sparse_rl.weight_sync import sync_to_engine

        return sync_to_engine(learner, self.engine, bucket_mb=bucket_mb, convert=self.weights.convert,
                              version=version, only=only)

    def verify(self, learner, tokens, tol: float) -> dict[str, float]:
        from megatron_sparse_rl.weight_sync import probe_metrics
        from megatron_sparse_rl.weight_sync.verify import own_engine

        return probe_metrics(learner, tokens, tol, own_engine(self.engine), self.weights)

    def shutdown(self) -> None:
        self.engine.shutdown()


class ColocatedSharedEngine(Colocated):
    """Colocated, one engine over t consecutive ranks: it samples for the data-parallel ranks `shares` of the
    ranks it spans (sorted, the same on each of them). Sync and verify are per rank, as with whole engines:
    each rank hands its engine the full tensors and vLLM's loaders keep its slice."""

    def __init__(self, engine, groups, model_parallel: int, shares: tuple[int, ...], *,
                 weights: EngineWeights = EngineWeights()):
        super().__init__(engine, groups, model_parallel, weights=weights)
        self.shares = shares

    def generate(self, work: Work) -> T:
        out = {d: work(self.engine, d) for d in self.shares}
        return self._from_leader(out[self.groups.dp_rank])

    @staticmethod
    def shares_of(dp_rank: int, engine_tp: int) -> tuple[int, ...]:
        """The data-parallel ranks of the `engine_tp` consecutive ranks that form this rank's engine (vLLM's
        external_launcher layout), sorted. Collective over the world."""
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, dp_rank)
        first = dist.get_rank() // engine_tp * engine_tp
        return tuple(sorted(set(every[first:first + engine_tp])))


class Disaggregated(Placement):
    """The engines are on the rollout ranks; `remote` (placement/disaggregated.py `RemoteEngine`) drives them
    from learner rank 0. `learner_group`: every learner rank, over which rank 0 hands out the shares."""

    def __init__(self, remote, groups, dp: int, learner_ranks: int, *, recompute_kv: bool = False,
                 weights: EngineWeights = EngineWeights(), depth: int = 0):
        self.remote, self.groups, self.dp, self.learner_ranks = remote, groups, dp, learner_ranks
        self.pad_id, self.weights = remote.pad_id, weights
        self.recompute_kv = recompute_kv  # trainer.in_flight_kv = recompute
        self.depth = depth  # trainer.max_staleness: batches queued at most (0: a synchronous run)
        self._ahead: deque[AheadBatch] = deque()  # the batches sampled ahead, oldest first
        self.engine_state = EngineWeightState()  # the rollout ranks' engines hold none of the learner's weights yet

    def _from_driver(self, out: list | None) -> Any:
        """Learner rank 0's per-share results `out`; this rank's share."""
        if self.learner_ranks > 1:
            holder = [out]
            dist.broadcast_object_list(holder, src=0, group=self.groups.learner)
            out = holder[0]
        return out[self.groups.dp_rank]

    def generate(self, work: Work) -> T:
        return self._from_driver([work(self.remote, d) for d in range(self.dp)] if self.remote.driver else None)

    def sample(self, requests: list[RolloutRequest], finish: Finish) -> Any:
        driver = self.remote.driver
        return self._from_driver([finish(self.remote.run(r), d) for d, r in enumerate(requests)] if driver else None)

    def sample_ahead(self, requests: list[RolloutRequest], finish: Finish) -> None:
        if len(self._ahead) >= self.depth:
            raise RuntimeError(f"{len(self._ahead)} batches sampled ahead are held already (trainer.max_staleness "
                               f"{self.depth}): take_ahead first")
        if self.remote.driver:
            self.remote.run_ahead(requests, recompute=self.recompute_kv)
        self._ahead.append(AheadBatch(finish, requests))

    def take_ahead(self) -> AheadBatch | None:
        if not self._ahead:
            return None
        ahead, start, out = self._ahead.popleft(), time.perf_counter(), None
        if self.remote.driver:
            batches, seconds = self.remote.collect_ahead()
            out = [(ahead.finish(batch, d), seconds) for d, batch in enumerate(batches)]
        result, engine_s = self._from_driver(out)
        return replace(ahead, result=result, engine_s=engine_s, learner_wait_s=time.perf_counter() - start)

    def _send(self, learner, *, bucket_mb: float, version: int, only: frozenset[str] | None):
        return self.remote.sync_weights(learner, bucket_mb=bucket_mb, version=version, convert=self.weights.convert,
                                        only=only)

    def verify(self, learner, tokens, tol: float) -> dict[str, float]:
        from megatron_sparse_rl.weight_sync import probe_metrics

        return probe_metrics(learner, tokens, tol, self.remote.probe_logprobs if self.remote.driver else None,
                             self.weights)

    def shutdown(self) -> None:
        self.remote.shutdown()

"""Disaggregated placement (docs/launch.md, "Disaggregated placement"): learner ranks [0, L) train, rollout ranks [L, L + R)
run R / t vLLM engines of t = rollout.tensor_parallel_size consecutive ranks each and serve commands from
learner rank 0 (t > 1: vLLM's external_launcher; every rank of an engine runs every command).

Each side has its own default torch.distributed world (parallel/bridge.py `SplitWorld`, made by
`ParallelLayout.initialize`): Megatron's collectives and checkpoints stay among the learner ranks, vLLM's among
the rollout ranks. Learner rank 0 drives the rollout ranks over the weight-sync `Bridge` (rank 0 + every
rollout rank) with the commands of placement/protocol.py (one frozen dataclass each; a rollout rank
dispatches them by type, `_HANDLERS`):

    Generate          the `RolloutRequest` (placement/rollout.py) cut into one part per engine; the parts come back
                      by gather_object and are joined in prompt order (`RolloutBatch.concat`). With env.kind a part
                      is an `EpisodeRequest` carrying its examples: the rollout rank runs the episodes, environments
                      and rewards included
    SyncWeights       every learner rank runs `send_weights`, every rollout rank `receive_weights` (checksummed
                      buckets; with t > 1 and trainer.sync_engine_slices each engine rank receives only its
                      slices, over its engine TP rank's bridge); each rollout rank then reports its status
    RunAhead          asynchronous RL (trainer.max_staleness k >= 1, docs/async.md): one more batch for the rollout
                      ranks' queue; rank 0 returns at once. The first one makes them sample ahead
                      (placement/run_ahead.py): they sample the batches handed to them one after another, up to k
                      ahead of the learner, and take every later command as a word between engine steps; weights
                      are loaded there without draining the running requests (`RolloutEngine.update_in_flight`);
                      Collect answers the oldest batch (`AheadBatches`, `collect_ahead`), re-scored at the weights
                      the learner trains it with. Stop as a word stops them (rank 0's shutdown)
    Probe             each engine's prompt logprobs of the probe rows, for rank 0 to compare with the learner's
                      own forward (weight_sync/verify.py `compare_engines`)
    Stop              the rollout ranks leave `serve`, shut their engines down and confirm

On learner ranks `RemoteEngine` stands where the colocated RolloutEngine stands (`pad_id`, `shutdown`; `run`
takes a whole `RolloutRequest`, re-scorings included); the `Disaggregated` placement
(placement/placements.py) wraps it for the steps. A rollout rank that fails a command sends the error back instead
of its result (`Failure.of`); rank 0 raises it naming the rank, and its `shutdown` (run on every exit path of
`trainer.train`) sends Stop, so no rollout rank waits forever; it waits for their confirmation, since rank 0 serves
the store their groups were made from. The rollout ranks hold no state worth saving: checkpoints, metrics and the
HF export are the learner's.
"""
from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_sparse_rl.placement.protocol import (FOLLOWS, SRC, AheadBatches, Collect, Command, Failure, Generate,
                                                   Probe, RunAhead, Stop, SyncWeights, to_word)
from megatron_sparse_rl.placement.rollout import RolloutRequest
from megatron_sparse_rl.placement.run_ahead import AheadRank, Stopped, receive
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.weight_sync import WeightSyncError, send_weights

log = logging.getLogger(__name__)


@dataclass
class RolloutRank:
    """What a rollout rank holds: its engine and the bridge it is driven through."""

    engine: Any
    sync_group: Any
    rank: int
    index: int
    """This rank's place among the rollout ranks (global rank - learner ranks)."""
    engine_tp: int = 1
    """Ranks per engine (rollout.tensor_parallel_size): this rank serves engine index // engine_tp."""
    weights_group: Any = None
    """Where its weights arrive: its engine TP rank's sliced-sync bridge (None: `sync_group`, whole tensors)."""


class RemoteEngine:
    """The rollout ranks as one engine, on learner ranks. Only global rank `SRC` talks to them; on the other
    learner ranks it is a stand-in with `pad_id` (their steps never generate)."""

    def __init__(self, sync_group, rollout_ranks: list[int], pad_id: int, engine_tp: int = 1, *,
                 shards=None, shard_groups: list | None = None):
        if len(rollout_ranks) % engine_tp:
            raise ValueError(f"{len(rollout_ranks)} rollout ranks do not split into engines of {engine_tp} ranks")
        self.group, self.ranks, self.pad_id, self.engine_tp = sync_group, rollout_ranks, pad_id, engine_tp
        self.engines = len(rollout_ranks) // engine_tp
        self.shards, self.shard_groups = shards, shard_groups
        self.driver = dist.get_rank() == SRC  # learner ranks keep their global ranks in the learner world
        self.stopped = False
        self.ahead = False  # the rollout ranks sample ahead (from the first run_ahead until Stop)

    def _command(self, command: Command) -> list:
        """Send `command` to every rollout rank, gather their answers (a rollout rank's error is raised here)."""
        self._send(command)
        return self._gather()

    def _send(self, command: Command) -> None:
        """`command` to every rollout rank: pickled, or as a word while they sample ahead (they poll for one
        between engine steps: placement/protocol.py)."""
        if not self.driver:
            raise RuntimeError(f"only learner rank {SRC} drives the rollout ranks (this is rank {dist.get_rank()})")
        if self.stopped:
            raise RuntimeError("the rollout ranks were stopped")
        if self.ahead:
            self.group.broadcast(to_word(command), src=SRC)
        if not self.ahead or isinstance(command, FOLLOWS):
            self.group.broadcast_object(command, src=SRC)

    def _gather(self) -> list:
        answers = self.group.gather_object(None, dst=SRC)
        for rank, answer in zip(self.ranks, answers[1:]):
            if isinstance(answer, Failure):
                raise (WeightSyncError if answer.sync else RuntimeError)(
                    f"rollout rank {rank} failed: {answer.message}")
        return answers[1:]

    def run(self, request: RolloutRequest) -> RolloutBatch | None:
        """`request` run on the engines, each its part (`RolloutRequest.parts`: seeds as one engine's), re-scorings
        included; the parts joined in prompt order (None: a request without prompts, sent to no engine)."""
        if not request.prompts:
            return None
        answers = self._command(Generate(request.parts(self.engines)))
        return RolloutBatch.concat([a for a in answers if a is not None], self.pad_id)

    def run_ahead(self, requests: list[RolloutRequest], *, recompute: bool) -> None:
        """One more batch (a request per data-parallel share) for the rollout ranks, which sample the batches handed
        to them one after another until Stop (placement/run_ahead.py) and return at once; the weights reach them
        between engine steps (partial rollouts, inside a turn of an episode too; `recompute`: the running requests'
        KV is recomputed under the new weights); `collect_ahead` returns the oldest batch."""
        per_share = [r.parts(self.engines) for r in requests]
        self._send(RunAhead(tuple(tuple(parts[e] for parts in per_share) for e in range(self.engines)), recompute))
        self.ahead = True

    def collect_ahead(self) -> tuple[list[RolloutBatch], dict[str, float]]:
        """The oldest batch sampled ahead (it waits for it): one batch per share (the engines' parts joined) and the
        rollout ranks' seconds (the slowest rank's): sampling, idle before the batch, loading weights."""
        self._send(Collect())
        answers: list[AheadBatches] = [a for a in self._gather() if a is not None]  # raises a rollout rank's error
        batches = [RolloutBatch.concat([a.batches[d] for a in answers if a.batches[d] is not None], self.pad_id)
                   for d in range(len(answers[0].batches))]
        return batches, {k: max(a.seconds[k] for a in answers) for k in answers[0].seconds}

    def sync_weights(self, learner, *, bucket_mb: float, version: int = 0, convert=None,
                     only: frozenset[str] | None = None):
        """Every learner rank calls it: learner -> every engine, checksummed, as weight version `version` (each HF
        tensor replaced by `convert(name, tensor)` when given; `only`: those HF tensors alone, weight_sync/scope.py);
        rank `SRC` checks the receipts (while sampling ahead: a failed load answers the next request)."""
        start = time.perf_counter()
        if self.driver:
            self._send(SyncWeights(version))
        stats = send_weights(learner, self.group, src=SRC, bucket_mb=bucket_mb, shards=self.shards,
                             shard_groups=self.shard_groups, convert=convert, only=only)
        if self.driver and not self.ahead:
            self._gather()  # every engine verified its buckets and loaded them
        return replace(stats, seconds=time.perf_counter() - start)

    def probe_logprobs(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        """Each rollout rank's engine prompt logprobs of `rows`: {"rollout rank r": float32 [B, S-1]}."""
        return {f"rollout rank {rank}": t for rank, t in zip(self.ranks, self._command(Probe(rows)))}

    def shutdown(self) -> None:
        """Send Stop once (rank `SRC`) and wait until every rollout rank has shut its engine down. A rollout
        rank that cannot confirm (it is gone) is logged, not raised: this runs on every way out, errors included."""
        if self.driver and not self.stopped:
            try:
                self._send(Stop())
                self.group.gather_object(None, dst=SRC)
            except Exception as e:  # noqa: BLE001 - never hide the error that brought us here
                log.warning("the rollout ranks did not confirm stop: %s", e)
            finally:
                self.stopped = True


def _generate(rr: RolloutRank, command: Generate) -> RolloutBatch | None:
    batch = command.parts[rr.index // rr.engine_tp].run(rr.engine)
    return batch if rr.index % rr.engine_tp == 0 else None  # the engine's other ranks hold the same rows


def _sync(rr: RolloutRank, command: SyncWeights) -> None:
    receive(rr, command.version)


def _probe(rr: RolloutRank, command: Probe) -> torch.Tensor:
    return torch.stack(rr.engine.prompt_logprobs(command.rows))


def _run_ahead(rr: RolloutRank, command: RunAhead) -> None:
    """RunAhead: sample batch after batch until Stop (placement/run_ahead.py); never answers as a command."""
    if rr.engine_tp > 1:
        raise RuntimeError("sampling ahead needs rollout.tensor_parallel_size 1 (every rank of an engine would have "
                           "to load the weights at the same engine step)")
    AheadRank(rr, command, handle=_handle).run()


_HANDLERS = {Generate: _generate, SyncWeights: _sync, RunAhead: _run_ahead, Probe: _probe}
"""What a rollout rank runs for each command (Stop ends `serve`); the handler's result is the answer."""


def _handle(rr: RolloutRank, command: Command):
    """One command on a rollout rank; returns what goes back to learner rank `SRC`."""
    handler = _HANDLERS.get(type(command))
    if handler is None:
        raise ValueError(f"rollout rank {rr.rank}: unknown command {type(command).__name__}")
    return handler(rr, command)


def serve(rr: RolloutRank) -> dict:
    """A rollout rank's loop: run learner rank `SRC`'s commands until Stop; then shut the engine down."""
    served = 0
    try:
        while True:
            command = rr.sync_group.broadcast_object(None, src=SRC)
            if isinstance(command, Stop):
                break
            try:
                answer = _handle(rr, command)
            except Stopped:
                break
            except Exception as e:  # report it to the driver, which raises it; keep serving until Stop
                log.error("rollout rank %d: %s failed:\n%s", rr.rank, type(command).__name__, traceback.format_exc())
                answer = Failure.of(e)
            rr.sync_group.gather_object(answer, dst=SRC)
            served += 1
    finally:
        rr.engine.shutdown()
    rr.sync_group.gather_object(None, dst=SRC)  # stopped: rank 0 (which serves the store) may exit now
    log.info("rollout rank %d: stopped after %d commands", rr.rank, served)
    return {"rank": rr.rank, "role": "rollout", "commands": served}

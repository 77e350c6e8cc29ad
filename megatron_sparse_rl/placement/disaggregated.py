"""Disaggregated placement (docs/launch.md, "Disaggregated placement"): learner ranks [0, L) train, rollout ranks [L, L + R)
run R / t vLLM engines of t = rollout.tensor_parallel_size consecutive ranks each and serve commands from
learner rank 0 (t > 1: vLLM's external_launcher; every rank of an engine runs every command).

Each side has its own default torch.distributed world (parallel/bridge.py `SplitWorld`, made by
`ParallelLayout.initialize`): Megatron's collectives and checkpoints stay among the learner ranks, vLLM's among
the rollout ranks. Learner rank 0 drives the rollout ranks over the weight-sync `Bridge` (rank 0 + every
rollout rank) with the commands of placement/protocol.py (one frozen dataclass each; a rollout rank
dispatches them by type, `_HANDLERS`):

    Generate          the `RolloutRequest` (placement/rollout.py) cut into one part per engine; the parts come
                      back by gather_object and are joined in prompt order (`RolloutBatch.concat`). With env.kind a
                      part carries its examples (`Episodes`): the rollout rank runs the episodes, environments and
                      rewards included
    SyncWeights       every learner rank runs `send_weights`, every rollout rank `receive_weights` (checksummed
                      buckets; with t > 1 and trainer.sync_engine_slices each engine rank receives only its
                      slices, over its engine TP rank's bridge); each rollout rank then reports its status
    GenerateAhead     asynchronous RL (trainer.max_staleness 1, docs/async.md): engine e samples its part of each
                      call while the learner trains; rank 0 returns at once. The next SyncWeights travels as a
                      word that the rollout rank polls between engine steps: it loads the weights there without
                      draining the running requests (`RolloutEngine.update_in_flight`), or after sampling if it
                      finished first; engine_mean re-scorings run after that, at the new weights; then the
                      batches and the rank's times come back (`AheadBatches`, `collect_ahead`). Stop as a word
                      instead stops the rank (rank 0's shutdown while it samples ahead)
    RunAhead          trainer.max_staleness k > 1: the rank keeps sampling batch after batch, up to k ahead of the
                      learner, and takes everything else as words (placement/run_ahead.py); Collect answers the
                      oldest batch
    Probe             each engine's prompt logprobs of the probe rows, for rank 0 to compare with the learner's
                      own forward (weight_sync/verify.py `compare_engines`)
    Stop              the rollout ranks leave `serve`, shut their engines down and confirm

On learner ranks `RemoteEngine` stands where the colocated RolloutEngine stands (`generate`, `pad_id`,
`shutdown`; `run` takes a whole `RolloutRequest`, re-scorings included); the `Disaggregated` placement
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

from megatron_sparse_rl.config.rollout import SamplingConfig
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.placement.protocol import (FOLLOWS, SRC, AheadBatches, Collect, Command, Failure, Generate,
                                                   GenerateAhead, Probe, RunAhead, Stop, SyncWeights, empty_word,
                                                   from_word, to_word)
from megatron_sparse_rl.placement.rollout import RolloutRequest
from megatron_sparse_rl.weight_sync import WeightSyncError, receive_weights, send_weights

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
        self.ahead = False  # the rollout ranks are sampling ahead (generate_ahead until collect_ahead)
        self.running_ahead = False  # they run ahead (run_ahead, trainer.max_staleness > 1) until Stop

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
        if self.running_ahead:
            self.group.broadcast(to_word(command, running_ahead=True), src=SRC)
            if isinstance(command, FOLLOWS):
                self.group.broadcast_object(command, src=SRC)
        elif self.ahead:
            self.group.broadcast(to_word(command), src=SRC)
        else:
            self.group.broadcast_object(command, src=SRC)

    def _gather(self) -> list:
        answers = self.group.gather_object(None, dst=SRC)
        for rank, answer in zip(self.ranks, answers[1:]):
            if isinstance(answer, Failure):
                raise (WeightSyncError if answer.sync else RuntimeError)(
                    f"rollout rank {rank} failed: {answer.message}")
        return answers[1:]

    def run(self, request: RolloutRequest) -> RolloutBatch:
        """`request` run on the engines, each its part (`RolloutRequest.parts`: seeds as one engine's), re-scorings
        included; the parts joined in prompt order."""
        answers = self._command(Generate(request.parts(self.engines)))
        return RolloutBatch.concat([a for a in answers if a is not None], self.pad_id)

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 group_ids: list[int] | None = None, *, episodes=None) -> RolloutBatch:
        """As RolloutEngine.generate, the prompts split across the engines (`run`)."""
        return self.run(RolloutRequest(prompt_token_ids, sampling, group_ids, episodes=episodes))

    def _per_engine(self, requests: list[RolloutRequest]) -> tuple[tuple[RolloutRequest, ...], ...]:
        """Per engine, its part of each share's request."""
        per_share = [r.parts(self.engines) for r in requests]
        return tuple(tuple(parts[e] for parts in per_share) for e in range(self.engines))

    def generate_ahead(self, requests: list[RolloutRequest], *, recompute: bool) -> None:
        """Start sampling `requests` (one per data-parallel share) on the rollout ranks and return at once. The next
        `sync_weights` reaches the engines between engine steps (partial rollouts, inside a turn of an episode too;
        `recompute`: the running requests' KV is recomputed under the new weights); `collect_ahead` returns the
        batches."""
        if self.ahead:
            raise RuntimeError("the rollout ranks are already sampling ahead: collect_ahead first")
        self._send(GenerateAhead(self._per_engine(requests), recompute))
        self.ahead = True

    def run_ahead(self, requests: list[RolloutRequest], *, recompute: bool) -> None:
        """trainer.max_staleness > 1: one more batch (`requests` as `generate_ahead` takes them) for the rollout
        ranks, which sample the batches handed to them one after another until Stop (placement/run_ahead.py); the
        weights reach them between engine steps; `collect_ahead` returns the oldest batch."""
        self._send(RunAhead(self._per_engine(requests), recompute))
        self.running_ahead = True

    def collect_ahead(self) -> tuple[list[RolloutBatch], dict[str, float]]:
        """After the `sync_weights` that follows `generate_ahead` (running ahead: whenever; it waits for the oldest
        batch): one batch per call (the engines' parts joined) and the rollout ranks' seconds (the slowest rank's):
        sampling, waiting for the weights after sampling (running ahead: idle before the batch), loading."""
        if self.running_ahead:
            self._send(Collect())
        answers: list[AheadBatches] = [a for a in self._gather() if a is not None]  # raises a rollout rank's error
        self.ahead = False
        calls = len(answers[0].batches)
        batches = [RolloutBatch.concat([a.batches[c] for a in answers if a.batches[c] is not None], self.pad_id)
                   for c in range(calls)]
        return batches, {k: max(a.seconds[k] for a in answers) for k in answers[0].seconds}

    def sync_weights(self, learner, *, bucket_mb: float, version: int = 0, convert=None):
        """Every learner rank calls it: learner -> every engine, checksummed, as weight version `version` (each HF
        tensor replaced by `convert(name, tensor)` when given); rank `SRC` checks the receipts (while sampling
        ahead: in `collect_ahead`)."""
        start = time.perf_counter()
        if self.driver:
            self._send(SyncWeights(version))
        stats = send_weights(learner, self.group, src=SRC, bucket_mb=bucket_mb, shards=self.shards,
                             shard_groups=self.shard_groups, convert=convert)
        if self.driver and not (self.ahead or self.running_ahead):
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
    _receive(rr, command.version)


def _probe(rr: RolloutRank, command: Probe) -> torch.Tensor:
    return torch.stack(rr.engine.prompt_logprobs(command.rows))


def _receive(rr: RolloutRank, version: int | None) -> None:
    """The weight stream from rank `SRC` into this rank's engine (checksummed, `receive_weights`), which then holds
    `version` (None: the caller records it, as `RolloutEngine.update_in_flight` does)."""
    receive_weights(rr.engine, rr.weights_group or rr.sync_group, src=SRC)
    if version is not None:
        rr.engine.weight_version = version


class _Stopped(Exception):
    """Learner rank `SRC` stopped the run while this rank sampled ahead."""


def _sample_ahead(rr: RolloutRank, command: GenerateAhead) -> AheadBatches:
    """GenerateAhead on a rollout rank: sample this engine's parts, loading the next weights between engine steps
    when their word arrives (or after sampling); then the engine_mean re-scorings."""
    if rr.engine_tp > 1:
        raise RuntimeError("sampling ahead needs rollout.tensor_parallel_size 1 (every rank of an engine would have "
                           "to load the weights at the same engine step)")
    requests = command.parts[rr.index // rr.engine_tp]
    word = empty_word()
    arrival = rr.sync_group.broadcast_async(word, src=SRC)
    seconds = {"generate_s": 0.0, "wait_s": 0.0, "load_s": 0.0, "in_flight": 0.0}
    loaded = []  # the word was taken (and the weights received, or failed while receiving: drained by then)

    def load(in_flight: bool) -> None:
        sync = from_word(word)
        if isinstance(sync, Stop):
            raise _Stopped
        loaded.append(True)
        start = time.perf_counter()
        if in_flight:
            rr.engine.update_in_flight(lambda: _receive(rr, None), sync.version, recompute=command.recompute)
        else:
            _receive(rr, sync.version)
        seconds["load_s"], seconds["in_flight"] = time.perf_counter() - start, float(in_flight)

    def between_steps() -> None:
        if not loaded and arrival.is_completed():
            load(in_flight=True)

    start = time.perf_counter()
    try:
        batches = [r.sample(rr.engine, between_steps=between_steps) for r in requests]
    except _Stopped:
        raise
    except Exception:  # keep to the protocol (take the word, drain the weights), then report the error
        if not loaded:
            _drain(rr, arrival, word)
        raise
    seconds["generate_s"] = time.perf_counter() - start - seconds["load_s"]
    if not loaded:
        waiting = time.perf_counter()
        arrival.wait()
        seconds["wait_s"] = time.perf_counter() - waiting
        load(in_flight=False)
    # pi_old estimates at the weights the learner trains this batch with
    return AheadBatches([r.rescored(rr.engine, b) for r, b in zip(requests, batches)], seconds)


def _drain(rr: RolloutRank, arrival, word: torch.Tensor) -> None:
    """After sampling ahead failed: take the word and receive (not load) the weights that follow it, so the bridge
    stays in step with rank `SRC`; a Stop word stops the rank."""
    arrival.wait()
    if isinstance(from_word(word), Stop):
        raise _Stopped from None
    receive_weights(None, rr.weights_group or rr.sync_group, src=SRC)


def _run_ahead(rr: RolloutRank, command: RunAhead) -> None:
    """RunAhead: sample batch after batch until Stop (placement/run_ahead.py); never answers as a command."""
    from megatron_sparse_rl.placement.run_ahead import AheadRank

    if rr.engine_tp > 1:
        raise RuntimeError("running ahead needs rollout.tensor_parallel_size 1")
    AheadRank(rr, command, handle=_handle, receive=_receive, stopped=_Stopped).run()


_HANDLERS = {Generate: _generate, SyncWeights: _sync, GenerateAhead: _sample_ahead, RunAhead: _run_ahead,
             Probe: _probe}
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
            except _Stopped:
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

"""Disaggregated placement (docs/launch.md, "Disaggregated placement"): learner ranks [0, L) train, rollout ranks [L, L + R)
run R / t vLLM engines of t = rollout.tensor_parallel_size consecutive ranks each and serve commands from
learner rank 0 (t > 1: vLLM's external_launcher; every rank of an engine runs every command).

Each side has its own default torch.distributed world (parallel/bridge.py `SplitWorld`, made by
`ParallelLayout.initialize`): Megatron's collectives and checkpoints stay among the learner ranks, vLLM's among
the rollout ranks. Learner rank 0 drives the rollout ranks over the weight-sync `Bridge` (rank 0 + every
rollout rank):

    ("generate", parts)            engine e (rollout ranks [e t, (e + 1) t)) samples parts[e] (a slice of the
                                   prompts); its first rank's part comes back to rank 0 by gather_object, and
                                   the parts are joined in prompt order
    ("sync", version)              every learner rank runs `send_weights`, every rollout rank `receive_weights`
                                   (checksummed buckets; with t > 1 and trainer.sync_engine_slices each engine
                                   rank receives only its slices, over its engine TP rank's bridge); each
                                   rollout rank then reports its status
    ("generate_ahead", calls, recompute)
                                   asynchronous RL (trainer.max_staleness 1, docs/async.md): engine e samples its
                                   part of each call while the learner trains; rank 0 returns at once. The next
                                   sync starts with a word broadcast (`AHEAD_WEIGHTS`, version) that the rollout
                                   rank polls between engine steps: it loads the weights there without draining the
                                   running requests (`RolloutEngine.update_in_flight`), or after sampling if it
                                   finished first; engine_mean re-scorings run after that, at the new weights; then
                                   the batches and the rank's times come back by gather_object (`collect_ahead`).
                                   `AHEAD_STOP` instead stops the rank (rank 0's shutdown while it samples ahead)
    ("probe", rows)                each engine's prompt logprobs of the probe rows, for rank 0 to compare
                                   with the learner's own forward (weight_sync/verify.py `compare_engines`)
    ("stop",)                      the rollout ranks leave `serve`, shut their engines down and confirm

On learner ranks `RemoteEngine` stands where the colocated RolloutEngine stands (`generate`, `pad_id`,
`shutdown`), so rollout.py runs unchanged on rank 0; the `Disaggregated` placement (training/placement.py)
wraps it for the steps. A rollout rank that fails a command sends the error back instead of its result; rank 0
raises it naming the rank, and its `shutdown` (run on every exit path of `trainer.train`) sends "stop", so no
rollout rank waits forever; it waits for their confirmation, since rank 0 serves the store their groups were
made from. The rollout ranks hold no state worth saving: checkpoints, metrics and the HF export are the
learner's.
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
from megatron_sparse_rl.weight_sync import WeightSyncError

log = logging.getLogger(__name__)

SRC = 0
"""The learner rank that drives the rollout ranks and sends the weights."""
AHEAD_WEIGHTS, AHEAD_STOP = 1, 2
"""The word rank `SRC` sends a rollout rank sampling ahead: new weights follow (with their version), or stop."""


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


def split_prompts(n: int, parts: int) -> list[range]:
    """`n` prompt indices cut into `parts` contiguous slices, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


class RemoteEngine:
    """The rollout ranks as one engine, on learner ranks. Only global rank `SRC` talks to them; on the other
    learner ranks it is a stand-in with `pad_id` (their steps never generate)."""

    def __init__(self, sync_group, rollout_ranks: list[int], pad_id: int, engine_tp: int = 1, *,
                 shards=None, shard_groups: list | None = None):
        if len(rollout_ranks) % engine_tp:
            raise ValueError(f"{len(rollout_ranks)} rollout ranks do not split into engines of {engine_tp} ranks")
        self.group, self.ranks, self.pad_id, self.engine_tp = sync_group, rollout_ranks, pad_id, engine_tp
        self.shards, self.shard_groups = shards, shard_groups
        self.driver = dist.get_rank() == SRC  # learner ranks keep their global ranks in the learner world
        self.stopped = False
        self.ahead = False  # the rollout ranks are sampling ahead (generate_ahead until collect_ahead)

    def _command(self, *command) -> list:
        """Send `command` to every rollout rank, gather their answers (a rollout rank's error is raised here)."""
        self._send(command)
        return self._gather()

    def _send(self, command: tuple) -> None:
        if not self.driver:
            raise RuntimeError(f"only learner rank {SRC} drives the rollout ranks (this is rank {dist.get_rank()})")
        if self.stopped:
            raise RuntimeError("the rollout ranks were stopped")
        self.group.broadcast_object(command, src=SRC)

    def _gather(self) -> list:
        answers = self.group.gather_object(None, dst=SRC)
        for rank, answer in zip(self.ranks, answers[1:]):
            if isinstance(answer, _Failure):
                raise (WeightSyncError if answer.sync else RuntimeError)(
                    f"rollout rank {rank} failed: {answer.message}")
        return answers[1:]

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 group_ids: list[int] | None = None, *, rescore: int = 0) -> RolloutBatch:
        """As RolloutEngine.generate, the prompts split across the engines (seeds as one engine's); each engine
        re-scores its own rows (`rescore`)."""
        answers = self._command("generate", self._parts(prompt_token_ids, sampling, group_ids, rescore))
        return RolloutBatch.concat([a for a in answers if a is not None], self.pad_id)

    def _parts(self, prompt_token_ids, sampling: SamplingConfig, group_ids, rescore: int) -> list[tuple]:
        """One generate call cut into one part per engine (prompt slices; seeds as one engine's)."""
        gids = list(range(len(prompt_token_ids))) if group_ids is None else list(group_ids)
        parts = []
        for r in split_prompts(len(prompt_token_ids), len(self.ranks) // self.engine_tp):
            seed = None if sampling.seed is None else sampling.seed + r.start * sampling.n
            parts.append(([prompt_token_ids[i] for i in r], replace(sampling, seed=seed), [gids[i] for i in r],
                          rescore))
        return parts

    def generate_ahead(self, calls: list[tuple], *, recompute: bool) -> None:
        """Start sampling `calls` ((prompt ids, sampling, group ids, rescore) each, as `generate` takes them) on the
        rollout ranks and return at once. The next `sync_weights` reaches the engines between engine steps (partial
        rollouts; `recompute`: the running requests' KV is recomputed under the new weights); `collect_ahead`
        returns the batches."""
        if self.ahead:
            raise RuntimeError("the rollout ranks are already sampling ahead: collect_ahead first")
        per_call = [self._parts(*call) for call in calls]
        per_engine = [[parts[e] for parts in per_call] for e in range(len(self.ranks) // self.engine_tp)]
        self._send(("generate_ahead", per_engine, recompute))
        self.ahead = True

    def collect_ahead(self) -> tuple[list[RolloutBatch], dict[str, float]]:
        """After the `sync_weights` that follows `generate_ahead`: one batch per call (the engines' parts joined) and
        the rollout ranks' seconds (the slowest rank's): sampling, waiting for the weights after sampling, loading."""
        answers = [a for a in self._gather() if a is not None]  # raises a rollout rank's error
        self.ahead = False
        calls = len(answers[0][0])
        batches = [RolloutBatch.concat([a[0][c] for a in answers if a[0][c] is not None], self.pad_id)
                   for c in range(calls)]
        return batches, {k: max(a[1][k] for a in answers) for k in answers[0][1]}

    def sync_weights(self, learner, *, bucket_mb: float, version: int = 0):
        """Every learner rank calls it: learner -> every engine, checksummed, as weight version `version`; rank `SRC`
        checks the receipts (while sampling ahead: in `collect_ahead`)."""
        from megatron_sparse_rl.weight_sync.disaggregated import send_weights

        start = time.perf_counter()
        if self.driver and self.ahead:
            self.group.broadcast(torch.tensor([AHEAD_WEIGHTS, version]), src=SRC)
        elif self.driver:
            self.group.broadcast_object(("sync", version), src=SRC)
        stats = send_weights(learner, self.group, src=SRC, bucket_mb=bucket_mb, shards=self.shards,
                             shard_groups=self.shard_groups)
        if self.driver and not self.ahead:
            self._gather()  # every engine verified its buckets and loaded them
        return replace(stats, seconds=time.perf_counter() - start)

    def probe_logprobs(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        """Each rollout rank's engine prompt logprobs of `rows`: {"rollout rank r": float32 [B, S-1]}."""
        return {f"rollout rank {rank}": t for rank, t in zip(self.ranks, self._command("probe", rows))}

    def shutdown(self) -> None:
        """Send "stop" once (rank `SRC`) and wait until every rollout rank has shut its engine down. A rollout
        rank that cannot confirm (it is gone) is logged, not raised: this runs on every way out, errors included."""
        if self.driver and not self.stopped:
            self.stopped = True
            try:
                if self.ahead:  # they wait for a word between engine steps, not for a command
                    self.group.broadcast(torch.tensor([AHEAD_STOP, 0]), src=SRC)
                else:
                    self.group.broadcast_object(("stop",), src=SRC)
                self.group.gather_object(None, dst=SRC)
            except Exception as e:  # noqa: BLE001 - never hide the error that brought us here
                log.warning("the rollout ranks did not confirm stop: %s", e)


@dataclass
class _Failure:
    message: str
    sync: bool = False


def _handle(rr: RolloutRank, command: tuple):
    """One command on a rollout rank; returns what goes back to learner rank `SRC`."""
    op = command[0]
    if op == "generate":
        prompts, sampling, gids, rescore = command[1][rr.index // rr.engine_tp]
        batch = rr.engine.generate(prompts, sampling, group_ids=gids, rescore=rescore) if prompts else None
        return batch if rr.index % rr.engine_tp == 0 else None  # the engine's other ranks hold the same rows
    if op == "generate_ahead":
        return _sample_ahead(rr, command[1][rr.index // rr.engine_tp], recompute=command[2])
    if op == "sync":
        _receive(rr, command[1])
        return None
    if op == "probe":
        return torch.stack(rr.engine.prompt_logprobs(command[1]))
    raise ValueError(f"rollout rank {rr.rank}: unknown command {op!r}")


def _receive(rr: RolloutRank, version: int | None) -> None:
    """The weight stream from rank `SRC` into this rank's engine (checksummed, `receive_weights`), which then holds
    `version` (None: the caller records it, as `RolloutEngine.update_in_flight` does)."""
    from megatron_sparse_rl.weight_sync.disaggregated import receive_weights

    receive_weights(rr.engine, rr.weights_group or rr.sync_group, src=SRC)
    if version is not None:
        rr.engine.weight_version = version


class _Stopped(Exception):
    """Learner rank `SRC` stopped the run while this rank sampled ahead."""


def _sample_ahead(rr: RolloutRank, calls: list[tuple], *, recompute: bool) -> tuple[list, dict[str, float]]:
    """("generate_ahead", ...) on a rollout rank: sample `calls`, loading the next weights between engine steps when
    their word arrives (or after sampling); then the engine_mean re-scorings. Returns (one batch or None per call,
    seconds: generate_s, wait_s, load_s, and in_flight 1.0 when the weights arrived while sampling)."""
    from megatron_sparse_rl.weight_sync.disaggregated import receive_weights

    if rr.engine_tp > 1:
        raise RuntimeError("sampling ahead needs rollout.tensor_parallel_size 1 (every rank of an engine would have "
                           "to load the weights at the same engine step)")
    word = torch.zeros(2, dtype=torch.int64)
    arrival = rr.sync_group.broadcast_async(word, src=SRC)
    seconds = {"generate_s": 0.0, "wait_s": 0.0, "load_s": 0.0, "in_flight": 0.0}
    loaded = []  # the word was taken (and the weights received, or failed while receiving: drained by then)

    def load(in_flight: bool) -> None:
        kind, version = word.tolist()
        if kind == AHEAD_STOP:
            raise _Stopped
        loaded.append(True)
        start = time.perf_counter()
        if in_flight:
            rr.engine.update_in_flight(lambda: _receive(rr, None), version, recompute=recompute)
        else:
            _receive(rr, version)
        seconds["load_s"], seconds["in_flight"] = time.perf_counter() - start, float(in_flight)

    def between_steps() -> None:
        if not loaded and arrival.is_completed():
            load(in_flight=True)

    start = time.perf_counter()
    try:
        batches = [rr.engine.generate(p, s, group_ids=g, between_steps=between_steps) if p else None
                   for p, s, g, _ in calls]
    except _Stopped:
        raise
    except Exception:  # keep to the protocol (take the word, drain the weights), then report the error
        if not loaded:
            arrival.wait()
            if word[0] == AHEAD_STOP:
                raise _Stopped from None
            receive_weights(None, rr.weights_group or rr.sync_group, src=SRC)  # drained, not loaded
        raise
    seconds["generate_s"] = time.perf_counter() - start - seconds["load_s"]
    if not loaded:
        waiting = time.perf_counter()
        arrival.wait()
        seconds["wait_s"] = time.perf_counter() - waiting
        load(in_flight=False)
    for batch, (_, _, _, rescore) in zip(batches, calls):
        if batch is not None and rescore:  # pi_old estimates at the weights the learner trains this batch with
            batch.rescored_logprobs = rr.engine.rescore(batch, rescore)
    return batches, seconds


def serve(rr: RolloutRank) -> dict:
    """A rollout rank's loop: run learner rank `SRC`'s commands until "stop"; then shut the engine down."""
    served = 0
    try:
        while True:
            command = rr.sync_group.broadcast_object(None, src=SRC)
            if command[0] == "stop":
                break
            try:
                answer = _handle(rr, command)
            except _Stopped:
                break
            except Exception as e:  # report it to the driver, which raises it; keep serving until "stop"
                log.error("rollout rank %d: %s failed:\n%s", rr.rank, command[0], traceback.format_exc())
                answer = _Failure(f"{type(e).__name__}: {e}", sync=isinstance(e, WeightSyncError))
            rr.sync_group.gather_object(answer, dst=SRC)
            served += 1
    finally:
        rr.engine.shutdown()
    rr.sync_group.gather_object(None, dst=SRC)  # stopped: rank 0 (which serves the store) may exit now
    log.info("rollout rank %d: stopped after %d commands", rr.rank, served)
    return {"rank": rr.rank, "role": "rollout", "commands": served}

"""Disaggregated placement (DESIGN.md "Process model"): learner ranks [0, L) train, rollout ranks [L, L + R)
run R / t vLLM engines of t = rollout.tensor_parallel_size consecutive ranks each and serve commands from
learner rank 0 (t > 1: vLLM's external_launcher; every rank of an engine runs every command).

Each side has its own default torch.distributed world (parallel/bridge.py `SplitWorld`, made by
`ParallelLayout.initialize`): Megatron's collectives and checkpoints stay among the learner ranks, vLLM's among
the rollout ranks. Learner rank 0 drives the rollout ranks over the weight-sync `Bridge` (rank 0 + every
rollout rank):

    ("generate", parts)            engine e (rollout ranks [e t, (e + 1) t)) samples parts[e] (a slice of the
                                   prompts); its first rank's part comes back to rank 0 by gather_object, and
                                   the parts are joined in prompt order
    ("sync",)                      every learner rank runs `send_weights`, every rollout rank `receive_weights`
                                   (checksummed buckets; with t > 1 and trainer.sync_engine_slices each engine
                                   rank receives only its slices, over its engine TP rank's bridge); each
                                   rollout rank then reports its status
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
from megatron_sparse_rl.rollout.batch import RolloutBatch, pad_rows
from megatron_sparse_rl.rollout.sampling_mask import SamplingSupport
from megatron_sparse_rl.weight_sync import WeightSyncError

log = logging.getLogger(__name__)

SRC = 0
"""The learner rank that drives the rollout ranks and sends the weights."""


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


def _concat_routes(stores: list):
    from moe.storage import RouteStore

    if any(s is None for s in stores):
        raise ValueError("some rollout ranks returned routes and some did not")
    lens = torch.cat([torch.zeros(1, dtype=torch.int64)] + [s.lengths for s in stores]).cumsum(0)
    first = stores[0]
    return RouteStore(indices=torch.cat([s.indices for s in stores]), offsets=lens,
                      token_hash=torch.cat([s.token_hash for s in stores]), num_experts=first.num_experts,
                      layers=first.layers, source=first.source)


def concat_batches(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """The rows of `parts` in order, one batch (re-padded to the widest part)."""
    if len(parts) == 1:
        return parts[0]

    def rows(name: str, pad, dtype) -> torch.Tensor:
        out = []
        for p in parts:
            lens = p.prompt_lens if name == "prompt_ids" else p.response_mask.sum(dim=1)
            out += [row[:n].tolist() for row, n in zip(getattr(p, name), lens.tolist())]
        return pad_rows(out, pad, dtype)

    response_ids = rows("response_ids", pad_id, torch.long)
    lens = torch.cat([p.response_mask.sum(dim=1) for p in parts])
    kv = [p.kv_keep for p in parts]
    rescored = None
    if any(p.rescored_logprobs is not None for p in parts):
        if any(p.rescored_logprobs is None for p in parts):
            raise ValueError("concat_batches: some parts carry rescored_logprobs and some do not")
        width = response_ids.shape[1]
        rescored = torch.cat([torch.nn.functional.pad(p.rescored_logprobs, (0, width - p.rescored_logprobs.shape[2]))
                              for p in parts])
    return RolloutBatch(
        prompt_ids=rows("prompt_ids", pad_id, torch.long), prompt_lens=torch.cat([p.prompt_lens for p in parts]),
        response_ids=response_ids, response_mask=torch.arange(response_ids.shape[1])[None, :] < lens[:, None],
        rollout_logprobs=rows("rollout_logprobs", 0.0, torch.float32),
        finish_reasons=sum((p.finish_reasons for p in parts), ()),
        group_ids=torch.cat([p.group_ids for p in parts]),
        routed_experts=None if all(p.routed_experts is None for p in parts)
        else _concat_routes([p.routed_experts for p in parts]),
        kv_keep=None if all(k is None for k in kv) else sum((tuple(k) for k in kv), ()),
        sampling_mask=None if all(p.sampling_mask is None for p in parts)
        else SamplingSupport.concat([p.sampling_mask for p in parts]),
        rescored_logprobs=rescored,
        kv_usage=_sum_usage([p.kv_usage for p in parts]),
    )


def _sum_usage(usages: list[dict | None]) -> dict | None:
    """The engines' KV pool usage as one pool (blocks, running requests and preemptions summed); None if any
    engine could not report it."""
    if not usages or any(u is None for u in usages):
        return None
    return {k: sum(u[k] for u in usages) for k in usages[0]}


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

    def _command(self, *command) -> list:
        """Send `command` to every rollout rank, gather their answers (a rollout rank's error is raised here)."""
        if not self.driver:
            raise RuntimeError(f"only learner rank {SRC} drives the rollout ranks (this is rank {dist.get_rank()})")
        if self.stopped:
            raise RuntimeError("the rollout ranks were stopped")
        self.group.broadcast_object(command, src=SRC)
        return self._gather()

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
        gids = list(range(len(prompt_token_ids))) if group_ids is None else list(group_ids)
        parts = []
        for r in split_prompts(len(prompt_token_ids), len(self.ranks) // self.engine_tp):
            seed = None if sampling.seed is None else sampling.seed + r.start * sampling.n
            parts.append(([prompt_token_ids[i] for i in r], replace(sampling, seed=seed), [gids[i] for i in r],
                          rescore))
        answers = self._command("generate", parts)
        return concat_batches([a for a in answers if a is not None], self.pad_id)

    def sync_weights(self, learner, *, bucket_mb: float):
        """Every learner rank calls it: learner -> every engine, checksummed; rank `SRC` checks the receipts."""
        from megatron_sparse_rl.weight_sync.disaggregated import send_weights

        start = time.perf_counter()
        if self.driver:
            self.group.broadcast_object(("sync",), src=SRC)
        stats = send_weights(learner, self.group, src=SRC, bucket_mb=bucket_mb, shards=self.shards,
                             shard_groups=self.shard_groups)
        if self.driver:
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
    if op == "sync":
        from megatron_sparse_rl.weight_sync.disaggregated import receive_weights

        receive_weights(rr.engine, rr.weights_group or rr.sync_group, src=SRC)
        return None
    if op == "probe":
        return torch.stack(rr.engine.prompt_logprobs(command[1]))
    raise ValueError(f"rollout rank {rr.rank}: unknown command {op!r}")


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

"""Disaggregated placement (DESIGN.md "Process model"): learner ranks [0, L) train, rollout ranks [L, L + R)
run R / t vLLM engines of t = rollout.tensor_parallel_size consecutive ranks each and serve commands from
learner rank 0 (t > 1: vLLM's external_launcher; every rank of an engine runs every command).

Learner rank 0 drives the rollout ranks over the weight-sync group (rank 0 + every rollout rank):

    ("generate", parts)            engine e (rollout ranks [e t, (e + 1) t)) samples parts[e] (a slice of the
                                   prompts); its first rank's part comes back to rank 0 by gather_object, and
                                   the parts are joined in prompt order
    ("sync",)                      every learner rank runs `send_weights`, every rollout rank `receive_weights`
                                   (checksummed buckets; with t > 1 and trainer.sync_engine_slices each engine
                                   rank receives only its slices, over its engine TP rank's group); each
                                   rollout rank then reports its status
    ("probe", rows)                each engine's prompt logprobs of the probe rows, for rank 0 to compare
                                   with the learner's own forward (`verify_engines`)
    ("stop",)                      the rollout ranks leave `serve` and shut their engines down

On learner ranks `RemoteEngine` stands where the colocated RolloutEngine stands (`generate`, `pad_id`,
`shutdown`), so steps.py and rollout.py run unchanged on rank 0. A rollout rank that fails a command sends
the error back instead of its result; rank 0 raises it naming the rank, and its `shutdown` (run on every
exit path of `trainer.train`) sends "stop", so no rollout rank waits forever. The rollout ranks hold no
state worth saving: checkpoints, metrics and the HF export are the learner's.

While the learner loop runs, `learner_default_group` makes the learner group the default process group on
learner ranks: the checkpoint code (Megatron dist_checkpointing, barriers) runs default-group collectives
that rollout ranks, busy in `serve`, must not be part of.
"""
from __future__ import annotations

import contextlib
import logging
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Iterator

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
    """What a rollout rank holds: its engine and the group it is driven through."""

    engine: Any
    sync_group: Any
    rank: int
    index: int
    """This rank's place among the rollout ranks (global rank - learner ranks)."""
    engine_tp: int = 1
    """Ranks per engine (rollout.tensor_parallel_size): this rank serves engine index // engine_tp."""
    weights_group: Any = None
    """Where its weights arrive: its engine TP rank's sliced-sync group (None: `sync_group`, whole tensors)."""


def join_vllm_groups(engine_tp: int = 1) -> None:
    """On a learner rank: the collective part of the rollout engines' start-up, so that they do not wait.

    vLLM makes its world and TP/PP groups with `new_group` over the whole world (every rank must enter);
    with engine TP > 1 (external_launcher) it also takes the MIN of the free KV memory over its world
    group (`ExecutorWithExternalLauncher.determine_available_memory`), which learner ranks join with +inf.
    vLLM cuts the world into TP groups of `engine_tp` consecutive ranks, so the learner ranks' groups are
    their own (the layout checks that `engine_tp` divides the learner and rollout rank counts)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as vps

    with set_current_vllm_config(VllmConfig()):
        vps.init_distributed_environment(engine_tp, dist.get_rank(), "env://", 0, "gloo")
        vps.ensure_model_parallel_initialized(engine_tp, 1)
    if engine_tp > 1:
        unbounded = torch.tensor([torch.iinfo(torch.int64).max], dtype=torch.int64)
        dist.all_reduce(unbounded, group=vps.get_world_group().cpu_group, op=dist.ReduceOp.MIN)


@contextlib.contextmanager
def learner_default_group(groups) -> Iterator[None]:
    """Learner ranks of a disaggregated run: `groups.learner` is the default process group meanwhile.

    Learner ranks are [0, L), so their global and learner-group ranks coincide and default-group calls
    (barrier, dist_checkpointing's gathers) run among the learners only. Groups made before stay valid;
    make no group spanning rollout ranks inside."""
    from torch.distributed import distributed_c10d as c10d

    if not hasattr(c10d, "_update_default_pg"):
        raise RuntimeError(f"torch {torch.__version__} has no distributed_c10d._update_default_pg, which the "
                           "disaggregated trainer needs to keep checkpoint collectives among the learner ranks")
    world = c10d._get_default_group()
    c10d._update_default_pg(groups.learner)
    try:
        yield
    finally:
        c10d._update_default_pg(world)


@contextlib.contextmanager
def learner_scope(ctx) -> Iterator[None]:
    """Around a learner rank's loop: the learner group is the default group when there are rollout ranks,
    and the engine (local, or the rollout ranks) is shut down on every way out, errors included."""
    try:
        with learner_default_group(ctx.groups) if ctx.layout.rollout_ranks else contextlib.nullcontext():
            yield
    finally:
        ctx.engine.shutdown()


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
    )


class RemoteEngine:
    """The rollout ranks as one engine, on learner ranks. Only global rank `SRC` talks to them; on the other
    learner ranks it is a stand-in with `pad_id` (their steps never generate)."""

    def __init__(self, sync_group, rollout_ranks: list[int], pad_id: int, engine_tp: int = 1, *,
                 shards=None, shard_groups: list | None = None):
        if len(rollout_ranks) % engine_tp:
            raise ValueError(f"{len(rollout_ranks)} rollout ranks do not split into engines of {engine_tp} ranks")
        self.group, self.ranks, self.pad_id, self.engine_tp = sync_group, rollout_ranks, pad_id, engine_tp
        self.shards, self.shard_groups = shards, shard_groups
        self.driver = dist.get_rank() == SRC
        self.stopped = False

    def _command(self, *command) -> list:
        """Send `command` to every rollout rank, gather their answers (a rollout rank's error is raised here)."""
        if not self.driver:
            raise RuntimeError(f"only learner rank {SRC} drives the rollout ranks (this is rank {dist.get_rank()})")
        if self.stopped:
            raise RuntimeError("the rollout ranks were stopped")
        dist.broadcast_object_list([command], src=SRC, group=self.group)
        return self._gather()

    def _gather(self) -> list:
        answers = [None] * (len(self.ranks) + 1)
        dist.gather_object(None, answers, dst=SRC, group=self.group)
        for rank, answer in zip(self.ranks, answers[1:]):
            if isinstance(answer, _Failure):
                raise (WeightSyncError if answer.sync else RuntimeError)(
                    f"rollout rank {rank} failed: {answer.message}")
        return answers[1:]

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 group_ids: list[int] | None = None) -> RolloutBatch:
        """As RolloutEngine.generate, the prompts split across the engines (seeds as one engine's)."""
        gids = list(range(len(prompt_token_ids))) if group_ids is None else list(group_ids)
        parts = []
        for r in split_prompts(len(prompt_token_ids), len(self.ranks) // self.engine_tp):
            seed = None if sampling.seed is None else sampling.seed + r.start * sampling.n
            parts.append(([prompt_token_ids[i] for i in r], replace(sampling, seed=seed), [gids[i] for i in r]))
        answers = self._command("generate", parts)
        return concat_batches([a for a in answers if a is not None], self.pad_id)

    def sync_weights(self, learner, *, bucket_mb: float):
        """Every learner rank calls it: learner -> every engine, checksummed; rank `SRC` checks the receipts."""
        from megatron_sparse_rl.weight_sync.disaggregated import send_weights

        start = time.perf_counter()
        if self.driver:
            dist.broadcast_object_list([("sync",)], src=SRC, group=self.group)
        stats = send_weights(learner, self.group, src=SRC, bucket_mb=bucket_mb, shards=self.shards,
                             shard_groups=self.shard_groups)
        if self.driver:
            self._gather()  # every engine verified its buckets and loaded them
        return replace(stats, seconds=time.perf_counter() - start)

    def probe_logprobs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Each rollout rank's engine prompt logprobs of `rows`: one float32 [B, S-1] tensor per rank."""
        return self._command("probe", rows)

    def shutdown(self) -> None:
        """Send "stop" once (rank `SRC`); the rollout ranks shut their engines down and return."""
        if self.driver and not self.stopped:
            self.stopped = True
            dist.broadcast_object_list([("stop",)], src=SRC, group=self.group)


@dataclass
class _Failure:
    message: str
    sync: bool = False


def _handle(rr: RolloutRank, command: tuple):
    """One command on a rollout rank; returns what goes back to learner rank `SRC`."""
    op = command[0]
    if op == "generate":
        prompts, sampling, gids = command[1][rr.index // rr.engine_tp]
        batch = rr.engine.generate(prompts, sampling, group_ids=gids) if prompts else None
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
            box = [None]
            dist.broadcast_object_list(box, src=SRC, group=rr.sync_group)
            command = box[0]
            if command[0] == "stop":
                break
            try:
                answer = _handle(rr, command)
            except Exception as e:  # report it to the driver, which raises it; keep serving until "stop"
                log.error("rollout rank %d: %s failed:\n%s", rr.rank, command[0], traceback.format_exc())
                answer = _Failure(f"{type(e).__name__}: {e}", sync=isinstance(e, WeightSyncError))
            dist.gather_object(answer, None, dst=SRC, group=rr.sync_group)
            served += 1
    finally:
        rr.engine.shutdown()
    log.info("rollout rank %d: stopped after %d commands", rr.rank, served)
    return {"rank": rr.rank, "role": "rollout", "commands": served}


def verify_engines(learner, remote: RemoteEngine, tokens: torch.Tensor, tol: float) -> float | None:
    """Max |engine prompt logprob - learner logprob| on the probe over every rollout rank's engine.

    Every learner rank calls it (the learner forward is collective); rank `SRC` asks the engines and
    compares, the others return None. Raises WeightSyncError naming the rollout rank above `tol`."""
    with learner.scoring_temperature(1.0):  # the engine's prompt logprobs are of the raw logits
        ours = learner.forward_logprobs(tokens)["logprobs"].float()
    if not remote.driver:
        return None
    worst = 0.0
    for rank, theirs in zip(remote.ranks, remote.probe_logprobs(tokens.tolist())):
        diff = (theirs.float() - ours).abs().max().item()
        if not diff <= tol:
            raise WeightSyncError(f"rollout rank {rank}: engine logprobs differ from the learner's by {diff:.3e} on "
                                  f"the probe (tolerance {tol:.1e}): the weight sync moved wrong weights")
        worst = max(worst, diff)
    return worst

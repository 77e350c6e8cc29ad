"""`ParallelLayout`: validated parallel degrees and the one place that initialises Megatron's groups.

    layout = ParallelLayout.from_config(run.parallel, world_size=8)
    layout.check_model(spec)             # TP divides heads, EP divides experts, ...
    groups = layout.initialize()         # Megatron parallel_state on gloo (CPU) or NCCL (GPU)

Everything else receives the `ParallelGroups` it needs instead of reaching into `parallel_state`.

Disaggregated placement (docs/launch.md "Disaggregated placement"): the launcher starts one world of L + R ranks, learner
ranks [0, L) and rollout ranks [L, L + R):

    layout = ParallelLayout.from_config(run.parallel, world_size=L, rollout_ranks=R)
    groups = layout.initialize()             # EVERY rank; None on rollout ranks (they hold no model)
    sync = layout.weight_sync_group(src=0)   # EVERY rank; a Bridge on src + the rollout ranks, None elsewhere
    if groups is not None:
        learner = Learner(adapter, spec, layout, groups, ...)

`initialize()` first splits the launcher's world (parallel/bridge.py `SplitWorld`): afterwards the DEFAULT
world of a learner rank is the L learner ranks (same ranks as before) and that of a rollout rank the R rollout
ranks (rollout rank L + i is rank i there). Megatron-Core then builds its groups, aligns its optimizer's param
groups and runs `dist_checkpointing` on a default world that is exactly the learners, and vLLM builds its groups
on one that is exactly the engines; neither library's collectives involve the other's ranks. What joins the two
is a `Bridge` (a gloo group made from the split's store, outside both default worlds): the weight-sync group and
the engine shard groups below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_sparse_rl.config.degrees import ParallelDegrees
from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.parallel.bridge import SplitWorld
from megatron_sparse_rl.parallel.world import join_world


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups and this rank's coordinates in them."""

    tp: Any
    pp: Any
    dp: Any
    ep: Any
    etp: Any
    expert_dp: Any
    model_parallel: Any
    """The ranks that hold one data-parallel rank's batch: tp x pp (Megatron's model-parallel group), and x cp with
    context parallelism (the context-parallel ranks share their sequences)."""
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    etp_rank: int
    learner: Any = None
    """All learner ranks [0, L): the default world (in a disaggregated run, the learner ranks' own world)."""
    cp: Any = None
    """The context-parallel group (the ranks that share a sequence, parallel.cp of them)."""
    cp_rank: int = 0


@dataclass(frozen=True)
class ParallelLayout(ParallelDegrees):
    """Validated parallel degrees (config/degrees.py `ParallelDegrees`: `from_config`, `check_model`) and the
    groups this rank initialises over them."""

    _split: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """This process's side of the split world once `initialize()` ran (disaggregated only): {"world": SplitWorld}."""

    def is_learner_rank(self, rank: int | None = None) -> bool:
        """Whether global `rank` (default: this process) holds the model: ranks [0, world_size) of the launcher's
        world (after a split, this process's rank in it, not in its own role's world)."""
        if rank is None:
            split = self._split.get("world")
            rank = split.global_rank if split is not None else dist.get_rank()
        return rank < self.world_size

    def initialize(self, timeout_minutes: int = 30) -> ParallelGroups | None:
        """Initialise torch.distributed (if needed) and Megatron's model-parallel groups over the learner ranks.

        Every rank of the launcher's world calls it. With rollout ranks it first splits that world (module
        docstring) and returns None on rollout ranks, which get a default world of their own and no Megatron
        state."""
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            join_world(ParallelConfig(backend=self.backend))
        total = self.world_size + self.rollout_ranks
        if dist.get_world_size() != total:
            where = f"{self.world_size} learner + {self.rollout_ranks} rollout" if self.rollout_ranks else "world size"
            raise ValueError(f"layout was made for {where} = {total} ranks, "
                             f"but torch.distributed has {dist.get_world_size()} ranks")
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if self.rollout_ranks:
            self._split["world"] = SplitWorld.split(self.world_size, self.backend,
                                                    timeout=timedelta(minutes=timeout_minutes))
            if not self.is_learner_rank():
                return None
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None,
            expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp,
            context_parallel_size=self.cp, distributed_timeout_minutes=timeout_minutes,
            # gloo side groups on NCCL too (Megatron's default): get_megatron_optimizer asks for the gloo data-parallel
            # groups and fails without them (seen on an H100: "Intra partial data parallel group is not initialized")
            create_gloo_process_groups=True,
        )
        model_parallel = ps.get_model_parallel_group()
        if self.cp > 1:  # Megatron's model-parallel group is tp x pp; the ranks of one batch are tp x pp x cp
            model_parallel = _same_data_group(ps.get_data_parallel_rank())
        return ParallelGroups(
            tp=ps.get_tensor_model_parallel_group(), pp=ps.get_pipeline_model_parallel_group(),
            dp=ps.get_data_parallel_group(), ep=ps.get_expert_model_parallel_group(),
            etp=ps.get_expert_tensor_parallel_group(), expert_dp=ps.get_expert_data_parallel_group(),
            model_parallel=model_parallel,
            tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(), ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(), learner=dist.group.WORLD,
            cp=ps.get_context_parallel_group(), cp_rank=ps.get_context_parallel_rank(),
        )

    def _bridge(self, members: list[int]):
        split = self._split.get("world")
        if split is None:
            raise RuntimeError("call initialize() first: the groups between learner and rollout ranks are made from "
                               "its split of the world")
        return split.bridge(members)

    def weight_sync_group(self, src: int = 0):
        """The `Bridge` (parallel/bridge.py) of learner rank `src` and every rollout rank (disaggregated weight
        sync and the trainer's command loop), after `initialize()`.

        Every rank of the launcher's world calls it, in the same order relative to `engine_shard_groups`; ranks
        outside it get None."""
        if not self.rollout_ranks:
            raise ValueError("weight_sync_group needs rollout ranks (a disaggregated layout, rollout_ranks > 0)")
        if not 0 <= src < self.world_size:
            raise ValueError(f"weight sync source must be a learner rank in [0, {self.world_size}) (got {src})")
        return self._bridge([src, *range(self.world_size, self.world_size + self.rollout_ranks)])

    def engine_shard_groups(self, src: int, engine_tp: int) -> list:
        """For engines of `engine_tp` consecutive rollout ranks: group r = learner rank `src` + every rollout rank
        of engine TP rank r (the sliced weight sync sends group r the slices those ranks keep); `Bridge`s, None
        on ranks outside a group.

        Called like `weight_sync_group`: every rank, in the same order."""
        if not self.rollout_ranks:
            raise ValueError("engine_shard_groups needs rollout ranks (a disaggregated layout, rollout_ranks > 0)")
        if engine_tp < 1 or self.rollout_ranks % engine_tp:
            raise ValueError(f"{self.rollout_ranks} rollout ranks do not split into engines of {engine_tp} ranks")
        if not 0 <= src < self.world_size:
            raise ValueError(f"weight sync source must be a learner rank in [0, {self.world_size}) (got {src})")
        first = self.world_size
        return [self._bridge([src, *range(first + r, first + self.rollout_ranks, engine_tp)])
                for r in range(engine_tp)]

    @staticmethod
    def destroy() -> None:
        """Tear down Megatron's groups (the torch.distributed world stays)."""
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


def _same_data_group(dp_rank: int):
    """The group of the learner ranks whose data-parallel rank is `dp_rank` (every learner rank calls this: each
    group is made on every rank, in the same order)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, dp_rank)
    mine = None
    for d in sorted(set(every)):
        group = dist.new_group([r for r, x in enumerate(every) if x == d])
        if d == dp_rank:
            mine = group
    return mine

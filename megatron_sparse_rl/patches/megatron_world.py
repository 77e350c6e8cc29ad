"""Patch (scoped): Megatron-Core sees a learner-only default world inside a larger torch.distributed world.

The gap it covers: Megatron-Core 0.16.1 sizes its model-parallel groups from the DEFAULT world
(`torch.distributed.get_world_size()`), and its optimizer aligns parameter groups with a default-world
`all_gather_object` (plus `barrier`s). In a disaggregated world (learner ranks [0, L), rollout ranks after
them) those calls would span the rollout ranks, which hold no model. Inside `learner_world_view(...)`:
`get_world_size()` (no group) reads L, and on learner ranks default-group `all_gather_object`/`barrier` run
on the learner group. Learner ranks are [0, L), so global and learner-group ranks coincide.

Not an import-time or global patch: the three functions are swapped only for the `with` block and
restored on exit. Used by `parallel/layout.py` (group construction on every rank, Learner construction on
learner ranks).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def learner_world_view(learner_ranks: int, learner_group, on_learner: bool) -> Iterator[None]:
    """Within the block the default world reads as `learner_ranks` ranks (see the module docstring)."""
    get_world_size, all_gather_object, barrier = dist.get_world_size, dist.all_gather_object, dist.barrier

    def world_size(group=None):
        return learner_ranks if group is None else get_world_size(group)

    def gather_object(object_list, obj, group=None):
        if group is None and not on_learner:
            raise RuntimeError("a rollout rank ran a default-world all_gather_object inside the learner world")
        return all_gather_object(object_list, obj, group=learner_group if group is None else group)

    def learner_barrier(group=None, **kwargs):
        return barrier(group=learner_group if group is None and on_learner else group, **kwargs)

    dist.get_world_size, dist.all_gather_object, dist.barrier = world_size, gather_object, learner_barrier
    try:
        yield
    finally:
        dist.get_world_size, dist.all_gather_object, dist.barrier = get_world_size, all_gather_object, barrier

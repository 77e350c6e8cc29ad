"""Gather a sharded Megatron model into full tensors on rank 0, one tensor at a time, in tensor-map order.

Tensor-parallel shards are joined with `learner/params.py:gather_full` (a collective on the TP or expert-TP
group); expert-parallel and pipeline-parallel ranks hold different tensors, so the lowest global rank that
holds a full tensor sends it to rank 0 point to point. Every rank walks the same names in the same order,
so the collectives line up and no rank waits on one that is itself waiting on it.

    for name, full in iter_full_tensors(model, groups, names):   # yields on rank 0 only
        ...
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron_sparse_rl.learner.params import gather_full, local_params
from megatron_sparse_rl.parallel.layout import ParallelGroups


def _full_shape(lp, groups: ParallelGroups) -> tuple[int, ...]:
    shape = list(lp.param.shape)
    if lp.tp_dim is not None:
        shape[lp.tp_dim] *= dist.get_world_size(groups.etp if lp.expert else groups.tp)
    return tuple(shape)


def ownership(model, groups: ParallelGroups, names: list[str]) -> dict[str, tuple[int, tuple, torch.dtype]]:
    """name -> (owner global rank, full shape, dtype) for every name; raises if some name is held by no rank."""
    params = local_params(model, groups)
    mine = {n: (_full_shape(lp, groups), lp.param.dtype) for n, lp in params.items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    owners = {}
    for rank, held in enumerate(every):
        for n, (shape, dtype) in held.items():
            owners.setdefault(n, (rank, shape, dtype))
    missing = [n for n in names if n not in owners]
    if missing:
        raise ValueError(f"the Megatron model holds no parameter for {len(missing)} tensor-map names, "
                         f"e.g. {missing[:3]}")
    extra = sorted(set(owners) - set(names))
    if extra:
        raise ValueError(f"the Megatron model has {len(extra)} parameters the adapter does not map, e.g. {extra[:3]}")
    return owners


@torch.no_grad()
def iter_full_tensors(model, groups: ParallelGroups, names: list[str], owners: dict | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) on rank 0 for each of `names`; other ranks yield nothing but must iterate.
    `owners`: the result of `ownership(model, groups, names)` if the caller already has it."""
    params = local_params(model, groups)
    owners = owners if owners is not None else ownership(model, groups, names)
    rank = dist.get_rank()
    for name in names:
        owner, shape, dtype = owners[name]
        full = gather_full(params[name], groups) if name in params else None
        if rank == 0:
            if owner == 0:
                yield name, full
            else:
                buf = torch.empty(shape, dtype=dtype)
                dist.recv(buf, src=owner)
                yield name, buf
        elif rank == owner:
            dist.send(full.contiguous(), dst=0)

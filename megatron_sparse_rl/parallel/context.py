"""Context parallelism's sequence split: which positions of a sequence a context-parallel rank holds, and the
gathers that put the pieces of the group back in sequence order.

Megatron's load-balanced split (megatron/core/utils.py `get_batch_on_this_cp_rank`): a sequence of W positions
(W a multiple of 2 x cp) is cut into 2 x cp equal chunks and rank r holds chunks r and 2cp - 1 - r, so every rank
has the same causal-attention work. Under that split:

    index = cp_positions(W, cp, rank)                      # LongTensor [W / cp]: the global positions rank holds
    full = gather_sequence(local, group, dim=1)            # every rank's pieces, in sequence order (no autograd)
    full = GatherSequence.apply(local, group, dim, True)   # differentiable; backward all-reduces over the group
                                                           # and keeps this rank's positions (K/V in attention)
    full = GatherSequence.apply(local, group, dim, False)  # backward keeps this rank's positions only: for values
                                                           # every rank then uses identically (the loss's logprobs)
    blocked = blocked_keys(index, W)                       # bool [W / cp, W]: True where a key is after the query

Pure torch.distributed: no Megatron import (the group comes from `ParallelGroups.cp` or a module's pg_collection).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def cp_positions(width: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [width / cp] that context-parallel `rank` of `cp` holds: chunks rank and 2cp - 1 - rank."""
    if width % (2 * cp):
        raise ValueError(f"a sequence of {width} positions does not split into 2 x cp = {2 * cp} equal chunks")
    chunk = width // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def blocked_keys(rows: torch.Tensor, width: int) -> torch.Tensor:
    """bool [len(rows), width], True where key position > query position `rows[i]`: the causal mask of a rank's
    global query positions against every key position (Megatron's convention, True = masked out)."""
    return rows[:, None] < torch.arange(width, device=rows.device)[None, :]


def _order(width: int, cp: int, device=None) -> torch.Tensor:
    """The permutation from the ranks' pieces concatenated (rank 0's, rank 1's, ...) to sequence order."""
    held = torch.cat([cp_positions(width, cp, r) for r in range(cp)])
    return torch.argsort(held).to(device)


def _gather(local: torch.Tensor, group, dim: int) -> torch.Tensor:
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    joined = torch.cat(parts, dim=dim)
    return joined.index_select(dim, _order(joined.shape[dim], cp, joined.device))


def _local(full: torch.Tensor, group, dim: int) -> torch.Tensor:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    return full.index_select(dim, cp_positions(full.shape[dim], cp, rank, full.device))


def gather_sequence(local: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's positions along `dim` -> the whole sequence in order (every rank's pieces; no gradient)."""
    if dist.get_world_size(group) == 1:
        return local
    with torch.no_grad():
        return _gather(local, group, dim)


def split_sequence(full: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The whole sequence along `dim` -> the positions this rank holds (no communication)."""
    if dist.get_world_size(group) == 1:
        return full
    return _local(full, group, dim)


class GatherSequence(torch.autograd.Function):
    """All-gather along `dim` into sequence order. Backward: with `reduce` the gradient of the whole sequence is
    summed over the group (every rank's queries reached every rank's keys) before this rank keeps its positions;
    without it each rank keeps its own positions of its own gradient (every rank computed the same function of
    the gathered tensor, e.g. the loss, so summing would count it cp times)."""

    @staticmethod
    def forward(ctx, local, group, dim: int, reduce: bool):
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        return _gather(local, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            grad = grad.contiguous().clone()  # all_reduce writes in place: not into a tensor autograd shares
            dist.all_reduce(grad, group=ctx.group)
        return _local(grad, ctx.group, ctx.dim), None, None, None

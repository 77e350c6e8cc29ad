"""Map between full (unsharded, HF-adapter-named) Megatron tensors and this rank's local parameter shards.

Local names differ from full names in two ways: pipeline stages number their layers from 0 (the layer's
`layer_number` attribute is global, 1-based), and expert-parallel ranks number their experts from 0
(global = ep_rank * local_count + local). Tensor-parallel shards follow each parameter's
`tensor_model_parallel` / `partition_dim` attributes; a gated (GLU) fc1 is split per half ([gate; up] ->
[gate_r; up_r] on rank r).

An interleaved pipeline's model chunks (learner/chunks.py) are listed together: each chunk's layers by their own
`layer_number`.

Persistent buffers are checkpointed state like parameters (they are in `state_dict`), so they are listed too:
DeepSeek-V3's router `expert_bias` (HF `e_score_correction_bias`) must be loaded, saved and synced, or routing
silently changes. Non-persistent buffers (token counters, caches) are not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_sparse_rl.learner.chunks import chunks_of, unwrap
from megatron_sparse_rl.models.tensor_map import global_layer_names
from megatron_sparse_rl.parallel.layout import ParallelGroups

_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class LocalParam:
    full_name: str
    param: torch.Tensor
    """The parameter, or a persistent buffer (replicated, never tensor-parallel)."""
    tp_dim: int | None
    """Dimension split across the (expert-)tensor-parallel group, None if replicated."""
    glu: bool
    expert: bool


def _named_state(model):
    """(name, tensor) of every parameter and persistent buffer of `model` (what its state_dict holds)."""
    yield from model.named_parameters()
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def local_params(model, groups: ParallelGroups) -> dict[str, LocalParam]:
    """Full name -> LocalParam for every parameter and persistent buffer of this rank's model shard (all its model
    chunks)."""
    out = {}
    for chunk in chunks_of(model):
        out.update(_chunk_params(unwrap(chunk), groups))
    return out


def _chunk_params(model, groups: ParallelGroups) -> dict[str, LocalParam]:
    global_name = global_layer_names(model)
    local_experts = None
    out = {}
    for name, param in _named_state(model):
        full = global_name(name)
        e = _EXPERT.search(full)
        if e:
            if local_experts is None:
                local_experts = _count_local_experts(model)
            glob = groups.ep_rank * local_experts + int(e.group(1))
            full = full[:e.start()] + f".local_experts.{glob}." + full[e.end():]
        tp_dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        out[full] = LocalParam(full, param, tp_dim, glu=name.endswith("linear_fc1.weight"), expert=bool(e))
    return out


def _count_local_experts(model) -> int:
    for layer in model.decoder.layers:
        experts = getattr(getattr(layer.mlp, "experts", None), "local_experts", None)
        if experts is not None:
            return len(experts)
    raise RuntimeError("no local experts found in an MoE model")


def _tp_coords(lp: LocalParam, groups: ParallelGroups) -> tuple[int, int, object]:
    group = groups.etp if lp.expert else groups.tp
    return dist.get_rank(group), dist.get_world_size(group), group


def shard_full(lp: LocalParam, full: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """This rank's slice of the full tensor `full` for parameter `lp`."""
    if lp.tp_dim is None:
        return full
    rank, size, _ = _tp_coords(lp, groups)
    if size == 1:
        return full
    if lp.glu:
        gate, up = torch.chunk(full, 2, dim=lp.tp_dim)
        return torch.cat([torch.chunk(gate, size, lp.tp_dim)[rank], torch.chunk(up, size, lp.tp_dim)[rank]],
                         dim=lp.tp_dim)
    return torch.chunk(full, size, dim=lp.tp_dim)[rank]


def gather_full(lp: LocalParam, groups: ParallelGroups) -> torch.Tensor:
    """The full tensor of `lp` gathered over its tensor-parallel group (a collective on that group)."""
    local = lp.param.detach()
    if lp.tp_dim is None:
        return local
    rank, size, group = _tp_coords(lp, groups)
    if size == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    if lp.glu:
        halves = [torch.chunk(p, 2, dim=lp.tp_dim) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=lp.tp_dim)
    return torch.cat(pieces, dim=lp.tp_dim)


@torch.no_grad()
def load_full_tensors(model, groups: ParallelGroups, full_tensors) -> set[str]:
    """Copy full tensors (an iterable of (full_name, tensor)) into the local shards they cover.

    Returns the set of full names that were loaded on this rank; names this rank does not hold are skipped.
    Shape mismatches raise naming the parameter.
    """
    params = local_params(model, groups)
    loaded = set()
    for name, full in full_tensors:
        lp = params.get(name)
        if lp is None:
            continue
        piece = shard_full(lp, full, groups)
        if tuple(piece.shape) != tuple(lp.param.shape):
            raise ValueError(f"{name}: shape {tuple(piece.shape)} (from full {tuple(full.shape)}) does not match "
                             f"the local parameter {tuple(lp.param.shape)}")
        lp.param.copy_(piece.to(lp.param.dtype))
        loaded.add(name)
    return loaded

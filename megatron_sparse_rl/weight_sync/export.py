"""Stream a sharded learner's weights as full, Hugging Face-named tensors, one tensor at a time.

    for hf_name, tensor in iter_hf_tensors(learner):   # EVERY learner rank iterates and receives
        ...

The adapter's tensor maps (`models/base.py: tensor_maps`) are walked in order; the HF name map is the
single naming truth, shared with checkpoint conversion. For each map:
- non-expert parameters: every rank holds a shard; `gather_full` joins the tensor-parallel shards
  (a collective on the TP group, a no-op at TP 1);
- routed experts: expert-parallel rank r holds global experts [r * n_local, (r + 1) * n_local); the
  holders join their expert-TP shards, then the tensor is broadcast over the EP group from its holder,
  so every rank receives every expert without ever materialising more than one tensor at a time.
- pipeline parallelism: the stage holding a tensor (the lowest, for tensors more than one stage holds)
  produces it as above, then broadcasts it over the pipeline group, so every stage receives every layer.
- LoRA (model.lora): the adapters themselves are not sent; each adapted linear is sent merged,
  W + scale x B A in every adapted part (lora/layers.py LoraParams.merged), so any engine serves the adapted model.
- `only` (a set of HF names; weight_sync/scope.py): the tensor maps holding none of them are skipped, on every rank
  alike (no gathers for them), and only those names are yielded: a LoRA sync to engines holding a full set.
Every rank walks the same maps in the same order, so collectives line up. Every rank receives the full
stream (each colocated rank may own an engine); a rank without an engine must still drain it.
Yielded tensors may share storage with the learner's parameters: do not modify them in place.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_sparse_rl.learner.params import LocalParam, gather_full
from megatron_sparse_rl.models.tensor_map import to_hf

_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


class WeightSyncError(RuntimeError):
    """Weights could not be moved, or arrived different from what was sent."""


def _expert_template(name: str, params: dict[str, LocalParam], ep_rank: int, n_local: int) -> LocalParam:
    """A local expert parameter of the same layer and kind as `name` (all experts of a layer share shape)."""
    m = _EXPERT.search(name)
    local = f"{name[:m.start()]}.local_experts.{ep_rank * n_local}.{name[m.end():]}"
    if local not in params:
        raise WeightSyncError(f"{name}: this rank holds no expert of the same layer ({local} is missing)")
    return params[local]


def _full_shape(lp: LocalParam, groups) -> tuple[int, ...]:
    shape = list(lp.param.shape)
    if lp.tp_dim is not None:
        shape[lp.tp_dim] *= dist.get_world_size(groups.etp if lp.expert else groups.tp)
    return tuple(shape)


def _n_local_experts(params: dict[str, LocalParam], ep: int, num_experts: int) -> int:
    if not num_experts:
        return 0
    if num_experts % ep:
        raise WeightSyncError(f"expert parallel size {ep} does not divide the expert count {num_experts}")
    return num_experts // ep


def _stage_key(name: str) -> str:
    """Experts of one layer share a shape and a pipeline stage: one key for all of them."""
    return _EXPERT.sub(".local_experts.*.", name)


def _stage_owners(params: dict[str, LocalParam], groups, pp: int) -> dict[str, tuple[int, tuple, torch.dtype]]:
    """stage key -> (lowest pipeline stage holding it, full shape, dtype), agreed over the pipeline group."""
    mine = {_stage_key(n): (_full_shape(lp, groups), lp.param.dtype) for n, lp in params.items()}
    if pp == 1:
        return {k: (0, *v) for k, v in mine.items()}
    every: list = [None] * pp
    dist.all_gather_object(every, mine, group=groups.pp)
    owners: dict = {}
    for stage, held in enumerate(every):
        for key, (shape, dtype) in held.items():
            owners.setdefault(key, (stage, shape, dtype))
    return owners


def _stage_tensor(tm, params: dict[str, LocalParam], groups, ep: int, n_local: int) -> torch.Tensor:
    """The full tensor of `tm` on a rank of the stage holding it (EP holders broadcast over the EP group)."""
    lp = params.get(tm.mcore)
    m = _EXPERT.search(tm.mcore)
    if m is None or ep == 1:
        if lp is None:
            raise WeightSyncError(f"{tm.mcore}: not held by this rank (the learner lacks a mapped parameter)")
        return gather_full(lp, groups)
    if lp is not None:
        full = gather_full(lp, groups).contiguous()
    else:
        template = _expert_template(tm.mcore, params, groups.ep_rank, n_local)
        full = torch.empty(_full_shape(template, groups), dtype=template.param.dtype, device=template.param.device)
    owner = int(m.group(1)) // n_local
    dist.broadcast(full, src=dist.get_process_group_ranks(groups.ep)[owner], group=groups.ep)
    return full


@torch.no_grad()
def iter_full_mcore(learner, only: frozenset[str] | None = None) -> Iterator[tuple[object, torch.Tensor]]:
    """(TensorMap, full Megatron tensor) for every adapter tensor map (with `only`: those holding one of its HF
    names), on every rank (collective)."""
    groups, pp = learner.groups, learner.layout.pp
    adapted = getattr(learner, "lora_linears", {})
    params = {n: lp for n, lp in learner.named_full_parameters() if n not in getattr(learner, "lora_params", {})}
    ep = learner.layout.ep
    n_local = _n_local_experts(params, ep, learner.spec.num_experts)
    maps = learner.adapter.tensor_maps(learner.spec)
    unmapped = set(params) - {tm.mcore for tm in maps}
    if unmapped:
        raise WeightSyncError(f"the learner has {len(unmapped)} parameters the adapter does not map, "
                              f"e.g. {sorted(unmapped)[:3]}")
    owners = _stage_owners(params, groups, pp)
    pp_ranks = dist.get_process_group_ranks(groups.pp) if pp > 1 else None
    for tm in maps:
        if only is not None and only.isdisjoint(tm.hf):  # every rank skips the same maps: collectives line up
            continue
        key = _stage_key(tm.mcore)
        if key not in owners:
            raise WeightSyncError(f"{tm.mcore}: held by no pipeline stage (the learner lacks a mapped parameter)")
        stage, shape, dtype = owners[key]
        if stage == groups.pp_rank:
            full = _stage_tensor(tm, params, groups, ep, n_local)
            if tm.mcore in adapted:  # merged on the stage that holds the adapters, then sent to the others
                full = adapted[tm.mcore].merged(full, learner.spec)
        else:
            full = torch.empty(shape, dtype=dtype, device=next(iter(params.values())).param.device)
        if pp > 1:
            full = full.contiguous()
            dist.broadcast(full, src=pp_ranks[stage], group=groups.pp)
        yield tm, full


def iter_hf_tensors(learner, convert=None, only: frozenset[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for the whole model (with `only`: those names alone), in the adapter's HF order, on
    every rank (collective). `convert(name, tensor)` (weight_sync/engine_weights.py: the FP8 round trip) replaces
    each tensor when given."""
    for tm, full in iter_full_mcore(learner, only):
        for name, tensor in zip(tm.hf, to_hf(tm, full, learner.spec)):
            if only is None or name in only:
                yield name, (tensor if convert is None else convert(name, tensor))

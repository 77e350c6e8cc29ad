"""LoRA adapters on Megatron-Core's linears (any tensor and pipeline parallel size): attention, the dense MLP and the shared experts.

    adapters = attach_lora(model, adapter, spec, lora_cfg, seed=1234)   # {name: Parameter}; the base frozen

Each adapted Megatron linear gets a `lora` submodule holding one A [r, in] and B [out_i, r] per Hugging Face module
it fuses (linear_qkv: q_proj, k_proj, v_proj; linear_fc1: gate_proj, up_proj), and a forward hook adding
scale x B_i A_i dropout(x) to the part of the output that module fills. The parts are laid out in the fused output
by the adapter's tensor map (models/tensor_map.py to_mcore), the one place that says how q/k/v interleave per query
group and gate/up stack, so a LoRA on q_proj here is PEFT's LoRA on the Hugging Face q_proj. The base parameters keep
their names (a checkpoint loads as before) and stop requiring gradients, so Megatron's DDP and optimizer hold the
adapters only. Init as PEFT's: A Kaiming-uniform (a = sqrt(5)), B zero; adapters in fp32 whatever the base dtype.

Tensor parallel (the split follows the base weight's `partition_dim`, TpPlacement): on a column-parallel linear
(linear_qkv, linear_fc1, MLA's projections but linear_proj) each B is split along its outputs in tp contiguous
chunks, which is how Megatron splits each fused part (a rank holds whole KV groups of q/k/v; [gate_r; up_r] of
fc1), and A is whole; on a row-parallel one (linear_proj, linear_fc2) A is split along its inputs and B is whole.
The split ones carry Megatron's `tensor_model_parallel` / `partition_dim` marks, so the grad norm counts them once
per shard and the replicated ones once. `delta` says where the tp communication goes, sequence parallel included.

Pipeline parallel: each stage adapts the linears of its own layers. The adapters are named by their full (global
layer) names, as the tensor maps name the base, so checkpoints, the merge and the sync find them on any stage.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megatron_sparse_rl.lora.targets import layout_problems, resolve_targets, target_problems
from megatron_sparse_rl.models.tensor_map import TensorMap, global_layer_names, to_mcore

LORA = "lora"
"""The submodule name of a linear's adapters: their parameters are named `<linear>.lora.A.<hf module>` / `.B.`."""


@dataclass(frozen=True)
class TpPlacement:
    """How an adapted linear sits over tensor parallelism (its base weight's `partition_dim`): 'column' (outputs
    split: each B split along `out` as the base's rows, A whole), 'row' (inputs split: A split along `in` as the base's
    columns, B whole) or 'whole' (tp 1, or a duplicated linear)."""

    parallel: Literal["whole", "column", "row"] = "whole"
    size: int = 1
    rank: int = 0
    group: object = None
    sequence_parallel: bool = False
    """The linear's own flag: its input (column) or output (row) is this rank's chunk of the sequence."""


class LoraParams(torch.nn.Module):
    """The adapters of one Megatron linear: A[name] [r, in], B[name] [out_i, r] per Hugging Face module it fuses; at
    tensor parallel > 1, this rank's shard of each (TpPlacement)."""

    def __init__(self, tm: TensorMap, names: tuple[str, ...], rank: int, scale: float, dropout: float,
                 generator: torch.Generator, tp: TpPlacement = TpPlacement()):
        super().__init__()
        self.tm, self.scale, self.dropout, self.tp = tm, scale, dropout, tp
        self.active = True  # False inside adapters_off: the linear computes with its base weight alone
        self.leaves = tuple(hf.split(".")[-2] for hf in tm.hf)
        column, row = tp.parallel == "column", tp.parallel == "row"
        self.outs = tuple(shape[0] // (tp.size if column else 1) for shape in tm.shapes)  # this rank's rows
        in_features = tm.shapes[0][1]
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        bound = 1 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on [r, in]: U(-1/sqrt(in), 1/sqrt(in))
        for leaf, out in zip(self.leaves, self.outs):
            if leaf in names:
                a = (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound  # whole: every tp rank alike
                self.A[leaf] = torch.nn.Parameter(a.chunk(tp.size, 1)[tp.rank].clone() if row else a)
                self.B[leaf] = torch.nn.Parameter(torch.zeros(out, rank))
                if column or row:  # the split one, marked as Megatron marks its own (grad norm, checkpoints)
                    _mark_split(self.B[leaf] if column else self.A[leaf], 0 if column else 1)

    def local_spec(self, spec):
        """`spec` as this rank's shard of a fused qkv sees it: its KV groups (and their query heads) alone."""
        if self.tp.parallel != "column" or self.tm.kind != "qkv":
            return spec
        return dataclasses.replace(spec, num_heads=spec.num_heads // self.tp.size,
                                   num_kv_heads=spec.num_kv_heads // self.tp.size)

    def delta(self, x: torch.Tensor, spec) -> torch.Tensor:
        """scale x B A dropout(x) of every adapted part, laid out as this rank's fused Megatron output ([..., sum(outs)]
        on the tokens the base's output holds). At tp > 1 the rank-r products carry the communication: a column
        linear's A x is whole on every rank (its backward sums the ranks' shares, as the base does for x); a row
        linear's A_local x_local is summed over the ranks before B. So every adapter's gradient is whole on each rank
        and the replicated ones need no reduction of their own."""
        from megatron.core.tensor_parallel import mappings as tpm

        tp, parallel = self.tp, (self.tp.parallel if self.tp.size > 1 else "whole")
        h = torch.nn.functional.dropout(x.to(torch.float32), self.dropout, self.training)
        if parallel == "column" and tp.sequence_parallel:  # whole sequence in; backward keeps this rank's chunk
            h = tpm.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False, group=tp.group)
        lead = h.shape[:-1]
        h = h.reshape(-1, h.shape[-1])
        parts = []
        for leaf, out in zip(self.leaves, self.outs):
            if leaf in self.A:
                z = h @ self.A[leaf].t()
                if parallel == "column":
                    z = tpm.copy_to_tensor_model_parallel_region(z, group=tp.group)
                elif parallel == "row":
                    z = tpm.reduce_from_tensor_model_parallel_region(z, group=tp.group)
                parts.append((z @ self.B[leaf].t()).t())  # [out_i, tokens]: a weight's layout
            else:
                parts.append(h.new_zeros(out, h.shape[0]))
        y = (to_mcore(self.tm, parts, self.local_spec(spec)).t() * self.scale).reshape(*lead, -1)
        if parallel == "row" and tp.sequence_parallel:  # the base's output is this rank's chunk of the sequence
            y = tpm.scatter_to_sequence_parallel_region(y, group=tp.group)
        return y

    def factors(self, leaf: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of `leaf`, whole (gathered over the tp ranks: a collective there when split)."""
        return gather_adapter(self.A[leaf], self.tp.group), gather_adapter(self.B[leaf], self.tp.group)

    @torch.no_grad()
    def merged(self, weight: torch.Tensor, spec) -> torch.Tensor:
        """The linear's full Megatron weight [sum(outs), in] with its adapters merged: W + scale x B_i A_i in each
        adapted part (laid out as in `delta`), computed in float32 and rounded to W's dtype. Collective over the tp
        group when the adapters are split (every tp rank calls it)."""
        parts = []
        for leaf, shape in zip(self.leaves, self.tm.shapes):
            if leaf in self.A:
                a, b = self.factors(leaf)
                parts.append((b @ a) * self.scale)
            else:
                parts.append(torch.zeros(shape[0], weight.shape[1], dtype=torch.float32, device=weight.device))
        return (weight.to(torch.float32) + to_mcore(self.tm, parts, spec)).to(weight.dtype)


def _mark_split(param: torch.nn.Parameter, dim: int) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, True, dim, 1)


def is_split(param: torch.Tensor) -> bool:
    """Whether an adapter parameter is split over the tp ranks (B of a column linear, A of a row one)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def gather_adapter(param: torch.Tensor, group, value: torch.Tensor | None = None) -> torch.Tensor:
    """The whole tensor of adapter `param` (or of `value`, a tensor of its shape: its Adam state), gathered along
    its split dimension over tp `group` (a collective there); `param` itself when it is not split."""
    local = (param if value is None else value).detach()
    size = 1 if group is None else dist.get_world_size(group)
    if not is_split(param) or size == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=param.partition_dim)


def shard_adapter(param: torch.Tensor, whole: torch.Tensor, group) -> torch.Tensor:
    """This tp rank's slice of `whole` (an adapter's whole tensor) for `param`."""
    size = 1 if group is None else dist.get_world_size(group)
    if not is_split(param) or size == 1:
        return whole
    return whole.chunk(size, dim=param.partition_dim)[dist.get_rank(group)]


def whole_shape(param: torch.Tensor, group) -> tuple[int, ...]:
    """The shape of adapter `param` whole (its split dimension times the tp size)."""
    shape = list(param.shape)
    if is_split(param) and group is not None:
        shape[param.partition_dim] *= dist.get_world_size(group)
    return tuple(shape)


def adapter_count(params: dict[str, torch.nn.Parameter], group) -> int:
    """Adapter parameters of the whole model (a split one counted whole) on this rank's pipeline stage."""
    return sum(math.prod(whole_shape(p, group)) for p in params.values())


def _full_named_modules(model) -> dict[str, torch.nn.Module]:
    """{full name: module} of `model` (a GPTModel, or a ModuleList of interleaved-pipeline chunks): a pipeline stage
    numbers its layers from 0, and a layer's `layer_number` (1-based) is global, so `decoder.layers.<local>.` becomes
    `decoder.layers.<global>.`, the names the tensor maps use."""
    out = {}
    for chunk in (model if isinstance(model, torch.nn.ModuleList) else [model]):
        global_name = global_layer_names(chunk)
        out.update((global_name(name), module) for name, module in chunk.named_modules())
    return out


def adapted_linears(model) -> dict[str, LoraParams]:
    """{full Megatron weight name (`<linear>.weight`): its adapters} of every adapted linear of this rank's stage."""
    return {f"{name.removesuffix(f'.{LORA}')}.weight": module for name, module in _full_named_modules(model).items()
            if isinstance(module, LoraParams)}


@contextmanager
def adapters_off(model) -> Iterator[None]:
    """Within the block every adapted linear of `model` computes with its base weight alone (PEFT's
    `disable_adapter`): what a base holding the merged weights needs (weight_sync/engine_weights.py `held_by`)."""
    adapters = [m for m in model.modules() if isinstance(m, LoraParams)]
    for m in adapters:
        m.active = False
    try:
        yield
    finally:
        for m in adapters:
            m.active = True


def _hook(spec):
    def add_delta(module, args, output):
        if not module.lora.active:
            return output
        out, bias = output
        return out + module.lora.delta(args[0], spec).to(out.dtype), bias
    return add_delta


def _placement(module, tp: int) -> TpPlacement:
    """Where `module`'s adapters sit over tp, read from its base weight as Megatron marks it (partition_dim 0:
    column-parallel, 1: row-parallel; not tensor-parallel: whole on every rank)."""
    weight = module.weight
    if tp == 1 or not getattr(weight, "tensor_model_parallel", False):
        return TpPlacement()
    group = module.tp_group
    return TpPlacement("column" if weight.partition_dim == 0 else "row", dist.get_world_size(group),
                       dist.get_rank(group), group, bool(getattr(module, "sequence_parallel", False)))


def _shard_split_adapters(module) -> None:
    """Make the torch_dist checkpoint hold each split adapter as its tp shards: the base linear's
    `sharded_state_dict` lists its `lora` submodule's tensors as replicated over tp (it knows only its weight and
    bias), which for a split B or A would keep one rank's shard. This linear's own method, wrapped once."""
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    base = module.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = base(prefix, sharded_offsets, metadata)
        for name, p in module.lora.named_parameters():
            if is_split(p):
                key = f"{prefix}{LORA}.{name}"
                out[key] = make_tp_sharded_tensor_for_checkpoint(
                    p, key, p.partition_dim, prepend_offsets=sharded_offsets, tp_group=module.tp_group,
                    dp_cp_group=(metadata or {}).get("dp_cp_group"))
        return out

    module.sharded_state_dict = sharded_state_dict


def adapted_weights(adapter, spec, lora) -> frozenset[str]:
    """The full Megatron weight names `lora` (config.LoraConfig) adapts, over every pipeline stage (what a sync of
    the adapted tensors alone sends: the same on every rank)."""
    return frozenset(f"{name}.weight" for name, _, _ in _adaptable(adapter, spec,
                                                                    resolve_targets(lora.target_modules, spec)))


def _adaptable(adapter, spec, targets: frozenset[str]):
    """(Megatron linear name, its tensor map, the targeted HF leaves) of every linear weight outside routed
    experts whose Hugging Face modules include a target."""
    for tm in adapter.tensor_maps(spec):
        if not tm.mcore.endswith(".weight") or ".mlp.experts." in tm.mcore or not tm.shapes or len(tm.shapes[0]) != 2:
            continue
        leaves = {hf.split(".")[-2] for hf in tm.hf} & targets
        if leaves:
            yield tm.mcore.removesuffix(".weight"), tm, tuple(sorted(leaves))


def attach_lora(model, adapter, spec, lora, *, tp: int, pp: int, seed: int) -> dict[str, torch.nn.Parameter]:
    """Freeze `model` (a GPTModel, not yet DDP-wrapped) and attach `lora` (config.LoraConfig) adapters to the linears
    its target_modules select; returns the adapter parameters by name (this rank's shards at tp > 1: the same
    whole values at any tp for one seed). Refused (ValueError naming the field): what lora/targets.py refuses
    (pipeline parallel above 1, dropout at tp > 1, routed-expert targets), the refusals validate reports too."""
    targets = resolve_targets(lora.target_modules, spec)
    problems = layout_problems(lora, tp=tp, pp=pp) + target_problems(targets)
    if problems:
        raise ValueError("; ".join(problems))
    for p in model.parameters():
        p.requires_grad_(False)
    modules = _full_named_modules(model)
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tm, leaves in _adaptable(adapter, spec, targets):
        module = modules.get(name)
        if module is None:  # the layer of another pipeline stage (its draws still made: the same values at any pp)
            LoraParams(tm, leaves, lora.rank, lora.scale, lora.dropout, generator)
            continue
        placement = _placement(module, tp)
        module.add_module(LORA, LoraParams(tm, leaves, lora.rank, lora.scale, lora.dropout, generator, placement))
        # first: MLA's down projection has a hook that gathers its output (patches/megatron_mla_tp.py); the
        # delta belongs to this rank's columns, before that
        module.register_forward_hook(_hook(spec), prepend=True)
        if placement.parallel != "whole":
            _shard_split_adapters(module)
        out.update({f"{name}.{LORA}.{n}": p for n, p in module.lora.named_parameters()})
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return out

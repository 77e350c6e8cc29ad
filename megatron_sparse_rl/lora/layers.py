"""LoRA adapters on Megatron-Core's linears (tensor parallel 1): attention, the dense MLP and the shared experts.

    adapters = attach_lora(model, adapter, spec, lora_cfg, seed=1234)   # {name: Parameter}; the base frozen

Each adapted Megatron linear gets a `lora` submodule holding one A [r, in] and B [out_i, r] per Hugging Face module
it fuses (linear_qkv: q_proj, k_proj, v_proj; linear_fc1: gate_proj, up_proj), and a forward hook adding
scale x B_i A_i dropout(x) to the part of the output that module fills. The parts are laid out in the fused output
by the adapter's tensor map (models/tensor_map.py to_mcore), the one place that says how q/k/v interleave per query
group and gate/up stack, so a LoRA on q_proj here is PEFT's LoRA on the Hugging Face q_proj. The base parameters keep
their names (a checkpoint loads as before) and stop requiring gradients, so Megatron's DDP and optimizer hold the
adapters only. Init as PEFT's: A Kaiming-uniform (a = sqrt(5)), B zero; adapters in fp32 whatever the base dtype.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megatron_sparse_rl.lora.targets import layout_problems, resolve_targets, target_problems
from megatron_sparse_rl.models.tensor_map import TensorMap, to_mcore

LORA = "lora"
"""The submodule name of a linear's adapters: their parameters are named `<linear>.lora.A.<hf module>` / `.B.`."""


class LoraParams(torch.nn.Module):
    """The adapters of one Megatron linear: A[name] [r, in], B[name] [out_i, r] per Hugging Face module it fuses."""

    def __init__(self, tm: TensorMap, names: tuple[str, ...], rank: int, scale: float, dropout: float,
                 generator: torch.Generator):
        super().__init__()
        self.tm, self.scale, self.dropout = tm, scale, dropout
        self.active = True  # False inside adapters_off: the linear computes with its base weight alone
        self.leaves = tuple(hf.split(".")[-2] for hf in tm.hf)
        self.outs = tuple(shape[0] for shape in tm.shapes)
        in_features = tm.shapes[0][1]
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        bound = 1 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on [r, in]: U(-1/sqrt(in), 1/sqrt(in))
        for leaf, out in zip(self.leaves, self.outs):
            if leaf in names:
                a = (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound
                self.A[leaf] = torch.nn.Parameter(a)
                self.B[leaf] = torch.nn.Parameter(torch.zeros(out, rank))

    def delta(self, x: torch.Tensor, spec) -> torch.Tensor:
        """scale x B A dropout(x) of every adapted part, laid out as the fused Megatron output ([..., sum(outs)])."""
        lead = x.shape[:-1]
        h = torch.nn.functional.dropout(x.to(torch.float32), self.dropout, self.training).reshape(-1, x.shape[-1])
        parts = []
        for leaf, out in zip(self.leaves, self.outs):
            if leaf in self.A:
                parts.append((h @ self.A[leaf].t() @ self.B[leaf].t()).t())  # [out_i, tokens]: a weight's layout
            else:
                parts.append(h.new_zeros(out, h.shape[0]))
        return (to_mcore(self.tm, parts, spec).t() * self.scale).reshape(*lead, -1)


    @torch.no_grad()
    def merged(self, weight: torch.Tensor, spec) -> torch.Tensor:
        """The linear's full Megatron weight [sum(outs), in] with its adapters merged: W + scale x B_i A_i in each
        adapted part (laid out as in `delta`), computed in float32 and rounded to W's dtype."""
        parts = [(self.B[leaf] @ self.A[leaf]) * self.scale if leaf in self.A else
                 torch.zeros(out, weight.shape[1], dtype=torch.float32, device=weight.device)
                 for leaf, out in zip(self.leaves, self.outs)]
        return (weight.to(torch.float32) + to_mcore(self.tm, parts, spec)).to(weight.dtype)


def adapted_linears(model) -> dict[str, LoraParams]:
    """{Megatron weight name (`<linear>.weight`): its adapters} of every adapted linear of `model` (TP1, PP1: local
    names are the full names)."""
    return {f"{name.removesuffix(f'.{LORA}')}.weight": module for name, module in model.named_modules()
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
    its target_modules select; returns the adapter parameters by name. Refused (ValueError naming the field): tensor
    and pipeline parallel above 1 and routed-expert targets, which the learner does not adapt yet (lora/targets.py,
    the refusals validate reports too)."""
    targets = resolve_targets(lora.target_modules, spec)
    problems = layout_problems(lora, tp=tp, pp=pp) + target_problems(targets)
    if problems:
        raise ValueError("; ".join(problems))
    for p in model.parameters():
        p.requires_grad_(False)
    modules = dict(model.named_modules())
    generator = torch.Generator().manual_seed(seed)
    for name, tm, leaves in _adaptable(adapter, spec, targets):
        module = modules[name]
        module.add_module(LORA, LoraParams(tm, leaves, lora.rank, lora.scale, lora.dropout, generator))
        module.register_forward_hook(_hook(spec))
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return {n: p for n, p in model.named_parameters() if f".{LORA}." in n}

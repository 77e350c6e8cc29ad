"""The linears of a model LoRA can adapt, named as Hugging Face PEFT names them, with their shapes and parallelism;
the one home of that fact for the config check (`model.lora.target_modules`) and the planner (`msrl plan
--lora-rank`).

    linears = lora_linears(spec)                      # one layer's adaptable linears, by group
    names = resolve_targets(("all-linear",), spec)    # the target names a config selects
    count = adapter_params(spec, rank=16, targets=names)

A LoRA adapter of rank r on a linear with `in_features` inputs and `out_features` outputs holds A [r, in] and
B [out, r]: r * (in + out) parameters. Names are the leaf module names of the Hugging Face model (q_proj, o_proj,
gate_proj, kv_b_proj, ...), which PEFT's `target_modules` matches: `gate_proj`/`up_proj`/`down_proj` adapt the dense
MLP and the shared experts; `experts` adapts the three linears of every routed expert, one adapter per expert
(transformers 5 holds routed experts as fused 3D parameters, not per-expert modules). Routers, embeddings, the
output layer and a DSA indexer are never adapted.

Parallelism (the A/B split follows the base layer): a column-parallel linear splits its outputs over TP, so B is split
and A is whole on every TP rank; a row-parallel linear splits its inputs, so A is split and B whole; MLA's down
projections are duplicated (whole on every TP rank, as Megatron-Core builds them with TE); routed experts are split
by EP (expert tensor parallel 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ALL_LINEAR = "all-linear"
"""The target that selects every linear the model has (PEFT's name for the same)."""
EXPERTS = "experts"
"""The target that selects the three linears of every routed expert."""
Group = Literal["attention", "dense_mlp", "shared_experts", "experts"]
Parallel = Literal["column", "row", "duplicated"]


@dataclass(frozen=True, slots=True)
class LoraLinear:
    """One adaptable linear of one layer (of one routed expert, for group 'experts')."""

    name: str
    """PEFT's target name: the Hugging Face leaf module name ('experts' for a routed expert's linears)."""
    group: Group
    in_features: int
    out_features: int
    parallel: Parallel
    """How Megatron splits the base linear over TP (the adapter follows it)."""

    def params(self, rank: int) -> int:
        """A [rank, in] + B [out, rank]."""
        return rank * (self.in_features + self.out_features)

    def params_per_tp_rank(self, rank: int, tp: int) -> float:
        """Adapter parameters one TP rank holds: B split for column, A split for row, both whole when duplicated."""
        if self.parallel == "column":
            return rank * (self.in_features + self.out_features / tp)
        if self.parallel == "row":
            return rank * (self.in_features / tp + self.out_features)
        return self.params(rank)


def _attention(spec) -> list[LoraLinear]:
    from megatron_sparse_rl.models.deepseek import DeepseekSpec

    h = spec.hidden_size
    if not isinstance(spec, DeepseekSpec):
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return [LoraLinear("q_proj", "attention", h, q, "column"), LoraLinear("k_proj", "attention", h, kv, "column"),
                LoraLinear("v_proj", "attention", h, kv, "column"), LoraLinear("o_proj", "attention", q, h, "row")]
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    heads = spec.num_heads
    if spec.q_lora_rank is None:
        out = [LoraLinear("q_proj", "attention", h, heads * qk, "column")]
    else:
        out = [LoraLinear("q_a_proj", "attention", h, spec.q_lora_rank, "duplicated"),
               LoraLinear("q_b_proj", "attention", spec.q_lora_rank, heads * qk, "column")]
    return out + [
        LoraLinear("kv_a_proj_with_mqa", "attention", h, spec.latent_width, "duplicated"),
        LoraLinear("kv_b_proj", "attention", spec.kv_lora_rank, heads * (spec.qk_nope_head_dim + spec.v_head_dim),
                   "column"),
        LoraLinear("o_proj", "attention", heads * spec.v_head_dim, h, "row")]


def _mlp(group: Group, h: int, ffn: int) -> list[LoraLinear]:
    if group == "experts":
        return [LoraLinear(EXPERTS, group, h, ffn, "column"), LoraLinear(EXPERTS, group, h, ffn, "column"),
                LoraLinear(EXPERTS, group, ffn, h, "row")]
    return [LoraLinear("gate_proj", group, h, ffn, "column"), LoraLinear("up_proj", group, h, ffn, "column"),
            LoraLinear("down_proj", group, ffn, h, "row")]


def lora_linears(spec) -> dict[Group, list[LoraLinear]]:
    """The adaptable linears of ONE layer of each kind, by group: 'attention' (every layer), 'dense_mlp' (each dense
    layer), 'shared_experts' (each MoE layer with shared experts, counted as the one MLP of their summed width, as
    Hugging Face holds them), 'experts' (ONE routed expert of one MoE layer). A group the model lacks is absent."""
    h = spec.hidden_size
    out: dict[Group, list[LoraLinear]] = {"attention": _attention(spec)}
    moe = tuple(spec.moe_layers) or (False,) * spec.num_layers
    if not all(moe):
        out["dense_mlp"] = _mlp("dense_mlp", h, spec.ffn_hidden_size)
    if any(moe) and spec.shared_expert_ffn_hidden_size:
        out["shared_experts"] = _mlp("shared_experts", h, spec.shared_expert_ffn_hidden_size)
    if any(moe) and spec.num_experts:
        out["experts"] = _mlp("experts", h, spec.moe_ffn_hidden_size)
    return out


def target_names(spec) -> tuple[str, ...]:
    """Every target name the model has, in layer order (what a refusal lists)."""
    names = [x.name for linears in lora_linears(spec).values() for x in linears]
    return tuple(dict.fromkeys(names))


def resolve_targets(targets, spec, *, field: str = "model.lora.target_modules") -> frozenset[str]:
    """The target names `targets` selects ('all-linear': every one); ValueError naming `field`, the missing name and
    what the model has when a target is not one of the model's."""
    have = target_names(spec)
    if ALL_LINEAR in targets:
        return frozenset(have)
    missing = [t for t in targets if t not in have]
    if missing:
        raise ValueError(f"{field}: {spec.architecture} has no module {', '.join(map(repr, missing))}; it has "
                         f"{', '.join(have)} (or {ALL_LINEAR!r} for all of them)")
    return frozenset(targets)


@dataclass(frozen=True, slots=True)
class AdapterCount:
    """Adapter parameters of a whole model, split as the planner shards them."""

    dense: int
    """Attention, dense MLP and shared-expert adapters (sharded by TP where the base is)."""
    experts: int
    """Routed-expert adapters, every expert of every MoE layer (sharded by EP)."""

    @property
    def total(self) -> int:
        return self.dense + self.experts


def _layer_counts(spec) -> dict[Group, int]:
    """How many times each group occurs in the model."""
    moe = tuple(spec.moe_layers) or (False,) * spec.num_layers
    n_moe = sum(moe)
    return {"attention": spec.num_layers, "dense_mlp": spec.num_layers - n_moe, "shared_experts": n_moe,
            "experts": n_moe * spec.num_experts}


def adapter_params(spec, rank: int, targets: frozenset[str]) -> AdapterCount:
    """Adapter parameters of rank `rank` on the selected `targets` (resolve_targets), over the whole model."""
    times = _layer_counts(spec)
    dense = experts = 0
    for group, linears in lora_linears(spec).items():
        n = sum(x.params(rank) for x in linears if x.name in targets) * times[group]
        if group == "experts":
            experts += n
        else:
            dense += n
    return AdapterCount(dense=dense, experts=experts)


def layer_params_per_tp_rank(spec, rank: int, targets: frozenset[str], tp: int) -> dict[Group, float]:
    """Adapter parameters one TP rank holds for one occurrence of each group (one layer, or one routed expert, which
    TP does not split: expert tensor parallel is 1)."""
    return {group: sum(x.params_per_tp_rank(rank, 1 if group == "experts" else tp) for x in linears
                       if x.name in targets)
            for group, linears in lora_linears(spec).items()}


def layout_problems(lora, *, tp: int, pp: int, cp: int = 1) -> list[str]:
    """What the learner's adapters (lora/layers.py) do not run on, naming the fields: context parallel above 1, and
    dropout at tensor parallel above 1 (data, expert, tensor and pipeline parallel run). The one home of these
    refusals: validate reports them, attach_lora raises them."""
    if lora is None:
        return []
    problems = []
    if tp != 1 and lora.dropout > 0:
        problems.append(f"model.lora.dropout must be 0 at parallel.tp > 1 (got dropout {lora.dropout:g}, tp {tp}): "
                        "the tp ranks of a column-parallel linear would drop different inputs of one shared A x")
    if cp != 1:
        problems.append(f"model.lora needs parallel.cp = 1 (got {cp}): adapters under context parallel are untested")
    return problems


def target_problems(targets: frozenset[str]) -> list[str]:
    """What the learner cannot adapt among the resolved `targets`: the routed experts."""
    if EXPERTS in targets:
        return [f"model.lora.target_modules: adapters on routed experts ({EXPERTS!r}, which {ALL_LINEAR!r} includes "
                "on an MoE model) are not in the learner yet; name the attention, dense MLP and shared-expert "
                "modules instead (e.g. [q_proj, k_proj, v_proj, o_proj])"]
    return []


def config_problems(lora, spec, *, tp: int = 1, pp: int = 1, cp: int = 1) -> list[str]:
    """What validate refuses in `model.lora` (a config.LoraConfig, or None: off) on a learner of `tp`, `pp`, `cp`: a
    target the model lacks or the learner cannot adapt (checked when the model is known here, `spec` not None), and
    the parallel layouts the adapters do not run on (layout_problems)."""
    if lora is None:
        return []
    problems = []
    if spec is not None:
        try:
            problems += target_problems(resolve_targets(lora.target_modules, spec))
        except ValueError as e:
            problems.append(str(e))
    return problems + layout_problems(lora, tp=tp, pp=pp, cp=cp)

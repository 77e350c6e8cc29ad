"""Per-GPU memory of learner states for one TP/PP/EP/DP layout, with what ranks it (ranking.py ranks them).

    opts = PlanOptions(gpus=256, gpus_per_node=8, gpu_mem_gib=80)
    plan = plan_layout(shape, 8, 8, 32, opts)  # memory, headroom, EP nodes, learner limits, published recipe

Assumptions (docs/scale.md explains them): bf16 weights; gradients fp32 (or bf16) in Megatron's buffer;
Megatron's distributed optimizer shards fp32 master weights + Adam m, v (12 bytes, +4 for an fp32 grad
copy when grads are bf16) over the data-parallel group of each parameter (DP for dense parameters,
expert-DP = world / (pp * ep) for routed experts): 6 + 12/d bytes per parameter with fp32 grads, as in
Megatron's distributed-optimizer table. Expert tensor parallel is 1. The worst pipeline stage counts:
ceil(layers / pp) layers, MoE layers first, plus the larger of embedding and output layer (with the final norm).
Activations follow Korthikanti et al. 2022 with TP + sequence parallel (everything / tp), flash attention (no
s^2), 1F1B keeping `pp` micro-batches in flight on the first stage, fp32 logits and their gradient. A DSA indexer
(DeepSeek-V3.2, GLM-5) is not split by TP: its parameters and activations count whole on every rank.
Context parallelism (cp > 1) splits every sequence over cp ranks: activations and logits count seq_len / cp tokens,
plus the K and V of the whole sequence that each attention gathers (bf16, hidden wide each: an upper bound for
GQA/MLA; one layer's worth under full recompute); the weights are whole on every CP rank; the distributed
optimizer shards dense states over dp * cp (Megatron's data-parallel group with context parallelism); expert data
parallel stays world / (pp * ep).

With LoRA (`lora_rank` > 0) the base is frozen in bf16 (2 B per parameter, no gradient, no optimizer state) and the
adapters (lora/targets.py) train in fp32: weights 4 B, gradients 4 B, Adam m, v 8 B sharded over the data-parallel
group of the base they adapt (Megatron's distributed-optimizer table: fp32 parameters and gradients, 8 + 8/d bytes;
no separate master copy). Activations are counted as without LoRA (the backward still runs through every layer).
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from math import ceil

from megatron_sparse_rl.config.degrees import ParallelDegrees
from megatron_sparse_rl.lora.targets import layer_params_per_tp_rank, resolve_targets
from megatron_sparse_rl.planner.recipes import Recipe, published_recipe
from megatron_sparse_rl.config.stages import balanced
from megatron_sparse_rl.planner.shapes import ModelShape

GiB = 1024 ** 3


@dataclass(kw_only=True, frozen=True, slots=True)
class PlanOptions:
    gpus: int
    """GPUs of the learner."""
    gpus_per_node: int = 8
    """GPUs joined by NVLink in one node: a TP group stays inside one; an EP group that spans nodes ranks lower."""
    gpu_mem_gib: float
    """Memory of one GPU."""
    seq_len: int = 32768
    """Tokens per learner micro-batch sequence (prompt + response)."""
    micro_batch: int = 1
    recompute: str = "full"
    """'full': only layer inputs are kept, one layer is recomputed at a time; 'none': everything kept."""
    grad_dtype: str = "fp32"
    optimizer_offload: bool = False
    """Master weights and Adam states on the host (Megatron's optimizer CPU offload)."""
    reserve_gib: float = 6.0
    """Left for the CUDA context, NCCL buffers, allocator fragmentation and temporaries."""
    lora_rank: int = 0
    """LoRA adapter rank; 0: full RL (every parameter trains)."""
    lora_targets: tuple[str, ...] = ("all-linear",)
    """The modules adapted when lora_rank > 0 (model.lora.target_modules' names; lora/targets.py)."""
    margin: float = 0.10
    """Headroom a layout should keep beyond `reserve_gib`, as a fraction of GPU memory (0.10: 8 GiB of 80): what
    the estimate leaves out (experts receiving more than their share of tokens, allocator peaks) has to fit there.
    A layout that fits with less ranks below every fitting layout that keeps it."""

    def __post_init__(self):
        for name in ("gpu_mem_gib", "reserve_gib", "margin"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite (got {getattr(self, name)})")
        if self.gpus < 1 or self.gpus_per_node < 1 or self.gpu_mem_gib <= 0:
            raise ValueError(f"gpus and gpus_per_node must be >= 1 and gpu_mem_gib > 0 (got {self.gpus}, "
                             f"{self.gpus_per_node}, {self.gpu_mem_gib:g})")
        if self.recompute not in ("full", "none") or self.grad_dtype not in ("fp32", "bf16"):
            raise ValueError(f"recompute must be full|none and grad_dtype fp32|bf16 (got {self.recompute!r}, "
                             f"{self.grad_dtype!r})")
        if self.lora_rank < 0 or not self.lora_targets:
            raise ValueError(f"lora_rank must be >= 0 (0: no LoRA) and lora_targets non-empty (got {self.lora_rank}, "
                             f"{self.lora_targets!r})")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be a fraction of GPU memory in [0, 1) (got {self.margin:g})")

    @property
    def usable_gib(self) -> float:
        return self.gpu_mem_gib - self.reserve_gib

    @property
    def margin_gib(self) -> float:
        return self.margin * self.gpu_mem_gib


def one_of(items: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def memory_remedies(opts: PlanOptions, *, states: bool = True, activations: bool = True,
                    bf16_grads_help: bool = True) -> list[str]:
    """The plan options that would lower learner memory and are not on yet: a hint never names one that is.
    `bf16_grads_help`: bf16 gradients need an fp32 copy in the optimizer (4 B / data-parallel size), so they save
    memory only where data parallel is wide enough."""
    out = []
    if states:
        out += [] if opts.optimizer_offload else ["offload the optimizer (--optimizer-offload)"]
        out += ["use bf16 gradients (--grad-dtype bf16)"] if opts.grad_dtype == "fp32" and bf16_grads_help else []
    if activations:
        out += ["recompute activations (--recompute full)"] if opts.recompute != "full" else []
        out += ["use a smaller --micro-batch"] if opts.micro_batch > 1 else []
    return out


@dataclass(kw_only=True, frozen=True, slots=True)
class LayoutPlan:
    tp: int
    pp: int
    ep: int
    dp: int
    edp: int
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    host_optimizer_gib: float
    usable_gib: float
    margin_gib: float
    """Headroom the options ask a layout to keep (PlanOptions.margin_gib)."""
    ep_nodes: int
    """Nodes one expert-parallel group spans (its all-to-all leaves NVLink when > 1)."""
    problems: tuple[str, ...]
    """Why it does not fit in memory ([] when it does)."""
    learner_limits: tuple[str, ...] = ()
    """Why this project's learner cannot run it although Megatron can (its own check, ParallelDegrees.check_model)."""
    stages: tuple[int, ...] = ()
    """Decoder layers per pipeline stage as the learner splits them (config/stages.py: balanced where pp does not
    divide the layers; the memory model counts the largest, ceil(layers / pp))."""
    recipe: Recipe | None = None
    """The published recipe that uses this layout on this many GPUs."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks."""

    @property
    def name(self) -> str:
        """'tp8 pp8 ep32', with ' cp2' after pp when cp > 1."""
        return f"tp{self.tp} pp{self.pp}" + (f" cp{self.cp}" if self.cp > 1 else "") + f" ep{self.ep}"

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib

    @property
    def headroom_gib(self) -> float:
        return self.usable_gib - self.total_gib

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def roomy(self) -> bool:
        """Fits and keeps the margin."""
        return self.fits and self.headroom_gib >= self.margin_gib

    @property
    def runs_here(self) -> bool:
        return not self.learner_limits

    @property
    def bubble(self) -> float:
        return 0.0 if self.pp == 1 else (self.pp - 1) / (self.pp - 1 + 4 * self.pp)  # 4*pp micro-batches assumed


def ep_nodes(ep: int, gpus: int, gpus_per_node: int) -> int:
    """Nodes the widest expert-parallel group spans. With expert tensor parallel 1, Megatron-Core's expert rank order
    (tp-cp-ep-dp-pp) makes each EP group `ep` consecutive ranks; ranks fill nodes in order."""
    return max((s + ep - 1) // gpus_per_node - s // gpus_per_node + 1 for s in range(0, gpus, ep))


_LIMITS_PREFIX = "parallel layout does not fit the model: "


def learner_limits(shape: ModelShape, tp: int, pp: int, ep: int, gpus: int, cp: int = 1) -> tuple[str, ...]:
    """What this project's learner refuses in a layout Megatron could run (its own check, ParallelDegrees.check_model:
    tp must divide the vocabulary, pp must not exceed the layers, ...); () when it runs it. Uneven pipeline stages
    run (balanced, config/stages.py)."""
    if shape.spec is None:
        return ()
    layout = ParallelDegrees(tp=tp, pp=pp, ep=ep, etp=1, dp=gpus // (tp * pp * cp), world_size=gpus,
                             sequence_parallel=tp > 1, cp=cp)
    try:
        layout.check_model(shape.spec)
    except ValueError as e:
        return tuple(str(e).removeprefix(_LIMITS_PREFIX).split("; "))
    return ()


def stage_params(shape: ModelShape, tp: int, pp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of the worst pipeline stage holds."""
    per_stage = ceil(shape.layers / pp)
    n_moe = min(per_stage, shape.n_moe)
    n_dense = per_stage - n_moe
    last = shape.head_params + shape.hidden  # the output layer and the final norm: the last stage's
    ends = shape.embed_params + last if pp == 1 else max(shape.embed_params, last)
    dense = (per_stage * shape.attn_params + n_dense * shape.dense_mlp_params
             + n_moe * (shape.shared_params + shape.router_params) + ends) / tp
    dense += per_stage * shape.indexer_params  # a DSA indexer is whole on every TP rank (Megatron: duplicated)
    experts = n_moe * (shape.num_experts // ep) * shape.expert_params
    return dense, experts


def lora_stage_params(shape: ModelShape, tp: int, pp: int, ep: int, opts: PlanOptions) -> tuple[float, float]:
    """(dense, expert) adapter parameters one GPU of the worst pipeline stage holds (0, 0 without LoRA): the A/B
    split follows the base linear's TP split (LoraLinear.params_per_tp_rank); routed experts' adapters go with their
    expert (EP)."""
    if not opts.lora_rank:
        return 0.0, 0.0
    targets = resolve_targets(opts.lora_targets, shape.spec, field="--lora-targets")
    per_layer = layer_params_per_tp_rank(shape.spec, opts.lora_rank, targets, tp)
    per_stage = ceil(shape.layers / pp)
    n_moe = min(per_stage, shape.n_moe)
    dense = (per_stage * per_layer.get("attention", 0) + (per_stage - n_moe) * per_layer.get("dense_mlp", 0)
             + n_moe * per_layer.get("shared_experts", 0))
    return dense, n_moe * (shape.num_experts // ep) * per_layer.get("experts", 0)


def activation_bytes(shape: ModelShape, tp: int, pp: int, opts: PlanOptions, cp: int = 1) -> float:
    """Activation bytes on the first stage (the one with the most micro-batches in flight)."""
    h, k = shape.hidden, shape.topk
    tokens = opts.seq_len * opts.micro_batch / cp
    attn = 2 * (2 * h + shape.act_attn) + 4 * shape.heads
    dense = 2 * (2 * h + 3 * shape.ffn)
    moe = 2 * (2 * h + k * (h + 3 * shape.moe_ffn) + 3 * shape.shared_ffn) + 4 * shape.num_experts
    per_stage = ceil(shape.layers / pp)
    n_moe = min(per_stage, shape.n_moe)
    layer_max = attn + (moe if n_moe else dense)
    stage_full = per_stage * attn + n_moe * moe + (per_stage - n_moe) * dense
    in_flight = pp  # 1F1B: the first stage holds pp micro-batches before its first backward
    if opts.recompute == "full":
        kept = per_stage * 2 * h * in_flight + layer_max
    else:
        kept = stage_full * in_flight
    logits = 2 * 4 * shape.vocab  # fp32 logits and their gradient (last stage; counted on the worst stage)
    # a DSA indexer's activations are whole on every TP rank (it gathers the sequence-parallel input)
    indexer = shape.dsa.activation_bytes if shape.dsa else 0
    indexer_kept = indexer if opts.recompute == "full" else per_stage * indexer * in_flight
    # cp > 1: each attention gathers the whole sequence's K and V (2 x hidden bf16 per token, split by TP)
    gathered = 0.0 if cp == 1 else (opts.seq_len * opts.micro_batch * 2 * 2 * h / tp
                                    * (1 if opts.recompute == "full" else per_stage * in_flight))
    return tokens * ((kept + logits) / tp + indexer_kept) + gathered


def plan_layout(shape: ModelShape, tp: int, pp: int, ep: int, opts: PlanOptions, cp: int = 1) -> LayoutPlan:
    world = opts.gpus
    dp, edp = world // (tp * pp * cp), world // (pp * ep)
    dense, experts = stage_params(shape, tp, pp, ep)
    grad_b = 4 if opts.grad_dtype == "fp32" else 2
    opt_b = 12 + (4 if grad_b == 2 else 0)
    if opts.lora_rank:  # the frozen base: bf16 weights only; the fp32 adapters: weights, grads, Adam m and v
        a_dense, a_experts = lora_stage_params(shape, tp, pp, ep, opts)
        weights, grads = 2 * (dense + experts) + 4 * (a_dense + a_experts), 4 * (a_dense + a_experts)
        optim = 8 * (a_dense / (dp * cp) + a_experts / edp)
    else:
        weights, grads = 2 * (dense + experts), grad_b * (dense + experts)
        optim = opt_b * (dense / (dp * cp) + experts / edp)
    acts = activation_bytes(shape, tp, pp, opts, cp)
    plan = dict(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, edp=edp, weights_gib=weights / GiB, grads_gib=grads / GiB,
                optimizer_gib=0.0 if opts.optimizer_offload else optim / GiB,
                activations_gib=acts / GiB, host_optimizer_gib=optim / GiB if opts.optimizer_offload else 0.0,
                usable_gib=opts.usable_gib, margin_gib=opts.margin_gib,
                ep_nodes=ep_nodes(ep, world, opts.gpus_per_node),
                learner_limits=learner_limits(shape, tp, pp, ep, world, cp),
                stages=balanced(shape.layers, pp) if pp <= shape.layers else (),
                recipe=published_recipe(shape, gpus=world, tp=tp, pp=pp, ep=ep) if cp == 1 else None)
    states = plan["weights_gib"] + plan["grads_gib"] + plan["optimizer_gib"]
    problems = []
    # bf16 grads: -2 B per parameter held, +4 B of fp32 grads sharded over the data-parallel group
    bf16_helps = not opts.lora_rank and 2 * (dense + experts) > 4 * (dense / (dp * cp) + experts / edp)
    if states > opts.usable_gib:
        fixes = ["raise ep/pp (experts) or tp (dense)"] + memory_remedies(opts, activations=False,
                                                                          bf16_grads_help=bf16_helps)
        problems.append(f"weights+grads+optimizer {states:.1f} GiB > usable {opts.usable_gib:.1f} GiB: "
                        + one_of(fixes))
    elif states + plan["activations_gib"] > opts.usable_gib:
        fixes = ["shorten --seq-len"] + memory_remedies(opts, bf16_grads_help=bf16_helps) + ["raise tp/pp/cp"]
        problems.append(f"activations {plan['activations_gib']:.1f} GiB leave no room "
                        f"({states + plan['activations_gib']:.1f} > {opts.usable_gib:.1f} GiB): " + one_of(fixes))
    return LayoutPlan(problems=tuple(problems), **plan)

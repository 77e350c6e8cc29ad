"""Per-GPU memory of learner states for a TP/PP/EP/DP layout, and the candidate layouts of a cluster.

    opts = PlanOptions(gpus=256, gpus_per_node=8, gpu_mem_gib=80)
    plans = rank_layouts(shape, opts)          # every candidate, fitting ones first, best first

Assumptions (docs/scale.md explains them): bf16 weights; gradients fp32 (or bf16) in Megatron's buffer;
Megatron's distributed optimizer shards fp32 master weights + Adam m, v (12 bytes, +4 for an fp32 grad
copy when grads are bf16) over the data-parallel group of each parameter (DP for dense parameters,
expert-DP = world / (pp * ep) for routed experts): 6 + 12/d bytes per parameter with fp32 grads, as in
Megatron's distributed-optimizer table. Expert tensor parallel is 1. The worst pipeline stage counts:
ceil(layers / pp) layers, MoE layers first, plus the larger of embedding and output layer. Activations
follow Korthikanti et al. 2022 with TP + sequence parallel (everything / tp), flash attention (no s^2),
1F1B keeping `pp` micro-batches in flight on the first stage, fp32 logits and their gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from megatron_sparse_rl.planner.shapes import ModelShape

GiB = 1024 ** 3


@dataclass(frozen=True)
class PlanOptions:
    gpus: int
    gpus_per_node: int
    gpu_mem_gib: float
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

    @property
    def usable_gib(self) -> float:
        return self.gpu_mem_gib - self.reserve_gib


@dataclass(frozen=True)
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
    problems: tuple[str, ...]

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def bubble(self) -> float:
        return 0.0 if self.pp == 1 else (self.pp - 1) / (self.pp - 1 + 4 * self.pp)  # 4*pp micro-batches assumed


def stage_params(shape: ModelShape, tp: int, pp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of the worst pipeline stage holds."""
    per_stage = ceil(shape.layers / pp)
    n_moe = min(per_stage, shape.n_moe)
    n_dense = per_stage - n_moe
    ends = shape.embed_params + shape.head_params if pp == 1 else max(shape.embed_params, shape.head_params)
    dense = (per_stage * shape.attn_params + n_dense * shape.dense_mlp_params
             + n_moe * (shape.shared_params + shape.router_params) + ends) / tp
    experts = n_moe * (shape.num_experts // ep) * shape.expert_params
    return dense, experts


def activation_bytes(shape: ModelShape, tp: int, pp: int, opts: PlanOptions) -> float:
    """Activation bytes on the first stage (the one with the most micro-batches in flight)."""
    h, k = shape.hidden, shape.topk
    tokens = opts.seq_len * opts.micro_batch
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
    return tokens * (kept + logits) / tp


def plan_layout(shape: ModelShape, tp: int, pp: int, ep: int, opts: PlanOptions) -> LayoutPlan:
    world = opts.gpus
    dp, edp = world // (tp * pp), world // (pp * ep)
    dense, experts = stage_params(shape, tp, pp, ep)
    grad_b = 4 if opts.grad_dtype == "fp32" else 2
    opt_b = 12 + (4 if grad_b == 2 else 0)
    optim = opt_b * (dense / dp + experts / edp)
    acts = activation_bytes(shape, tp, pp, opts)
    plan = dict(tp=tp, pp=pp, ep=ep, dp=dp, edp=edp, weights_gib=2 * (dense + experts) / GiB,
                grads_gib=grad_b * (dense + experts) / GiB,
                optimizer_gib=0.0 if opts.optimizer_offload else optim / GiB,
                activations_gib=acts / GiB, host_optimizer_gib=optim / GiB if opts.optimizer_offload else 0.0,
                usable_gib=opts.usable_gib)
    states = plan["weights_gib"] + plan["grads_gib"] + plan["optimizer_gib"]
    problems = []
    if states > opts.usable_gib:
        problems.append(f"weights+grads+optimizer {states:.1f} GiB > usable {opts.usable_gib:.1f} GiB: "
                        "raise ep/pp (experts) or tp (dense), or offload the optimizer")
    elif states + plan["activations_gib"] > opts.usable_gib:
        problems.append(f"activations {plan['activations_gib']:.1f} GiB leave no room "
                        f"({states + plan['activations_gib']:.1f} > {opts.usable_gib:.1f} GiB): shorten seq_len, "
                        "recompute, or raise tp/pp")
    return LayoutPlan(problems=tuple(problems), **plan)


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def shard_problems(shape: ModelShape, tp: int, pp: int, ep: int, opts: PlanOptions) -> list[str]:
    """Why (tp, pp, ep) cannot shard `shape` on `opts.gpus` GPUs at all ([] if it can)."""
    p = []
    if opts.gpus % (tp * pp) or (opts.gpus // pp) % ep:
        p.append(f"{opts.gpus} GPUs do not divide into tp*pp={tp * pp} and ep={ep} per stage")
    if tp > opts.gpus_per_node:
        p.append(f"tp={tp} > {opts.gpus_per_node} GPUs per node")
    if shape.heads % tp or (shape.kv_heads and shape.kv_heads % tp):
        p.append(f"tp={tp} must divide heads ({shape.heads}) and KV heads ({shape.kv_heads or shape.heads})")
    if pp > shape.layers:
        p.append(f"pp={pp} > {shape.layers} layers")
    if shape.num_experts % ep or (ep > 1 and not shape.num_experts):
        p.append(f"ep={ep} must divide the experts ({shape.num_experts})")
    return p


def candidate_layouts(shape: ModelShape, opts: PlanOptions) -> list[tuple[int, int, int]]:
    """(tp, pp, ep) with tp, pp, ep powers of two that shard the model on the cluster."""
    out = []
    for tp in _pow2_upto(min(8, opts.gpus_per_node)):
        for pp in _pow2_upto(min(32, opts.gpus)):
            for ep in _pow2_upto(min(opts.gpus, max(shape.num_experts, 1))):
                if not shard_problems(shape, tp, pp, ep, opts):
                    out.append((tp, pp, ep))
    return out


def rank_key(p: LayoutPlan):
    """Fitting first; then the least model parallelism (tp*pp: fewer per-layer collectives, smaller bubble),
    then fewer pipeline stages, then EP groups inside a node when possible, then the most headroom."""
    return (not p.fits, p.tp * p.pp, p.pp, p.ep * p.tp > 8, p.ep, -(p.usable_gib - p.total_gib))


def rank_layouts(shape: ModelShape, opts: PlanOptions) -> list[LayoutPlan]:
    plans = [plan_layout(shape, tp, pp, ep, opts) for tp, pp, ep in candidate_layouts(shape, opts)]
    return sorted(plans, key=rank_key)

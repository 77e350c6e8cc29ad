"""The candidate learner layouts of a cluster and their ranking (`msrl plan`; docs/scale.md "Ranking").

    plans = rank_layouts(shape, PlanOptions(gpus=256, gpus_per_node=8, gpu_mem_gib=80))   # best first
    chosen_reason(plans)                                                                 # why plans[0]

Order: first by class (TIERS), then within a class: a published recipe's layout, the fewest nodes an
expert-parallel group spans (its all-to-all, dispatch and combine in every MoE layer forward and backward, runs
over NVLink inside a node and over the slower network across nodes), the least model parallelism tp*pp*cp (fewer
per-layer collectives, more data parallelism), fewer pipeline stages (bubble), the least context parallelism (its
K/V gathers), the smallest ep, the most headroom. Context parallelism (cp 2, 4, 8) is a candidate where the sequence
splits into 2 x cp chunks; it ranks above cp 1 only where cp 1 does not fit or keeps less headroom class.
A heuristic, not a simulator: it does not model all-to-all bandwidth or overlap.
"""
from __future__ import annotations

import dataclasses

from megatron_sparse_rl.config.stages import compact
from megatron_sparse_rl.planner.memory import LayoutPlan, PlanOptions, plan_layout
from megatron_sparse_rl.planner.shapes import ModelShape

TIERS = ("fits with the margin, runs here", "fits TIGHT, runs here", "fits with the margin, NOT IN THIS LEARNER",
         "fits TIGHT, NOT IN THIS LEARNER", "does not fit")
"""The classes a layout ranks in, best first (tier() gives a layout's index). TIGHT: headroom below the margin;
NOT IN THIS LEARNER: Megatron could run it, this project's learner refuses it (ParallelDegrees.check_model)."""


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def shard_problems(shape: ModelShape, tp: int, pp: int, ep: int, opts: PlanOptions, cp: int = 1) -> list[str]:
    """Why (tp, pp, ep) at context parallel `cp` cannot shard `shape` on `opts.gpus` GPUs at all ([] if it can)."""
    p = []
    if opts.gpus % (tp * pp * cp) or (opts.gpus // pp) % ep:
        mp = f"tp*pp={tp * pp}" if cp == 1 else f"tp*pp*cp={tp * pp * cp}"
        p.append(f"{opts.gpus} GPUs do not divide into {mp} and ep={ep} per stage")
    if cp > 1 and opts.seq_len % (2 * cp):
        p.append(f"cp={cp}: seq {opts.seq_len} does not split into 2*cp={2 * cp} equal chunks")
    if tp > opts.gpus_per_node:
        p.append(f"tp={tp} > {opts.gpus_per_node} GPUs per node")
    if shape.heads % tp or (shape.kv_heads and shape.kv_heads % tp):
        p.append(f"tp={tp} must divide heads ({shape.heads}) and KV heads ({shape.kv_heads or shape.heads})")
    if pp > shape.layers:
        p.append(f"pp={pp} > {shape.layers} layers")
    if shape.num_experts % ep or (ep > 1 and not shape.num_experts):
        p.append(f"ep={ep} must divide the experts ({shape.num_experts})")
    return p


def candidate_layouts(shape: ModelShape, opts: PlanOptions) -> list[tuple[int, int, int, int]]:
    """(tp, pp, ep, cp) with tp, pp, ep powers of two and cp 1, 2, 4 or 8 that shard the model on the cluster."""
    out = []
    for tp in _pow2_upto(min(8, opts.gpus_per_node)):
        for pp in _pow2_upto(min(32, opts.gpus)):
            for ep in _pow2_upto(min(opts.gpus, max(shape.num_experts, 1))):
                for cp in _pow2_upto(min(8, opts.gpus)):
                    if not shard_problems(shape, tp, pp, ep, opts, cp):
                        out.append((tp, pp, ep, cp))
    return out


def tier(p: LayoutPlan) -> int:
    """Index of `p`'s class in TIERS: a fitting layout this learner runs ranks above any fitting one it cannot run;
    within each, one that keeps the margin above a tight one; a layout that does not fit ranks last."""
    if not p.fits:
        return 4
    return (0 if p.roomy else 1) + (0 if p.runs_here else 2)


def rank_key(p: LayoutPlan):
    return (tier(p), p.recipe is None, p.ep_nodes, p.tp * p.pp * p.cp, p.pp, p.cp, p.ep, -p.headroom_gib)


def rank_layouts(shape: ModelShape, opts: PlanOptions) -> list[LayoutPlan]:
    """Every candidate layout, best first (see the module docstring)."""
    plans = [plan_layout(shape, tp, pp, ep, opts, cp) for tp, pp, ep, cp in candidate_layouts(shape, opts)]
    return sorted(plans, key=rank_key)


def chosen_reason(plans: list[LayoutPlan]) -> str | None:
    """One line on why plans[0] (ranked) is first, and where a fitting published recipe's layout ranks when it is
    not first; None when no layout fits."""
    best = plans[0]
    if not best.fits:
        return None
    t = tier(best)
    peers = [p for p in plans if tier(p) == t]
    spare = (f"{best.headroom_gib:.1f} GiB to spare, keeping the {best.margin_gib:.1f} GiB margin" if best.roomy else
             f"only {best.headroom_gib:.1f} GiB to spare, below the {best.margin_gib:.1f} GiB margin (no layout keeps "
             "it)")
    uneven = f" with uneven pipeline stages {compact(best.stages)} layers (balanced)" if len(set(best.stages)) > 1 else ""
    where = (f"this learner runs it{uneven}" if best.runs_here else
             "no fitting layout runs in this learner; this one needs: " + "; ".join(best.learner_limits))
    why = [spare, where]
    if best.recipe is not None:
        why.append(f"it is the layout of the published recipe {best.recipe.name}")
    ep = "inside one node" if best.ep_nodes == 1 else f"over {best.ep_nodes} nodes"
    if best.recipe is None and len(peers) > 1:
        among = (f"the fewest of the {len(peers)}" if any(p.ep_nodes > best.ep_nodes for p in peers) else
                 f"as in all {len(peers)}")
        why.append(f"its EP group runs {ep}, {among} layouts that rank as '{TIERS[t]}'")
        if sum(p.ep_nodes == best.ep_nodes for p in peers) > 1:
            mp = f"tp*pp {best.tp * best.pp}" if best.cp == 1 else f"tp*pp*cp {best.tp * best.pp * best.cp}"
            why.append(f"of those it has the least model parallelism ({mp}, pp {best.pp})")
    else:
        why.append(f"its EP group runs {ep}")
    for i, p in enumerate(plans[1:], 2):
        if p.recipe is not None and p.fits:
            why.append(f"the published layout {p.name} ranks #{i}: {TIERS[tier(p)]}")
    return f"chosen: {best.name}: " + "; ".join(why)


def fewest_gpus(shape: ModelShape, opts: PlanOptions, *, limit: int = 8192) -> tuple[int, LayoutPlan] | None:
    """The smallest power-of-two GPU count (up to `limit`, `opts`' node size and memory) on which a layout fits and
    this learner runs it, and the layout ranked first there; None when none up to `limit` does. `msrl plan
    --lora-rank` prints it for LoRA and for full RL side by side."""
    for gpus in _pow2_upto(limit):
        plans = rank_layouts(shape, dataclasses.replace(opts, gpus=gpus))
        if plans and plans[0].fits and plans[0].runs_here:
            return gpus, plans[0]
    return None

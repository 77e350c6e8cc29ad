"""Text report of a plan: model summary, ranked learner layouts with reasons and why the first is chosen, rollout
KV, weight sync, and `failures`: what makes a plan unusable (`msrl plan` exits 1 when there is any)."""
from __future__ import annotations

from megatron_sparse_rl.planner.memory import LayoutPlan, PlanOptions, memory_remedies, one_of, plan_layout
from megatron_sparse_rl.planner.ranking import TIERS, chosen_reason, shard_problems
from megatron_sparse_rl.planner.rollout import RolloutPlan, SyncPlan
from megatron_sparse_rl.planner.shapes import ModelShape


def count(n: float) -> str:
    """A parameter count in the unit that suits it: 1.026T, 671.03B, 12.92M, 98.3K, 512."""
    for unit, scale, digits in (("T", 1e12, 3), ("B", 1e9, 2), ("M", 1e6, 2), ("K", 1e3, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f}{unit}"
    return f"{n:.0f}"


def size(n_bytes: float) -> str:
    """A byte count in decimal units: 1342.1 GB, 25.8 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes:.0f} B"


def model_lines(shape: ModelShape) -> list[str]:
    lines = [f"model {shape.name} ({shape.architecture}): {count(shape.total_params())} parameters, "
             f"{count(shape.active_params())} active per token",
             f"  {shape.layers} layers ({shape.n_moe} MoE, {shape.n_dense} dense), hidden {shape.hidden}, "
             f"{shape.num_experts} experts top-{shape.topk}, routed experts {count(shape.expert_total())}, "
             f"vocab {shape.vocab}"]
    return lines + [f"  note: {n}" for n in shape.notes]


def _status(p: LayoutPlan) -> str:
    """The row's verdict: fits (with the spare GiB and the margin), published recipe, learner limits, or why not."""
    if not p.fits:
        out = "NO: " + "; ".join(p.problems)
    elif p.roomy:
        out = f"fits, {p.headroom_gib:.1f} spare"
    else:
        out = f"fits, TIGHT: {p.headroom_gib:.1f} spare < margin {p.margin_gib:.1f}"
    if p.fits and p.host_optimizer_gib:
        out += f" (host optimizer {p.host_optimizer_gib:.1f} GiB/GPU)"
    if p.learner_limits:
        out += "; NOT IN THIS LEARNER: " + "; ".join(p.learner_limits)
    if p.recipe is not None:
        out += f"; published: {p.recipe.name}" + (f" ({p.recipe.note})" if p.recipe.note else "")
    return out


def layout_lines(plans: list[LayoutPlan], opts: PlanOptions, top: int) -> list[str]:
    """The ranked table: the `top` best fitting layouts, any published recipe's layout, the closest misses; then
    why the first one is chosen."""
    head = (f"learner layouts on {opts.gpus} GPUs ({opts.gpus_per_node}/node, {opts.gpu_mem_gib:g} GiB, usable "
            f"{opts.usable_gib:g}, margin {opts.margin_gib:.1f} = {opts.margin:.0%} of the GPU); seq {opts.seq_len} x "
            f"mbs {opts.micro_batch}, recompute {opts.recompute}, grads {opts.grad_dtype}, optimizer "
            f"{'offloaded to host' if opts.optimizer_offload else 'on GPU'}")
    order = ("ranked: " + " > ".join(TIERS) + "; then a published recipe's layout, fewest nodes per EP group (epN), "
             "least tp*pp, fewest stages, smallest ep, most headroom")
    cols = f"{'#':>3} {'tp':>3} {'pp':>3} {'ep':>4} {'epN':>3} {'dp':>5} {'edp':>4} {'weights':>8} {'grads':>8} " \
           f"{'optim':>8} {'activ':>8} {'total':>8}  GiB/GPU"
    rank = {id(p): str(i) for i, p in enumerate(plans, 1) if p.fits}  # a layout that does not fit shows '-'
    fitting = [p for p in plans if p.fits][:top]
    shown = {id(p) for p in fitting}
    published = [p for p in plans if p.recipe is not None and id(p) not in shown]
    shown |= {id(p) for p in published}
    # the closest misses, to say why they fail
    rest = sorted((p for p in plans if not p.fits and id(p) not in shown), key=lambda p: p.total_gib)
    lines = [head, order, cols]
    for p in fitting + published + rest[:max(3, top // 2)]:
        lines.append(f"{rank.get(id(p), '-'):>3} {p.tp:>3} {p.pp:>3} {p.ep:>4} {p.ep_nodes:>3} {p.dp:>5} {p.edp:>4} "
                     f"{p.weights_gib:>8.1f} {p.grads_gib:>8.1f} {p.optimizer_gib:>8.1f} {p.activations_gib:>8.1f} "
                     f"{p.total_gib:>8.1f}  " + _status(p))
    reason = chosen_reason(plans)
    if reason:
        lines.append(reason)
    else:
        # bf16 grads save memory only where data parallel is wide: the rows say where
        fixes = ["add GPUs"] + memory_remedies(opts, bf16_grads_help=False) + ["shorten --seq-len"]
        lines.append("no candidate layout fits: " + one_of(fixes))
    return lines


def requested_layout(shape: ModelShape, layout: tuple[int, int, int], opts: PlanOptions) -> tuple[str, list[str]]:
    """The report line of one layout asked for by name (`--layout TP,PP,EP`), and its problems (what stops it from
    sharding or fitting; what only this learner refuses is on the line, not a problem)."""
    tp, pp, ep = layout
    bad = shard_problems(shape, tp, pp, ep, opts)
    if bad:
        return f"layout tp{tp} pp{pp} ep{ep}: " + "; ".join(bad), bad
    p = plan_layout(shape, tp, pp, ep, opts)
    line = (f"layout tp{tp} pp{pp} ep{ep}: {p.total_gib:.1f} GiB/GPU (weights {p.weights_gib:.1f}, grads "
            f"{p.grads_gib:.1f}, optimizer {p.optimizer_gib:.1f}, activations {p.activations_gib:.1f}), EP group "
            + ("inside one node" if p.ep_nodes == 1 else f"over {p.ep_nodes} nodes") + " -> " + ("" if p.fits else "does not fit: ") + _status(p).removeprefix("NO: "))
    return line, list(p.problems)


def rollout_lines(r: RolloutPlan, kv_dtype: str, budget: int, interval: int) -> list[str]:
    weights = "fp8" if r.weight_bytes == 1 else "bf16"
    head = (f"rollout engine on {r.engine_gpus} GPU(s): {weights} weights {r.weights_gib_per_gpu:.1f} GiB/GPU, "
            f"KV space {r.kv_free_gib_per_gpu:.1f} GiB/GPU ({kv_dtype} cache)")
    flags = [f"  note: {n}" for n in r.notes]
    if "fp8" in (weights, kv_dtype):
        flags.append("  note: fp8 engine weights / KV cache are projections: rollout.dtype offers float32 and "
                     "bfloat16 only")
    if r.kv_free_gib_per_gpu <= 0:
        return [head] + flags + [f"  NO: {p}" for p in r.problems]
    ratio = f"{r.sparse_max_seqs / r.dense_max_seqs:.1f}x dense" if r.dense_max_seqs else "dense holds none"
    where = "on each GPU (MLA latent, whole on every GPU)" if r.mla else "over the engine"
    kept = f"budget {budget} + interval {interval} = {budget + interval} tokens"
    if budget + interval > r.dense_tokens:  # a sequence never grows past the budget: the sparse cache is the dense
        kept += f", more than the {r.dense_tokens}-token sequence: no compression, {r.sparse_tokens} tokens"
    sparse = (f"  sparse KV: {kept} -> {r.sparse_mib_per_seq:.0f} MiB/sequence; max concurrent sequences per engine "
              f"{r.sparse_max_seqs} ({ratio})")
    if r.mla:
        sparse += "; a projection: sparse KV on the MLA latent cache is not supported yet"
    return [
        head,
        f"  KV per token and GPU: {r.kv_layers} layers x {r.kv_values} values "
        f"({'one MLA latent row' if r.mla else 'K and V of the KV heads on the GPU'}) x {r.kv_dtype_bytes} B = "
        f"{r.kv_bytes_per_token} bytes",
        f"  dense  KV: {r.dense_tokens} tokens -> {r.dense_mib_per_seq:.0f} MiB/sequence {where}; "
        f"max concurrent sequences per engine {r.dense_max_seqs}",
        sparse,
    ] + flags + [f"  NO: {p}" for p in r.problems]


def sync_lines(s: SyncPlan) -> list[str]:
    senders = (f"all {s.learner_nodes} learner nodes sending their shards" if s.learner_nodes > 1 else
               "the one learner node sending")
    return [f"weight sync: {size(s.bytes_per_update)} per update (bf16, whole model to every engine); "
            f"{s.seconds_one_link:.3g} s over one {s.link_gbps:g} Gb/s link, "
            f"{s.seconds_all_learner_links:.3g} s with {senders}"]


def failures(shape: ModelShape, plans: list[LayoutPlan], opts: PlanOptions, rollout: RolloutPlan,
             layout: tuple[tuple[int, int, int], list[str]] | None = None) -> list[str]:
    """What makes the plan unusable, one plain sentence each ([] when a learner layout this learner runs and the
    rollout engine fit). `layout` is an explicitly requested (tp, pp, ep) and its problems. A tight layout (below the
    margin), an EP group or an engine across nodes are flagged in the report, not failures."""
    out = []
    if not any(p.fits for p in plans):  # tp = pp = ep = 1 always shards, so `plans` is never empty
        best = min(plans, key=lambda p: p.total_gib)
        where = f"{opts.gpus} x {opts.gpu_mem_gib:g} GiB GPUs"
        out.append(f"no learner layout fits {shape.name} on {where}; the closest, tp{best.tp} pp{best.pp} "
                   f"ep{best.ep}, needs {best.total_gib:.1f} GiB/GPU ({best.problems[0]})")
    elif not any(p.fits and p.runs_here for p in plans):
        best = next(p for p in plans if p.fits)
        out.append(f"no fitting learner layout runs in this learner: the best, tp{best.tp} pp{best.pp} ep{best.ep}, "
                   "needs what it refuses (" + "; ".join(best.learner_limits) + ")")
    if layout is not None and layout[1]:
        (tp, pp, ep), problems = layout
        out.append(f"layout tp{tp} pp{pp} ep{ep} does not fit: " + "; ".join(problems))
    out += [f"rollout: {p}" for p in rollout.problems]
    return out

"""Text report of a plan: model summary, ranked learner layouts with reasons, rollout KV, weight sync, and
`failures`: what makes a plan unusable (`msrl plan` exits 1 when there is any)."""
from __future__ import annotations

from megatron_sparse_rl.planner.memory import LayoutPlan, PlanOptions, plan_layout, shard_problems
from megatron_sparse_rl.planner.rollout import RolloutPlan, SyncPlan
from megatron_sparse_rl.planner.shapes import ModelShape


def _b(n: float) -> str:
    return f"{n / 1e12:.3f}T" if n >= 1e12 else f"{n / 1e9:.2f}B"


def model_lines(shape: ModelShape) -> list[str]:
    lines = [f"model {shape.name} ({shape.architecture}): {_b(shape.total_params())} parameters, "
             f"{_b(shape.active_params())} active per token",
             f"  {shape.layers} layers ({shape.n_moe} MoE, {shape.n_dense} dense), hidden {shape.hidden}, "
             f"{shape.num_experts} experts top-{shape.topk}, routed experts {_b(shape.expert_total())}, "
             f"vocab {shape.vocab}"]
    return lines + [f"  note: {n}" for n in shape.notes]


def layout_lines(plans: list[LayoutPlan], opts: PlanOptions, top: int) -> list[str]:
    head = (f"learner layouts on {opts.gpus} GPUs ({opts.gpus_per_node}/node, {opts.gpu_mem_gib:g} GiB, usable "
            f"{opts.usable_gib:g}); seq {opts.seq_len} x mbs {opts.micro_batch}, recompute {opts.recompute}, "
            f"grads {opts.grad_dtype}, optimizer {'offloaded to host' if opts.optimizer_offload else 'on GPU'}")
    cols = f"{'#':>3} {'tp':>3} {'pp':>3} {'ep':>4} {'dp':>5} {'edp':>4} {'weights':>8} {'grads':>8} " \
           f"{'optim':>8} {'activ':>8} {'total':>8}  GiB/GPU"
    lines = [head, cols]
    fitting = [p for p in plans if p.fits][:top]
    rest = [p for p in plans if not p.fits]
    # the closest misses, to say why they fail
    rest = sorted(rest, key=lambda p: p.total_gib)[:max(3, top // 2)]
    for i, p in enumerate(fitting + rest, 1):
        row = (f"{i:>3} {p.tp:>3} {p.pp:>3} {p.ep:>4} {p.dp:>5} {p.edp:>4} {p.weights_gib:>8.1f} "
               f"{p.grads_gib:>8.1f} {p.optimizer_gib:>8.1f} {p.activations_gib:>8.1f} {p.total_gib:>8.1f}  ")
        row += "fits" if p.fits else "NO: " + "; ".join(p.problems)
        if p.fits and p.host_optimizer_gib:
            row += f" (host optimizer {p.host_optimizer_gib:.1f} GiB/GPU)"
        lines.append(row)
    if not fitting:
        lines.append("no candidate layout fits: add GPUs, offload the optimizer (--optimizer-offload), "
                     "use bf16 grads, shorten --seq-len, or recompute")
    return lines


def requested_layout(shape: ModelShape, layout: tuple[int, int, int], opts: PlanOptions) -> tuple[str, list[str]]:
    """The report line of one layout asked for by name (`--layout TP,PP,EP`), and its problems."""
    tp, pp, ep = layout
    bad = shard_problems(shape, tp, pp, ep, opts)
    if bad:
        return f"layout tp{tp} pp{pp} ep{ep}: " + "; ".join(bad), bad
    p = plan_layout(shape, tp, pp, ep, opts)
    line = (f"layout tp{tp} pp{pp} ep{ep}: {p.total_gib:.1f} GiB/GPU (weights {p.weights_gib:.1f}, grads "
            f"{p.grads_gib:.1f}, optimizer {p.optimizer_gib:.1f}, activations {p.activations_gib:.1f}) -> "
            + ("fits" if p.fits else "does not fit: " + "; ".join(p.problems)))
    return line, list(p.problems)


def rollout_lines(r: RolloutPlan, kv_dtype: str, budget: int, interval: int) -> list[str]:
    head = (f"rollout engine on {r.engine_gpus} GPU(s): weights {r.weights_gib_per_gpu:.1f} GiB/GPU, "
            f"KV space {r.kv_free_gib_per_gpu:.1f} GiB/GPU ({kv_dtype} cache)")
    if r.kv_free_gib_per_gpu <= 0:
        return [head] + [f"  NO: {p}" for p in r.problems]
    ratio = f"{r.sparse_max_seqs / r.dense_max_seqs:.1f}x dense" if r.dense_max_seqs else "dense holds none"
    where = "on each GPU (MLA latent, whole on every GPU)" if r.mla else "over the engine"
    sparse = (f"  sparse KV: budget {budget} + interval {interval} = {r.sparse_tokens} tokens -> "
              f"{r.sparse_mib_per_seq:.0f} MiB/sequence; max concurrent sequences per engine {r.sparse_max_seqs} "
              f"({ratio})")
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
    ] + [f"  NO: {p}" for p in r.problems]


def sync_lines(s: SyncPlan) -> list[str]:
    return [f"weight sync: {s.bytes_per_update / 1e9:.1f} GB per update (bf16, whole model to every engine); "
            f"{s.seconds_one_link:.1f} s over one {s.link_gbps:g} Gb/s link, "
            f"{s.seconds_all_learner_links:.2f} s with all {s.learner_nodes} learner nodes sending their shards"]


def failures(shape: ModelShape, plans: list[LayoutPlan], opts: PlanOptions, rollout: RolloutPlan,
             layout: tuple[tuple[int, int, int], list[str]] | None = None) -> list[str]:
    """What makes the plan unusable, one plain sentence each ([] when a learner layout and the rollout engine
    fit). `layout` is an explicitly requested (tp, pp, ep) and its problems."""
    out = []
    if not any(p.fits for p in plans):  # tp = pp = ep = 1 always shards, so `plans` is never empty
        best = min(plans, key=lambda p: p.total_gib)
        where = f"{opts.gpus} x {opts.gpu_mem_gib:g} GiB GPUs"
        out.append(f"no learner layout fits {shape.name} on {where}; the closest, tp{best.tp} pp{best.pp} "
                   f"ep{best.ep}, needs {best.total_gib:.1f} GiB/GPU ({best.problems[0]})")
    if layout is not None and layout[1]:
        (tp, pp, ep), problems = layout
        out.append(f"layout tp{tp} pp{pp} ep{ep} does not fit: " + "; ".join(problems))
    out += [f"rollout: {p}" for p in rollout.problems]
    return out

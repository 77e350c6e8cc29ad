"""Text report of a plan: model summary, ranked learner layouts with reasons and why the first is chosen, rollout
KV, a DSA model's indexer replay record, the weight-sync estimate, and `failures`: what makes a plan unusable
(`msrl plan` exits 1 when there is any)."""
from __future__ import annotations

from dataclasses import fields

from megatron_sparse_rl.config.stages import compact
from megatron_sparse_rl.lora.targets import AdapterCount
from megatron_sparse_rl.planner.indexer_record import IndexerRecord
from megatron_sparse_rl.planner.memory import LayoutPlan, PlanOptions, memory_remedies, one_of, plan_layout
from megatron_sparse_rl.planner.ranking import TIERS, chosen_reason, shard_problems
from megatron_sparse_rl.planner.rollout import DSA_SPARSE_WHY, MLA_SPARSE_SINGLE_RANK, MLA_SPARSE_WHY, \
    RolloutPlan
from megatron_sparse_rl.planner.shapes import ModelShape
from megatron_sparse_rl.planner.sync import MEASURED_GBPS, SyncCosts, SyncEstimate, SyncVolume


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


def lora_lines(shape: ModelShape, opts: PlanOptions, adapters: AdapterCount, lora: tuple[int, LayoutPlan] | None,
               full: tuple[int, LayoutPlan] | None) -> list[str]:
    """The adapter count and what it saves: the fewest GPUs (powers of two) on which LoRA and full RL each fit."""
    targets = ", ".join(opts.lora_targets)
    total = shape.total_params()

    def fewest(found: tuple[int, LayoutPlan] | None) -> str:
        if found is None:
            return "none up to 8192"
        gpus, p = found
        tight = "" if p.roomy else f", TIGHT: {p.headroom_gib:.1f} spare < margin {p.margin_gib:.1f}"
        return f"{gpus} ({p.name}, {p.total_gib:.1f} GiB/GPU{tight})"

    return [f"LoRA rank {opts.lora_rank} on {targets}: {count(adapters.total)} adapter parameters "
            f"({adapters.total / total:.2%} of the model; {count(adapters.dense)} on attention, dense MLP and shared "
            f"experts, {count(adapters.experts)} on routed experts); {size(4 * adapters.total)} in fp32, "
            f"{size(2 * adapters.total)} in bf16",
            f"  base {count(total)} frozen in bf16 (2 B, no gradient, no optimizer state); adapters fp32: weights 4 B, "
            "gradients 4 B, Adam m, v 8 B over the data-parallel size",
            f"  fewest GPUs ({opts.gpus_per_node}/node, {opts.gpu_mem_gib:g} GiB, powers of two) with a layout that "
            f"fits and runs here: LoRA {fewest(lora)}; full RL {fewest(full)}"]


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
    elif len(set(p.stages)) > 1:
        out += f"; uneven stages {compact(p.stages)} layers"
    if p.recipe is not None:
        out += f"; published: {p.recipe.name}" + (f" ({p.recipe.note})" if p.recipe.note else "")
    return out


def layout_lines(plans: list[LayoutPlan], opts: PlanOptions, top: int) -> list[str]:
    """The ranked table: the `top` best fitting layouts, any published recipe's layout, the closest misses; then
    why the first one is chosen."""
    head = (f"learner layouts on {opts.gpus} GPUs ({opts.gpus_per_node}/node, {opts.gpu_mem_gib:g} GiB, usable "
            f"{opts.usable_gib:g}, margin {opts.margin_gib:.1f} = {opts.margin:.0%} of the GPU); seq {opts.seq_len} x "
            f"mbs {opts.micro_batch}, recompute {opts.recompute}, grads {opts.grad_dtype}, optimizer "
            f"{'offloaded to host' if opts.optimizer_offload else 'on GPU'}"
            + (f"; LoRA rank {opts.lora_rank}: bf16 base frozen, fp32 adapters" if opts.lora_rank else ""))
    order = ("ranked: " + " > ".join(TIERS) + "; then a published recipe's layout, fewest nodes per EP group (epN), "
             "least tp*pp*cp, fewest stages, least cp, smallest ep, most headroom")
    cols = f"{'#':>3} {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>4} {'epN':>3} {'dp':>5} {'edp':>4} {'weights':>8} {'grads':>8} " \
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
        lines.append(f"{rank.get(id(p), '-'):>3} {p.tp:>3} {p.pp:>3} {p.cp:>3} {p.ep:>4} {p.ep_nodes:>3} {p.dp:>5} {p.edp:>4} "
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
    sparse = (f"  sparse KV: {kept} -> {r.sparse_mib_per_seq:.0f} MiB/sequence{' on each GPU' if r.mla else ''}; "
              f"max concurrent sequences per engine {r.sparse_max_seqs} ({ratio})")
    return [
        head,
        _kv_line(r),
        f"  dense  KV: {r.dense_tokens} tokens -> {r.dense_mib_per_seq:.0f} MiB/sequence {where}; "
        f"max concurrent sequences per engine {r.dense_max_seqs}",
    ] + (_mla_sparse_lines(r, sparse) if r.mla else [sparse]) + flags + [f"  NO: {p}" for p in r.problems]


def _kv_line(r: RolloutPlan) -> str:
    """The per-token KV bytes on one GPU and how they add up (a DSA model: the latent row plus the indexer key)."""
    row = (f"{r.kv_values} values ({'one MLA latent row' if r.mla else 'K and V of the KV heads on the GPU'}) x "
           f"{r.kv_dtype_bytes} B")
    if r.kv_row_bytes != r.kv_values * r.kv_dtype_bytes:
        row = f"{r.kv_row_bytes} B (one MLA latent row as vLLM's fp8_ds_mla: fp8 values, fp32 scales, bf16 rope key)"
    if not r.indexer_bytes:
        return f"  KV per token and GPU: {r.kv_layers} layers x {row} = {r.kv_bytes_per_token} bytes"
    return (f"  KV per token and GPU: {r.kv_layers} layers x ({row} + {r.indexer_bytes} B DSA indexer key, fp8 with "
            f"its fp32 scale) = {r.kv_bytes_per_token} bytes")


def _mla_sparse_lines(r: RolloutPlan, sparse: str) -> list[str]:
    """The sparse line of an MLA engine and what it means there: used for real on a single-rank engine; on a
    multi-GPU one, or any DSA engine, what the budget would buy, which this engine cannot run (the dense numbers
    decide the fit)."""
    if r.indexer_bytes:
        return [sparse + "; what the budget would buy: NOT RUNNABLE on a DSA engine",
                f"  note: {DSA_SPARSE_WHY}; the dense numbers decide whether this engine fits"]
    if r.sparse_runs:
        return [sparse + "; runs on this single-rank engine",
                f"  note: {MLA_SPARSE_SINGLE_RANK}, as this one is"]
    return [sparse + f"; what the budget would buy: NOT RUNNABLE on this {r.engine_gpus}-GPU engine",
            f"  note: {MLA_SPARSE_SINGLE_RANK}: on {r.engine_gpus} ranks {MLA_SPARSE_WHY}; the dense numbers decide "
            "whether this engine fits"]


def indexer_record_lines(rec: IndexerRecord, learner: str) -> list[str]:
    """The DSA indexer replay record: bytes per token, then the host memory of one learner rank of `learner`."""
    dtype = "uint16" if rec.index_bytes == 2 else "int32"
    per_rank = (f"{rec.sequences_per_rank} sequence(s) (ceil({rec.batch} per step / dp {rec.dp})) x {rec.seq_len} "
                f"tokens x {rec.stage_layers} layers of its stage x {rec.layer_bytes_per_token:,} B")
    return [f"indexer replay record (DSA; host memory, not judged), learner {learner}, --rollout-batch {rec.batch} "
            f"sequences of {rec.seq_len} tokens:",
            f"  per token and layer: top-{rec.topk} positions x {rec.index_bytes} B ({dtype} holds positions up to "
            f"{rec.seq_len - 1}) = {rec.layer_bytes_per_token:,} B; per token, {rec.layers} layers: "
            f"{rec.bytes_per_token:,} B; per sequence {size(rec.bytes_per_token * rec.seq_len)}",
            f"  per learner rank: {per_rank} = {size(rec.rank_bytes)} (every token counted; tokens before position "
            f"{rec.topk} could be skipped)"]


def seconds(s: float) -> str:
    """A duration to about 3 figures without exponents: 1133 s, 47.6 s, 0.68 s."""
    return f"{s:.0f} s" if s >= 100 else f"{s:.1f} s" if s >= 10 else f"{s:.2f} s"


def gbps(rate: float) -> str:
    """A rate in GB/s to about 3 figures without exponents: 6818, 34.2, 0.719."""
    return f"{rate:.0f}" if rate >= 1000 else f"{rate:.3g}"


def sync_lines(v: SyncVolume, costs: SyncCosts, estimates: list[SyncEstimate], *, learner: str, weights: str,
               target_s: float = 2.0) -> list[str]:
    """The sync volume, the per-byte rates used, and one estimate line per scheme with the link it needs for
    `target_s`. `learner`: the layout's label; `weights`: the engine dtype."""
    rates = ", ".join(_rate(f.name, getattr(costs, f.name)) for f in fields(costs))
    out = [f"weight sync, learner {learner} on {v.learner_gpus} GPUs -> {v.engines} engine(s) of {v.engine_gpus} "
           f"GPU(s), {weights} weights (model in docs/weight_sync.md \"What 1T in <= 2 s takes\"):",
           f"  per engine {size(v.engine_bytes)}: the {size(v.model_bytes)} model plus "
           f"{size(v.engine_bytes - v.model_bytes)} of tensors each of its GPUs holds whole; its busiest GPU "
           f"{size(v.rank_bytes)}; the bf16 model less what learner rank 0's node holds: {size(v.gather_bytes)}",
           f"  per-byte rates, GB/s: {rates} (measured: by msrl bench sync on a 2-core CPU machine, "
           "docs/weight_sync.md \"Phases\"; given: --sync-pack-gbps etc.)"]
    for e in estimates:
        out.append(f"  weight sync estimate, {e.scheme}: {size(v.engine_bytes)} per engine over {v.engines} engine(s), "
                   f"link {gbps(e.link_gbps)} GB/s: transport {seconds(e.transport_s)} + pack {seconds(e.pack_s)} + "
                   f"digest {seconds(e.digest_s)} + load {seconds(e.load_s)} = {seconds(e.total_s)} (lower bound: full "
                   f"link rate, phases in series; overlapped, the largest alone: {seconds(e.largest_s)})")
        out.append("    " + _target_line(e, target_s))
    return out


def _rate(name: str, rate: float) -> str:
    """'load 0.719 measured' or 'load 100 given' (a rate from the command line)."""
    phase = name.removesuffix("_gbps")
    return f"{phase} {gbps(rate)} " + ("measured" if rate == MEASURED_GBPS[phase] else "given")


def _target_line(e: SyncEstimate, target_s: float) -> str:
    """The link a sync of `target_s` needs, or by how much the per-byte phases must shrink first."""
    busiest = f"{size(e.wire_bytes)} through the busiest link"
    need = e.bandwidth_for(target_s)
    if need is not None:
        return f"<= {target_s:g} s needs link >= {gbps(need)} GB/s ({busiest})"
    half = target_s / 2
    return (f"<= {target_s:g} s: no link is fast enough: pack + digest + load alone take {seconds(e.per_byte_s)}; "
            f"at {half:g} s ({e.per_byte_s / half:.3g}x faster) they leave {half:g} s for transport: link >= "
            f"{gbps(e.wire_bytes / half / 1e9)} GB/s ({busiest})")


def failures(shape: ModelShape, plans: list[LayoutPlan], opts: PlanOptions, rollout: RolloutPlan,
             layout: tuple[tuple[int, int, int], list[str]] | None = None) -> list[str]:
    """What makes the plan unusable, one plain sentence each ([] when a learner layout this learner runs and the
    rollout engine fit). `layout` is an explicitly requested (tp, pp, ep) and its problems. A tight layout (below the
    margin), an EP group or an engine across nodes are flagged in the report, not failures."""
    out = []
    if not any(p.fits for p in plans):  # tp = pp = ep = 1 always shards, so `plans` is never empty
        best = min(plans, key=lambda p: p.total_gib)
        where = f"{opts.gpus} x {opts.gpu_mem_gib:g} GiB GPUs"
        out.append(f"no learner layout fits {shape.name} on {where}; the closest, {best.name}, needs {best.total_gib:.1f} GiB/GPU ({best.problems[0]})")
    elif not any(p.fits and p.runs_here for p in plans):
        best = next(p for p in plans if p.fits)
        out.append(f"no fitting learner layout runs in this learner: the best, {best.name}, "
                   "needs what it refuses (" + "; ".join(best.learner_limits) + ")")
    if layout is not None and layout[1]:
        (tp, pp, ep), problems = layout
        out.append(f"layout tp{tp} pp{pp} ep{ep} does not fit: " + "; ".join(problems))
    out += [f"rollout: {p}" for p in rollout.problems]
    return out

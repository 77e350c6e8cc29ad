"""`msrl plan MODEL --gpus N --gpu-mem GiB`: memory and layout plan for a model on a cluster.

    msrl plan kimi-k2 --gpus 256 --gpu-mem 80 --optimizer-offload
    msrl plan qwen3-30b-a3b --gpus 8 --gpu-mem 80 --seq-len 16384 --kv-budget 2048
    msrl plan /models/MyMoE --nodes 4 --gpu-mem 141 --sync-bandwidth 50
    msrl plan kimi-k2 --gpus 64 --gpu-mem 80 --lora-rank 16

MODEL is a bundled name (qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, kimi-k2, deepseek-v3.2, glm-5) or a model
directory / config.json. Prints parameters, ranked learner layouts (per-GPU weights, grads, optimizer, activations; the
headroom against `--margin`, the nodes an EP group spans, a published recipe's layout, what this learner cannot
run, why a layout does not fit) and why the first is chosen, rollout KV per sequence dense vs sparse and the
sequences an engine can hold (an engine across nodes flagged), for DSA models (DeepSeek-V3.2, GLM-5) the indexer's
key cache in the KV and the indexer replay record's host memory per learner rank (`--rollout-batch`), and the
weight-sync time of the planned layout (`--layout`, else the chosen one, else the closest miss) as built and
shard-to-shard, with the link it needs for <= 2 s. With `--lora-rank R` the learner memory is that of LoRA (bf16 frozen
base, fp32 adapters on `--lora-targets`), with the adapter count and the fewest GPUs LoRA and full RL each fit on. The assumptions and the ranking are in docs/scale.md; the sync estimate in docs/weight_sync.md ("What 1T in
<= 2 s takes").

Exit status: 0 when a learner layout this learner runs and the rollout engine fit; 1 when none does (or the
`--layout` asked for does not fit or shard, or the engine's weights leave no KV room), each reason printed as
`error: ...` on stderr; 2 for a bad argument.
"""
from __future__ import annotations

import argparse
import math
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_sparse_rl.config.checks import finite, positive

    a = parser.add_argument
    a("model", help="bundled model name or HF model directory / config.json")
    a("--gpus", type=int, default=None, help="total GPUs of the learner (default: nodes * gpus-per-node)")
    a("--nodes", type=int, default=None, help="nodes (default: gpus / gpus-per-node)")
    a("--gpus-per-node", type=int, default=8, help="GPUs joined by NVLink in one node (TP stays inside one; EP "
      "groups and engines across nodes are flagged)")
    a("--gpu-mem", type=positive(float), required=True, metavar="GiB", help="memory of one GPU")
    a("--seq-len", type=int, default=32768, help="tokens per sequence (prompt + response), learner and rollout")
    a("--micro-batch", type=int, default=1)
    a("--recompute", choices=("full", "none"), default="full")
    a("--grad-dtype", choices=("fp32", "bf16"), default="fp32")
    a("--optimizer-offload", action="store_true", help="master weights + Adam states on the host")
    a("--margin", type=finite, default=0.10, metavar="FRACTION",
      help="headroom a layout should keep, as a fraction of GPU memory (default 0.10); tighter layouts rank lower")
    a("--lora-rank", type=int, default=0, metavar="R", help="plan LoRA of rank R: bf16 frozen base, fp32 adapters "
      "(default 0: full RL)")
    a("--lora-targets", default="all-linear", metavar="NAMES", help="comma-separated modules LoRA adapts, as "
      "model.lora.target_modules names them (default all-linear: every one; 'experts': the routed experts)")
    a("--top", type=int, default=8, help="fitting layouts to show")
    a("--layout", default=None, metavar="TP,PP,EP", help="also evaluate this one layout (e.g. 8,8,32)")
    a("--rollout-gpus", type=int, default=None, help="GPUs per rollout engine (default: smallest that fits)")
    a("--kv-budget", type=int, default=2048, help="sparse KV budget (tokens kept)")
    a("--kv-interval", type=int, default=128, help="tokens generated between compressions")
    a("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    a("--engine-weights", choices=("bf16", "fp8"), default="bf16", help="rollout engine weight dtype (fp8: 1 byte "
      "per parameter)")
    a("--rollout-batch", type=int, default=1024, metavar="SEQUENCES", help="sequences per RL step, all ranks "
      "(prompts_per_step x samples; default 1024 = 128 x 8): sizes a DSA model's indexer replay record per rank")
    a("--engines", type=int, default=None, help="rollout engines each sync feeds (default: learner GPUs / engine GPUs)")
    a("--sync-bandwidth", type=_gbps, default=50.0, metavar="GBPS", help="GB/s of one GPU's learner <-> engine link, "
      "learner and engine side (default 50: 400 Gb/s)")
    for phase, what in (("pack", "copy into buckets"), ("digest", "sender's XXH3-128"),
                        ("verify", "receiver's XXH3-128"), ("load", "engine.load_weights")):
        a(f"--sync-{phase}-gbps", type=_gbps, default=None, metavar="GBPS",
          help=f"per-byte rate of the sync's {what} (default: measured, planner/sync.py MEASURED_GBPS)")


def _gbps(text: str) -> float:
    """A rate in GB/s: a finite number > 0 (argparse names the flag with the message)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of GB/s > 0 (got {text!r})")
    return value


def _check(args) -> tuple[int, int]:
    """Reject impossible arguments before planning; return (gpus, nodes)."""
    from megatron_sparse_rl.config import ConfigError

    g, n, per = args.gpus, args.nodes, args.gpus_per_node
    if per < 1 or args.gpu_mem <= 0:
        raise ConfigError("--gpus-per-node must be >= 1 and --gpu-mem > 0")
    for flag in ("seq_len", "micro_batch", "top", "kv_budget", "kv_interval", "rollout_gpus", "engines",
                 "rollout_batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1 (got {value})")
    if args.lora_rank < 0:
        raise ConfigError(f"--lora-rank must be >= 1, or 0 for full RL (got {args.lora_rank})")
    if not 0 <= args.margin < 1:
        raise ConfigError(f"--margin is a fraction of GPU memory in [0, 1) (got {args.margin:g})")
    if g is None and n is None:
        raise ConfigError("give --gpus N or --nodes N")
    g = g if g is not None else n * per
    n = n if n is not None else -(-g // per)
    if g < 1 or g > n * per:
        raise ConfigError(f"--gpus {g} must be in [1, nodes * gpus-per-node = {n * per}]")
    return g, n


def _layout(text: str) -> tuple[int, int, int]:
    """`--layout TP,PP,EP` -> (tp, pp, ep)."""
    from megatron_sparse_rl.config import ConfigError

    try:
        tp, pp, ep = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--layout must be TP,PP,EP (got {text!r})") from None
    if min(tp, pp, ep) < 1:
        raise ConfigError(f"--layout degrees must be >= 1 (got {text!r})")
    return tp, pp, ep


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.config import ConfigError
    from megatron_sparse_rl.planner import PlanOptions, default_engine_gpus, load_shape, rank_layouts, rollout_plan
    from megatron_sparse_rl.planner import report

    gpus, _ = _check(args)
    layout = _layout(args.layout) if args.layout else None
    try:
        shape = load_shape(args.model)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ConfigError(str(e)) from None
    opts = PlanOptions(gpus=gpus, gpus_per_node=args.gpus_per_node, gpu_mem_gib=args.gpu_mem, seq_len=args.seq_len,
                       micro_batch=args.micro_batch, recompute=args.recompute, grad_dtype=args.grad_dtype,
                       optimizer_offload=args.optimizer_offload, margin=args.margin, lora_rank=args.lora_rank,
                       lora_targets=tuple(t.strip() for t in args.lora_targets.split(",")))
    lines = report.model_lines(shape) + [""] + (_lora_lines(shape, opts) if opts.lora_rank else [])
    plans = rank_layouts(shape, opts)
    lines += report.layout_lines(plans, opts, args.top)
    asked = None
    if layout:
        line, bad = report.requested_layout(shape, layout, opts)
        lines.append(line)
        asked = (layout, bad)
    weight_bytes = 1 if args.engine_weights == "fp8" else 2
    engine = args.rollout_gpus or default_engine_gpus(shape, args.gpu_mem, gpus, weight_bytes)
    r = rollout_plan(shape, gpu_mem_gib=args.gpu_mem, engine_gpus=engine, seq_len=args.seq_len,
                     budget=args.kv_budget, interval=args.kv_interval, kv_bytes=1 if args.kv_dtype == "fp8" else 2,
                     weight_bytes=weight_bytes, gpus_per_node=args.gpus_per_node)
    lines += [""] + report.rollout_lines(r, args.kv_dtype, args.kv_budget, args.kv_interval)
    lines += _record_lines(args, shape, *_planned(plans, layout), gpus)
    lines += _sync_lines(args, shape, *_planned(plans, layout), engine, gpus)
    print("\n".join(lines))
    problems = report.failures(shape, plans, opts, r, asked)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _lora_lines(shape, opts) -> list[str]:
    """The adapter count of `opts`' LoRA and the fewest GPUs it and full RL fit on; a target the model lacks is a
    bad argument (exit 2, naming what the model has)."""
    import dataclasses

    from megatron_sparse_rl.config import ConfigError
    from megatron_sparse_rl.lora import adapter_params, resolve_targets
    from megatron_sparse_rl.planner import report
    from megatron_sparse_rl.planner.ranking import fewest_gpus

    try:
        targets = resolve_targets(opts.lora_targets, shape.spec, field="--lora-targets")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    adapters = adapter_params(shape.spec, opts.lora_rank, targets)
    full = fewest_gpus(shape, dataclasses.replace(opts, lora_rank=0))
    return report.lora_lines(shape, opts, adapters, fewest_gpus(shape, opts), full) + [""]


def _planned(plans, layout: tuple[int, int, int] | None) -> tuple[tuple[int, int, int], str]:
    """The learner layout the sync estimate is for, and how the report names it: `--layout`, else the chosen one
    (the first ranked), else the closest miss."""
    if layout:
        return layout, "--layout"
    best = plans[0] if plans[0].fits else min(plans, key=lambda p: p.total_gib)
    return (best.tp, best.pp, best.ep), "the chosen layout" if best.fits else "the closest layout; none fits"


def _record_lines(args, shape, layout: tuple[int, int, int], how: str, gpus: int) -> list[str]:
    """A DSA model's indexer replay record for `layout` (planner/indexer_record.py); nothing for other models."""
    from megatron_sparse_rl.planner import indexer_record, report

    rec = indexer_record(shape, layout=layout, gpus=gpus, seq_len=args.seq_len, batch=args.rollout_batch)
    tp, pp, ep = layout
    return [] if rec is None else [""] + report.indexer_record_lines(rec, f"tp{tp} pp{pp} ep{ep} ({how})")


def _sync_lines(args, shape, layout: tuple[int, int, int], how: str, engine_gpus: int, gpus: int) -> list[str]:
    """The weight-sync estimate of `layout` feeding the engines, as built and shard-to-shard (planner/sync.py)."""
    from megatron_sparse_rl.planner import SyncCosts, as_built, report, shard_to_shard, sync_volume

    rates = {f"{phase}_gbps": getattr(args, f"sync_{phase}_gbps") for phase in ("pack", "digest", "verify", "load")}
    costs = SyncCosts(**{k: v for k, v in rates.items() if v is not None})
    engines = args.engines or max(1, gpus // engine_gpus)
    v = sync_volume(shape, layout=layout, learner_gpus=gpus, gpus_per_node=args.gpus_per_node,
                    engine_gpus=engine_gpus, engines=engines, weight_bytes=1 if args.engine_weights == "fp8" else 2)
    tp, pp, ep = layout
    bw = args.sync_bandwidth
    return [""] + report.sync_lines(v, costs, [as_built(v, costs, bw), shard_to_shard(v, costs, bw)],
                                    learner=f"tp{tp} pp{pp} ep{ep} ({how})", weights=args.engine_weights)

"""`msrl plan MODEL --gpus N --gpu-mem GiB`: memory and layout plan for a model on a cluster.

    msrl plan kimi-k2 --gpus 256 --gpu-mem 80 --optimizer-offload
    msrl plan qwen3-30b-a3b --gpus 8 --gpu-mem 80 --seq-len 16384 --kv-budget 2048
    msrl plan /models/MyMoE --nodes 4 --gpu-mem 141 --link-gbps 400

MODEL is a bundled name (qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, kimi-k2) or a model directory /
config.json. Prints parameters, ranked learner layouts (per-GPU weights, grads, optimizer, activations; the
headroom against `--margin`, the nodes an EP group spans, a published recipe's layout, what this learner cannot
run, why a layout does not fit) and why the first is chosen, rollout KV per sequence dense vs sparse and the
sequences an engine can hold (an engine across nodes flagged), and the weight-sync volume and time. The
assumptions and the ranking are in docs/scale.md.

Exit status: 0 when a learner layout this learner runs and the rollout engine fit; 1 when none does (or the
`--layout` asked for does not fit or shard, or the engine's weights leave no KV room), each reason printed as
`error: ...` on stderr; 2 for a bad argument.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("model", help="bundled model name or HF model directory / config.json")
    a("--gpus", type=int, default=None, help="total GPUs of the learner (default: nodes * gpus-per-node)")
    a("--nodes", type=int, default=None, help="nodes (default: gpus / gpus-per-node)")
    a("--gpus-per-node", type=int, default=8, help="GPUs joined by NVLink in one node (TP stays inside one; EP "
      "groups and engines across nodes are flagged)")
    a("--gpu-mem", type=float, required=True, metavar="GiB", help="memory of one GPU")
    a("--seq-len", type=int, default=32768, help="tokens per sequence (prompt + response), learner and rollout")
    a("--micro-batch", type=int, default=1)
    a("--recompute", choices=("full", "none"), default="full")
    a("--grad-dtype", choices=("fp32", "bf16"), default="fp32")
    a("--optimizer-offload", action="store_true", help="master weights + Adam states on the host")
    a("--margin", type=float, default=0.10, metavar="FRACTION",
      help="headroom a layout should keep, as a fraction of GPU memory (default 0.10); tighter layouts rank lower")
    a("--top", type=int, default=8, help="fitting layouts to show")
    a("--layout", default=None, metavar="TP,PP,EP", help="also evaluate this one layout (e.g. 8,8,32)")
    a("--rollout-gpus", type=int, default=None, help="GPUs per rollout engine (default: smallest that fits)")
    a("--kv-budget", type=int, default=2048, help="sparse KV budget (tokens kept)")
    a("--kv-interval", type=int, default=128, help="tokens generated between compressions")
    a("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    a("--engine-weights", choices=("bf16", "fp8"), default="bf16", help="rollout engine weight dtype (fp8: 1 byte "
      "per parameter)")
    a("--link-gbps", type=float, default=400.0, help="bandwidth of one learner -> engine link")


def _check(args) -> tuple[int, int]:
    """Reject impossible arguments before planning; return (gpus, nodes)."""
    from megatron_sparse_rl.config import ConfigError

    g, n, per = args.gpus, args.nodes, args.gpus_per_node
    if per < 1 or args.gpu_mem <= 0:
        raise ConfigError("--gpus-per-node must be >= 1 and --gpu-mem > 0")
    for flag in ("seq_len", "micro_batch", "top", "kv_budget", "kv_interval", "rollout_gpus"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1 (got {value})")
    if args.link_gbps <= 0:
        raise ConfigError(f"--link-gbps must be > 0 (got {args.link_gbps:g})")
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
    from megatron_sparse_rl.planner import (PlanOptions, default_engine_gpus, load_shape, rank_layouts, rollout_plan,
                                            weight_sync)
    from megatron_sparse_rl.planner import report

    gpus, nodes = _check(args)
    layout = _layout(args.layout) if args.layout else None
    try:
        shape = load_shape(args.model)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ConfigError(str(e)) from None
    opts = PlanOptions(gpus=gpus, gpus_per_node=args.gpus_per_node, gpu_mem_gib=args.gpu_mem, seq_len=args.seq_len,
                       micro_batch=args.micro_batch, recompute=args.recompute, grad_dtype=args.grad_dtype,
                       optimizer_offload=args.optimizer_offload, margin=args.margin)
    plans = rank_layouts(shape, opts)
    lines = report.model_lines(shape) + [""] + report.layout_lines(plans, opts, args.top)
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
    lines += report.sync_lines(weight_sync(shape, link_gbps=args.link_gbps, learner_nodes=nodes))
    print("\n".join(lines))
    problems = report.failures(shape, plans, opts, r, asked)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0

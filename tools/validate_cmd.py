"""`msrl validate CONFIG [--world-size N] [--set a.b=v ...]`: load and check a run config, start nothing.

Prints a summary of the resolved config (model, parallel layout, parameter count, rollout, algorithm)
and exits 0; a bad config prints `error: <message>` naming the fields and exits 2 (through tools/cli.py).

    msrl validate configs/tiny_moe_tp2ep2.yaml
    msrl validate configs/tiny_moe.yaml --set parallel.tp=2 --set launch.nproc_per_node=2 --dump
    msrl validate configs/tiny_moe.yaml --set launch.nproc_per_node=2 --set launch.rollout_ranks=1  # disaggregated
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (overrides of the dataclass defaults)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="total ranks; must equal launch.nodes * launch.nproc_per_node "
                             "(default: that product); a disaggregated config's parallel degrees are "
                             "checked against the learner ranks (N minus the rollout ranks)")
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="A.B=V",
                        help="override a field, value parsed as YAML (repeatable)")
    parser.add_argument("--dump", action="store_true", help="also print the whole resolved config as YAML")


def summary(run, spec, world_size: int) -> list[str]:
    """Human-readable lines describing the resolved run."""
    from megatron_sparse_rl.parallel.layout import ParallelLayout

    rollout = run.launch.rollout_world_size
    m = run.model
    layout = ParallelLayout.from_config(run.parallel, world_size - rollout, rollout_ranks=rollout)
    lines = [f"model: {m.path or '(no path)'}" + (f" (tiny {m.tiny.arch}, built on first use)" if m.tiny else "")]
    if spec is None:
        lines.append("  architecture: unknown here (no config.json at model.path); model checks skipped")
    else:
        arch = (f"  {spec.architecture}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
                f"{spec.num_heads} heads ({spec.num_kv_heads} KV) x {spec.head_dim}, vocab {spec.vocab_size}")
        if spec.is_moe:
            arch += f", {spec.num_experts} experts top-{spec.moe_topk} (ffn {spec.moe_ffn_hidden_size})"
        lines += [arch, f"  parameters: {spec.parameter_count():,}"]
    who = "world" if not rollout else "learner ranks"
    lines.append(f"layout: {who} {layout.world_size} = tp {layout.tp} x pp {layout.pp} x dp {layout.dp}; "
                 f"ep {layout.ep}, etp {layout.etp}, sequence_parallel {layout.sequence_parallel}, "
                 f"backend {layout.backend}")
    if rollout:
        lines.append(f"placement: disaggregated, learner ranks 0-{layout.world_size - 1}, rollout ranks "
                     f"{layout.world_size}-{world_size - 1} (one engine each)")
    else:
        lines.append("placement: colocated (every rank a learner with its own engine)")
    s, kv, a = run.rollout.sampling, run.rollout.kv, run.algorithm
    lines.append(f"rollout: n {s.n}, temperature {s.temperature}, max_tokens {s.max_tokens}, kv policy {kv.policy}"
                 + (f" (budget {kv.budget}, window {kv.window})" if kv.policy != "none" else ""))
    enabled = [n for n in ("tis", "mis", "geo_rs", "veto", "icepop", "opsm", "sparse_rl", "batch_skip")
               if getattr(a.corrections, n).enabled]
    lines.append(f"algorithm: advantage {a.advantage.estimator}, loss {a.loss.name} ({a.loss.aggregation}), "
                 f"corrections {', '.join(enabled) or 'none'}, kl coef {a.kl.coef}")
    lines.append(f"logging: {run.logging.dir}")
    return lines


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.config import load_config, to_dict, validate

    cfg = load_config(args.config, args.overrides)
    world_size = args.world_size or cfg.launch.nodes * cfg.launch.nproc_per_node
    spec = validate(cfg, args.world_size)
    print(f"config: {args.config}" + (f" (with --set {' '.join(args.overrides)})" if args.overrides else ""))
    print("\n".join(summary(cfg, spec, world_size)))
    if args.dump:
        import yaml

        print("---")
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    print("ok")
    return 0

"""`msrl convert`: checkpoint conversion between Hugging Face safetensors and Megatron-Core torch_dist.

    msrl convert hf-to-mcore --hf DIR --out DIR --tp 2 --ep 2 [--pp N] [--etp N] [--overwrite] [--verify]
    msrl convert mcore-to-hf --mcore DIR --out DIR [--tp N --ep N ...] [--hf-config DIR] [--max-shard-size 5GB]
    msrl convert merge-lora --base DIR --adapter DIR --out DIR [--overwrite]

Under torchrun/srun (WORLD_SIZE set) every rank runs the conversion in the launcher's world. Without a
launcher the command spawns the smallest world the layout needs (pp * lcm(tp, ep * etp) local processes).
Rank 0 prints throttled progress lines (tensors, MB done of the total, MB/s) to stderr. See docs/conversion.md.
merge-lora (no process group) writes an HF model with a PEFT-format adapter merged into its base: docs/lora.md.
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_sparse_rl.observability.logging import RankLogging, init_tool_logging, tool_log_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    h2m = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron torch_dist (+ manifest)")
    h2m.add_argument("--hf", required=True, help="HF model directory (config.json, safetensors, tokenizer)")
    m2h = sub.add_parser("mcore-to-hf", help="Megatron torch_dist -> HF safetensors, checked against the manifest")
    m2h.add_argument("--mcore", required=True, help="Megatron checkpoint directory")
    m2h.add_argument("--hf-config", default=None,
                     help="HF config/tokenizer directory (default: the checkpoint's own hf/ copy, which converted "
                          "and training checkpoints carry; needed only for checkpoints saved without one)")
    m2h.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    merge = sub.add_parser("merge-lora", help="HF base + PEFT LoRA adapter -> HF model with W + (alpha/r) B A")
    merge.add_argument("--base", required=True, help="HF model directory the adapter was trained on")
    merge.add_argument("--adapter", required=True, help="adapter checkpoint directory (adapter_model.safetensors, "
                       "adapter_config.json, base_model.json)")
    merge.add_argument("--out", required=True, help="output HF model directory (must not exist unless --overwrite)")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing --out (after success)")
    merge.add_argument("--verbose", action="store_true", help="also show the libraries' warnings on the console")
    for p in (h2m, m2h):
        p.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
        p.add_argument("--tp", type=int, default=1, help="tensor parallel degree (default 1)")
        p.add_argument("--ep", type=int, default=1, help="expert parallel degree (default 1)")
        p.add_argument("--pp", type=int, default=1, help="pipeline parallel degree (default 1)")
        p.add_argument("--etp", type=int, default=1, help="expert tensor parallel degree (default 1)")
        p.add_argument("--pipeline-layout", default=None,
                       help="Megatron-Core layout string of the pipeline stages, e.g. 'Ettt|tt|ttL' (default: "
                            "balanced stages where --pp does not divide the layers); with --vpp it has pp * vpp "
                            "stages")
        p.add_argument("--vpp", type=int, default=1,
                       help="model chunks (virtual pipeline stages) per pipeline rank, as parallel.vpp (default 1; "
                            "> 1 needs --pp > 1)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --out (after success)")
        p.add_argument("--verbose", action="store_true", help="also show the libraries' warnings on the console "
                       f"(always in {tool_log_path('convert')})")
        p.add_argument("--verify", action="store_true",
                       help="also compare a forward pass (HF transformers vs Megatron) on a few tokens")


def convert(args: argparse.Namespace) -> None:
    """Run the conversion on this rank (the process group is initialised)."""
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    layout = dict(tp=args.tp, ep=args.ep, pp=args.pp, etp=args.etp, pipeline_layout=args.pipeline_layout,
                  vpp=args.vpp)
    if args.direction == "hf-to-mcore":
        hf_to_mcore(args.hf, args.out, overwrite=args.overwrite, verify=args.verify, **layout)
    else:
        mcore_to_hf(args.mcore, args.out, hf_config_dir=args.hf_config, max_shard_size=args.max_shard_size,
                    overwrite=args.overwrite, verify=args.verify, **layout)


def _merge_lora(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.lora.merge import merge_adapter

    try:
        merge_adapter(args.base, args.adapter, args.out, overwrite=args.overwrite)
    except (ValueError, OSError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into {args.base} -> {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.checkpoint import launch

    log_file = init_tool_logging("convert", verbose=args.verbose)
    if args.direction == "merge-lora":
        return _merge_lora(args)
    for name in ("tp", "ep", "pp", "etp"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be >= 1 (got {getattr(args, name)})", file=sys.stderr)
            return 2
    if "WORLD_SIZE" in os.environ:
        launch.init_from_env()
        try:
            convert(args)
        except (ValueError, OSError, RuntimeError) as e:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        return 0
    errors = launch.run_local(convert, launch.min_world_size(args.tp, args.ep, args.pp, args.etp), args=(args,),
                              rank_init=RankLogging(str(log_file), args.verbose))  # the ranks log like this process
    if errors:
        print(f"error: {errors[0]}", file=sys.stderr)
        return 2
    print(f"converted -> {args.out}")
    return 0

"""`msrl validate CONFIG [--world-size N] [--set a.b=v ...] [--no-files]`: check a run config and the files it
points to; start nothing, write nothing.

Checks the config (`validate`), then what it points to (training/preflight.py, which `msrl train` runs too): the
model directory (config.json, safetensors shards and every tensor's shape and dtype, fp8 scales, a tokenizer
AutoTokenizer loads that fits the vocabulary) unless `model.tiny` will build it, the run and checkpoint
directories (directories, writable or creatable), and every record of the data (`check_data`: file and
line of the first problem; prompt lengths with the run's tokenizer, against data.max_prompt_tokens and
rollout.max_model_len). `--no-files` checks the config alone
(a cluster config on another machine). Prints a summary (validation/summary.py: model, parameter count, dtypes,
max_model_len as resolved from the model, parallel layout, engines, rollout, algorithm, every path made absolute
against the working directory, data) and exits 0; a problem prints `error: <message>` naming the fields, files
and lines and exits 2 (through tools/cli.py). `--world-size N` alone checks the config for N ranks; only a config
that sets a launch shape (`launch.nodes * launch.nproc_per_node` above 1) must agree with it.

    msrl validate configs/tiny_moe_tp2ep2.yaml
    msrl validate configs/tiny_moe.yaml --world-size 2 --set parallel.ep=2
    msrl validate configs/tiny_moe.yaml --set parallel.tp=2 --set launch.nproc_per_node=2 --dump
    msrl validate configs/tiny_moe.yaml --set launch.nproc_per_node=2 --set launch.rollout_ranks=1  # disaggregated
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (overrides of the dataclass defaults)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="total ranks (default: launch.nodes * launch.nproc_per_node); must equal that "
                             "product when the config sets launch.nodes or launch.nproc_per_node; a disaggregated "
                             "config's parallel degrees are checked against the learner ranks (N minus the "
                             "rollout ranks)")
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="A.B=V",
                        help="override a field, value parsed as YAML (repeatable)")
    parser.add_argument("--dump", action="store_true", help="also print the whole resolved config as YAML")
    parser.add_argument("--no-files", action="store_true",
                        help="check the config alone, not the model, data and directories it points to "
                             "(e.g. a cluster config on another machine)")


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.config import load_config, to_dict
    from megatron_sparse_rl.validation import validate
    from megatron_sparse_rl.validation.summary import run_summary
    from megatron_sparse_rl.validation.resolve import resolve
    from megatron_sparse_rl.training.preflight import check_files

    cfg = load_config(args.config, args.overrides)
    world_size = args.world_size or cfg.launch.nodes * cfg.launch.nproc_per_node
    spec = validate(cfg, args.world_size)
    # the same checks `msrl train` runs before anything starts (training/preflight.py)
    files = ["files: not checked (--no-files)"] if args.no_files else check_files(resolve(cfg, spec), spec)
    print(f"config: {args.config}" + (f" (with --set {' '.join(args.overrides)})" if args.overrides else ""))
    print("\n".join(run_summary(cfg, spec, world_size) + files))
    if args.dump:
        import yaml

        print("---")
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    print("ok")
    return 0

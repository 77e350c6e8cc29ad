"""`msrl train CONFIG [--set a.b=v ...]`: run the RL loop (SFT warm-start first when configured).

One process, or every rank of a torchrun/srun world (`msrl launch local --nproc N CONFIG`).

    msrl train configs/demo_tiny_moe.yaml
    msrl train configs/tiny_moe.yaml --set trainer.steps=2 --set logging.dir=runs/try
    msrl train configs/tiny_moe.yaml --verbose      # library INFO lines on the console too

Run again with the same logging.dir, it resumes from its newest checkpoint; a config that changes what the
resumed steps compute is refused (`error: ...`, exit 2, nothing written) unless --allow-config-change
(= --set checkpoint.allow_config_change=true; docs/runs.md).

SIGTERM or Ctrl-C stops the run at the next step boundary with a checkpoint: exit 75 means "stopped, resumable"
(run the same command again); a second signal, or trainer.stop_timeout_s passing, ends it at once (exit 128 + the
signal number; it resumes from its previous checkpoint). Under torchrun the ranks exit 0 on a stop and
`msrl launch local` exits 75.
"""
from __future__ import annotations

import argparse
import json
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (overrides of the dataclass defaults)")
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="A.B=V",
                        help="override a field, value parsed as YAML (repeatable)")
    parser.add_argument("--verbose", action="store_true",
                        help="also show vLLM / Megatron-Core INFO lines and their benign start-up warnings "
                             "(= --set logging.verbose=true; the full log is in <logging.dir>/logs/ either way)")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even when the config changes what the resumed steps compute, e.g. the "
                             "model, data, SFT stage or algorithm (= --set checkpoint.allow_config_change=true)")


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.trainer import train
    from megatron_sparse_rl.run.stops import EXIT_STOPPED

    overrides = [*args.overrides, *(["logging.verbose=true"] if args.verbose else []),
                 *(["checkpoint.allow_config_change=true"] if args.allow_config_change else [])]
    summary = train(load_config(args.config, overrides))
    if summary.get("rank", 0) == 0:
        print(json.dumps(summary, indent=2, sort_keys=True))
    # Under torchrun a non-zero rank is a failed rank (the agent aborts the others): `msrl launch local` reports the
    # stop from the run's stop record instead.
    return EXIT_STOPPED if summary.get("stopped") and "TORCHELASTIC_RUN_ID" not in os.environ else 0

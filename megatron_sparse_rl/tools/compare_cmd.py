"""`msrl compare RUN_DIR... [--metric NAME ...] [--out PNG]`: several runs' metrics on shared axes in one PNG, and a
table of each run's final and peak values (observability/compare.py).

    msrl compare runs/dense runs/sparse                           reward, accuracy, held-out accuracy, k1
    msrl compare seed*/dense seed*/sparse --metric kv/saved_frac  runs sharing a directory name: mean and band

Runs whose directories share a name are one arm: drawn as their mean with a min-max band. A metric that some of the
runs logged and others did not is refused (exit 2) naming the runs without it and the metric. Only this project's
lines reach the console; the libraries' warnings go to <temp dir>/msrl/compare.log (`--verbose`: on the console too).
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories (a run's logging.dir, holding metrics.jsonl) or metrics.jsonl files")
    parser.add_argument("--metric", dest="metrics", action="append", metavar="NAME",
                        help="a metric of metrics.jsonl to compare (repeatable; default: rollout/reward, "
                             "rollout/accuracy, eval/accuracy, mismatch/k1, those any run logged)")
    parser.add_argument("--out", default="compare.png", help="the PNG to write (default: compare.png)")
    parser.add_argument("--verbose", action="store_true", help="also show the libraries' warnings on the console")


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.observability.compare import compare, format_table
    from megatron_sparse_rl.observability.logging import init_tool_logging

    init_tool_logging("compare", verbose=args.verbose, libraries=False)  # matplotlib only: no torch to rewire
    out, rows = compare(args.runs, args.out, args.metrics)
    print(format_table(rows))
    print(f"wrote {out}")
    return 0

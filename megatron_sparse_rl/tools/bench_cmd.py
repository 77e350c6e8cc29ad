"""`msrl bench KIND [...]`: benchmarks that print ratios (measured results: docs/sparse_kv.md, docs/weight_sync.md,
docs/algorithms.md "Cost", docs/routing.md, docs/conversion.md, docs/async.md).

    msrl bench kv [--budget 128 --max-tokens 1024 ...]     sparse vs dense KV blocks, admitted sequences, tokens/s
    msrl bench sync [--mode both --bucket-mb 64 ...]       weight sync bytes/s over plain copy bytes/s (~100M params)
    msrl bench learner [--seq 256 --batch 16 ...]          learner tokens/s; corrections / keep-mask overhead
    msrl bench routing [--experts 64 --topk 8 ...]         routing replay overhead, route bytes per token
    msrl bench convert [--hidden 512 --layers 6 ...]       conversion GB/s over raw read+write (~80M params)
    msrl bench async [--config ... --staleness 0,1,2,4]     async RL steps/s over the synchronous loop's, per k

Only this project's lines reach the console; vLLM's, Megatron-Core's and the other libraries' warnings go to
<temp dir>/msrl/bench.log (`--verbose`: on the console too; observability/logging.py, `init_tool_logging`), also
from the processes a kind spawns (`args.rank_logging`, handed to run_ranks or to its own child process).

Each kind is a module `benchmarks/<kind>.py` (`MODULES` names the exceptions) exposing `add_arguments(parser)` and
`run(args) -> int`; add one by writing that module and a line in KINDS. Only the chosen kind's module is imported.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from megatron_sparse_rl.observability.logging import RankLogging, init_tool_logging, tool_log_path

# kind -> one-line help; the implementation is benchmarks/<kind>.py
KINDS: dict[str, str] = {
    "kv": "sparse vs dense KV: vLLM blocks in use, sequences admitted at a fixed pool, tokens/s",
    "sync": "learner -> engine weight sync bytes/s over a plain tensor copy of the same bytes",
    "learner": "learner step tokens/s; overhead of the off-policy corrections and of keep-sampling-mask",
    "routing": "learner step time with routing replay over without; route storage bytes per token",
    "convert": "HF <-> Megatron conversion GB/s over a raw read+write of the same bytes; peak memory",
    "async": "asynchronous RL (trainer.max_staleness 1, 2, 4) steps/s over the synchronous loop's, phases, learning",
}
MODULES = {"async": "async_rl"}  # `async` is a Python keyword: no module of that name


def _module(kind: str):
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"benchmarks.{MODULES.get(kind, kind)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    for kind, help_text in KINDS.items():
        p = sub.add_parser(kind, help=help_text, description=help_text)
        module = _module(kind)
        module.add_arguments(p)
        p.add_argument("--verbose", action="store_true",
                       help=f"also show the libraries' warnings on the console (always in {tool_log_path('bench')})")
        p.set_defaults(bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    # the kinds that spawn processes (sync, learner, convert) set them up with `rank_logging`: they log like this one
    args.rank_logging = RankLogging(str(init_tool_logging("bench", verbose=args.verbose)), args.verbose)
    return int(args.bench_run(args) or 0)

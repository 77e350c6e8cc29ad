"""`msrl`: the command-line entry point (console script `msrl = megatron_sparse_rl.tools.cli:main`; this folder
installs as `megatron_sparse_rl.tools`, setup.py maps it).

    msrl validate configs/tiny_moe.yaml [--world-size N] [--set a.b=v ...]
    msrl <command> --help

Each subcommand lives in its own module `tools/<name>_cmd.py` exposing `add_arguments(parser)` and
`run(args) -> int`; add one by writing that module and, for a new name, a line in COMMANDS. Only the
chosen command's module is imported. A command whose module does not exist yet answers
"not implemented yet" (exit 2). Unless the command's --verbose, the C++ warnings of torch and its extensions stay off
the console (observability/logging.py `quiet_native_logs`). A ConfigError from any command prints `error: <message>` (exit 2); in a rank of a
torchrun launch it goes to the rank's error file instead, and the launcher prints it once (launch/refusal.py).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> one-line help (README.md, "Commands"); the implementation is the module tools/<name>_cmd.py.
COMMANDS: dict[str, str] = {
    "train": "run the RL loop (and the sft stage when configured)",
    "validate": "check a config without starting anything",
    "convert": "convert checkpoints: hf-to-mcore | mcore-to-hf (--tp/--ep/--pp, --verify) | merge-lora",
    "launch": "start a run: local (torchrun) | slurm (sbatch; --dry-run prints the script)",
    "plan": "memory and layout plan for a model and cluster",
    "routing": "routing statistics from recorded routes: inspect | compare",
    "bench": "benchmarks that print ratios: sync | kv | learner | routing | convert | async",
    "compare": "draw several runs' metrics on shared axes and print their final and peak values",
}


def load_command(name: str):
    """The module implementing `name`, or None when tools/<name>_cmd.py does not exist (yet).

    Only a missing module of that exact name counts as "not implemented": any other ImportError (a
    dependency the module needs) propagates, so a broken install is never reported as a missing feature.
    """
    module = f"megatron_sparse_rl.tools.{name}_cmd"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return None
        raise


def _not_implemented(name: str):
    def run(args: argparse.Namespace) -> int:
        print(f"error: not implemented yet: msrl {name}: {COMMANDS[name]}; "
              f"it will live in tools/{name}_cmd.py", file=sys.stderr)
        return 2
    return run


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser; only the command named in `argv` gets its module imported and its arguments added."""
    parser = argparse.ArgumentParser(prog="msrl", description="RL post-training for MoE LLMs "
                                     "(Megatron-Core learners, vLLM sparse-KV rollouts).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = load_command(name) if name == chosen else None
        if module is not None:
            module.add_arguments(p)
            p.set_defaults(func=module.run)
        else:
            if name == chosen:
                p.description = f"{help_text} (not implemented yet)"
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            p.set_defaults(func=_not_implemented(name))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the command and return its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    if not getattr(args, "verbose", False):
        from megatron_sparse_rl.observability.logging import quiet_native_logs

        quiet_native_logs()  # before any command imports torch: c10 reads it then
    from megatron_sparse_rl.config import ConfigError
    from megatron_sparse_rl.launch.refusal import record

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        if not record(str(e)):  # a torchrun rank's refusal is printed once, by the launcher
            print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

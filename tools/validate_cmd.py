"""`msrl validate CONFIG [--world-size N] [--set a.b=v ...] [--no-files]`: check a run config and the files it
points to; start nothing, write nothing.

Checks the config (`validate`), then what it points to: the model directory (config.json, safetensors
weights, a tokenizer AutoTokenizer loads) unless `model.tiny` will build it, the run and checkpoint
directories (directories, writable or creatable), and every record of the data (`check_data`: file and
line of the first problem; prompt lengths with the run's tokenizer). `--no-files` checks the config alone
(a cluster config on another machine). Prints a summary (config/summary.py: model, parameter count, dtypes,
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
import os
from pathlib import Path


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


def _model_problems(model) -> list[str]:
    """The model directory the learner and engines load (only a non-directory path when model.tiny builds it)."""
    from megatron_sparse_rl.checkpoint.hf_io import INDEX, HFCheckpoint

    path, where = Path(model.path), f"model.path {model.path!r}"
    if model.tiny is not None and not (path / "config.json").is_file():
        if path.exists() and not path.is_dir():
            return [f"{where} exists and is not a directory (model.tiny builds the model there)"]
        return []
    if not path.exists():
        return [f"{where} does not exist (and model.tiny is not set): point it at a Hugging Face model "
                "directory, or set model.tiny to build a tiny one; --no-files checks the config alone"]
    if not (path / "config.json").is_file():
        return [f"{where} has no config.json" + ("" if path.is_dir() else " (it is not a directory)")]
    try:
        weights = HFCheckpoint(path)
    except (FileNotFoundError, ValueError) as e:
        return [f"{where}: {e}"]
    missing = sorted({f for f in weights.weight_map.values() if not (path / f).is_file()})
    if missing:
        return [f"{where}: {len(missing)} weight files named in {INDEX} are missing, e.g. {missing[0]!r}"]
    return []


def _tokenizer(model, spec):
    """The run's tokenizer, checked: the model directory's, or the character tokenizer model.tiny will write."""
    from megatron_sparse_rl.config import ConfigError
    from megatron_sparse_rl.data.checks import check_tokenizer

    if model.tiny is not None and not (Path(model.path) / "config.json").is_file():
        from megatron_sparse_rl.data.tokenizer import character_tokenizer

        return character_tokenizer()
    from megatron_sparse_rl.data import load_tokenizer

    where = f"model.path {model.path!r}"
    try:
        tokenizer = load_tokenizer(model.path)
    except Exception as e:  # transformers raises OSError, ValueError, ... for a missing or broken tokenizer
        raise ConfigError(f"{where}: no tokenizer AutoTokenizer can load ({type(e).__name__}: {e})") from None
    check_tokenizer(tokenizer, where, spec.vocab_size if spec is not None else None)
    return tokenizer


def _dir_problems(field: str, path: Path) -> list[str]:
    """A directory the run writes into: a writable directory, or creatable (its nearest existing parent is)."""
    if path.exists():
        if not path.is_dir():
            return [f"{field} {str(path)!r} exists and is not a directory"]
        return [] if os.access(path, os.W_OK | os.X_OK) else [f"{field} {str(path)!r} is not writable"]
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return [f"{field} {str(path)!r} cannot be created: {str(parent)!r} is not a writable directory"]
    return []


def check_files(run, spec) -> list[str]:
    """Check the files `run` points to (reading them, writing nothing); the data lines of the summary.
    `spec` is the model's ModelSpec from `validate` (None when unknown).

    Raises ConfigError listing every problem: model directory, run and checkpoint directories, the data.
    """
    from megatron_sparse_rl.config import ConfigError
    from megatron_sparse_rl.data import DatasetError, check_data
    from megatron_sparse_rl.data.checks import summary_lines

    problems = _model_problems(run.model)
    tokenizer = None
    if not problems:
        try:
            tokenizer = _tokenizer(run.model, spec)
        except ConfigError as e:
            problems.append(str(e))
    problems += _dir_problems("logging.dir", Path(run.logging.dir))
    if run.checkpoint.dir:
        problems += _dir_problems("checkpoint.dir", Path(run.checkpoint.dir))
    else:
        problems += _dir_problems("checkpoint.dir (default <logging.dir>/checkpoints)",
                                  Path(run.logging.dir) / "checkpoints")
    lines = []
    try:
        lines = summary_lines(check_data(run.data, tokenizer), run.data)
    except DatasetError as e:
        problems.append(str(e))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return lines


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.config import load_config, to_dict, validate
    from megatron_sparse_rl.config.summary import run_summary

    cfg = load_config(args.config, args.overrides)
    world_size = args.world_size or cfg.launch.nodes * cfg.launch.nproc_per_node
    spec = validate(cfg, args.world_size)
    files = ["files: not checked (--no-files)"] if args.no_files else check_files(cfg, spec)
    print(f"config: {args.config}" + (f" (with --set {' '.join(args.overrides)})" if args.overrides else ""))
    print("\n".join(run_summary(cfg, spec, world_size) + files))
    if args.dump:
        import yaml

        print("---")
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    print("ok")
    return 0

"""`msrl validate CONFIG [--world-size N] [--set a.b=v ...] [--no-files]`: check a run config and the files it
points to; start nothing, write nothing.

Checks the config (`validate`), then what it points to: the model directory (config.json, safetensors
weights, a tokenizer AutoTokenizer loads) unless `model.tiny` will build it, the run and checkpoint
directories (directories, writable or creatable), and every record of the data (`check_data`: file and
line of the first problem; prompt lengths with the run's tokenizer). `--no-files` checks the config alone
(a cluster config on another machine). Prints a summary (model, parallel layout, parameter count, rollout,
algorithm, data) and exits 0; a problem prints `error: <message>` naming the fields, files and lines and
exits 2 (through tools/cli.py).

    msrl validate configs/tiny_moe_tp2ep2.yaml
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
                        help="total ranks; must equal launch.nodes * launch.nproc_per_node "
                             "(default: that product); a disaggregated config's parallel degrees are "
                             "checked against the learner ranks (N minus the rollout ranks)")
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="A.B=V",
                        help="override a field, value parsed as YAML (repeatable)")
    parser.add_argument("--dump", action="store_true", help="also print the whole resolved config as YAML")
    parser.add_argument("--no-files", action="store_true",
                        help="check the config alone, not the model, data and directories it points to "
                             "(e.g. a cluster config on another machine)")


def summary(run, spec, world_size: int) -> list[str]:
    """Human-readable lines describing the resolved run."""
    from megatron_sparse_rl.models.deepseek import DeepseekSpec
    from megatron_sparse_rl.parallel.layout import ParallelLayout

    rollout = run.launch.rollout_world_size
    m = run.model
    layout = ParallelLayout.from_config(run.parallel, world_size - rollout, rollout_ranks=rollout)
    lines = [f"model: {m.path or '(no path)'}" + (f" (tiny {m.tiny.arch}, built on first use)" if m.tiny else "")]
    if spec is None:
        lines.append("  architecture: unknown here (no config.json at model.path); model checks skipped")
    else:
        attention = (f"{spec.num_heads} heads, MLA latent {spec.latent_width} (kv_lora_rank {spec.kv_lora_rank} + "
                     f"qk_rope_head_dim {spec.qk_rope_head_dim})" if isinstance(spec, DeepseekSpec)
                     else f"{spec.num_heads} heads ({spec.num_kv_heads} KV) x {spec.head_dim}")
        arch = (f"  {spec.architecture}: {spec.num_layers} layers, hidden {spec.hidden_size}, {attention}, "
                f"vocab {spec.vocab_size}")
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

    cfg = load_config(args.config, args.overrides)
    world_size = args.world_size or cfg.launch.nodes * cfg.launch.nproc_per_node
    spec = validate(cfg, args.world_size)
    files = ["files: not checked (--no-files)"] if args.no_files else check_files(cfg, spec)
    print(f"config: {args.config}" + (f" (with --set {' '.join(args.overrides)})" if args.overrides else ""))
    print("\n".join(summary(cfg, spec, world_size) + files))
    if args.dump:
        import yaml

        print("---")
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    print("ok")
    return 0

"""The checks of the files a run points to, shared by `msrl validate` and `msrl train` (which runs them on rank 0,
before Megatron or vLLM start, so a bad file is named in seconds and never as a traceback mid-run). They read and
write nothing else.

- the model directory: config.json, every safetensors shard named by the index present and readable, every tensor's
  name, shape and dtype against the model config (headers only; an fp8 release's scales included), an fp8 release
  the engine cannot serve on this machine, a tokenizer that loads, encodes and fits the model's vocabulary;
- FP8 rollouts (rollout.quantization fp8): every quantised tensor of the model fits the engine's tensor-parallel
  shards in whole 128x128 blocks (`fp8_rollout_problems`);
- episodes (env.kind set): every tool in env.tools registered (`tool_problems`; the registry lives in envs/, above
  config/, so the check runs here);
- the model's own chat template (data.template: chat): rendered in a child process with a deadline and refused,
  naming its file, when the sandbox stops it, it raises, hangs, or leaves out or reorders the messages a run needs
  (`template_problems`, data/template_check.py); the data is then read without rendering it;
- the run and checkpoint directories: directories, writable or creatable;
- the data: every record (`check_data`: file and line of the first problem), every templated prompt short
  enough for the engine (`rollout.max_model_len`, a response needs one position at least), and with episodes no
  demonstrated assistant turn holding an `env.turn_stop` string;
- the trackers `logging.trackers` names (`tracker_problems`): installed and importable, a local MLflow store's
  directory writable or creatable, a file store MLflow accepts, a tracking server that answers (the one thing
  contacted, within logging.mlflow.check_timeout_s), W&B online with credentials.

    lines = check_files(run, spec)     # ConfigError listing every problem; else the data summary lines
"""
from __future__ import annotations

import os
from pathlib import Path

from megatron_sparse_rl.config import ConfigError
from megatron_sparse_rl.envs.tools import TOOLS


def _model_problems(model, spec, cuda: bool) -> list[str]:
    """The model directory the learner and engines load (only a non-directory path when model.tiny builds it)."""
    from megatron_sparse_rl.formats.hf_io import INDEX, HFCheckpoint

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
    return _tensor_problems(weights, where, spec, cuda)


def _tensor_problems(weights, where: str, spec, cuda: bool) -> list[str]:
    """Shards readable, tensors as the config implies (fp8 scales included), and an fp8 release only where an
    engine can serve it."""
    from megatron_sparse_rl.checkpoint.checks import check_hf_files, check_hf_tensors
    from megatron_sparse_rl.models import load_spec

    try:
        check_hf_files(weights)
        adapter, model_spec = load_spec(weights.dir)
        check_hf_tensors(weights, adapter, spec or model_spec, weights.dir / "config.json")
    except (FileNotFoundError, ValueError) as e:
        return [f"{where}: {e}"]
    if weights.fp8 is not None and not cuda:
        return [f"{where} is a block-wise fp8 checkpoint (config.json quantization_config), which vLLM serves on "
                "GPUs only: on this CPU machine write a dequantised copy first (`msrl convert hf-to-mcore` then "
                "`msrl convert mcore-to-hf`, docs/conversion.md) and point model.path at it"]
    return []


def _tokenizer(model, spec):
    """The run's tokenizer, checked: the model directory's, or the character tokenizer model.tiny will write."""
    from megatron_sparse_rl.data.checks import check_tokenizer

    if model.tiny is not None and not (Path(model.path) / "config.json").is_file():
        from megatron_sparse_rl.models.char_tokenizer import character_tokenizer

        return character_tokenizer()
    from megatron_sparse_rl.data import load_tokenizer

    where = f"model.path {model.path!r}"
    try:
        tokenizer = load_tokenizer(model.path)
    except Exception as e:  # transformers raises OSError, ValueError, ... for a missing or broken tokenizer
        raise ConfigError(f"{where}: no tokenizer AutoTokenizer can load ({type(e).__name__}: {e})") from None
    check_tokenizer(tokenizer, where, spec.vocab_size if spec is not None else None)
    return tokenizer


def dir_problems(field: str, path: Path) -> list[str]:
    """A directory the run writes into: a writable directory, or creatable (its nearest existing parent is)."""
    if path.exists():
        if not path.is_dir():
            return [f"{field} {str(path)!r} exists and is not a directory"]
        return [] if os.access(path, os.W_OK | os.X_OK) else [f"{field} {str(path)!r} is not writable"]
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return [f"{field} {str(path)!r} cannot be created: {str(parent)!r} is not a writable directory"]
    return []


def fp8_rollout_problems(rollout, spec) -> list[str]:
    """rollout.quantization fp8 with engine shards that would cut FP8 blocks, naming the first such tensor: the
    sync quantises whole tensors, and an engine shard holding part of a block would hold a scale it shares with
    another rank (vLLM's block-FP8 layers refuse such shards: formats/fp8.py `BlockFp8.block_problem`). One
    engine rank holds every tensor whole, so any shape fits there (a partial block is a block)."""
    if rollout.quantization != "fp8" or spec is None or rollout.tensor_parallel_size == 1:
        return []
    from megatron_sparse_rl.formats.fp8 import RELEASE_BLOCK, BlockFp8
    from megatron_sparse_rl.models import adapter_for

    tp = rollout.tensor_parallel_size
    problems = BlockFp8(block=RELEASE_BLOCK).engine_problems(adapter_for(spec), spec, tp, merged=False)
    # one tensor named is enough: the others of its kind share its shape
    return [f"rollout.quantization = 'fp8' with rollout.tensor_parallel_size = {tp}: {problems[0]}"] if problems else []


def tool_problems(env) -> list[str]:
    """env.tools names that are not registered tools (none when no environment is configured)."""
    if not env.multi_turn:
        return []
    return [f"env.tools: {name!r} is not a registered tool; registered: {', '.join(map(repr, sorted(TOOLS)))}"
            for name in env.tools if name not in TOOLS]


def tracker_problems(logging_cfg) -> list[str]:
    """The trackers of `logging.trackers` unable to open (observability/trackers.py `check_trackers`), and the
    directory of a local MLflow store the user names (`logging.mlflow.tracking_uri`) not writable or creatable."""
    from megatron_sparse_rl.observability.trackers import check_trackers, mlflow_store_dir

    problems = check_trackers(logging_cfg)
    store = mlflow_store_dir(logging_cfg.mlflow) if "mlflow" in logging_cfg.trackers else None
    if store is not None and not problems:
        problems += dir_problems(f"logging.mlflow.tracking_uri {logging_cfg.mlflow.tracking_uri!r}: its directory",
                                 store)
    return problems


def template_problems(run, tokenizer) -> list[str]:
    """The model's own chat template, when the run renders with it (data.template: chat), unable to render the
    conversations the run needs: user and assistant messages, and tool messages for episodes (env.kind)."""
    from megatron_sparse_rl.data.template_check import chat_template_problem, template_file

    if run.data.template != "chat" or not getattr(tokenizer, "chat_template", None):
        return []  # plain prompts, or the built-in CHAR_CHAT_TEMPLATE (data/templates.py)
    roles = ("user", "assistant", "tool") if run.env.multi_turn else ("user", "assistant")
    problem = chat_template_problem(tokenizer, template_file(run.model.path), roles)
    if problem is None:
        return []
    needs = (f"env.kind = {run.env.kind!r} renders user, assistant and tool messages" if run.env.multi_turn
             else "data.template: chat renders user and assistant messages")
    return [f"model.path {run.model.path!r}: {problem}; {needs}"]


def check_files(run, spec, *, cuda: bool | None = None) -> list[str]:
    """Check the files `run` points to (reading them, writing nothing); the data lines of the summary.
    `spec` is the model's ModelSpec from `validate` (None when unknown); `run` as resolved (`resolve`) where
    max_model_len comes from the model.

    Raises ConfigError listing every problem: model directory, FP8 rollout shapes, env.tools, the chat template, run
    and checkpoint directories, the data, the trackers.
    """
    from megatron_sparse_rl.data import DatasetError, check_data
    from megatron_sparse_rl.data.checks import summary_lines

    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    problems = (_model_problems(run.model, spec, cuda) + fp8_rollout_problems(run.rollout, spec)
                + tool_problems(run.env))
    tokenizer = None
    if not problems:
        try:
            tokenizer = _tokenizer(run.model, spec)
        except ConfigError as e:
            problems.append(str(e))
    refused = template_problems(run, tokenizer) if tokenizer is not None else []
    if refused:  # the data is read, but not rendered with a template that may hang or raise
        problems += refused
        tokenizer = None
    problems += dir_problems("logging.dir", Path(run.logging.dir))
    if run.checkpoint.dir:
        problems += dir_problems("checkpoint.dir", Path(run.checkpoint.dir))
    else:
        problems += dir_problems("checkpoint.dir (default <logging.dir>/checkpoints)",
                                 Path(run.logging.dir) / "checkpoints")
    lines = []
    try:
        turn_stop = run.env.turn_stop if run.env.multi_turn else ()
        lines = summary_lines(check_data(run.data, tokenizer, run.rollout.max_model_len, turn_stop=turn_stop),
                              run.data)
    except DatasetError as e:
        problems.append(str(e))
    problems += tracker_problems(run.logging)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return lines

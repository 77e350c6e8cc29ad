"""The check of a run's prompt data, run before anything expensive starts (`msrl validate`, and
`build_context` right after the config checks, before Megatron and vLLM).

`check_data(cfg)` streams every record of the train and eval splits once through the dataset readers'
own parsing (`datasets.iter_prompts`: the rules are defined there, once) and holds none of them. The first
problem raises `DatasetError` (`DatasetMissing` when a file does not exist) naming the config field, the
file and the line (or row): a missing file, an empty one, undecodable bytes, bad or pathologically nested
JSON, a missing or repeated field, a wrong type, a whitespace-only prompt, an empty answer, a parquet path
that does not exist. It reads and writes nothing else. Given the run's tokenizer it also applies the
`data.max_prompt_tokens` rule to every prompt and refuses characters of a prompt or an answer that the
tokenizer cannot encode (file:line and the characters); `check_tokenizer` checks that tokenizer itself. Given the
stop strings of episode turns (env.turn_stop) it refuses a demonstrated assistant turn holding one (file:line and the
message): an episode's turn ends at a stop string, so the model could never write that turn whole.

    from megatron_sparse_rl.data import check_data
    for split in check_data(run.data):        # DatasetError: "data.path: runs/x.jsonl:3: not valid JSON (...)"
        print(split.line())                   # "train: data.path 'runs/x.jsonl', 1,204 records"
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_sparse_rl.config.data import BUILT_IN_SOURCES, DataConfig
from megatron_sparse_rl.config.loader import ConfigError
from megatron_sparse_rl.data.datasets import DatasetError, all_too_long, encode_one, iter_prompts
from megatron_sparse_rl.data.task import no_held_out_note

Split = Literal["train", "eval"]
_SAMPLE = "12+7="  # any tokenizer encodes this to tokens (the character tokenizer included)


@dataclass(frozen=True, slots=True)
class SplitSummary:
    """What `check_data` found in one split."""

    split: Split
    """"train" or "eval"."""
    origin: str
    """Where its records come from: "data.path 'x.jsonl'", "data.arithmetic", or "" for no eval split."""
    records: int
    """Records read (0: no such split)."""
    too_long: int | None
    """Prompts over data.max_prompt_tokens, dropped under on_long_prompt: skip (None: not checked, no tokenizer)."""

    def line(self) -> str:
        """One line for a person: where the split comes from and how many records it holds."""
        if not self.records:
            return f"{self.split}: none"
        dropped = f", {self.too_long:,} over data.max_prompt_tokens (skipped)" if self.too_long else ""
        return f"{self.split}: {self.origin}, {self.records:,} records{dropped}"


def _origin(cfg: DataConfig, split: Split) -> str:
    if cfg.source in BUILT_IN_SOURCES:
        return f"data.{cfg.source}"
    field, path = ("data.path", cfg.path) if split == "train" else ("data.eval_path", cfg.eval_path)
    return f"{field} {path!r}" if path else ""


def _check_demo(prompt, cfg: DataConfig, turn_stop: tuple[str, ...]) -> None:
    """A demonstrated assistant turn holding a stop string of episode turns."""
    for k, (role, content) in enumerate(prompt.demo):
        stops = [s for s in turn_stop if s in content] if role == "assistant" else []
        if stops:
            index = len(prompt.messages) + k
            raise DatasetError(f"{prompt.source}: {cfg.prompt_key}[{index}], an assistant turn of the demonstration, "
                               f"holds {stops[0]!r}, a stop string of env.turn_stop: an episode's turn ends there, so "
                               "the model could never write this turn whole; split it into turns or remove the string")


def _check_split(cfg: DataConfig, split: Split, tokenizer, max_model_len: int | None,
                 turn_stop: tuple[str, ...]) -> SplitSummary:
    records = too_long = 0
    for prompt in iter_prompts(cfg, split):
        records += 1
        _check_demo(prompt, cfg, turn_stop)
        example = encode_one(prompt, tokenizer, cfg) if tokenizer is not None else None
        if tokenizer is not None and example is None:
            too_long += 1
        elif example is not None and max_model_len is not None and len(example.ids) >= max_model_len:
            raise DatasetError(f"{prompt.source}: the templated prompt is {len(example.ids)} tokens, but "
                               f"rollout.max_model_len is {max_model_len}, which must leave room for one response "
                               f"token at least: raise rollout.max_model_len, or set data.max_prompt_tokens below "
                               f"{max_model_len} (with data.on_long_prompt: skip to drop such prompts)")
    if records and too_long == records:
        raise DatasetError(f"{_origin(cfg, split)}: {all_too_long(records, cfg)}")
    return SplitSummary(split, _origin(cfg, split), records, too_long if tokenizer is not None else None)


def check_data(cfg: DataConfig, tokenizer=None, max_model_len: int | None = None, *,
               turn_stop: tuple[str, ...] = ()) -> list[SplitSummary]:
    """Read every record of `cfg`'s splits once; raise the first problem, naming field, file and line.

    Args:
        cfg: the data config.
        tokenizer: the run's tokenizer, to check templated prompt lengths too (None: not checked).
        max_model_len: the engine's rollout.max_model_len, which every templated prompt must stay below (vLLM
            needs room for one response token); None: not checked.
        turn_stop: the stop strings of episode turns (env.turn_stop when env.kind is set), which no demonstrated
            assistant turn may hold; (): not checked.
    Returns:
        The train and eval `SplitSummary`.
    Raises:
        DatasetError: the first problem (DatasetMissing for a file that does not exist); a ConfigError,
            which the command line prints as `error: <message>`.
    """
    try:
        return [_check_split(cfg, split, tokenizer, max_model_len, turn_stop) for split in ("train", "eval")]
    except ImportError as e:  # parquet without pyarrow: a config the install cannot serve
        raise DatasetError(f"data.source is {cfg.source!r}: {e}") from None


def check_tokenizer(tokenizer, where: str, vocab_size: int | None = None) -> None:
    """Raise ConfigError when `tokenizer` (loaded from `where`) cannot serve a run: it encodes text to no
    tokens (transformers builds an empty tokenizer from a directory without tokenizer files), or it has
    more tokens than the model's `vocab_size` (ids the embedding does not have)."""
    if not tokenizer(_SAMPLE, add_special_tokens=False)["input_ids"]:
        raise ConfigError(f"{where}: its tokenizer encodes {_SAMPLE!r} to no tokens; the directory has no usable "
                          "tokenizer files (tokenizer.json, tokenizer.model, vocab.json + merges.txt, ...)")
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ConfigError(f"{where}: its tokenizer has {len(tokenizer):,} tokens, more than the model's "
                          f"vocab_size {vocab_size:,}: the tokenizer does not belong to this model")


def summary_lines(summaries: list[SplitSummary], cfg: DataConfig) -> list[str]:
    """`msrl validate`'s data lines: one per split, and what evaluation uses when there is no eval split."""
    lines = [f"data: {cfg.source}, template {cfg.template}"] + [f"  {s.line()}" for s in summaries]
    if not any(s.records for s in summaries if s.split == "eval"):
        lines.append(f"  note: {no_held_out_note(cfg)}")
    return lines

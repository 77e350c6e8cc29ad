"""Prompt datasets (JSONL, parquet, the built-in arithmetic task), encoding, and the resumable stream.

- JSONL: one JSON object per line with `data.prompt_key` (a non-empty string) and `data.answer_key`
  (a string or a number; numbers become their decimal text). Blank lines are ignored. Any other
  malformed line (bad JSON, not an object, a missing key, a wrong type) raises `DatasetError` naming
  the file and the 1-based line number; nothing is skipped silently.
- Parquet: read with pyarrow (an ImportError says how to install it when absent); the same checks,
  reported with the 1-based row number.
- Prompts longer than `data.max_prompt_tokens` after templating: `DatasetError` naming the line
  (on_long_prompt="error"), or dropped and counted (on_long_prompt="skip"; the count is returned by
  `encode_prompts` and held by `PromptStream.skipped` for the trainer to log).

    train = load_prompts(cfg.data, "train")
    encoded, skipped = encode_prompts(train, load_tokenizer(model_dir), cfg.data)
    stream = PromptStream(encoded, batch_size=8, seed=cfg.data.seed)
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Generic, Literal, Sequence, TypeVar

import numpy as np

from megatron_sparse_rl._optional import require
from megatron_sparse_rl.config.data import DataConfig
from megatron_sparse_rl.data import arithmetic
from megatron_sparse_rl.data.templates import encode_prompt
from megatron_sparse_rl.data.types import Example, Prompt

T = TypeVar("T")


class DatasetError(ValueError):
    """A dataset file or record is malformed; the message names the file and the line (or row)."""


def load_tokenizer(model_dir: str | Path):
    """The Hugging Face tokenizer saved in `model_dir` (AutoTokenizer, local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _record(obj: Any, where: str, prompt_key: str, answer_key: str) -> Prompt:
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object with keys {prompt_key!r} and {answer_key!r}, "
                           f"got {type(obj).__name__}")
    for key in (prompt_key, answer_key):
        if key not in obj:
            raise DatasetError(f"{where}: missing key {key!r} (has {sorted(obj)})")
    prompt, answer = obj[prompt_key], obj[answer_key]
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}: {prompt_key!r} must be a non-empty string (got {prompt!r})")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{where}: {answer_key!r} must be a string or a number (got {answer!r})")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise DatasetError(f"{where}: {answer_key!r} must be finite (got {answer!r})")
    return Prompt(text=prompt, answer=str(answer), source=where)


def read_jsonl(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Prompt]:
    """All records of a JSONL file, in file order; `DatasetError` with file:line on a malformed line."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            prompts.append(_record(obj, where, prompt_key, answer_key))
    if not prompts:
        raise DatasetError(f"dataset file {str(path)!r} holds no records")
    return prompts


def read_parquet(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Prompt]:
    """All rows of a parquet table; `DatasetError` with file and 1-based row on a malformed row."""
    require("pyarrow", "Reading parquet datasets (data.source: parquet)",
            "Install it with `pip install pyarrow` (or `pip install -e .[parquet]`), or convert the data to JSONL.")
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    names = pq.read_schema(path).names
    for key in (prompt_key, answer_key):
        if key not in names:
            raise DatasetError(f"{path}: missing column {key!r} (has {names})")
    table = pq.read_table(path, columns=[prompt_key, answer_key])
    rows = table.to_pylist()
    if not rows:
        raise DatasetError(f"dataset file {str(path)!r} holds no rows")
    return [_record(row, f"{path}:row {i}", prompt_key, answer_key) for i, row in enumerate(rows, start=1)]


def load_prompts(cfg: DataConfig, split: Literal["train", "eval"]) -> list[Prompt]:
    """The raw prompts of one split. jsonl/parquet read `path` (train) or `eval_path` (eval; [] if unset)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval' (got {split!r})")
    if cfg.source == "arithmetic":
        train, held_out = arithmetic.generate(cfg.arithmetic)
        return train if split == "train" else held_out
    path = cfg.path if split == "train" else cfg.eval_path
    if not path:
        return []
    reader = read_jsonl if cfg.source == "jsonl" else read_parquet
    return reader(path, cfg.prompt_key, cfg.answer_key)


def encode_prompts(prompts: Sequence[Prompt], tokenizer, cfg: DataConfig) -> tuple[list[Example], int]:
    """Template and tokenize; returns (encoded prompts, number skipped for length).

    A prompt over `cfg.max_prompt_tokens` raises `DatasetError` naming its line (on_long_prompt="error")
    or is skipped and counted (on_long_prompt="skip"). Raises if nothing is left.
    """
    out, skipped = [], 0
    for p in prompts:
        text, ids = encode_prompt(tokenizer, p.text, cfg.template)
        if len(ids) > cfg.max_prompt_tokens:
            if cfg.on_long_prompt == "error":
                raise DatasetError(f"{p.source}: the prompt is {len(ids)} tokens after the {cfg.template!r} "
                                   f"template, more than data.max_prompt_tokens={cfg.max_prompt_tokens} "
                                   f"(raise it, or set data.on_long_prompt: skip)")
            skipped += 1
            continue
        out.append(Example(prompt=text, answer=p.answer, ids=tuple(ids), difficulty=p.difficulty, source=p.source))
    if prompts and not out:
        raise DatasetError(f"all {len(prompts)} prompts are longer than data.max_prompt_tokens="
                           f"{cfg.max_prompt_tokens}")
    return out, skipped


class PromptStream(Generic[T]):
    """Endless batches over `items`, reshuffled every epoch, with a resumable position.

    Epoch e visits the items in the order `numpy.random.default_rng([seed, e]).permutation(n)` (or in
    order when shuffle is false). A batch that reaches the end of an epoch is filled from the start of
    the next one, so every batch has `batch_size` items. `state_dict()` is the position (epoch, index
    into that epoch's order); `load_state_dict` restores it, and the next batch is then the one an
    uninterrupted stream would have given.
    """

    def __init__(self, items: Sequence[T], batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 skipped: int = 0):
        if not items:
            raise ValueError("PromptStream needs at least one item")
        if batch_size < 1:
            raise ValueError(f"PromptStream batch_size must be >= 1 (got {batch_size})")
        self.items = list(items)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.skipped = skipped  # prompts dropped for length before the stream was built (a metric)
        self.epoch = 0
        self.index = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.items)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self) -> list[T]:
        """The next `batch_size` items."""
        batch = []
        while len(batch) < self.batch_size:
            if self.index == len(self.items):
                self.epoch += 1
                self.index = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), len(self.items) - self.index)
            batch.extend(self.items[i] for i in self._order[self.index:self.index + take])
            self.index += take
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> list[T]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int | bool]:
        """The position, plus what must match on load (size, seed, shuffle); plain ints (JSON-safe)."""
        return {"epoch": self.epoch, "index": self.index, "size": len(self.items), "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict`; raises ValueError if the dataset or seed changed."""
        for key, mine in (("size", len(self.items)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state.get(key) != mine:
                raise ValueError(f"PromptStream state does not match this stream: {key} was {state.get(key)!r}, "
                                 f"is {mine!r} (the dataset or data.seed changed since the checkpoint)")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self.items):
            raise ValueError(f"PromptStream state has an invalid position (epoch {epoch}, index {index})")
        self.epoch, self.index = epoch, index
        self._order = self._epoch_order(epoch)

"""Prompt datasets (JSONL, parquet, the built-in arithmetic task), encoding, and the resumable stream.

- JSONL: one JSON object per line, UTF-8, with `data.prompt_key` (a string that is not only whitespace, or chat
  data: a non-empty list of messages {"role": system/user/assistant/tool, "content": a string}, which needs
  `data.template: chat`; the messages before the first assistant message are the prompt, the rest a demonstrated
  episode the SFT warm start trains on) and
  `data.answer_key` (a non-blank string, or a finite number, which becomes the decimal numeral a response writes:
  19.0 -> "19", 1e-07 -> "0.0000001"). Blank lines are ignored. Any other problem (undecodable bytes, bad or
  pathologically nested JSON, not an object, a missing key, a key given twice, a wrong type, an empty answer)
  raises `DatasetError` naming the file and the 1-based line number; an empty file and a file that does not
  exist (`DatasetMissing`) are errors too. Nothing is skipped silently.
- Parquet: read with pyarrow one record batch at a time (an ImportError says how to install it when
  absent); the same checks, reported with the 1-based row number.
- A prompt or answer holding characters the run's tokenizer cannot encode (it would read them as its unknown
  token): `DatasetError` naming the line and the characters (`encode_one`, so `msrl validate` and `build_task`,
  which `msrl train` runs before Megatron and vLLM start, both refuse it).
- Prompts longer than `data.max_prompt_tokens` after templating: `DatasetError` naming the line
  (on_long_prompt="error"), or dropped and counted (on_long_prompt="skip"; the count is returned by
  `encode_prompts` and held by `PromptStream.skipped` for the trainer to log).

The `iter_*` readers stream (one record at a time); `read_*` and `load_prompts` collect them. `checks.py`
runs the same readers over every record before a run starts.

    train = load_prompts(cfg.data, "train")
    encoded, skipped = encode_prompts(train, load_tokenizer(model_dir), cfg.data)
    stream = PromptStream(encoded, batch_size=8, seed=cfg.data.seed)
"""
from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path
from typing import Any, Generic, Iterator, Literal, Sequence, TypeVar

import numpy as np

from megatron_sparse_rl._optional import require
from megatron_sparse_rl.config.data import BUILT_IN_SOURCES, DataConfig
from megatron_sparse_rl.config.loader import ConfigError
from megatron_sparse_rl.data import arithmetic, chain
from megatron_sparse_rl.data.templates import (CHAT_ROLES, ChatTemplateError, encode_demo, encode_messages,
                                               encode_prompt, unknown_characters)
from megatron_sparse_rl.data.types import Example, Prompt

T = TypeVar("T")


class DatasetError(ConfigError):
    """A dataset file or record is malformed; the message names the file and the line (or row).

    A ConfigError: the data a config points to is part of what `msrl validate` and `msrl train` check
    before anything starts, and the command line prints it as `error: <message>` (exit 2)."""


class DatasetMissing(DatasetError, FileNotFoundError):
    """A dataset file named by the config does not exist."""


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
            raise DatasetError(f"{where}: missing key {key!r} (need {prompt_key!r} and {answer_key!r}; "
                               f"has {sorted(obj)})")
    prompt, answer = obj[prompt_key], obj[answer_key]
    messages = _messages(prompt, where, prompt_key) if isinstance(prompt, list) else ()
    first_turn = next((i for i, (role, _) in enumerate(messages) if role == "assistant"), len(messages))
    messages, demo = messages[:first_turn], messages[first_turn:]
    if demo and not messages:
        raise DatasetError(f"{where}: {prompt_key!r} starts with an assistant message: nothing comes before the "
                           "model's first turn")
    if messages:
        prompt = "\n".join(content for _, content in messages)
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}: {prompt_key!r} must be a non-empty string (got {prompt!r})")
    if not prompt.strip():
        raise DatasetError(f"{where}: {prompt_key!r} is only whitespace (got {prompt!r}): there is no problem to "
                           "pose")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{where}: {answer_key!r} must be a string or a number (got {answer!r})")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise DatasetError(f"{where}: {answer_key!r} must be finite (got {answer!r})")
    if isinstance(answer, str) and not answer.strip():
        raise DatasetError(f"{where}: {answer_key!r} is empty (got {answer!r}): it would reward a response that "
                           "answers nothing")
    return Prompt(text=prompt, answer=answer if isinstance(answer, str) else number_text(answer), source=where,
                  messages=messages, demo=demo)


def _messages(value: list, where: str, key: str) -> tuple[tuple[str, str], ...]:
    """Chat data: a non-empty list of {"role", "content"} objects as (role, content) pairs; `DatasetError` naming the
    message otherwise."""
    if not value:
        raise DatasetError(f"{where}: {key!r} is an empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise DatasetError(f"{where}: {key}[{i}] must be an object with exactly the keys 'role' and 'content' "
                               f"(got {m!r})")
        if m["role"] not in CHAT_ROLES or not isinstance(m["content"], str):
            raise DatasetError(f"{where}: {key}[{i}] needs a role among {', '.join(map(repr, CHAT_ROLES))} and a "
                               f"string content (got {m!r})")
        out.append((m["role"], m["content"]))
    return tuple(out)


def number_text(value: int | float) -> str:
    """A dataset's number as the decimal numeral a response writes: 19 -> "19", 19.0 -> "19", 0.5 -> "0.5",
    1e-07 -> "0.0000001" (no exponent, no fraction ending in zeros, no "-0")."""
    if isinstance(value, int):
        return str(value)
    text = format(Decimal(repr(value)), "f")  # repr: the shortest text that reads back as this float
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def _existing_file(path: str | Path) -> Path:
    """`path` as a Path; `DatasetMissing` when nothing is there, `DatasetError` for a directory."""
    path = Path(path)
    if not path.exists():
        raise DatasetMissing(f"dataset file {str(path)!r} does not exist")
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} is not a file (a directory?)")
    return path


def _decode(raw: bytes, where: str, first: bool) -> str:
    # utf-8-sig on the first line accepts the byte-order mark some editors write; json.loads refuses it.
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{where}: undecodable bytes (not UTF-8: byte 0x{raw[e.start]:02x} at byte "
                           f"{e.start + 1} of the line)") from None


def _parse_json(line: str, where: str, keys: tuple[str, str]) -> Any:
    def no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict:
        names = [k for k, _ in pairs]
        for key in keys:  # json.loads would keep the last value silently; which one the user meant is unknown
            if names.count(key) > 1:
                raise DatasetError(f"{where}: key {key!r} appears {names.count(key)} times in one object")
        return dict(pairs)

    try:
        return json.loads(line, object_pairs_hook=no_repeated_keys)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # the parser recurses once per level: a line of "[[[[..." exhausts the stack
        raise DatasetError(f"{where}: JSON nested too deeply to read (a record is an object of a prompt and an "
                           "answer)") from None


def iter_jsonl(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> Iterator[Prompt]:
    """The records of a JSONL file one at a time, in file order (nothing is held); `DatasetError` naming
    file:line on the first malformed line, `DatasetMissing` when the file does not exist."""
    path = _existing_file(path)
    records = lineno = 0
    try:
        f = path.open("rb")  # bytes: an undecodable line is reported with its number
    except OSError as e:
        raise DatasetError(f"dataset file {str(path)!r} cannot be read ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            line = _decode(raw, where, first=lineno == 1)
            if not line.strip():
                continue
            records += 1
            yield _record(_parse_json(line, where, (prompt_key, answer_key)), where, prompt_key, answer_key)
    if not records:
        what = "is empty" if not lineno else f"has only blank lines ({lineno})"
        raise DatasetError(f"dataset file {str(path)!r} {what}: it holds no records")


def read_jsonl(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Prompt]:
    """All records of a JSONL file, in file order; `DatasetError` with file:line on a malformed line."""
    return list(iter_jsonl(path, prompt_key, answer_key))


def iter_parquet(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> Iterator[Prompt]:
    """The rows of a parquet table one record batch at a time; `DatasetError` with file and 1-based row.

    A path that does not exist is reported before the pyarrow check (ImportError when it is missing)."""
    path = _existing_file(path)
    require("pyarrow", "Reading parquet datasets (data.source: parquet)",
            "Install it with `pip install pyarrow` (or `pip install -e .[parquet]`), or convert the data to JSONL.")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 0
    try:
        table = pq.ParquetFile(path)
        names = table.schema_arrow.names
        for key in (prompt_key, answer_key):
            if key not in names:
                raise DatasetError(f"{path}: missing column {key!r} (need {prompt_key!r} and {answer_key!r}; "
                                   f"has {names})")
        for batch in table.iter_batches(columns=[prompt_key, answer_key]):
            for row in batch.to_pylist():
                rows += 1
                yield _record(row, f"{path}:row {rows}", prompt_key, answer_key)
    except (pa.ArrowException, OSError) as e:  # not parquet, truncated, unreadable
        raise DatasetError(f"{path}: not a readable parquet file (after {rows} rows: {e})") from None
    if not rows:
        raise DatasetError(f"dataset file {str(path)!r} holds no rows")


def read_parquet(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Prompt]:
    """All rows of a parquet table; `DatasetError` with file and 1-based row on a malformed row."""
    return list(iter_parquet(path, prompt_key, answer_key))


_GENERATORS = {"arithmetic": arithmetic.generate, "chain": chain.generate}
"""The in-process generator of each of `BUILT_IN_SOURCES`: its config section -> (train, eval) prompts."""


def iter_prompts(cfg: DataConfig, split: Literal["train", "eval"]) -> Iterator[Prompt]:
    """The raw prompts of one split, streamed. jsonl/parquet read `path` (train) or `eval_path` (eval; none
    if unset). A file's errors are prefixed with the config field that names it ("data.path: ...")."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval' (got {split!r})")
    if cfg.source in BUILT_IN_SOURCES:
        try:  # each built-in source reads the `data` section named like it
            train, held_out = _GENERATORS[cfg.source](getattr(cfg, cfg.source))
        except ValueError as e:
            raise DatasetError(str(e)) from None
        yield from (train if split == "train" else held_out)
        return
    field, path = ("data.path", cfg.path) if split == "train" else ("data.eval_path", cfg.eval_path)
    if not path:
        return
    reader = iter_jsonl if cfg.source == "jsonl" else iter_parquet
    try:
        yield from reader(path, cfg.prompt_key, cfg.answer_key)
    except DatasetError as e:
        raise type(e)(f"{field}: {e}") from None


def load_prompts(cfg: DataConfig, split: Literal["train", "eval"]) -> list[Prompt]:
    """The raw prompts of one split. jsonl/parquet read `path` (train) or `eval_path` (eval; [] if unset)."""
    return list(iter_prompts(cfg, split))


def _check_encodable(prompt: Prompt, tokenizer, ids: list[int]) -> None:
    """`DatasetError` naming the line and the characters when the prompt (whose templated `ids` are given) or the
    answer holds characters `tokenizer` reads as its unknown token: the model would see <unk> where the data says
    something, and could never write such an answer."""
    for what, text in (("prompt", prompt.text), ("answer", prompt.answer)):
        if what == "prompt" and getattr(tokenizer, "unk_token_id", None) not in ids:
            continue  # the usual case, decided from the ids already made
        chars = unknown_characters(tokenizer, text)
        if chars:
            shown = ", ".join(f"{c!r} (U+{ord(c):04X})" if len(c) == 1 else repr(c) for c in chars[:5])
            more = f" and {len(chars) - 5} more" if len(chars) > 5 else ""
            raise DatasetError(f"{prompt.source}: the {what} holds {shown}{more}, which the model's tokenizer "
                               f"cannot encode (it would read {tokenizer.unk_token!r}); remove or replace them, or "
                               "use a model whose tokenizer covers them")


def encode_one(prompt: Prompt, tokenizer, cfg: DataConfig) -> Example | None:
    """The templated, tokenized prompt; None when it is over `cfg.max_prompt_tokens` and
    on_long_prompt="skip"; `DatasetError` naming its line when on_long_prompt="error", when the prompt or
    the answer holds characters the tokenizer cannot encode, or when the chat template fails on it."""
    if prompt.messages and cfg.template != "chat":
        raise DatasetError(f"{prompt.source}: chat data (a list of messages) needs data.template: chat (got "
                           f"{cfg.template!r}): the messages are rendered with the tokenizer's chat template")
    demo_ids, demo_mask = (), ()
    try:
        if prompt.messages:
            text, ids = encode_messages(tokenizer, [{"role": r, "content": c} for r, c in prompt.messages])
            if prompt.demo:
                demo_ids, demo_mask = encode_demo(tokenizer, prompt.messages, prompt.demo)
        else:
            text, ids = encode_prompt(tokenizer, prompt.text, cfg.template)
    except ChatTemplateError as e:
        raise DatasetError(f"{prompt.source}: {e}") from None
    _check_encodable(prompt, tokenizer, ids)
    if len(ids) <= cfg.max_prompt_tokens:
        return Example(prompt=text, answer=prompt.answer, ids=tuple(ids), difficulty=prompt.difficulty,
                       source=prompt.source, solution=prompt.solution, demo_ids=demo_ids, demo_mask=demo_mask)
    if cfg.on_long_prompt == "error":
        raise DatasetError(f"{prompt.source}: the prompt is {len(ids)} tokens after the {cfg.template!r} "
                           f"template, more than data.max_prompt_tokens={cfg.max_prompt_tokens} "
                           f"(raise it, or set data.on_long_prompt: skip)")
    return None


def all_too_long(count: int, cfg: DataConfig) -> DatasetError:
    """The error for a split whose `count` prompts were all skipped for length."""
    return DatasetError(f"all {count} prompts are longer than data.max_prompt_tokens={cfg.max_prompt_tokens}")


def encode_prompts(prompts: Sequence[Prompt], tokenizer, cfg: DataConfig) -> tuple[list[Example], int]:
    """Template and tokenize; returns (encoded prompts, number skipped for length).

    A prompt over `cfg.max_prompt_tokens` raises `DatasetError` naming its line (on_long_prompt="error")
    or is skipped and counted (on_long_prompt="skip"). Raises if nothing is left.
    """
    encoded = [encode_one(p, tokenizer, cfg) for p in prompts]
    out = [e for e in encoded if e is not None]
    if prompts and not out:
        raise all_too_long(len(prompts), cfg)
    return out, len(encoded) - len(out)


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

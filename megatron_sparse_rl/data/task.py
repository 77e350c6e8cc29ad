"""The task the trainer consumes: encoded train and eval examples, and the resumable streams over them.

    task = build_task(run.data, tokenizer)
    batch = task.next_train(8)        # list[Example]: .prompt (templated text), .ids, .answer
    sft = task.next_sft(16)           # the warm-start stream: same train split, its own order
    held_out = task.eval_examples(64) # the first 64 eval examples, always the same ones
    state = task.state_dict()         # checkpoint this; task.load_state_dict(state) resumes exactly

Without a held-out split (jsonl/parquet without `data.eval_path`, or `data.arithmetic.eval_size: 0`)
`eval_examples` gives the first train examples instead, in file order: evaluation and the weight-sync
probe still run, on prompts the policy trains on, and `build_task` logs a warning saying so.
"""
from __future__ import annotations

import logging
from typing import Any

from megatron_sparse_rl.config.data import BUILT_IN_SOURCES, DataConfig
from megatron_sparse_rl.data.datasets import PromptStream, encode_prompts, load_prompts
from megatron_sparse_rl.data.types import Example

log = logging.getLogger(__name__)

_SFT_SEED_OFFSET = 1_000_003  # the SFT stream visits the train split in an order unrelated to the RL one


class Task:
    """Train/eval examples of one run and two streams over the train split (RL prompts, SFT examples)."""

    def __init__(self, train: list[Example], eval_: list[Example], *, seed: int = 0, shuffle: bool = True,
                 skipped: int = 0):
        self.train = train
        self.eval = eval_
        self.skipped = skipped  # prompts dropped for length (data.on_long_prompt: skip), both splits
        self._rl = PromptStream(train, 1, seed=seed, shuffle=shuffle)
        self._sft = PromptStream(train, 1, seed=seed + _SFT_SEED_OFFSET, shuffle=shuffle)

    @staticmethod
    def _take(stream: PromptStream, n: int) -> list[Example]:
        if n < 1:
            raise ValueError(f"batch size must be >= 1 (got {n})")
        stream.batch_size = n
        return stream.next_batch()

    def next_train(self, n: int) -> list[Example]:
        """The next n RL prompts (epochs reshuffled from data.seed)."""
        return self._take(self._rl, n)

    def next_sft(self, n: int) -> list[Example]:
        """The next n warm-start examples (train split, its own shuffled order)."""
        return self._take(self._sft, n)

    @property
    def has_held_out(self) -> bool:
        """Whether there is a held-out split; without one `eval_examples` gives train examples."""
        return bool(self.eval)

    def eval_examples(self, n: int | None = None) -> list[Example]:
        """The first n held-out examples (all of them when n is None, <= 0, or more than there are);
        the first n train examples, in file order, when there is no held-out split."""
        pool = self.eval if self.eval else self.train
        return list(pool) if n is None or n <= 0 else pool[:n]

    def state_dict(self) -> dict[str, Any]:
        return {"train": self._rl.state_dict(), "sft": self._sft.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rl.load_state_dict(state["train"])
        self._sft.load_state_dict(state["sft"])


def no_held_out_note(cfg: DataConfig) -> str:
    """What happens when `cfg` has no held-out split (said by `build_task` and `msrl validate`)."""
    why = f"data.{cfg.source}.eval_size is 0" if cfg.source in BUILT_IN_SOURCES else "data.eval_path is unset"
    return (f"{why}: evaluation and the weight-sync probe use the first train prompts, so eval/accuracy "
            "is measured on prompts the policy trains on (not held out)")


def build_task(cfg: DataConfig, tokenizer) -> Task:
    """Load, template and tokenize both splits of `cfg` (see datasets.py for the errors it raises)."""
    train, skipped_train = encode_prompts(load_prompts(cfg, "train"), tokenizer, cfg)
    held_out, skipped_eval = encode_prompts(load_prompts(cfg, "eval"), tokenizer, cfg)
    if not held_out:
        log.warning(no_held_out_note(cfg))
    return Task(train, held_out, seed=cfg.seed, shuffle=cfg.shuffle, skipped=skipped_train + skipped_eval)

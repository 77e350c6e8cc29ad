"""Configuration of the prompt data (section `data`) and of the reward (section `reward`).

Frozen, keyword-only dataclasses with a docstring under every field; each `__post_init__` rejects a
bad value with the dotted path of the field, the rule and the value, e.g.
`ValueError("data.arithmetic.max_digits must be >= min_digits=2 (got 1)")`.
`megatron_sparse_rl.data` consumes `DataConfig`; `megatron_sparse_rl.rewards` consumes `RewardConfig`.
"""
from dataclasses import dataclass, field
from typing import Literal
from megatron_sparse_rl.config.checks import MAX_RECORDS, MAX_SEED, MAX_TOKENS
from megatron_sparse_rl.config.checks import require as _require
from megatron_sparse_rl.config.checks import require_range as _range

ArithmeticOp = Literal["+", "-", "*"]
DataSource = Literal["arithmetic", "chain", "jsonl", "parquet"]
BUILT_IN_SOURCES = ("arithmetic", "chain")
"""The sources generated in-process (no file): each has its own section of `data` named like the source."""
Template = Literal["plain", "chat"]
RewardKind = Literal["exact", "math"]
SCRATCHPAD_ANSWER_MARKER = "so"
"""What precedes the final answer in a worked response ("...,4+2+1=07 so 7633"): the generator writes it,
the reward reads the answer after its last occurrence (`DataConfig.answer_marker`)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ArithmeticConfig:
    """The built-in synthetic task: integer problems like "12+7=" with the answer "19"."""

    ops: tuple[ArithmeticOp, ...] = ("+", "-")
    """Operators drawn uniformly per problem: any of "+", "-", "*"."""
    min_digits: int = 1
    """Fewest digits of an operand (difficulty, low end); 1-digit operands include 0."""
    max_digits: int = 2
    """Most digits of an operand (difficulty, high end); each operand's digit count is uniform in range."""
    negative_results: bool = False
    """Allow "3-12=" (answer "-9"); when false the operands of "-" are ordered so the answer is >= 0."""
    train_size: int = 2000
    """Distinct training problems."""
    eval_size: int = 200
    """Distinct held-out evaluation problems; none of them (nor its commuted twin) appears in train."""
    seed: int = 0
    """Seed of the generator: the same seed and settings give the same problems, in the same order."""
    scratchpad: bool = False
    """Reference responses worked column by column, right to left, e.g. "47+85=" -> "7+5+0=12,4+8+1=13 so 132"
    (each column: the two digits, the carry or borrow in, then the carry or borrow out and the column's digit);
    SFT trains on the whole working, the reward checks only the final answer after "so". Needs ops within
    '+', '-' and negative_results false. The problems drawn are the same as without it."""

    def __post_init__(self) -> None:
        _require(len(self.ops) >= 1 and all(op in ("+", "-", "*") for op in self.ops)
                 and len(set(self.ops)) == len(self.ops),
                 "data.arithmetic.ops", "must be a non-empty tuple of distinct '+', '-', '*'", self.ops)
        _require(1 <= self.min_digits <= 9, "data.arithmetic.min_digits", "must be in [1, 9]", self.min_digits)
        _require(self.min_digits <= self.max_digits <= 9, "data.arithmetic.max_digits",
                 f"must be in [min_digits={self.min_digits}, 9]", self.max_digits)
        _require(self.train_size >= 1, "data.arithmetic.train_size", "must be >= 1", self.train_size)
        _range(self.train_size, "data.arithmetic.train_size", 1, MAX_RECORDS)
        _require(self.eval_size >= 0, "data.arithmetic.eval_size", "must be >= 0", self.eval_size)
        _range(self.eval_size, "data.arithmetic.eval_size", 0, MAX_RECORDS)
        _require(self.seed >= 0, "data.arithmetic.seed", "must be >= 0", self.seed)
        _range(self.seed, "data.arithmetic.seed", 0, MAX_SEED)
        if self.scratchpad:
            _require("*" not in self.ops, "data.arithmetic.ops", "must be within '+', '-' when scratchpad is true",
                     self.ops)
            _require(not self.negative_results, "data.arithmetic.negative_results",
                     "must be false when scratchpad is true", self.negative_results)


@dataclass(kw_only=True, frozen=True, slots=True)
class ChainConfig:
    """The built-in digit-chain task: a shift register over digits written state by state from a start number,
    e.g. "47381=" -> "1:73815,2:38152,...(steps labelled states) so <last state>": each step drops the first digit
    and appends (first + last) mod 10, so the working reads only its last 2 * width + 4 tokens: a long response
    whose dependencies are recent, as in reasoning (see megatron_sparse_rl/data/chain.py)."""

    width: int = 5
    """Digits of the start number and of every state (3..8; 10**width distinct problems)."""
    steps: int = 9
    """States written before the answer, each labelled with its one-digit step number (1..9); a response is
    steps * (width + 3) + width + 4 characters, <eos> included."""
    train_size: int = 20000
    """Distinct training problems."""
    eval_size: int = 200
    """Distinct held-out evaluation problems (none of them appears in train)."""
    seed: int = 0
    """Seed of the generator: the same seed and settings give the same problems, in the same order."""

    def __post_init__(self) -> None:
        _require(3 <= self.width <= 8, "data.chain.width", "must be in [3, 8]", self.width)
        _require(1 <= self.steps <= 9, "data.chain.steps", "must be in [1, 9]", self.steps)
        _require(self.train_size >= 1, "data.chain.train_size", "must be >= 1", self.train_size)
        _range(self.train_size, "data.chain.train_size", 1, MAX_RECORDS)
        _require(self.eval_size >= 0, "data.chain.eval_size", "must be >= 0", self.eval_size)
        _range(self.eval_size, "data.chain.eval_size", 0, MAX_RECORDS)
        _require(2 * (self.train_size + self.eval_size) <= 10 ** self.width, "data.chain.train_size",
                 f"plus eval_size must be at most half of the 10**width = {10 ** self.width} start numbers",
                 self.train_size)
        _require(self.seed >= 0, "data.chain.seed", "must be >= 0", self.seed)
        _range(self.seed, "data.chain.seed", 0, MAX_SEED)


@dataclass(kw_only=True, frozen=True, slots=True)
class DataConfig:
    """Where prompts (and their reference answers) come from, how they are templated and streamed."""

    source: DataSource = "arithmetic"
    """arithmetic or chain (built-in generators, see the sections of those names), jsonl or parquet (files at
    `path`/`eval_path`)."""
    path: str = ""
    """Training prompts file (jsonl: one JSON object per line; parquet: a table); required for jsonl/parquet."""
    eval_path: str = ""
    """Held-out evaluation prompts file in the same format ('' = no evaluation set for jsonl/parquet)."""
    prompt_key: str = "prompt"
    """Field (jsonl key or parquet column) holding the prompt text."""
    answer_key: str = "answer"
    """Field holding the reference answer (a string or a number)."""
    template: Template = "plain"
    """plain: the prompt text as is; chat: the tokenizer's chat template, or "q: {prompt}\\na: " without one."""
    max_prompt_tokens: int = 256
    """Longest templated prompt in tokens (special tokens included)."""
    on_long_prompt: Literal["error", "skip"] = "error"
    """A prompt longer than max_prompt_tokens: error (names the file and line) or skip (counted, logged)."""
    shuffle: bool = True
    """Shuffle the prompt order every epoch (from `seed` and the epoch number; resumable)."""
    seed: int = 0
    """Seed of the per-epoch shuffle of the prompt stream."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """The synthetic arithmetic task (used when source is arithmetic)."""
    chain: ChainConfig = field(default_factory=ChainConfig)
    """The synthetic digit-chain task (used when source is chain)."""

    def __post_init__(self) -> None:
        if self.source not in BUILT_IN_SOURCES:
            _require(bool(self.path), "data.path", f"must be set when data.source is {self.source!r}", self.path)
        _require(bool(self.prompt_key), "data.prompt_key", "must be non-empty", self.prompt_key)
        _require(bool(self.answer_key), "data.answer_key", "must be non-empty", self.answer_key)
        _require(self.prompt_key != self.answer_key, "data.answer_key",
                 f"must differ from data.prompt_key={self.prompt_key!r}", self.answer_key)
        _require(self.max_prompt_tokens >= 1, "data.max_prompt_tokens", "must be >= 1", self.max_prompt_tokens)
        _range(self.max_prompt_tokens, "data.max_prompt_tokens", 1, MAX_TOKENS)
        _require(self.seed >= 0, "data.seed", "must be >= 0", self.seed)
        _range(self.seed, "data.seed", 0, MAX_SEED)

    @property
    def answer_marker(self) -> str:
        """What the final answer follows in a response: `SCRATCHPAD_ANSWER_MARKER` for the worked tasks (scratchpad
        arithmetic, the digit chain), '' (the answer is the whole first line) otherwise. The trainer hands it to
        the reward."""
        worked = self.source == "chain" or (self.source == "arithmetic" and self.arithmetic.scratchpad)
        return SCRATCHPAD_ANSWER_MARKER if worked else ""


@dataclass(kw_only=True, frozen=True, slots=True)
class RewardConfig:
    """How a response is scored against the reference answer (see megatron_sparse_rl.rewards)."""

    kind: RewardKind = "exact"
    """exact: the answer text (up to <eos>/newline, stripped; after the data's answer marker when it has one, see
    `DataConfig.answer_marker`) equals the reference; math: equivalence
    through math-verify (falls back to exact-or-numeric equality, with a warning, when not installed)."""
    partial_credit: float = 0.0
    """Weight in [0, 1) of digit-level partial credit for a wrong answer: it scores
    partial_credit * (fraction of the reference's characters matched, aligned from the right). 0 = off."""
    format_penalty: float = 0.0
    """Subtracted from the score of a response whose answer text is empty (>= 0; 0 = off)."""

    def __post_init__(self) -> None:
        _require(0.0 <= self.partial_credit < 1.0, "reward.partial_credit", "must be in [0, 1)", self.partial_credit)
        _require(self.format_penalty >= 0.0, "reward.format_penalty", "must be >= 0", self.format_penalty)

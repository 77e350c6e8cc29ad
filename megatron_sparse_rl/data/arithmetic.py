"""The built-in verifiable task: multi-digit integer arithmetic ("12+7=" -> "19").

Problems are drawn from `random.Random(cfg.seed)`: an operator uniformly from `cfg.ops`, then each
operand's digit count uniformly in [min_digits, max_digits] (so easy and hard problems are balanced),
then the operand uniformly among the numbers with that many digits (1 digit includes 0). Duplicates are
dropped, where "12+7" and "7+12" (and the same for "*") count as one problem. The first `eval_size`
distinct problems form the held-out eval split and the next `train_size` the train split, so the two
are disjoint and the eval split does not depend on `train_size`.

Prompts and answers use only digits, "+-*=" (all in the character tokenizer's alphabet); the model is
to emit the answer and then <eos>.

With `cfg.scratchpad` the same problems get a worked reference response (`Prompt.solution`, what SFT trains
on), one fixed-width step per column from the right, the shorter operand padded with 0, then the answer after
"so": "4738+2895=" -> "8+5+0=13,3+9+1=13,7+8+1=16,4+2+1=07 so 7633". A step "x op y op c=oz" reads: digits x
and y of the column, carry (or borrow) c in; carry (or borrow) o out and the column's digit z, so x+y+c = 10o+z
(x-y-c = z-10o). Every step needs two digits from the prompt, so dropping prompt entries from the KV cache
hurts; 6-9 digit operands give 59-95-token responses. `Prompt.answer` stays the bare result the reward checks.

    python -c "from megatron_sparse_rl.data.arithmetic import generate; \
from megatron_sparse_rl.config.data import ArithmeticConfig; print(generate(ArithmeticConfig())[1][:3])"
"""
from __future__ import annotations

import random

from megatron_sparse_rl.config.data import SCRATCHPAD_ANSWER_MARKER, ArithmeticConfig
from megatron_sparse_rl.data.types import Prompt


def solve(a: int, op: str, b: int) -> int:
    """The value of `a op b` for op in "+", "-", "*"."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown arithmetic operator {op!r}; choose one of '+', '-', '*'")


def _operand_count(cfg: ArithmeticConfig) -> int:
    lo = 0 if cfg.min_digits == 1 else 10 ** (cfg.min_digits - 1)
    return 10 ** cfg.max_digits - lo


def problem_space_size(cfg: ArithmeticConfig) -> int:
    """Number of distinct problems the settings allow (commuted twins counted once)."""
    n = _operand_count(cfg)
    unordered = n * (n + 1) // 2
    return sum(n * n if (op == "-" and cfg.negative_results) else unordered for op in cfg.ops)


def _operand(rng: random.Random, digits: int) -> int:
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(lo, 10 ** digits - 1)


def _draw(rng: random.Random, cfg: ArithmeticConfig) -> tuple[int, str, int]:
    op = rng.choice(cfg.ops)
    a = _operand(rng, rng.randint(cfg.min_digits, cfg.max_digits))
    b = _operand(rng, rng.randint(cfg.min_digits, cfg.max_digits))
    if op == "-" and not cfg.negative_results and a < b:
        a, b = b, a
    return a, op, b


def _key(a: int, op: str, b: int) -> tuple[str, int, int]:
    # "+" and "*" commute: "7+12" is the same problem as "12+7", so it may not sit in both splits.
    return (op, min(a, b), max(a, b)) if op in "+*" else (op, a, b)


def worked_solution(a: int, op: str, b: int) -> str:
    """The scratchpad response of `a op b` for op "+" or "-" (a >= b): column steps, then "so" and the result."""
    if op not in "+-" or (op == "-" and a < b):
        raise ValueError(f"a scratchpad is worked for '+' and for '-' with a >= b only (got {a}{op}{b})")
    width = max(len(str(a)), len(str(b)))
    steps, carry = [], 0
    for x, y in zip(map(int, reversed(str(a).zfill(width))), map(int, reversed(str(b).zfill(width)))):
        value = x + y + carry if op == "+" else x - y - carry
        out, digit = divmod(value, 10) if op == "+" else (int(value < 0), value % 10)
        steps.append(f"{x}{op}{y}{op}{carry}={out}{digit}")
        carry = out
    return f"{','.join(steps)} {SCRATCHPAD_ANSWER_MARKER} {solve(a, op, b)}"


def make_prompt(a: int, op: str, b: int, *, scratchpad: bool = False) -> Prompt:
    """The `Prompt` of one problem: text "a op b =", answer the decimal result (and, with `scratchpad`, the
    worked solution)."""
    return Prompt(text=f"{a}{op}{b}=", answer=str(solve(a, op, b)),
                  difficulty=max(len(str(a)), len(str(b))), source="arithmetic",
                  solution=worked_solution(a, op, b) if scratchpad else "")


def generate(cfg: ArithmeticConfig) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) splits: deterministic from `cfg`, disjoint, each free of duplicates.

    Raises ValueError when the settings allow too few distinct problems (the sum of the split sizes
    may be at most half of `problem_space_size`, which keeps the sampler fast and the splits varied).
    """
    total = cfg.train_size + cfg.eval_size
    space = problem_space_size(cfg)
    if 2 * total > space:
        raise ValueError(
            f"data.arithmetic.train_size + eval_size = {total} is more than half of the {space} distinct "
            f"problems that ops={cfg.ops}, digits {cfg.min_digits}..{cfg.max_digits} allow; "
            f"raise data.arithmetic.max_digits or lower the sizes")
    rng = random.Random(cfg.seed)
    seen: set[tuple[str, int, int]] = set()
    problems: list[Prompt] = []
    attempts = 0
    while len(problems) < total:
        attempts += 1
        if attempts > 100 * total + 10_000:  # only when the low-digit buckets are nearly exhausted
            raise ValueError(f"data.arithmetic: could not draw {total} distinct problems in {attempts - 1} "
                             f"tries; raise data.arithmetic.max_digits or lower the sizes")
        a, op, b = _draw(rng, cfg)
        key = _key(a, op, b)
        if key in seen:
            continue
        seen.add(key)
        problems.append(make_prompt(a, op, b, scratchpad=cfg.scratchpad))
    return problems[cfg.eval_size:], problems[:cfg.eval_size]

"""The built-in digit-chain task: a long worked response whose every step reads recent tokens only.

A problem is a start number of `cfg.width` digits (leading zeros kept), e.g. "47381=". The response writes
`cfg.steps` states, each labelled with its step number and made from the one before by one rule, then the last
state again after "so":

    "47381=" -> "1:73815,2:38152,3:81525,4:15253,5:52534,6:25349,7:53491,8:34916,9:49169 so 49169"   (steps 9)

A step drops the first digit of the state and appends (first digit + last digit) mod 10 (a shift register over
the digits mod 10; a bijection of the 10**width states). Over the digits it appends alone this is the
lagged-Fibonacci sequence d[t] = (d[t-1] + d[t-width]) mod 10 seeded with the start digits, written as a sliding
window: per state, a label one more than the last, width - 1 copies of the digit width + 2 tokens before, and one
addition of two digits of the state before. The label says when to stop (after the state labelled `steps`), so the
working depends on its last 2 * width + 4 tokens only, never on the prompt after the first state nor on how many
states came before: unlike the column scratchpad of the arithmetic task (which re-reads two prompt digits per
column), a KV cache that keeps the recent entries can keep this task right, and what compression perturbs is
everything else the model attends to, as in long reasoning rollouts.
`Prompt.answer` is the last state (what the reward checks, after the "so" marker); `Prompt.solution` the whole
working (what SFT trains on). Start numbers are drawn without repeats from `random.Random(cfg.seed)`: the first
`eval_size` are the held-out split, the next `train_size` the train split.

    python -c "from megatron_sparse_rl.data.chain import generate; \
from megatron_sparse_rl.config.data import ChainConfig; print(generate(ChainConfig())[1][:2])"
"""
from __future__ import annotations

import random

from megatron_sparse_rl.config.data import SCRATCHPAD_ANSWER_MARKER, ChainConfig
from megatron_sparse_rl.data.types import Prompt


def next_state(state: str) -> str:
    """One step of the rule: drop the first digit, append (first digit + last digit) mod 10."""
    return state[1:] + str((int(state[0]) + int(state[-1])) % 10)


def worked_chain(start: str, steps: int) -> str:
    """The response for `start`: `steps` states labelled "k:" (k = 1..steps) joined by commas, then "so" and the
    last state."""
    states, state = [], start
    for k in range(1, steps + 1):
        state = next_state(state)
        states.append(f"{k}:{state}")
    return f"{','.join(states)} {SCRATCHPAD_ANSWER_MARKER} {state}"


def make_prompt(start: str, steps: int) -> Prompt:
    """The `Prompt` of one problem: text "start=", the worked chain as solution, its last state as answer."""
    solution = worked_chain(start, steps)
    return Prompt(text=f"{start}=", answer=solution.rsplit(" ", 1)[1], difficulty=steps, source="chain",
                  solution=solution)


def generate(cfg: ChainConfig) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) splits: deterministic from `cfg`, disjoint, each free of duplicates (the config checks that
    the two splits fit in half of the 10**width start numbers)."""
    starts = random.Random(cfg.seed).sample(range(10 ** cfg.width), cfg.eval_size + cfg.train_size)
    problems = [make_prompt(str(s).zfill(cfg.width), cfg.steps) for s in starts]
    return problems[cfg.eval_size:], problems[:cfg.eval_size]

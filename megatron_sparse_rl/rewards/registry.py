"""Reward registry keyed by `RewardConfig.kind`, batch scoring, and the configured scorer.

    score("exact", ["19<eos>", "20"], ["19", "19"])      # [1.0, 0.0]
    marker = run.data.answer_marker                      # "so" for scratchpad arithmetic, else ""
    scorer = make_scorer(run.reward, answer_marker=marker)                 # responses, answers -> rewards
    correct = make_scorer(run.reward, shaping=False, answer_marker=marker)  # 1.0/0.0 correctness, for accuracy
"""
from __future__ import annotations

from typing import Callable, Sequence

from megatron_sparse_rl.config.data import RewardConfig
from megatron_sparse_rl.rewards.exact import digit_overlap, exact_answer, extract_answer
from megatron_sparse_rl.rewards.math_equiv import math_scorer

RewardFn = Callable[[str, str], float]
# A factory per kind, so that picking the math fallback (and its warning) happens when a scorer is built.
REWARDS: dict[str, Callable[[], RewardFn]] = {
    "exact": lambda: exact_answer,
    "math": math_scorer,
}


def reward_fn(kind: str) -> RewardFn:
    """The per-response function `(response, answer) -> float in {0, 1}` of `kind`."""
    if kind not in REWARDS:
        raise ValueError(f"reward.kind: {kind!r} is not allowed; choose one of {', '.join(map(repr, REWARDS))}")
    return REWARDS[kind]()


def _check_lengths(responses: Sequence[str], answers: Sequence[str]) -> None:
    if len(responses) != len(answers):
        raise ValueError(f"score: {len(responses)} responses but {len(answers)} answers")


def score(kind: str, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Correctness (1.0 or 0.0) of each response against its answer, under reward `kind`."""
    _check_lengths(responses, answers)
    fn = reward_fn(kind)
    return [fn(r, a) for r, a in zip(responses, answers)]


def make_scorer(cfg: RewardConfig, *, shaping: bool = True,
                answer_marker: str = "") -> Callable[[Sequence[str], Sequence[str]], list[float]]:
    """`(responses, answers) -> rewards` for `cfg`: correctness, plus (when `shaping`) partial credit for a
    wrong answer and the format penalty for an empty one. With shaping=False it is 1.0/0.0 correctness.

    `answer_marker` (the data's `DataConfig.answer_marker`): when set, each response is first cut to its answer
    text after the marker (`extract_answer`), so every kind, partial credit and the penalty see only the final
    answer; a response without the marker has an empty answer. '' scores the responses as they are.
    The scorer pickles as its settings (a disaggregated run's rollout ranks score episodes with it)."""
    return Scorer(cfg, shaping, answer_marker)


class Scorer:
    """The configured scorer (`make_scorer`); pickled, it is built again from `cfg`, `shaping`, `answer_marker`."""

    def __init__(self, cfg: RewardConfig, shaping: bool, answer_marker: str):
        self.cfg, self.shaping, self.answer_marker = cfg, shaping, answer_marker
        self.fn = reward_fn(cfg.kind)
        self.partial = cfg.partial_credit if shaping else 0.0
        self.penalty = cfg.format_penalty if shaping else 0.0

    def __reduce__(self):
        return Scorer, (self.cfg, self.shaping, self.answer_marker)

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        _check_lengths(responses, answers)
        if self.answer_marker:
            responses = [extract_answer(r, self.answer_marker) for r in responses]
        out = []
        for r, a in zip(responses, answers):
            value = self.fn(r, a)
            if value < 1.0 and self.partial:
                value = self.partial * digit_overlap(r, a)
            if self.penalty and not extract_answer(r):
                value -= self.penalty
            out.append(value)
        return out

"""The environment interface of multi-turn episodes.

An `Environment` is one episode's counterpart, made fresh for every episode:

    env = make()                      # a new environment for one episode
    first = env.reset(example)        # the first observation: the prompt (token ids or text)
    result = env.step(turn_text)      # the model's turn (decoded) -> observation, reward, done, tool counts

The limits (`max_turns`, `max_total_tokens`) are enforced by whoever runs the episode (rollout/multi_turn.py), from
the `env` config section, so that no environment can forget them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Union

Observation = Union[str, tuple[int, ...]]
"""What the environment shows the model: text (encoded by the episode runner as text: no special tokens added, and a
special-token string in it, "<eos>" or "<|im_end|>", stays characters) or token ids (used as they are; an
environment that needs a chat template's special tokens gives ids, envs/tool_env.py)."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one environment step gives back after a model turn."""

    observation: Observation
    """Appended to the sequence before the next model turn (ignored when `done`)."""
    reward: float
    """The reward of this step; an episode's reward is the sum over its steps."""
    done: bool
    """Whether the episode is over (no observation follows)."""
    tool_calls: int = 0
    """Tool calls the turn made."""
    tool_errors: int = 0
    """Of those, the calls that failed (unknown tool, arguments the tool refused, a tool that raised, returned what is
    not text or timed out)."""
    tool_timeouts: int = 0
    """Of the failed calls, those that timed out (env.tool_timeout_s)."""


class Environment(ABC):
    """One episode's environment: `reset` once, then `step` after every model turn until a result says done."""

    @abstractmethod
    def reset(self, sample: Any) -> Observation:
        """Start the episode for `sample` (a data.types.Example) and give the first observation (the prompt)."""

    @abstractmethod
    def step(self, turn: str) -> StepResult:
        """The model's turn `turn` (decoded text, special tokens dropped) -> the environment's answer."""

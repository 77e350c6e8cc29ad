"""Configuration of the environment of multi-turn episodes (section `env`).

`env.kind: none` (the default) keeps rollouts single-turn: one prompt, one sampled response. Any other kind makes
every rollout an episode (megatron_sparse_rl/envs, rollout/multi_turn.py): the model's turn is sampled, the
environment answers with an observation, and so on until the environment says done, `max_turns` model turns were
sampled, or the episode reached `max_total_tokens`. Whether each named tool exists is checked by `validate`
(validation/validate.py), against the tool registry of megatron_sparse_rl/envs/tools.py. A tool is untrusted code: one
that raises, returns what is not text or does not answer within `tool_timeout_s` gives the episode an error
observation and counts a tool error (envs/tools.py `call_tool`).
"""
import math
import warnings
from dataclasses import dataclass
from typing import Literal

from megatron_sparse_rl.config.checks import MAX_TOKENS
from megatron_sparse_rl.config.checks import require as _require
from megatron_sparse_rl.config.checks import require_range as _range

EnvKind = Literal["none", "tools"]
MAX_TURNS = 4096
"""The most model turns of an episode (agentic runs use tens to hundreds; each turn adds at least one token)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class EnvConfig:
    """The environment a rollout talks to, turn by turn."""

    kind: EnvKind = "none"
    """none: single-turn rollouts (no environment); tools: the model may call the tools of `tools` by writing one
    line `name(arguments)`; the tool's result comes back as a `tool` message of the chat template, and a line that
    calls no tool is the final answer, rewarded against the reference (envs/tool_env.py)."""
    tools: tuple[str, ...] = ("calc",)
    """Tools the model may call, by registered name (megatron_sparse_rl/envs/tools.py: calc)."""
    max_turns: int = 3
    """Most model turns of one episode (1 to 4096); an episode still calling tools after them ends unrewarded."""
    max_total_tokens: int = 96
    """Most tokens an episode adds after its first prompt, model turns and observations together (1 to 16777216); a
    turn is sampled with at most what is left (and at most rollout.sampling.max_tokens), and an observation that
    would pass the limit ends the episode unrewarded."""
    turn_stop: tuple[str, ...] = ("\n",)
    """Stop strings that end a model turn (besides <eos>); the turn's tokens up to and including the one that holds
    the stop string stay in the sequence."""
    tool_timeout_s: float = 10.0
    """Seconds a tool call may take (> 0, finite); a call still running then answers the model "error: ..." and
    counts as a tool error and a tool timeout (episode/tool_timeouts). The call's thread cannot be stopped: it is
    left running as a daemon thread (envs/tools.py `call_tool`)."""

    def __post_init__(self) -> None:
        _require(self.max_turns >= 1, "env.max_turns", "must be >= 1: an episode samples at least one model turn",
                 self.max_turns)
        _range(self.max_turns, "env.max_turns", 1, MAX_TURNS)
        _require(self.max_total_tokens >= 1, "env.max_total_tokens", "must be >= 1", self.max_total_tokens)
        _range(self.max_total_tokens, "env.max_total_tokens", 1, MAX_TOKENS)
        _require(len(set(self.tools)) == len(self.tools), "env.tools", "must not name a tool twice", self.tools)
        _require(self.kind == "none" or bool(self.tools), "env.tools",
                 f"must name at least one tool when env.kind is {self.kind!r}", self.tools)
        _require(self.tool_timeout_s > 0 and math.isfinite(self.tool_timeout_s), "env.tool_timeout_s",
                 "must be > 0 and finite: a tool call needs a bound", self.tool_timeout_s)
        _require(all(bool(s) for s in self.turn_stop), "env.turn_stop", "must hold non-empty strings",
                 self.turn_stop)

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are multi-turn episodes (an environment is configured)."""
        return self.kind != "none"

    @property
    def episodes(self) -> bool:
        """Deprecated alias of `multi_turn` (to be removed after one release)."""
        warnings.warn("EnvConfig.episodes is deprecated: use EnvConfig.multi_turn", DeprecationWarning, stacklevel=2)
        return self.multi_turn

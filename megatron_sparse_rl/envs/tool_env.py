"""The built-in tool environment (`env.kind: tools`): the model calls tools by writing one line `name(arguments)`.

Turn by turn: a turn whose text (stripped) reads `name(arguments)` with `name` a lowercase identifier is a tool call.
A tool of `env.tools` answers with its result; an unknown name, refused arguments or a tool that fails (raises,
returns what is not text, or has not answered after `env.tool_timeout_s`: envs/tools.py `call_tool`) answer
"error: ..." and count a tool error (a timeout also a tool timeout). The answer goes back as a `tool` message of the
chat template followed by the generation prompt (data/templates.py `tool_observation`), as token ids: the result is
tokenized as text, so a special-token string in it is characters, and only the template's own tokens are special.
The episode goes on. Any other turn is the final answer: the episode
ends with `score(answer text, reference answer)` as its reward. Running out of turns or tokens ends it unrewarded
(rollout/multi_turn.py).

With the character tokenizer an episode of the calc task reads:
    <bos>q: 47382*5821=\\na: calc(47382*5821)\\nr: 275810622\\na: 275810622\\n
model turns after each "a: ", environment tokens "r: ...\\na: " between them.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from megatron_sparse_rl.data.templates import encode_pieces, tool_observation
from megatron_sparse_rl.envs.base import Environment, Observation, StepResult
from megatron_sparse_rl.envs.tools import ToolError, ToolTimeout, call_tool

_CALL = re.compile(r"^([a-z][a-z0-9_]*)\((.*)\)$", re.S)


def exact_score(text: str, answer: str) -> float:
    """1.0 when the stripped answer text equals the reference, else 0.0."""
    return float(text.strip() == answer.strip())


class ToolEnv(Environment):
    """Tool calls by name, the final answer scored against the sample's reference answer.

    Args:
        tools: the tool names the model may call (registered in envs/tools.py).
        observe: the observation of a tool's result text (data/templates.py `tool_observation` bound to a
            tokenizer): the chat template's tool message followed by the generation prompt.
        score: (final answer text, reference answer) -> reward.
        timeout_s: seconds a tool call may take (env.tool_timeout_s).
    """

    def __init__(self, tools: Sequence[str], observe: Callable[[str], Observation],
                 score: Callable[[str, str], float] = exact_score, *, timeout_s: float = 10.0):
        self.tools = tuple(tools)
        self.observe = observe
        self.score = score
        self.timeout_s = timeout_s
        self.answer: str | None = None

    def reset(self, sample) -> Observation:
        self.answer = sample.answer
        return tuple(sample.ids)

    def step(self, turn: str) -> StepResult:
        if self.answer is None:
            raise RuntimeError("ToolEnv.step before reset")
        text = turn.strip()
        call = _CALL.match(text)
        if call is None:
            return StepResult(observation="", reward=self.score(text, self.answer), done=True)
        name, arguments = call.group(1), call.group(2)
        errors = timeouts = 0
        try:
            if name not in self.tools:
                raise ToolError(f"no tool {name}")
            result = call_tool(name, arguments, timeout_s=self.timeout_s)
        except ToolError as e:
            result, errors, timeouts = f"error: {e}", 1, int(isinstance(e, ToolTimeout))
        return StepResult(observation=self.observe(result), reward=0.0, done=False, tool_calls=1, tool_errors=errors,
                          tool_timeouts=timeouts)


def environment_factory(cfg, tokenizer, score: Callable[[str, str], float] = exact_score
                        ) -> Callable[[], Environment]:
    """A function making one fresh environment of the `env` section `cfg` (config/env.py EnvConfig) per episode:
    kind tools -> `ToolEnv` with `cfg.tools` and `cfg.tool_timeout_s`, tool results rendered by `tokenizer`'s chat
    template and encoded as token ids, the result as text (data/templates.py `encode_pieces`)."""
    if cfg.kind != "tools":
        raise ValueError(f"env.kind = {cfg.kind!r} has no environment to make (choose 'tools')")
    suffix = tool_observation(tokenizer, "\0")  # the template around a result, rendered once
    head, tail = suffix.split("\0")

    def observe(result: str) -> Observation:
        return tuple(encode_pieces(tokenizer, [(head, False), (result, True), (tail, False)]))

    return lambda: ToolEnv(cfg.tools, observe, score, timeout_s=cfg.tool_timeout_s)

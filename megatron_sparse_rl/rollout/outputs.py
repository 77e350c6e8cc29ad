"""What `RolloutEngine` (rollout/engine.py) makes of vLLM's request outputs: the rows of a generate call
(`sample_rows`), each sampled token's logprob (`sampled_logprobs`), and one sampled turn of an episode
(`SampledTurn`, what `RolloutEngine.sample_turns` returns)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class SampledTurn:
    """One sampled turn of an episode (`RolloutEngine.sample_turns`)."""

    token_ids: list[int]
    """The sampled tokens (a stop string's token included)."""
    logprobs: list[float]
    """The sampled tokens' logprobs (RolloutConfig.logprobs_mode)."""
    finish_reason: str
    """stop (EOS or a stop string), length (max_tokens) or abort."""
    cached_tokens: int
    """Prompt tokens whose KV came from vLLM's prefix cache (not prefilled again)."""
    records: dict[str, Any] = field(default_factory=dict)
    """What the engine's extensions keep of the sequence so far (prompt + this turn): "routed_experts" (a
    one-sequence RouteStore, R3 route capture), "sampling_mask" (a one-row SamplingSupport), "kv_keep" (the
    episode's KVKeepRecord, sparse KV); empty without them."""
    token_version: list[int] = field(default_factory=list)
    """The weight version that sampled each token (weights loaded during the turn: `update_in_flight`)."""


def sample_rows(outputs, prompt_token_ids: list[list[int]], gids: list[int]) -> tuple[list, ...]:
    """Per row of vLLM's `outputs` (the n samples of prompt i consecutive): prompt, response, sampled logprobs,
    finish reason, group id and (output request id, sample index)."""
    prompts, responses, logprobs, reasons, groups, samples = [], [], [], [], [], []
    for out, prompt, gid in zip(outputs, prompt_token_ids, gids):
        for c in sorted(out.outputs, key=lambda c: c.index):
            samples.append((out.request_id, c.index))
            prompts.append(list(prompt))
            responses.append(list(c.token_ids))
            logprobs.append(sampled_logprobs(c.token_ids, c.logprobs))
            reasons.append(c.finish_reason or "abort")
            groups.append(gid)
    return prompts, responses, logprobs, reasons, groups, samples


def sampled_logprobs(token_ids, logprobs) -> list[float]:
    """The sampled token's logprob at each step from vLLM's logprobs=0 output."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {0 if logprobs is None else len(logprobs)} logprob entries for "
                           f"{len(token_ids)} tokens")
    return [step[tok].logprob for tok, step in zip(token_ids, logprobs)]

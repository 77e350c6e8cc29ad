"""The engine side of one RL step: encode prompts, sample with the rollout engine, score the responses,
and greedy evaluation on held-out prompts."""
from __future__ import annotations

import dataclasses

import torch

from megatron_sparse_rl.config.rollout import SamplingConfig
from megatron_sparse_rl.rollout.batch import RolloutBatch


def decode(tokenizer, rows: list[list[int]]) -> list[str]:
    return [tokenizer.decode(r, skip_special_tokens=True) for r in rows]


def collect(engine, tokenizer, examples, sampling: SamplingConfig, *, seed: int, score, correct
            ) -> tuple[RolloutBatch, torch.Tensor]:
    """n samples for each example; rewards filled by `score(responses, answers)`. Also returns which samples
    are correct by `correct(responses, answers)` (the unshaped reward)."""
    sampling = dataclasses.replace(sampling, seed=seed)
    batch = engine.generate([list(e.ids) for e in examples], sampling)
    answers = [examples[g].answer for g in batch.group_ids.tolist()]
    texts = decode(tokenizer, batch.responses())
    batch.reward = torch.tensor(score(texts, answers), dtype=torch.float32)
    return batch, torch.tensor(correct(texts, answers), dtype=torch.float32)


def greedy_accuracy(engine, tokenizer, examples, *, max_tokens: int, score) -> tuple[float, int]:
    """(sum of rewards, count) of greedy answers on `examples`."""
    if not examples:
        return 0.0, 0
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=max_tokens, seed=0)
    batch = engine.generate([list(e.ids) for e in examples], greedy)
    rewards = score(decode(tokenizer, batch.responses()), [e.answer for e in examples])
    return float(sum(rewards)), len(rewards)

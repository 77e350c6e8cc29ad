"""The engine side of one RL step: encode prompts, sample with the rollout engine, score the responses,
and greedy evaluation on held-out prompts. With an environment (`env.kind`) every sample is a multi-turn episode
(`collect_episodes`, rollout/episodes.py) rewarded by the environment on its final answer."""
from __future__ import annotations

import dataclasses

import torch

from megatron_sparse_rl.config.env import EnvConfig
from megatron_sparse_rl.config.rollout import SamplingConfig
from megatron_sparse_rl.envs.tool_env import environment_factory
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.rollout.episodes import final_turns, run_episodes


def decode(tokenizer, rows: list[list[int]]) -> list[str]:
    return [tokenizer.decode(r, skip_special_tokens=True) for r in rows]


def collect(engine, tokenizer, examples, sampling: SamplingConfig, *, seed: int, score, correct, rescore: int = 0
            ) -> tuple[RolloutBatch, torch.Tensor]:
    """n samples for each example; rewards filled by `score(responses, answers)`. Also returns which samples
    are correct by `correct(responses, answers)` (the unshaped reward). `rescore` > 0: each sampled sequence is
    also scored that many times by the engine (algorithm.old_logprobs = engine_mean)."""
    prompts, sampling, group_ids, rescore = request(examples, sampling, seed=seed, rescore=rescore)
    batch = engine.generate(prompts, sampling, group_ids, rescore=rescore)
    return scored(batch, tokenizer, examples, score=score, correct=correct)


def request(examples, sampling: SamplingConfig, *, seed: int, rescore: int = 0) -> tuple:
    """The engine call of `collect`: (prompt ids, sampling, group ids (None: the prompt index), rescore)."""
    return [list(e.ids) for e in examples], dataclasses.replace(sampling, seed=seed), None, rescore


def scored(batch: RolloutBatch, tokenizer, examples, *, score, correct) -> tuple[RolloutBatch, torch.Tensor]:
    """`collect`'s second half: `batch` (sampled for `examples`) with its rewards, and which samples are correct."""
    answers = [examples[g].answer for g in batch.group_ids.tolist()]
    texts = decode(tokenizer, batch.responses())
    batch.reward = torch.tensor(score(texts, answers), dtype=torch.float32)
    return batch, torch.tensor(correct(texts, answers), dtype=torch.float32)


def collect_episodes(engine, tokenizer, examples, sampling: SamplingConfig, env: EnvConfig, *, seed: int, score,
                     correct, rescore: int = 0) -> tuple[RolloutBatch, torch.Tensor]:
    """`collect` for multi-turn episodes: `sampling.n` episodes per example, each rewarded by its environment with
    `score` of its final answer; correct = `correct` of the final turn of the episodes the environment ended (an
    episode out of turns or tokens is not). `rescore` > 0 (algorithm.old_logprobs = engine_mean): every finished
    episode is also scored that many times by the engine, as one sequence (its environment tokens too; the loss
    mask drops those)."""
    make = environment_factory(env, tokenizer, lambda text, answer: float(score([text], [answer])[0]))
    batch = run_episodes(engine, tokenizer, examples, dataclasses.replace(sampling, seed=seed), env, make)
    if rescore:
        batch.rescored_logprobs = engine.rescore(batch, rescore)
    answers = [examples[g].answer for g in batch.group_ids.tolist()]
    right = correct(decode(tokenizer, final_turns(batch)), answers)
    ended = [float(r == "stop") for r in batch.finish_reasons]
    return batch, torch.tensor(right, dtype=torch.float32) * torch.tensor(ended)


def accuracy(engine, tokenizer, examples, *, max_tokens: int, score, temperature: float, samples: int,
             seed: int = 0, env: EnvConfig | None = None) -> tuple[float, int]:
    """(sum of correctness, count) on `examples`: `samples` samples per prompt at `temperature` (one
    greedy answer when temperature is 0); with an environment `env`, episodes judged on their final answer."""
    if not examples:
        return 0.0, 0
    n = 1 if temperature == 0 else samples
    params = SamplingConfig(n=n, temperature=temperature, max_tokens=max_tokens, seed=seed)
    if env is not None and env.episodes:
        _, right = collect_episodes(engine, tokenizer, examples, params, env, seed=seed, score=score, correct=score)
        return float(right.sum()), len(right)
    batch = engine.generate([list(e.ids) for e in examples], params)
    answers = [examples[g].answer for g in batch.group_ids.tolist()]
    rewards = score(decode(tokenizer, batch.responses()), answers)
    return float(sum(rewards)), len(rewards)

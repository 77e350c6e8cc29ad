"""The engine side of one RL step: encode prompts, sample with the rollout engine, score the responses,
and greedy evaluation on held-out prompts. With an environment (`env.kind`) every sample is a multi-turn episode
(`collect_episodes`, rollout/episodes.py) rewarded by the environment on its final answer: the engine call carries
an `Episodes` (examples, env section, reward), which runs where the engine runs (a rollout rank, in a disaggregated
run), so the rewards come back in the batch; which episodes are correct is judged here."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_sparse_rl.config.env import EnvConfig
from megatron_sparse_rl.config.rollout import SamplingConfig
from megatron_sparse_rl.data.datasets import load_tokenizer
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
    prompts, sampling, group_ids, rescore, _ = request(examples, sampling, seed=seed, rescore=rescore)
    batch = engine.generate(prompts, sampling, group_ids, rescore=rescore)
    return scored(batch, tokenizer, examples, score=score, correct=correct)


def request(examples, sampling: SamplingConfig, *, seed: int, rescore: int = 0) -> tuple:
    """The engine call of `collect`: (prompt ids, sampling, group ids (None: the prompt index), rescore, episodes
    (None: single-turn samples; `episode_request` gives the `Episodes`)), as `engine.generate` takes them."""
    return [list(e.ids) for e in examples], dataclasses.replace(sampling, seed=seed), None, rescore, None


def scored(batch: RolloutBatch, tokenizer, examples, *, score, correct) -> tuple[RolloutBatch, torch.Tensor]:
    """`collect`'s second half: `batch` (sampled for `examples`) with its rewards, and which samples are correct."""
    answers = [examples[g].answer for g in batch.group_ids.tolist()]
    texts = decode(tokenizer, batch.responses())
    batch.reward = torch.tensor(score(texts, answers), dtype=torch.float32)
    return batch, torch.tensor(correct(texts, answers), dtype=torch.float32)


@dataclass(frozen=True)
class Episodes:
    """What an engine needs to run a generate call's samples as multi-turn episodes (env.kind): the examples
    (`env.reset`'s samples, one per prompt), the `env` section and the reward `score(responses, answers)` the
    environment gives the final answer. Picklable when `score` is (rewards/registry.py's scorer is): a
    disaggregated run sends it to the rollout ranks, which run the episodes and their rewards there. Handed to
    `engine.generate(..., episodes=...)`, which calls `run`."""

    examples: tuple
    env: EnvConfig
    score: Callable

    def run(self, engine, sampling: SamplingConfig, group_ids=None, *, between_steps=None, tokenizer=None
            ) -> RolloutBatch:
        """`sampling.n` episodes per example on the in-process `engine` (rollout/episodes.py `run_episodes`), with
        `tokenizer` (None: the one in the engine's model directory, loaded once per process)."""
        tokenizer = _tokenizer(str(engine.model_dir)) if tokenizer is None else tokenizer
        make = environment_factory(self.env, tokenizer, lambda text, answer: float(self.score([text], [answer])[0]))
        return run_episodes(engine, tokenizer, self.examples, sampling, self.env, make, group_ids,
                            between_steps=between_steps)

    def select(self, rows: range) -> "Episodes":
        """The episodes of examples `rows` (one engine's part of a call)."""
        return dataclasses.replace(self, examples=tuple(self.examples[i] for i in rows))


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    return load_tokenizer(model_dir)


def collect_episodes(engine, tokenizer, examples, sampling: SamplingConfig, env: EnvConfig, *, seed: int, score,
                     correct, rescore: int = 0) -> tuple[RolloutBatch, torch.Tensor]:
    """`collect` for multi-turn episodes: `sampling.n` episodes per example, each rewarded by its environment with
    `score` of its final answer; correct = `correct` of the final turn of the episodes the environment ended (an
    episode out of turns or tokens is not). `rescore` > 0 (algorithm.old_logprobs = engine_mean): every finished
    episode is also scored that many times by the engine, as one sequence (its environment tokens too; the loss
    mask drops those)."""
    prompts, sampling, group_ids, rescore, episodes = episode_request(examples, sampling, env, score, seed=seed,
                                                                      rescore=rescore)
    batch = engine.generate(prompts, sampling, group_ids, rescore=rescore, episodes=episodes)
    return episodes_scored(batch, tokenizer, examples, correct=correct)


def episode_request(examples, sampling: SamplingConfig, env: EnvConfig, score, *, seed: int, rescore: int = 0
                    ) -> tuple:
    """The engine call of `collect_episodes`: `request`'s, with the `Episodes` to run."""
    return request(examples, sampling, seed=seed, rescore=rescore)[:4] + (Episodes(tuple(examples), env, score),)


def episodes_scored(batch: RolloutBatch, tokenizer, examples, *, correct) -> tuple[RolloutBatch, torch.Tensor]:
    """`collect_episodes`' second half: `batch` (rewarded by the environments) and which episodes are correct."""
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

"""The engine side of one RL step: the engine call (`RolloutRequest`, made by `request` / `episode_request`: what
to sample, and how many engine re-scorings to add), the rewards of what came back (`scored`), and evaluation on
held-out prompts. With an environment (`env.kind`) every sample is a multi-turn episode (rollout/episodes.py)
rewarded by the environment on its final answer: the request carries an `Episodes` (examples, env section, reward),
which runs where the engine runs (a rollout rank, in a disaggregated run), so the rewards come back in the batch;
which episodes are correct is judged here (`episodes_scored`)."""
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


@dataclass(frozen=True, slots=True)
class RolloutRequest:
    """One engine call of a rollout, typed from `request` to the rollout ranks' wire: the prompts, their sampling
    (the seed of the first prompt), their group ids (None: the prompt index), how many engine re-scorings to add
    (`rescore`, algorithm.old_logprobs = engine_mean) and, for multi-turn episodes (env.kind), the `Episodes` to run.
    A disaggregated run cuts it into one part per engine (`parts`) and sends those parts as they are."""

    prompts: list[list[int]]
    sampling: SamplingConfig
    group_ids: list[int] | None = None
    rescore: int = 0
    episodes: Episodes | None = None

    def parts(self, engines: int) -> tuple[RolloutRequest, ...]:
        """One part per engine: contiguous prompt slices (sizes differing by at most one) with the seeds one engine
        would give them, their group ids and their episodes (one engine's seeds only with one engine, since an
        episode's seed counts the episodes of its engine's part)."""
        gids = list(range(len(self.prompts))) if self.group_ids is None else list(self.group_ids)
        seed, n = self.sampling.seed, self.sampling.n
        return tuple(RolloutRequest([self.prompts[i] for i in r],
                                    dataclasses.replace(self.sampling,
                                                        seed=None if seed is None else seed + r.start * n),
                                    [gids[i] for i in r], self.rescore,
                                    None if self.episodes is None else self.episodes.select(r))
                     for r in split_prompts(len(self.prompts), engines))

    def sample(self, engine, *, between_steps=None) -> RolloutBatch | None:
        """The samples (episodes with `episodes`) on the in-process `engine`, not re-scored yet; None without prompts
        (an engine's empty part). `between_steps()` runs after every engine step (weights loaded in flight)."""
        if not self.prompts:
            return None
        return engine.generate(self.prompts, self.sampling, self.group_ids, between_steps=between_steps,
                               episodes=self.episodes)

    def rescored(self, engine, batch: RolloutBatch | None) -> RolloutBatch | None:
        """`batch` (sampled for this request) with its `rescore` engine scorings (RolloutBatch.rescored_logprobs) at
        the weights `engine` holds now: the one place re-scoring happens (sampled ahead: after the weights the
        learner trains the batch with were loaded)."""
        if batch is not None and self.rescore:
            batch = dataclasses.replace(batch, rescored_logprobs=engine.rescore(batch, self.rescore))
        return batch

    def run(self, engine) -> RolloutBatch | None:
        """Sample and re-score at once on the in-process `engine`."""
        return self.rescored(engine, self.sample(engine))


def split_prompts(n: int, parts: int) -> list[range]:
    """`n` prompt indices cut into `parts` contiguous slices, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def request(examples, sampling: SamplingConfig, *, seed: int, rescore: int = 0) -> RolloutRequest:
    """The engine call that samples `sampling.n` responses to each of `examples` (`scored` rewards them)."""
    return RolloutRequest([list(e.ids) for e in examples], dataclasses.replace(sampling, seed=seed), None, rescore)


def scored(batch: RolloutBatch, tokenizer, examples, *, score, correct) -> tuple[RolloutBatch, torch.Tensor]:
    """`collect`'s second half: `batch` (sampled for `examples`) with its rewards, and which samples are correct."""
    answers = [examples[g].answer for g in batch.group_ids.tolist()]
    texts = decode(tokenizer, batch.responses())
    rewarded = dataclasses.replace(batch, reward=torch.tensor(score(texts, answers), dtype=torch.float32))
    return rewarded, torch.tensor(correct(texts, answers), dtype=torch.float32)


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
                     correct) -> tuple[RolloutBatch, torch.Tensor]:
    """`sampling.n` multi-turn episodes per example on `engine` (an in-process engine, or the rollout ranks'), each
    rewarded by its environment with `score` of its final answer; correct = `correct` of the final turn of the
    episodes the environment ended (an episode out of turns or tokens is not)."""
    req = episode_request(examples, sampling, env, score, seed=seed)
    batch = engine.generate(req.prompts, req.sampling, req.group_ids, episodes=req.episodes)
    return episodes_scored(batch, tokenizer, examples, correct=correct)


def episode_request(examples, sampling: SamplingConfig, env: EnvConfig, score, *, seed: int, rescore: int = 0
                    ) -> RolloutRequest:
    """`request`'s engine call as multi-turn episodes: with the `Episodes` to run (every finished episode re-scored
    as one sequence, its environment tokens too; the loss mask drops those)."""
    return dataclasses.replace(request(examples, sampling, seed=seed, rescore=rescore),
                               episodes=Episodes(tuple(examples), env, score))


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

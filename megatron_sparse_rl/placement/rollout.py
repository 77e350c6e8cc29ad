"""The engine side of one RL step: what to sample and how (a request), the rewards of what came back, and evaluation
on held-out prompts.

    rollouts = rollouts_for(run.env, score=score, correct=correct)   # at set-up: SingleTurn or MultiTurn
    req = rollouts.request(examples, sampling, seed=s, rescore=k)    # RolloutRequest or EpisodeRequest
    batch = req.run(engine)                                          # the request runs the engine, re-scorings too
    batch, correct = rollouts.judged(batch, tokenizer, examples)     # rewarded, and which samples are correct

The request runs the engine; the engine only samples (`RolloutEngine.generate` for one response per sample,
`sample_turns` for one turn of each running episode). A `RolloutRequest` asks for single-turn samples; an
`EpisodeRequest` (env.kind) runs every sample as a multi-turn episode (rollout/multi_turn.py): it owns the turn loop,
the tokenizer of the engine's model and the turn stop strings, and it runs where the engine runs (a rollout rank, in
a disaggregated run), the environments and their rewards included, so the batch comes back rewarded; which episodes
are correct is judged here (`MultiTurn.judged`). The steps and the placement call `request`, `run`/`sample` and
`judged` and never ask which kind they have."""
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
from megatron_sparse_rl.rollout.multi_turn import final_turns, run_episodes


def decode(tokenizer, rows: list[list[int]]) -> list[str]:
    return [tokenizer.decode(r, skip_special_tokens=True) for r in rows]


@dataclass(frozen=True, slots=True)
class RolloutRequest:
    """One engine call of single-turn samples, typed from `request` to the rollout ranks' wire: the prompts, their
    sampling (the seed of the first prompt), their group ids (None: the prompt index) and how many engine re-scorings
    to add (`rescore`, algorithm.old_logprobs = engine_mean). A disaggregated run cuts it into one part per engine
    (`parts`) and sends those parts as they are."""

    prompts: list[list[int]]
    sampling: SamplingConfig
    group_ids: list[int] | None = None
    rescore: int = 0

    def parts(self, engines: int) -> tuple[RolloutRequest, ...]:
        """One part per engine: contiguous prompt slices (sizes differing by at most one) with the seeds one engine
        would give them and their group ids (and an episode request's examples: `_rows`)."""
        gids = list(range(len(self.prompts))) if self.group_ids is None else list(self.group_ids)
        seed, n = self.sampling.seed, self.sampling.n
        return tuple(dataclasses.replace(self._rows(r), prompts=[self.prompts[i] for i in r],
                                         sampling=dataclasses.replace(self.sampling,
                                                                      seed=None if seed is None else seed + r.start * n),
                                         group_ids=[gids[i] for i in r])
                     for r in split_prompts(len(self.prompts), engines))

    def _rows(self, rows: range) -> RolloutRequest:
        """This request with what else it holds per prompt cut to `rows` (nothing else, single-turn)."""
        return self

    def sample(self, engine, *, between_steps=None) -> RolloutBatch | None:
        """The samples on the in-process `engine` (`RolloutEngine.generate`), not re-scored yet; None without
        prompts (an engine's empty part). `between_steps()` runs after every engine step (weights loaded in flight)."""
        if not self.prompts:
            return None
        return engine.generate(self.prompts, self.sampling, self.group_ids, between_steps=between_steps)

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


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeRequest(RolloutRequest):
    """An engine call whose samples are multi-turn episodes (env.kind): besides the prompts, the examples
    (`env.reset`'s samples, one per prompt), the `env` section and the reward `score(responses, answers)` the
    environment gives the final answer. Picklable when `score` is (rewards/registry.py's scorer is): a disaggregated
    run sends it to the rollout ranks, which run the episodes and their rewards there. Every finished episode is
    re-scored as one sequence, its environment tokens too (the loss mask drops those)."""

    examples: tuple
    env: EnvConfig
    score: Callable

    def _rows(self, rows: range) -> EpisodeRequest:
        return dataclasses.replace(self, examples=tuple(self.examples[i] for i in rows))

    def sample(self, engine, *, between_steps=None, tokenizer=None) -> RolloutBatch | None:
        """`sampling.n` episodes per example on the in-process `engine` (rollout/multi_turn.py `run_episodes`, one
        `RolloutEngine.sample_turns` call per turn), with `tokenizer` (None: the one in the engine's model directory,
        loaded once per process); None without prompts."""
        if not self.prompts:
            return None
        tokenizer = _tokenizer(str(engine.model_dir)) if tokenizer is None else tokenizer
        make = environment_factory(self.env, tokenizer, lambda text, answer: float(self.score([text], [answer])[0]))
        return run_episodes(engine, tokenizer, self.examples, self.sampling, self.env, make, self.group_ids,
                            between_steps=between_steps)


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    return load_tokenizer(model_dir)


def split_prompts(n: int, parts: int) -> list[range]:
    """`n` prompt indices cut into `parts` contiguous slices, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


@dataclass(frozen=True)
class Rollouts:
    """The kind of rollout a run makes (`rollouts_for`, chosen at set-up): it makes each step's requests and judges
    what came back. `score(responses, answers)` gives the rewards, `correct` judges correctness."""

    score: Callable
    correct: Callable

    def request(self, examples, sampling: SamplingConfig, *, seed: int, rescore: int = 0) -> RolloutRequest:
        """The engine call that samples `sampling.n` samples of each of `examples`, seeded from `seed`."""
        raise NotImplementedError

    def judged(self, batch: RolloutBatch, tokenizer, examples) -> tuple[RolloutBatch, torch.Tensor]:
        """`batch` (sampled for `examples`) with its rewards, and which samples are correct (float32 [B])."""
        raise NotImplementedError


@dataclass(frozen=True)
class SingleTurn(Rollouts):
    """Single-turn rollouts (env.kind none): one response per sample, rewarded here."""

    def request(self, examples, sampling: SamplingConfig, *, seed: int, rescore: int = 0) -> RolloutRequest:
        return RolloutRequest([list(e.ids) for e in examples], dataclasses.replace(sampling, seed=seed), None, rescore)

    def judged(self, batch: RolloutBatch, tokenizer, examples) -> tuple[RolloutBatch, torch.Tensor]:
        answers = [examples[g].answer for g in batch.group_ids.tolist()]
        texts = decode(tokenizer, batch.responses())
        rewarded = dataclasses.replace(batch, reward=torch.tensor(self.score(texts, answers), dtype=torch.float32))
        return rewarded, torch.tensor(self.correct(texts, answers), dtype=torch.float32)


@dataclass(frozen=True)
class MultiTurn(Rollouts):
    """Multi-turn episodes (env.kind): each sample an episode of `env`, rewarded by its environment with `score` of
    its final answer where the engine runs; `correct` judges the final turn of the episodes the environment ended."""

    env: EnvConfig

    def request(self, examples, sampling: SamplingConfig, *, seed: int, rescore: int = 0) -> EpisodeRequest:
        return EpisodeRequest([list(e.ids) for e in examples], dataclasses.replace(sampling, seed=seed), None, rescore,
                              examples=tuple(examples), env=self.env, score=self.score)

    def judged(self, batch: RolloutBatch, tokenizer, examples) -> tuple[RolloutBatch, torch.Tensor]:
        """`batch` (rewarded by the environments already) and which episodes are correct: `correct` of the final
        turn of the episodes the environment ended (an episode out of turns or tokens is not)."""
        answers = [examples[g].answer for g in batch.group_ids.tolist()]
        right = self.correct(decode(tokenizer, final_turns(batch)), answers)
        ended = [float(r == "stop") for r in batch.finish_reasons]
        return batch, torch.tensor(right, dtype=torch.float32) * torch.tensor(ended)


def rollouts_for(env: EnvConfig | None, *, score: Callable, correct: Callable) -> Rollouts:
    """The kind of rollout the run makes, chosen once at set-up: `MultiTurn` episodes with an environment
    (env.kind), else `SingleTurn`."""
    if env is not None and env.multi_turn:
        return MultiTurn(score, correct, env)
    return SingleTurn(score, correct)


def collect_episodes(engine, tokenizer, examples, sampling: SamplingConfig, env: EnvConfig, *, seed: int, score,
                     correct) -> tuple[RolloutBatch, torch.Tensor]:
    """`sampling.n` multi-turn episodes per example on the in-process `engine`, each rewarded by its environment with
    `score` of its final answer, and which are correct (`MultiTurn.judged`)."""
    multi_turn = MultiTurn(score, correct, env)
    batch = multi_turn.request(examples, sampling, seed=seed).sample(engine, tokenizer=tokenizer)
    return multi_turn.judged(batch, tokenizer, examples)


def eval_sampling(*, max_tokens: int, temperature: float, samples: int, seed: int = 0) -> SamplingConfig:
    """Evaluation's sampling: `samples` samples per prompt at `temperature` (one greedy answer when it is 0)."""
    return SamplingConfig(n=1 if temperature == 0 else samples, temperature=temperature, max_tokens=max_tokens,
                          seed=seed)


def accuracy(engine, tokenizer, examples, *, max_tokens: int, score, temperature: float, samples: int,
             seed: int = 0, env: EnvConfig | None = None) -> tuple[float, int]:
    """(sum of correctness, count) on `examples` on the in-process `engine`: `samples` samples per prompt at
    `temperature` (one greedy answer when temperature is 0), judged by `score`; with an environment `env`, episodes
    judged on their final answer."""
    if not examples:
        return 0.0, 0
    rollouts = rollouts_for(env, score=score, correct=score)
    params = eval_sampling(max_tokens=max_tokens, temperature=temperature, samples=samples, seed=seed)
    _, right = rollouts.judged(rollouts.request(examples, params, seed=seed).run(engine), tokenizer, examples)
    return float(right.sum()), len(right)

"""algorithm.old_logprobs: where pi_old comes from (learner recompute, the sampler's mu, or the mean in probability
space of n engine re-scorings), checked against float64 references and hand-built batches."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_sparse_rl.algorithms.old_policy import engine_mean_logprobs
from megatron_sparse_rl.config import ConfigError, RunConfig
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.algorithm import AlgorithmConfig
from megatron_sparse_rl.config.loader import from_dict, merge_overrides
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.training import update as U


def test_engine_mean_of_one_scoring_is_that_scoring():
    lp = -torch.rand(3, 5) * 4
    mask = torch.rand(3, 5) > 0.3
    old, metrics = engine_mean_logprobs(lp.unsqueeze(0), mask)
    assert torch.allclose(old[mask], lp[mask], atol=1e-6, rtol=0)
    assert (old[~mask] == 0).all()
    assert float(metrics["old_logprobs/rescore_std"]) == 0.0


def test_engine_mean_is_the_mean_probability_of_the_scorings():
    scorings = torch.tensor([[[-0.1, -2.0]], [[-0.3, -1.0]], [[-0.2, -3.0]]])  # n = 3, B = 1, T = 2
    mask = torch.tensor([[True, True]])
    old, metrics = engine_mean_logprobs(scorings, mask)
    x = scorings.double()
    want = [math.log(sum(math.exp(float(x[j, 0, t])) for j in range(3)) / 3) for t in range(2)]
    assert old[0].tolist() == pytest.approx(want, abs=1e-6)
    std = x.std(dim=0, unbiased=False)[0]
    assert float(metrics["old_logprobs/rescore_std"]) == pytest.approx(float(std.mean()), abs=1e-6)
    assert float(metrics["old_logprobs/rescore_range_max"]) == pytest.approx(2.0, abs=1e-6)


def test_engine_mean_of_a_stochastic_scorer_converges_to_the_true_mean_probability():
    """A noisy scorer lp_j = log p + e_j, e_j ~ N(0, s^2): the estimator targets log E[exp(lp_j)] = log p + s^2 / 2
    (the mean in probability space), not E[lp_j] = log p; its error shrinks with n."""
    gen = torch.Generator().manual_seed(0)
    log_p = torch.log(torch.tensor([[0.7, 0.2, 0.05, 0.9]], dtype=torch.float64))
    s = 0.5
    mask = torch.ones_like(log_p, dtype=torch.bool)
    target = log_p + s * s / 2
    errors = []
    for n in (4, 64, 16384):
        noise = torch.randn((n, *log_p.shape), generator=gen, dtype=torch.float64) * s
        old, metrics = engine_mean_logprobs(log_p + noise, mask)
        errors.append(float((old - target).abs().max()))
        assert float(metrics["old_logprobs/rescore_std"]) == pytest.approx(s, rel=0.6 if n == 4 else 0.1)
    assert errors[-1] < 0.02 and errors[-1] < errors[0]
    assert float((old - log_p).abs().min()) > 0.08  # the plain mean of logprobs would be log p: biased


def test_engine_mean_rejects_scorings_of_another_shape():
    with pytest.raises(ValueError, match=r"scorings must be \[n, B, T\]"):
        engine_mean_logprobs(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))


# ---- config ---------------------------------------------------------------------------------------------
def run_of(*overrides: str) -> RunConfig:
    return from_dict(RunConfig, merge_overrides({"model": {"path": "/nonexistent/tiny", "tiny": {}}}, list(overrides)))


def test_bad_source_and_sample_count_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"algorithm\.old_logprobs must be one of \['learner', 'engine', "):
        AlgorithmConfig(old_logprobs="sampler")
    with pytest.raises(ValueError, match=r"algorithm\.old_logprobs_samples must be >= 1"):
        AlgorithmConfig(old_logprobs="engine_mean", old_logprobs_samples=0)


@pytest.mark.parametrize("overrides, message", [
    (("algorithm.old_logprobs=engine", "routing.mode=R2"), r"routing\.mode = 'R2' records the routes"),
    (("algorithm.old_logprobs=engine_mean", "routing.mode=R2"), r"routing\.mode = 'R2' records the routes"),
    (("algorithm.old_logprobs=engine", "algorithm.corrections.sparse_rl.enabled=true",
      "algorithm.corrections.tis.enabled=true"), r"rho = pi_old / mu = 1 and algorithm\.corrections\.tis, sparse_rl"),
    (("algorithm.old_logprobs=engine_mean", "rollout.sampling.temperature=0.8"),
     r"rollout\.sampling\.temperature must be 1\.0 \(got 0\.8\)"),
    (("algorithm.old_logprobs=engine_mean", "rollout.record_sampling_mask=true", "algorithm.keep_sampling_mask=true"),
     r"cannot be combined with algorithm\.keep_sampling_mask"),
])
def test_combinations_the_source_cannot_serve_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(run_of(*overrides), 1, cuda=False)


@pytest.mark.parametrize("overrides", [
    ("algorithm.old_logprobs=engine", "routing.mode=R3", "algorithm.corrections.opsm.enabled=true"),
    ("algorithm.old_logprobs=engine_mean", "algorithm.corrections.sparse_rl.enabled=true", "rollout.kv.policy=rkv"),
])
def test_combinations_that_make_sense_are_accepted(overrides):
    validate(run_of(*overrides), 1, cuda=False)


# ---- the trainer's prepare ----------------------------------------------------------------------------------
class CountingLearner:
    """Stands in for the Megatron learner where only our selection logic is under test: counts old forwards."""

    routing = None
    indexer = None  # no DSA indexer

    def __init__(self, logprobs: torch.Tensor):
        self.logprobs, self.forwards = logprobs, 0

    def forward_logprobs(self, tokens, *, lengths=None, extras=None):
        self.forwards += 1
        return {"logprobs": self.logprobs.clone()}


def _batch(rescored: torch.Tensor | None = None) -> RolloutBatch:
    # sample 0: prompt [1, 5, 6], response [7, 2]; sample 1: prompt [1, 9], response [4, 4, 2]; one group
    return RolloutBatch(
        prompt_ids=torch.tensor([[1, 5, 6], [1, 9, 0]]), prompt_lens=torch.tensor([3, 2]),
        response_ids=torch.tensor([[7, 2, 0], [4, 4, 2]]),
        response_mask=torch.tensor([[True, True, False], [True, True, True]]),
        rollout_logprobs=torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]),
        finish_reasons=("stop", "stop"), group_ids=torch.tensor([0, 0]), reward=torch.tensor([1.0, 0.0]),
        rescored_logprobs=rescored)


def _prepare(source: str, batch: RolloutBatch, samples: int = 2):
    learner = CountingLearner(torch.full((2, 4), -0.7))
    cfg = AlgorithmConfig(old_logprobs=source, old_logprobs_samples=samples)
    return learner, U.prepare(learner, batch, cfg, pad_id=0, dp_group=None)


def test_learner_source_recomputes_once():
    learner, prep = _prepare("learner", _batch())
    assert learner.forwards == 1 and prep.metrics["old_logprobs/learner_forwards"] == 1.0
    assert (prep.old_logprobs == -0.7).all()


def test_engine_source_takes_the_samplers_logprobs_without_a_learner_forward():
    learner, prep = _prepare("engine", _batch())
    assert learner.forwards == 0 and prep.metrics["old_logprobs/learner_forwards"] == 0.0
    assert torch.equal(prep.old_logprobs, prep.rollout_logprobs)
    assert prep.metrics["mismatch/k1"] == 0.0
    assert prep.metrics["mismatch/rho_p5"] == 1.0 and prep.metrics["mismatch/rho_below_0.5_frac"] == 0.0


def test_engine_mean_source_averages_the_rescorings_in_the_learner_layout():
    rescored = torch.zeros(2, 2, 3)
    rescored[0, :, :2] = torch.tensor([[-0.2, -1.0], [-0.4, -2.0]])
    rescored[1, :, :3] = torch.tensor([[-0.3, -0.4, -0.5], [-0.3, -0.4, -0.5]])
    learner, prep = _prepare("engine_mean", _batch(rescored))
    assert learner.forwards == 0
    lse = lambda a, b: math.log((math.exp(a) + math.exp(b)) / 2)  # noqa: E731 - the float64 reference
    want = torch.tensor([[0.0, 0.0, lse(-0.2, -0.4), lse(-1.0, -2.0)], [0.0, -0.3, -0.4, -0.5]])
    assert torch.allclose(prep.old_logprobs, want.float(), atol=1e-6, rtol=0)
    assert prep.metrics["old_logprobs/rescore_range_max"] == pytest.approx(1.0, abs=1e-6)


def test_engine_mean_without_rescorings_is_an_error_not_a_fallback():
    with pytest.raises(ValueError, match=r"carries no engine re-scorings"):
        _prepare("engine_mean", _batch())


def test_rescored_logprobs_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match=r"RolloutBatch\.rescored_logprobs must have shape \(2, n, 3\)"):
        _batch(torch.zeros(2, 2, 4))


def test_every_configurable_source_has_one_table_entry_and_only_engine_mean_asks_for_rescorings():
    from typing import get_args

    from megatron_sparse_rl.config.algorithm import OldLogprobsSource

    assert set(U.OLD_LOGPROB_SOURCES) == set(get_args(OldLogprobsSource))
    cfg = {s: AlgorithmConfig(old_logprobs=s, old_logprobs_samples=3) for s in U.OLD_LOGPROB_SOURCES}
    assert {s: U.old_logprob_source(c).rescorings(c) for s, c in cfg.items()} == \
        {"learner": 0, "engine": 0, "engine_mean": 3}

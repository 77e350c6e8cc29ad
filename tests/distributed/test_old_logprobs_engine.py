"""algorithm.old_logprobs = engine on a real Megatron-Core learner (one gloo rank, tiny MoE): the step's prepare runs
no learner old forward, and the update trains with the PPO ratio against the sampler's logprobs mu: its loss equals
a float64 GRPO loss computed in the test from the learner's logprobs and mu, and the weights move.
Run: .venv/bin/python -m pytest -q tests/distributed/test_old_logprobs_engine.py
"""
from __future__ import annotations

import pytest
import torch

from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed


def engine_source_worker(rank, world_size, model_dir):
    from megatron_sparse_rl.config.algorithm import AlgorithmConfig
    from megatron_sparse_rl.rollout.batch import RolloutBatch
    from megatron_sparse_rl.training import update as U
    from tests.learner_workers import make_learner

    learner = make_learner(world_size, model_dir, mbs=4)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 60, (4, 5), generator=gen)
    response = torch.randint(4, 60, (4, 6), generator=gen)
    batch_tokens = torch.cat([prompt, response], dim=1)
    theta = learner.forward_logprobs(batch_tokens)["logprobs"][:, 4:].clone()  # scores the 6 response tokens
    mu = theta + 0.3 * torch.randn(theta.shape, generator=gen)  # a sampler that disagrees with the learner
    batch = RolloutBatch(prompt_ids=prompt, prompt_lens=torch.full((4,), 5), response_ids=response,
                         response_mask=torch.ones(4, 6, dtype=torch.bool), rollout_logprobs=mu,
                         finish_reasons=("length",) * 4, group_ids=torch.zeros(4, dtype=torch.long),
                         reward=torch.tensor([1.0, 0.0, 0.0, 1.0]))
    calls = []
    forward = learner.forward_logprobs
    learner.forward_logprobs = lambda *a, **k: calls.append(1) or forward(*a, **k)
    cfg = AlgorithmConfig(old_logprobs="engine")
    prep = U.prepare(learner, batch, cfg, pad_id=0, dp_group=learner.groups.dp)
    old_forwards = len(calls)
    before = [p.detach().clone() for p in learner.model.parameters()]
    out = U.update(learner, prep, cfg, updates=1, dp_group=learner.groups.dp)
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(learner.model.parameters(), before))
    return {"old_forwards": old_forwards, "metric": prep.metrics["old_logprobs/learner_forwards"], "theta": theta,
            "mu": mu, "adv": prep.advantages, "loss": out["loss/value"], "moved": moved}


def test_engine_source_trains_against_the_samplers_logprobs(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / "moe", experts=8, topk=2, seed=0))
    out = run_distributed(engine_source_worker, 1, args=(model_dir,), timeout=240)[0]
    assert out["old_forwards"] == 0 and out["metric"] == 0.0
    theta, mu, adv = (out[k].double() for k in ("theta", "mu", "adv"))
    ratio = torch.exp(theta - mu)  # pi_theta / pi_old with pi_old = mu
    a = adv[:, None].expand_as(ratio)
    want = torch.maximum(-ratio * a, -ratio.clamp(0.8, 1.2) * a).mean()  # GRPO, token_mean, clip 0.2
    assert out["loss"] == pytest.approx(float(want), abs=1e-5)
    assert (ratio - 1).abs().max() > 0.2, "mu must differ from pi_theta for the ratio to mean anything"
    assert out["moved"] > 0

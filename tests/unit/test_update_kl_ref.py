"""The KL-to-reference term as the trainer computes it (training/update.py `update`: its loss function over
micro-batches and updates, the token-weighted reduction to `loss/kl_ref`) against a float64 recomputation of one
batch from the estimator's formula (algorithms/kl.py; J. Schulman, "Approximating KL divergence";
DeepSeek-V3.2 for the unbiased form). A stand-in learner feeds known policy logprobs to the loss function the
way `Learner.train_step` does (micro-batches of row indices, metrics summed); no Megatron, no vLLM.

    .venv/bin/python -m pytest -q tests/unit/test_update_kl_ref.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_sparse_rl.config.algorithm import AlgorithmConfig, KLConfig
from megatron_sparse_rl.learner.host_metrics import summed_on_host
from megatron_sparse_rl.training.update import PreparedBatch, update

B, T1, COEF = 6, 7, 0.05  # rows, scored positions (T - 1), algorithm.kl.coef


class StandInLearner:
    """`train_step` as `Learner.train_step` calls a loss function: micro-batches of `micro` rows, each
    `loss_fn(logprobs [b, T-1], entropy [b, T-1], index [b])`, the returned metrics summed over micro-batches,
    plus loss, grad_norm and lr. Column 0 of `tokens` is the row's id in `policy` (the policy's logprobs)."""

    routing = None
    indexer = None  # no DSA indexer

    def __init__(self, policy: torch.Tensor, micro: int):
        self.policy, self.micro, self.calls = policy, micro, []

    def train_step(self, tokens, loss_fn, *, lengths=None, extras=None):
        self.calls.append(tokens[:, 0].tolist())
        items = []
        for index in torch.arange(tokens.shape[0]).split(self.micro):
            logprobs = self.policy[tokens[index, 0]].clone().requires_grad_(True)
            loss, metrics = loss_fn(logprobs, torch.zeros_like(logprobs), index)
            loss.backward()  # the loss is differentiable in the policy's logprobs, as the learner needs
            items.append({"loss": loss.detach(), **metrics})
        return {**summed_on_host(items), "grad_norm": 0.0, "lr": 0.0}


def _batch(seed: int):
    g = np.random.default_rng(seed)
    policy, ref, old = (-np.abs(g.normal(1.0, 1.0, (B, T1))) for _ in range(3))
    mask = g.random((B, T1)) < 0.7
    mask[:, 0] = True  # every row scores at least one token
    weights = g.uniform(0.5, 1.5, (B, T1))
    return policy, ref, old, mask, weights


def _prepared(ref, old, mask, weights) -> PreparedBatch:
    f32 = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731 - the learner's dtype
    tokens = torch.zeros(B, T1 + 1, dtype=torch.long)
    tokens[:, 0] = torch.arange(B)
    m = torch.tensor(mask)
    return PreparedBatch(tokens, m, f32(old), f32(old), torch.zeros(B), f32(weights), {},
                         lengths=torch.full((B,), T1 + 1), ref_logprobs=f32(ref), loss_mask=m)


@pytest.mark.parametrize("estimator,unbiased", [("k3", False), ("k2", False), ("k1", False), ("k3", True)])
@pytest.mark.parametrize("updates,micro", [(1, B), (2, 2)])
def test_kl_ref_metric_and_loss_match_a_float64_recomputation(estimator, unbiased, updates, micro):
    policy, ref, old, mask, weights = _batch(seed=3)
    d = policy - ref  # log p - log q, the sampled tokens drawn from the policy p, q the reference
    per = {"k1": d, "k2": 0.5 * d ** 2, "k3": np.exp(-d) + d - 1.0}[estimator] * weights
    if unbiased:
        per = np.exp(policy - old) * per
    cfg = AlgorithmConfig(kl=KLConfig(coef=COEF, estimator=estimator, use_unbiased=unbiased))
    learner = StandInLearner(torch.tensor(policy, dtype=torch.float32), micro)

    out = update(learner, _prepared(ref, old, mask, weights), cfg, updates=updates, dp_group=None)

    assert out["loss/kl_ref"] == pytest.approx(per[mask].sum() / mask.sum(), rel=1e-5, abs=1e-7)
    # advantages are 0, so the policy term is 0 and the loss is the KL term alone: coef * the token mean of each
    # update's rows (token_mean over the update's tokens), averaged over the updates
    chunks = np.array_split(np.arange(B), updates)
    want = np.mean([COEF * per[c][mask[c]].sum() / mask[c].sum() for c in chunks])
    assert out["loss/value"] == pytest.approx(want, rel=1e-5, abs=1e-8)
    assert out["train/tokens"] == mask.sum()
    assert learner.calls == [c.tolist() for c in chunks]


def test_kl_ref_is_zero_when_the_policy_is_the_reference():
    policy, _, old, mask, weights = _batch(seed=4)
    cfg = AlgorithmConfig(kl=KLConfig(coef=COEF))
    learner = StandInLearner(torch.tensor(policy, dtype=torch.float32), micro=B)
    out = update(learner, _prepared(policy, old, mask, weights), cfg, updates=1, dp_group=None)
    assert out["loss/kl_ref"] == 0.0 and out["loss/value"] == 0.0

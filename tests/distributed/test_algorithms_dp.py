"""Data parallelism: on 2 gloo ranks, each holding part of the batch, the corrections (with the DP
group) and every loss/aggregation (normaliser all-reduced) sum to exactly the full-batch values.

    .venv/bin/python -m pytest -q -m distributed tests/distributed/test_algorithms_dp.py
"""
import pytest
import torch
import torch.distributed as dist

from megatron_sparse_rl.algorithms import POLICY_LOSSES, AGGREGATIONS, apply_corrections, loss_normalizer, policy_loss
from megatron_sparse_rl.config.algorithm import (
    BatchSkipConfig, CorrectionsConfig, LossConfig, SparseRLConfig, TISConfig,
)
from tests.spawn import run_distributed

B, T, SPLIT = 7, 6, 3
CFG = CorrectionsConfig(sparse_rl=SparseRLConfig(enabled=True, token_reject=True), tis=TISConfig(enabled=True),
                        batch_skip=BatchSkipConfig(enabled=True, max_k1=1.0))


def make_batch():
    g = torch.Generator().manual_seed(1234)
    old = -(torch.randn(B, T, generator=g, dtype=torch.float64) + 1).abs()
    mu = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mu[4, 2] = old[4, 2] + 12.0  # rank 1 holds a rejected sequence
    lp = old + 2e-3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[4, 2] = True
    mask[1] = False
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return lp, old, mu, mask, adv


def step(lp, old, mu, mask, adv, group):
    """Corrections then every loss and mode: {(name, mode): (loss, grad)} and the weights."""
    corr = apply_corrections(CFG, old, mu, mask, advantages=adv, group=group)
    train = mask & corr.keep
    out = {}
    for name in POLICY_LOSSES:
        for mode in AGGREGATIONS:
            x = lp.clone().requires_grad_(True)
            loss, _ = policy_loss(x, old, adv, train, cfg=LossConfig(name=name, aggregation=mode),
                                  normalizer=loss_normalizer(train, mode, group=group), weights=corr.weights)
            loss.backward()
            out[(name, mode)] = (loss.detach(), x.grad)
    return out, corr.weights, corr.metrics["batch_skip/k1"]


def _rank_fn(rank, world_size):
    rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, B)
    lp, old, mu, mask, adv = (t[rows] for t in make_batch())
    return step(lp, old, mu, mask, adv, dist.group.WORLD)


@pytest.mark.distributed
def test_two_ranks_sum_to_full_batch():
    full, full_weights, full_k1 = step(*make_batch(), group=None)
    assert full_weights[4].eq(0).all() and full_weights.ne(0).any()
    (out0, w0, k1_0), (out1, w1, k1_1) = run_distributed(_rank_fn, world_size=2, timeout=120)
    torch.testing.assert_close(torch.cat([w0, w1]), full_weights, rtol=1e-12, atol=1e-15)
    assert k1_0.item() == pytest.approx(full_k1.item()) and k1_1.item() == pytest.approx(full_k1.item())
    for key, (loss, grad) in full.items():
        assert (out0[key][0] + out1[key][0]).item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15), key
        torch.testing.assert_close(torch.cat([out0[key][1], out1[key][1]]), grad, rtol=1e-12, atol=1e-15)

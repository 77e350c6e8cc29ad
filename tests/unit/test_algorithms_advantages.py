"""Advantages (GRPO, Dr.GRPO, RLOO) against per-group statistics computed with plain Python.

    .venv/bin/python -m pytest -q tests/unit/test_algorithms_advantages.py
"""
import statistics

import pytest
import torch

from megatron_sparse_rl.algorithms import compute_advantages, grpo_advantages, rloo_advantages
from megatron_sparse_rl.config.algorithm import AdvantageConfig

IDS = [7, -3, 7, 100, -3, 7, 100, 42, 5, 5, 5]           # non-contiguous, unsorted; 42 is a group of one
REWARDS = [1.0, 0.0, 0.5, 2.0, 1.0, -1.0, 2.0, 3.0, 0.3, 0.3, 0.3]  # groups 100 and 5 are constant


def by_group():
    groups = {}
    for i, g in enumerate(IDS):
        groups.setdefault(g, []).append(i)
    return groups


def reference(kind, scale=True, unbiased=True, eps=1e-6):
    out = [0.0] * len(IDS)
    for members in by_group().values():
        rs = [REWARDS[i] for i in members]
        for i in members:
            if len(set(rs)) == 1:
                continue
            if kind == "rloo":
                out[i] = REWARDS[i] - (sum(rs) - REWARDS[i]) / (len(rs) - 1)
                continue
            a = REWARDS[i] - sum(rs) / len(rs)
            if scale:
                a /= (statistics.stdev(rs) if unbiased else statistics.pstdev(rs)) + eps
            out[i] = a
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scale,unbiased", [(True, True), (True, False), (False, True)])
def test_grpo(scale, unbiased):
    got = grpo_advantages(torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(IDS),
                          scale_by_std=scale, std_unbiased=unbiased)
    torch.testing.assert_close(got, reference("grpo", scale, unbiased), rtol=1e-12, atol=1e-12)


def test_rloo():
    got = rloo_advantages(torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(IDS))
    torch.testing.assert_close(got, reference("rloo"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cfg", [AdvantageConfig(), AdvantageConfig(scale_by_std=False),
                                 AdvantageConfig(estimator="rloo")])
def test_constant_groups_are_exactly_zero(cfg):
    # 0.1 * 3 / 3 != 0.1 in floating point: the mean is not exact, the advantage must still be 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7], dtype=torch.float32)
    ids = torch.tensor([3, 3, 3, 9, 9, 9, 9])
    got = compute_advantages(rewards, ids, cfg=cfg)
    assert torch.isfinite(got).all() and (got == 0).all()


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="rewards and group_ids"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))

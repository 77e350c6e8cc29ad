"""Data parallelism of `tail_metrics`: on 2 gloo ranks holding unequal parts of a batch (1 row vs 4, different
widths), the percentiles and fractions with the DP group equal numpy float64 over the whole batch (percentiles of
all tokens, not a mean of the ranks' percentiles, which differ here).

    .venv/bin/python -m pytest -q -m distributed tests/distributed/test_tail_metrics_dp.py
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

B, T, SPLIT, EXTRA = 5, 8, 2, 3  # rank 0: rows 0-1; rank 1: rows 2-4, padded with EXTRA masked columns


def make_batch():
    g = np.random.default_rng(11)
    mu = -np.abs(g.normal(1.0, 1.0, (B, T)))
    old = mu + g.standard_t(2, (B, T))
    mask = g.random((B, T)) < 0.75
    old[0, :], mask[0, :] = mu[0, :] - 0.01, True  # rank 0's tokens agree: its own p5 is near 1
    old[3, 2], mask[3, 2] = mu[3, 2] - 15.0, True   # rho < 1e-4 on rank 1
    mu[4, 1], mask[4, 1] = np.nan, True              # non-finite: out
    return old, mu, mask


def _rank_fn(rank, world_size):
    from megatron_sparse_rl.algorithms import tail_metrics

    old, mu, mask = (torch.tensor(x) for x in make_batch())
    rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, B)
    old, mu, mask = old[rows], mu[rows], mask[rows]
    if rank == 1:  # a wider local batch: the ranks gather different sizes
        pad = lambda x, v: torch.cat([x, torch.full((x.shape[0], EXTRA), v, dtype=x.dtype)], dim=1)  # noqa: E731
        old, mu, mask = pad(old, -1.0), pad(mu, -50.0), pad(mask, False)
    both = {k: float(v) for k, v in tail_metrics(old, mu, mask, group=dist.group.WORLD).items()}
    alone = {k: float(v) for k, v in tail_metrics(old, mu, mask).items()}
    return both, alone


def reference() -> dict[str, float]:
    old, mu, mask = make_batch()
    valid = mask & np.isfinite(old) & np.isfinite(mu)
    lr = np.where(valid, old - mu, 0.0)
    rho = np.exp(np.clip(lr[valid], -20, 20))
    sums = lr.sum(axis=1)[valid.any(axis=1)]
    want = {f"mismatch/rho_p{q}": np.percentile(rho, q) for q in (1, 5, 50)}
    want.update({f"mismatch/seq_log_rho_p{q}": np.percentile(sums, q) for q in (1, 5, 50)})
    want["mismatch/rho_below_0.5_frac"] = (rho < 0.5).mean()
    want["mismatch/rho_below_1e-4_frac"] = (rho < 1e-4).mean()
    return want


def test_two_ranks_give_the_full_batch_percentiles():
    want = reference()
    (both0, alone0), (both1, alone1) = run_distributed(_rank_fn, world_size=2, timeout=120)
    for out in (both0, both1):
        for k, v in want.items():
            assert out[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    # the ranks' own values differ from the batch's, and their mean is not it either
    p5 = "mismatch/rho_p5"
    assert abs((alone0[p5] + alone1[p5]) / 2 - want[p5]) > 0.05
    assert want["mismatch/rho_below_1e-4_frac"] > 0

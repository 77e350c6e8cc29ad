"""`tail_metrics` (algorithms/metrics.py): percentiles of rho_t = pi_old / mu and of each sequence's sum of
log rho_t, and the fractions of tokens with rho_t below 0.5 and 1e-4, against a hand computation written out
here and against numpy float64 (np.percentile, linear) on recorded logprobs; masked and non-finite tokens excluded.

    .venv/bin/python -m pytest -q tests/unit/test_tail_metrics.py
"""
import math

import numpy as np
import pytest
import torch

from megatron_sparse_rl.algorithms import tail_metrics

NAN = float("nan")


def test_tail_metrics_by_hand():
    # log rho per token (pi_old = mu * rho); mu is some recorded logprob per token.
    log_rho = torch.tensor([[0.0, math.log(0.4), math.log(0.9), math.log(1e-6)],
                            [math.log(2.0), math.log(5e-5), 3.0, 0.0],
                            [math.log(1e-8), 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0],     # the 1e-6 token is not sampled: out
                         [1, 1, 1, 0],     # the third token's mu is NaN below: out (non-finite)
                         [0, 0, 0, 0]],    # no sampled token: not a sequence
                        dtype=torch.bool)
    mu = torch.tensor([[-0.3, -1.2, -2.5, -0.7], [-0.1, -4.0, NAN, -9.0], [-1.0, -1.0, -1.0, -1.0]],
                      dtype=torch.float64)
    m = tail_metrics(mu + log_rho, mu, mask)
    # valid rho sorted: 5e-5, 0.4, 0.9, 1, 2 (n = 5): p at (n-1) q / 100 = 0.04, 0.2, 2
    want = {
        "rho_p1": 5e-5 + 0.04 * (0.4 - 5e-5),  # 0.016048
        "rho_p5": 5e-5 + 0.2 * (0.4 - 5e-5),   # 0.08004
        "rho_p50": 0.9,
        "rho_below_0.5_frac": 2 / 5,
        "rho_below_1e-4_frac": 1 / 5,
        # sequence sums: row 0 log(0.4 * 0.9) = log 0.36, row 1 log(2 * 5e-5) = log 1e-4; row 2 has none
        "seq_log_rho_p1": math.log(1e-4) + 0.01 * (math.log(0.36) - math.log(1e-4)),
        "seq_log_rho_p5": math.log(1e-4) + 0.05 * (math.log(0.36) - math.log(1e-4)),
        "seq_log_rho_p50": 0.5 * math.log(3.6e-5),
    }
    assert set(m) == {f"mismatch/{k}" for k in want}
    for k, v in want.items():
        assert float(m[f"mismatch/{k}"]) == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in m.values())


def test_tail_metrics_match_numpy_float64():
    g = np.random.default_rng(5)
    mu = -np.abs(g.normal(1.0, 1.0, (7, 33))).astype(np.float32)
    old = (mu + g.standard_t(2, (7, 33))).astype(np.float32)  # heavy tails: some rho far below 1e-4
    mask = g.random((7, 33)) < 0.7
    mask[6] = False
    old[1, 1], old[2, 2], mask[1, 1], mask[2, 2] = mu[1, 1] - 25.0, mu[2, 2] - 12.0, True, True  # rho < 1e-4
    old[0, 3], mask[0, 3] = np.nan, True
    m = tail_metrics(torch.tensor(old), torch.tensor(mu), torch.tensor(mask))
    valid = mask & np.isfinite(old)
    lr = old.astype(np.float64) - mu.astype(np.float64)
    rho = np.exp(np.clip(lr[valid], -20, 20))
    sums = np.where(valid, lr, 0.0).sum(axis=1)[valid.any(axis=1)]
    assert (rho < 1e-4).any() and len(sums) == 6
    for q in (1, 5, 50):
        assert float(m[f"mismatch/rho_p{q}"]) == pytest.approx(np.percentile(rho, q), rel=1e-12)
        assert float(m[f"mismatch/seq_log_rho_p{q}"]) == pytest.approx(np.percentile(sums, q), rel=1e-12)
    assert float(m["mismatch/rho_below_0.5_frac"]) == pytest.approx((rho < 0.5).mean(), rel=1e-12)
    assert float(m["mismatch/rho_below_1e-4_frac"]) == pytest.approx((rho < 1e-4).mean(), rel=1e-12)


def test_tail_metrics_empty_and_single():
    x = torch.zeros(2, 3)
    empty = tail_metrics(x, x, torch.zeros(2, 3, dtype=torch.bool), prefix="")
    assert {k: float(v) for k, v in empty.items()} == {
        "rho_p1": 1.0, "rho_p5": 1.0, "rho_p50": 1.0, "seq_log_rho_p1": 0.0, "seq_log_rho_p5": 0.0,
        "seq_log_rho_p50": 0.0, "rho_below_0.5_frac": 0.0, "rho_below_1e-4_frac": 0.0}
    one = torch.zeros(2, 3, dtype=torch.bool)
    one[1, 2] = True
    old = torch.full((2, 3), -1.0)
    old[1, 2] = -1.0 + math.log(0.25)
    got = tail_metrics(old, torch.full((2, 3), -1.0), one, prefix="")
    assert float(got["rho_p1"]) == pytest.approx(0.25) and float(got["rho_p50"]) == pytest.approx(0.25)
    assert float(got["seq_log_rho_p5"]) == pytest.approx(math.log(0.25))
    assert float(got["rho_below_0.5_frac"]) == 1.0 and float(got["rho_below_1e-4_frac"]) == 0.0

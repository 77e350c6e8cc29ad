"""KL estimators, the unbiased off-policy KL, the KL loss, keep-sampling-mask and mismatch metrics,
against numpy float64 formulas and hand-derived gradients.

    .venv/bin/python -m pytest -q tests/unit/test_algorithms_kl_metrics.py
"""
from decimal import Decimal, localcontext

import numpy as np
import pytest
import torch

from megatron_sparse_rl.algorithms import (
    k3_from_log_ratio, kl_k1, kl_k2, kl_k3, kl_loss, loss_normalizer, masked_log_softmax, masked_token_logprobs,
    mismatch_metrics, unbiased_kl,
)
from megatron_sparse_rl.config.algorithm import KLConfig

G = np.random.default_rng(0)


def test_estimators_values_and_gradients():
    logp, logq = -np.abs(G.normal(1, 1, 50)), -np.abs(G.normal(1, 1, 50))
    want = {"k1": logp - logq, "k2": 0.5 * (logp - logq) ** 2, "k3": np.exp(logq - logp) - (logq - logp) - 1}
    dwant = {"k1": np.ones(50), "k2": logp - logq, "k3": 1 - np.exp(logq - logp)}  # d/dlogp
    for name, fn in {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}.items():
        x = torch.tensor(logp, requires_grad=True)
        out = fn(x, torch.tensor(logq))
        out.sum().backward()
        np.testing.assert_allclose(out.detach().numpy(), want[name], rtol=1e-12)
        np.testing.assert_allclose(x.grad.numpy(), dwant[name], rtol=1e-12, atol=1e-14)
    assert (want["k3"] >= 0).all()


def _k3_exact(x: float) -> float:
    """exp(x) - 1 - x with 100 significant digits (decimal), rounded to float64."""
    with localcontext() as ctx:
        ctx.prec = 100
        d = Decimal(x)
        return float(d.exp() - 1 - d)


def test_k3_is_never_negative_and_keeps_its_precision():
    # float32 log-probs 1e-5 apart: the old form exp(x) - x - 1 rounds ~1 in 8 of these below zero, and their mean
    # too (the -8e-10 of issue 38 was such a mean)
    rng = np.random.default_rng(1)
    logp = torch.tensor(-rng.uniform(0.5, 3.0, 4000), dtype=torch.float32)
    logq = logp + torch.tensor(rng.uniform(-1e-5, 1e-5, 4000), dtype=torch.float32)
    x = logq - logp  # exact: the operands are within a factor 2 of each other
    old_form = torch.exp(x) - x - 1.0
    assert (old_form < 0).any() and old_form.mean() < 0, "no input found where the old form rounds negative"
    new = kl_k3(logp, logq)
    assert (new >= 0).all() and new.dtype == torch.float32
    want = np.array([_k3_exact(float(v)) for v in x.double()])
    np.testing.assert_allclose(new.double().numpy(), want, rtol=1e-5, atol=0)
    m = mismatch_metrics(logq[None], logp[None], torch.ones(1, 4000, dtype=torch.bool))
    assert m["mismatch/k3"].item() >= 0
    assert m["mismatch/k3"].item() == pytest.approx(want.mean(), rel=1e-4)
    # float64 over the whole range, both sides of the series/expm1 switch at |x| = 0.1, and the clamp at +-20
    xs = np.concatenate([[0.0, 1e-30, -1e-12, 0.0999999, 0.1, -0.1000001, 19.5, -20.0],
                         rng.normal(0, 1e-3, 50), rng.normal(0, 2, 50)])
    got = k3_from_log_ratio(torch.tensor(xs, dtype=torch.float64)).numpy()
    assert (got >= 0).all()
    np.testing.assert_allclose(got, [_k3_exact(v) for v in xs], rtol=1e-13, atol=0)


def test_unbiased_kl_value_gradient_and_expectation():
    lp, old, ref = (-np.abs(G.normal(1, 1, 40)) for _ in range(3))
    r, k3 = np.exp(lp - old), np.exp(ref - lp) - (ref - lp) - 1
    x = torch.tensor(lp, requires_grad=True)
    out = unbiased_kl(x, torch.tensor(old), torch.tensor(ref))
    out.sum().backward()
    np.testing.assert_allclose(out.detach().numpy(), r * k3, rtol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), r * k3 + r * (1 - np.exp(ref - lp)), rtol=1e-12)
    # exact expectation over a categorical: E_{y~pi_old}[D] = KL(pi_theta || pi_ref)
    theta, o, rf = (torch.tensor(G.normal(size=12)).log_softmax(0) for _ in range(3))
    expectation = (o.exp() * unbiased_kl(theta, o, rf)).sum()
    exact = (theta.exp() * (theta - rf)).sum()
    assert expectation.item() == pytest.approx(exact.item(), rel=1e-12)


@pytest.mark.parametrize("unbiased", [False, True])
def test_kl_loss_aggregates_like_the_policy_loss(unbiased):
    lp, old, ref = (-np.abs(G.normal(1, 1, (4, 5))) for _ in range(3))
    mask = G.random((4, 5)) < 0.7
    mask[0] = True
    per = np.exp(ref - lp) - (ref - lp) - 1
    if unbiased:
        per = np.exp(lp - old) * per
    cfg = KLConfig(coef=0.05, use_unbiased=unbiased)
    m = torch.tensor(mask)
    loss, metrics = kl_loss(torch.tensor(lp), torch.tensor(ref), m, cfg=cfg, aggregation="token_mean",
                            normalizer=loss_normalizer(m, "token_mean"), old_logprobs=torch.tensor(old))
    assert loss.item() == pytest.approx(0.05 * per[mask].sum() / mask.sum(), rel=1e-12)
    assert metrics["kl_ref"].item() == pytest.approx(per[mask].mean(), rel=1e-12)
    if unbiased:
        with pytest.raises(ValueError, match="algorithm.kl.use_unbiased"):
            kl_loss(torch.tensor(lp), torch.tensor(ref), m, cfg=cfg, aggregation="token_mean", normalizer=1.0)


def test_keep_sampling_mask_bool_and_ids_agree_with_formula_and_gradient():
    V = 10
    logits = G.normal(size=(2, 3, V))
    ids = np.full((2, 3, 4), -1)
    ids[0, 0, :3] = [1, 4, 7]
    ids[0, 1, :4] = [0, 2, 3, 9]
    ids[1, 0, :1] = [5]
    ids[1, 1, :2] = [8, 8]          # a duplicate id is harmless
    ids[1, 2, :3] = [6, 2, 1]       # [0, 2] stays empty: full vocabulary
    chosen = np.array([[4, 9, 3], [5, 8, 1]])
    want, dwant = np.zeros((2, 3)), np.zeros_like(logits)
    for i in range(2):
        for t in range(3):
            kept = sorted(set(ids[i, t][ids[i, t] >= 0])) or list(range(V))
            z = np.exp(logits[i, t, kept] - logits[i, t, kept].max())
            p = z / z.sum()
            want[i, t] = np.log(p[kept.index(chosen[i, t])])
            dwant[i, t, kept] = -p
            dwant[i, t, chosen[i, t]] += 1
    bool_mask = np.zeros((2, 3, V), dtype=bool)
    for i in range(2):
        for t in range(3):
            bool_mask[i, t, ids[i, t][ids[i, t] >= 0]] = True
    for keep in (torch.tensor(ids), torch.tensor(bool_mask)):
        x = torch.tensor(logits, requires_grad=True)
        got = masked_token_logprobs(x, keep, torch.tensor(chosen))
        got.sum().backward()
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-12)
        np.testing.assert_allclose(x.grad.numpy(), dwant, rtol=1e-10, atol=1e-14)
    full = masked_log_softmax(torch.tensor(logits), torch.tensor(bool_mask))
    assert torch.isinf(full[0, 0, 0]) and torch.isfinite(full[0, 2]).all()


def test_mismatch_metrics():
    old = -np.abs(G.normal(1, 1, (5, 6)))
    mu = old + 0.3 * G.normal(size=(5, 6))
    mask = G.random((5, 6)) < 0.8
    mask[1, 2] = True
    mu[1, 2] = np.nan
    valid = mask & np.isfinite(mu)
    keep = valid & (G.random((5, 6)) < 0.7)
    lr = (old - mu)[valid]
    m = mismatch_metrics(torch.tensor(old), torch.tensor(mu), torch.tensor(mask), keep=torch.tensor(keep))
    want = {
        "k1": (-lr).mean(), "k3": (np.exp(lr) - lr - 1).mean(), "ppl_old": np.exp(-old[valid].mean()),
        "ppl_rollout": np.exp(-mu[valid].mean()), "chi2": (np.exp(lr) ** 2).mean() - 1,
        "max_abs_log_rho": np.abs(lr).max(), "nonfinite_tokens": 1.0,
        "masked_frac": (mask & ~keep).sum() / mask.sum(),
    }
    for k, v in want.items():
        assert m[f"mismatch/{k}"].item() == pytest.approx(v, rel=1e-10), k
    empty = mismatch_metrics(torch.tensor(old), torch.tensor(mu), torch.zeros(5, 6, dtype=torch.bool))
    assert all(torch.isfinite(v) for v in empty.values())

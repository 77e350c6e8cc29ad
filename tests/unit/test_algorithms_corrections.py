"""Corrections (TIS, MIS, Geo-RS, veto, IcePop, OPSM, Sparse-RL, batch skip) against numpy float64
formulas, their composition, Sparse-RL's rejection/denominator rules end to end with gradients, and
the edge cases (all rejected, inf/NaN rollout logprobs).

    .venv/bin/python -m pytest -q tests/unit/test_algorithms_corrections.py
"""
import numpy as np
import pytest
import torch

from megatron_sparse_rl.algorithms import apply_corrections, loss_normalizer, policy_loss
from megatron_sparse_rl.algorithms.corrections import opsm_keep
from megatron_sparse_rl.config.algorithm import (
    BatchSkipConfig, CorrectionsConfig, GeoRSConfig, IcePopConfig, LossConfig, MISConfig, OPSMConfig,
    SparseRLConfig, TISConfig, VetoConfig,
)

B, T = 8, 7


def make(seed=0, noise=0.4):
    g = np.random.default_rng(seed)
    old = -np.abs(g.normal(1.0, 0.8, (B, T)))
    mu = old + noise * g.normal(size=(B, T))
    mu[0] = old[0] + 1e-4 * g.normal(size=T)       # nearly on-policy rows (pass the tight Geo-RS bounds)
    mu[1] = old[1] + 2e-4 * g.normal(size=T)
    mu[2, 3] = old[2, 3] + 12.0                     # one catastrophic token: rho = e^-12 < 1e-4
    mask = g.random((B, T)) < 0.85
    mask[2, 3] = True
    mask[5] = False                                 # an empty row
    adv = g.normal(size=B)
    return old, mu, mask, adv


def run(cfg, old, mu, mask, adv=None, logprobs=None):
    t = lambda a: None if a is None else torch.tensor(a)  # noqa: E731
    return apply_corrections(cfg, t(old), t(mu), torch.tensor(mask), advantages=t(adv), logprobs=t(logprobs))


def check(res, weights, keep):
    np.testing.assert_array_equal(res.keep.numpy(), keep)
    np.testing.assert_allclose(res.weights.numpy(), np.where(keep, weights, 0.0), rtol=1e-12, atol=1e-300)


def rows(keep_row, mask):
    return mask & np.asarray(keep_row)[:, None]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis(level):
    old, mu, mask, _ = make()
    rho = np.exp(old - mu)
    if level == "token":
        w = np.minimum(rho, 2.0)
    else:
        w = np.repeat(np.minimum(np.prod(np.where(mask, rho, 1.0), axis=1), 2.0)[:, None], T, 1)
    res = run(CorrectionsConfig(tis=TISConfig(enabled=True, level=level)), old, mu, mask)
    check(res, w, mask)


@pytest.mark.parametrize("reweight", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis(level, reweight):
    old, mu, mask, _ = make(1)
    rho = np.exp(old - mu)
    if level == "token":
        keep = mask & (rho >= 0.5) & (rho <= 2.0)
        w = rho if reweight else np.ones_like(rho)
    else:
        prod = np.prod(np.where(mask, rho, 1.0), axis=1)
        keep = rows((prod >= 0.5) & (prod <= 2.0), mask)
        w = np.repeat(prod[:, None], T, 1) if reweight else np.ones_like(rho)
    assert 0 < keep.sum() < mask.sum()
    res = run(CorrectionsConfig(mis=MISConfig(enabled=True, level=level, reweight=reweight)), old, mu, mask)
    check(res, w, keep)


def test_geo_rs_veto_icepop():
    old, mu, mask, _ = make(2)
    rho = np.exp(old - mu)
    geo = np.exp((np.where(mask, old - mu, 0)).sum(1) / np.maximum(mask.sum(1), 1))
    keep = rows((geo >= 0.999) & (geo <= 1.001), mask)
    assert keep[0].any() and not keep[3].any()
    check(run(CorrectionsConfig(geo_rs=GeoRSConfig(enabled=True)), old, mu, mask), np.ones_like(rho), keep)

    keep = rows(~(mask & (rho < 1e-4)).any(1), mask)
    assert not keep[2].any() and keep.sum() == mask.sum() - mask[2].sum()
    check(run(CorrectionsConfig(veto=VetoConfig(enabled=True)), old, mu, mask), np.ones_like(rho), keep)

    keep = mask & (rho >= 0.5) & (rho <= 5.0)
    check(run(CorrectionsConfig(icepop=IcePopConfig(enabled=True)), old, mu, mask), rho, keep)


def test_opsm_uses_current_policy_and_negative_advantages():
    old, mu, mask, adv = make(3, noise=1.0)
    g = np.random.default_rng(9)
    lp = old + 0.5 * g.normal(size=(B, T))
    for current in (None, lp):
        pi = old if current is None else lp
        drift = np.where(mask, mu - pi, 0).sum(1) / np.maximum(mask.sum(1), 1)
        keep = rows(~((drift > 0.5) & (adv < 0)), mask)
        res = run(CorrectionsConfig(opsm=OPSMConfig(enabled=True)), old, mu, mask, adv=adv, logprobs=current)
        check(res, np.ones_like(old), keep)
    assert keep.sum() < mask.sum()
    with pytest.raises(ValueError, match="opsm"):
        run(CorrectionsConfig(opsm=OPSMConfig(enabled=True)), old, mu, mask)


def test_icepop_weight_of_a_dropped_overflowing_token_is_zero_not_nan():
    old = torch.tensor([[-1.0, -1.0, -1.0]])  # float32: rho = e^119 overflows
    mu = torch.tensor([[-1.2, -120.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    res = apply_corrections(CorrectionsConfig(icepop=IcePopConfig(enabled=True)), old, mu, mask)
    assert res.keep.tolist() == [[True, False, True]]
    torch.testing.assert_close(res.weights, torch.tensor([[float(np.exp(0.2)), 0.0, 1.0]]))


def test_opsm_keep_is_the_per_sequence_rule_and_ignores_padding():
    old, mu, mask, adv = make(4, noise=1.0)
    lp = old + 0.6 * np.random.default_rng(2).normal(size=(B, T))
    drift = np.where(mask, mu - lp, 0).sum(1) / np.maximum(mask.sum(1), 1)
    want = ~((drift > 0.3) & (adv < 0))
    padded = torch.tensor(np.where(mask, lp, np.nan))  # padding may hold NaN/inf
    t = torch.tensor
    got = opsm_keep(OPSMConfig(enabled=True, delta=0.3), t(mu), padded, t(mask), t(adv))
    assert got.shape == (B, 1) and got.dtype == torch.bool
    np.testing.assert_array_equal(got.squeeze(-1).numpy(), want)
    assert not want.all() and got[t(adv) > 0].all()  # some dropped; positive advantages never


def sparse_rl_reference(old, mu, mask, token_reject=False):
    xi = np.exp(np.clip(old - mu, -20, 20))
    keep = rows(~(mask & (xi < 1e-4)).any(1), mask)
    if token_reject:
        keep &= (xi >= 0.5) & (xi <= 1.5)
    w = np.minimum(xi, 1.5)
    return w / w[keep].mean(), keep


@pytest.mark.parametrize("token_reject", [False, True])
def test_sparse_rl_weights(token_reject):
    old, mu, mask, _ = make(4)
    mu[6, 0] = old[6, 0] - 50.0  # log rho = 50: clamped to 20, weight capped at 1.5
    mask[6, 0] = True
    w, keep = sparse_rl_reference(old, mu, mask, token_reject)
    res = run(CorrectionsConfig(sparse_rl=SparseRLConfig(enabled=True, token_reject=token_reject)), old, mu, mask)
    check(res, w, keep)
    assert res.weights[res.keep].mean().item() == pytest.approx(1.0)
    # the sequence with one xi < eps is zero everywhere
    assert not res.keep[2].any() and (res.weights[2] == 0).all()
    seqs = mask.any(1)
    assert res.metrics["sparse_rl/rejected_seq_frac"].item() == pytest.approx(1 / seqs.sum())


def ppo_objective(lp, old, adv, keep, w):
    """Sparse-RL objective by hand: mean over kept sequences of the mean over kept tokens of
    w * -min(r A, clip(r, 0.8, 1.2) A); and its gradient in lp."""
    r, a = np.exp(lp - old), adv[:, None] * np.ones_like(lp)
    un, cl = -r * a, -np.clip(r, 0.8, 1.2) * a
    kept_rows = [i for i in range(lp.shape[0]) if keep[i].any()]
    value, grad = 0.0, np.zeros_like(lp)
    for i in kept_rows:
        n = keep[i].sum()
        for t in np.flatnonzero(keep[i]):
            value += w[i, t] * max(un[i, t], cl[i, t]) / n / len(kept_rows)
            if un[i, t] >= cl[i, t]:
                grad[i, t] = w[i, t] * (-a[i, t] * r[i, t]) / n / len(kept_rows)
    return value, grad


@pytest.mark.parametrize("token_reject", [False, True])
def test_sparse_rl_end_to_end_rejected_tokens_leave_denominators(token_reject):
    old, mu, mask, adv = make(5)
    g = np.random.default_rng(1)
    lp = old + 0.3 * g.normal(size=(B, T))
    cfg = CorrectionsConfig(sparse_rl=SparseRLConfig(enabled=True, token_reject=token_reject))
    res = run(cfg, old, mu, mask)
    train_mask = torch.tensor(mask) & res.keep
    x = torch.tensor(lp, requires_grad=True)
    loss, _ = policy_loss(x, torch.tensor(old), torch.tensor(adv), train_mask,
                          cfg=LossConfig(name="grpo", aggregation="seq_mean_token_mean"),
                          normalizer=loss_normalizer(train_mask, "seq_mean_token_mean"), weights=res.weights)
    loss.backward()
    w, keep = sparse_rl_reference(old, mu, mask, token_reject)
    want_v, want_g = ppo_objective(lp, old, adv, keep, w)
    assert loss.item() == pytest.approx(want_v, rel=1e-10)
    np.testing.assert_allclose(x.grad.numpy(), want_g, rtol=1e-9, atol=1e-14)
    assert (x.grad[2] == 0).all()


def test_composition_multiplies_weights_and_ands_masks():
    old, mu, mask, _ = make(6)
    rho = np.exp(old - mu)
    cfg = CorrectionsConfig(tis=TISConfig(enabled=True, cap=1.5), mis=MISConfig(enabled=True, low=0.6, high=1.8),
                            veto=VetoConfig(enabled=True))
    keep = rows(~(mask & (rho < 1e-4)).any(1), mask) & (rho >= 0.6) & (rho <= 1.8)
    res = run(cfg, old, mu, mask)
    check(res, np.minimum(rho, 1.5), keep)
    assert res.metrics["corrections/kept_token_frac"].item() == pytest.approx(keep.sum() / mask.sum())
    assert {"tis/truncated_frac", "mis/rejected_token_frac", "veto/vetoed_seq_frac"} <= set(res.metrics)


def test_nothing_enabled_is_identity():
    old, mu, mask, _ = make(7)
    res = run(CorrectionsConfig(), old, mu, mask)
    check(res, np.ones_like(old), mask)


def test_batch_skip():
    old, mu, mask, _ = make(8, noise=0.05)
    mu[2, 3] = old[2, 3]  # no catastrophic token here
    k1 = (mu - old)[mask].mean()
    res = run(CorrectionsConfig(batch_skip=BatchSkipConfig(enabled=True, max_k1=0.1)), old, mu, mask)
    assert res.metrics["batch_skip/k1"].item() == pytest.approx(k1)
    assert k1 < 0.1 and res.metrics["batch_skip/skipped"].item() == 0 and (res.keep.numpy() == mask).all()
    mu_far = mu + 0.5  # the sampler gives every token more mass: k1 ~ 0.5 > 0.1
    res = run(CorrectionsConfig(batch_skip=BatchSkipConfig(enabled=True)), old, mu_far, mask)
    assert res.metrics["batch_skip/skipped"].item() == 1 and not res.keep.any()


def test_all_rejected_gives_zero_loss_and_says_so():
    old, mu, mask, adv = make(9)
    mu[:, 0] = old[:, 0] + 15.0
    mask[:, 0] = True
    res = run(CorrectionsConfig(sparse_rl=SparseRLConfig(enabled=True)), old, mu, mask)
    assert res.metrics["corrections/all_rejected"].item() == 1.0
    assert res.metrics["sparse_rl/rejected_seq_frac"].item() == 1.0
    assert (res.weights == 0).all() and torch.isfinite(res.weights).all()
    train_mask = torch.tensor(mask) & res.keep
    lp = torch.tensor(old, requires_grad=True)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        loss, metrics = policy_loss(lp, torch.tensor(old), torch.tensor(adv), train_mask,
                                    cfg=LossConfig(aggregation=mode), normalizer=loss_normalizer(train_mask, mode),
                                    weights=res.weights)
        loss.backward()
        assert loss.item() == 0.0 and torch.isfinite(lp.grad).all() and (lp.grad == 0).all()
        assert all(torch.isfinite(v) for v in metrics.values())


def test_nonfinite_rollout_logprobs_are_masked_and_counted():
    old, mu, mask, adv = make(10)
    mask[3, :4] = True
    mask[4, 6] = False
    mu[3, 0], mu[3, 1], mu[3, 2] = np.inf, -np.inf, np.nan
    mu[4, 6] = np.nan  # padding: not counted
    cfg = CorrectionsConfig(tis=TISConfig(enabled=True), sparse_rl=SparseRLConfig(enabled=True),
                            batch_skip=BatchSkipConfig(enabled=True, max_k1=10.0), opsm=OPSMConfig(enabled=True))
    res = run(cfg, old, mu, mask, adv=adv)
    assert res.metrics["corrections/nonfinite_tokens"].item() == 3
    assert not res.keep[3, :3].any() and res.keep[3, 3]
    assert torch.isfinite(res.weights).all()
    assert all(torch.isfinite(v).all() for v in res.metrics.values())
    # the other tokens are treated exactly as if the bad ones were padding
    clean_mask = mask.copy()
    clean_mask[3, :3] = False
    mu_clean = np.where(np.isfinite(mu), mu, 0.0)
    ref = run(cfg, old, mu_clean, clean_mask, adv=adv)
    torch.testing.assert_close(res.weights, ref.weights)
    assert torch.equal(res.keep, ref.keep)

"""Policy losses against float64 formulas written out here with numpy (values and analytic gradients),
GSPO-token == GSPO, micro-batch additivity, edge cases and the registry.

    .venv/bin/python -m pytest -q tests/unit/test_algorithms_losses.py
"""
import numpy as np
import pytest
import torch

from megatron_sparse_rl.algorithms import POLICY_LOSSES, get_policy_loss, loss_normalizer, policy_loss
from megatron_sparse_rl.config.algorithm import LossConfig, LossName
from typing import get_args

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
B, T = 6, 9


def make_batch(seed, spread=0.3, token_adv=False):
    g = np.random.default_rng(seed)
    old = -np.abs(g.normal(1.0, 0.7, (B, T)))
    lp = old + spread * g.normal(size=(B, T))
    mask = g.random((B, T)) < 0.8
    mask[0, :] = False  # an empty row
    mask[1, :] = True
    adv = g.normal(size=(B, T)) if token_adv else g.normal(size=B)
    w = g.uniform(0.3, 1.7, (B, T))
    return lp, old, adv, mask, w


def agg_coef(mask, mode):
    """d loss / d (token term) for each aggregation mode, from the full mask."""
    m = mask.astype(np.float64)
    if mode == "token_mean":
        return m / max(m.sum(), 1)
    nseq = max((m.sum(1) > 0).sum(), 1)
    if mode == "seq_mean_token_sum":
        return m / nseq
    return m / np.maximum(m.sum(1, keepdims=True), 1) / nseq


def adv2d(adv):
    return adv if adv.ndim == 2 else np.repeat(adv[:, None], T, axis=1)


def ref_ppo(lp, old, adv, mask, w, lo, hi, mode, dual_c=None):
    """value and d/dlp of sum_t c_t * w_t * (-min(r A, clip(r) A)) [dual: min(., -cA) for A < 0]."""
    r, a = np.exp(lp - old), adv2d(adv)
    unclipped, clipped = -r * a, -np.clip(r, 1 - lo, 1 + hi) * a
    v = np.maximum(unclipped, clipped)
    grad_active = unclipped >= clipped  # the r*A branch is the one chosen (ties: r inside the range)
    if dual_c is not None:
        cap = (a < 0) & (v > -dual_c * a)
        v = np.where(cap, -dual_c * a, v)
        grad_active &= ~cap
    c = agg_coef(mask, mode)
    return (c * w * v).sum(), c * w * np.where(grad_active, -a * r, 0.0)


def ref_gspo(lp, old, adv, mask, w, lo, hi, mode, token_level):
    m = mask.astype(np.float64)
    n = np.maximum(m.sum(1, keepdims=True), 1)
    s = np.exp((m * (lp - old)).sum(1, keepdims=True) / n) * np.ones_like(lp)
    a = adv2d(adv)
    unclipped, clipped = -s * a, -np.clip(s, 1 - lo, 1 + hi) * a
    v = np.maximum(unclipped, clipped)
    d = np.where(unclipped >= clipped, -a * s, 0.0)  # d(term)/d(log s)
    c = agg_coef(mask, mode)
    if token_level:
        grad = c * w * d
    else:  # log s_i = mean_t log r_t: every token of the row gets (sum_t c w d) / |y_i|
        grad = (c * w * d).sum(1, keepdims=True) * m / n
    return (c * w * v).sum(), grad


def ref_cispo(lp, old, adv, mask, w, lo, hi, mode):
    r, a = np.exp(lp - old), adv2d(adv)
    coef = np.clip(r, 1 - lo, 1 + hi)
    c = agg_coef(mask, mode)
    return (c * w * (-coef * a)).sum(), c * w * (-coef * a)


def run_impl(name, lp, old, adv, mask, w, mode, **cfg_kw):
    cfg = LossConfig(name=name, aggregation=mode, **cfg_kw)
    x = torch.tensor(lp, requires_grad=True)
    norm = loss_normalizer(torch.tensor(mask), mode)
    loss, metrics = get_policy_loss(name)(x, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), cfg=cfg,
                                          normalizer=norm, weights=torch.tensor(w))
    loss.backward()
    return loss.item(), x.grad.numpy(), metrics


REFS = {
    "grpo": lambda *a, mode: ref_ppo(*a, 0.2, 0.2, mode),
    "dapo": lambda *a, mode: ref_ppo(*a, 0.2, 0.28, mode),
    "dual_clip": lambda *a, mode: ref_ppo(*a, 0.2, 0.2, mode, dual_c=3.0),
    "gspo": lambda *a, mode: ref_gspo(*a, 3e-4, 4e-4, mode, token_level=False),
    "gspo_token": lambda *a, mode: ref_gspo(*a, 3e-4, 4e-4, mode, token_level=True),
    "cispo": lambda *a, mode: ref_cispo(*a, 1.0, 0.28, mode),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(REFS))
@pytest.mark.parametrize("token_adv", [False, True])
def test_loss_matches_float64_formula(name, mode, token_adv):
    spread = 4e-3 if name.startswith("gspo") else 0.4  # so that some (sequence) ratios clip, some not
    batch = make_batch(3, spread=spread, token_adv=token_adv)
    if name == "dual_clip":  # a few very large ratios with negative advantages hit the cap c = 3
        batch[0][2:4, :3] += 1.5
    want_v, want_g = REFS[name](*batch, mode=mode)
    got_v, got_g, _ = run_impl(name, *batch, mode)
    assert got_v == pytest.approx(want_v, rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(got_g, want_g, rtol=1e-9, atol=1e-12)


def test_clip_metrics_and_dual_clip_fraction():
    lp, old, adv, mask, w = make_batch(5, spread=0.5)
    lp[2:4, :3] += 1.5
    _, _, m = run_impl("dual_clip", lp, old, adv, mask, w, "token_mean")
    r, a = np.exp(lp - old), adv2d(adv)
    n = mask.sum()
    assert m["clip_frac_low"].item() == pytest.approx((mask & (r < 0.8) & (a < 0)).sum() / n)
    assert m["clip_frac_high"].item() == pytest.approx((mask & (r > 1.2) & (a > 0)).sum() / n)
    assert m["dual_clip_frac"].item() == pytest.approx((mask & (r > 3.0) & (a < 0)).sum() / n)
    assert m["dual_clip_frac"].item() > 0
    assert m["ratio_max"].item() == pytest.approx(r[mask].max())
    assert m["kl_k3"].item() == pytest.approx((r - 1 - np.log(r))[mask].mean())
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in m.values())


@pytest.mark.parametrize("mode", MODES)
def test_gspo_token_equals_gspo_for_sequence_advantages(mode):
    lp, old, adv, mask, w = make_batch(7, spread=2e-3)
    w = np.ones_like(w)
    v1, g1, _ = run_impl("gspo", lp, old, adv, mask, w, mode)
    v2, g2, _ = run_impl("gspo_token", lp, old, adv, mask, w, mode)
    assert v1 == pytest.approx(v2, rel=1e-12)
    np.testing.assert_allclose(g1, g2, rtol=1e-10, atol=1e-14)
    assert np.abs(g1).sum() > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_micro_batches_add_up_to_full_batch(name, mode):
    lp, old, adv, mask, w = (torch.tensor(a) for a in make_batch(11, spread=0.3 if "gspo" not in name else 3e-3))
    cfg = LossConfig(name=name, aggregation=mode)
    norm = loss_normalizer(mask, mode)  # from the full batch
    full = lp.clone().requires_grad_(True)
    loss_full, _ = policy_loss(full, old, adv, mask, cfg=cfg, normalizer=norm, weights=w)
    loss_full.backward()
    micro = lp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, B)):
        loss, _ = policy_loss(micro[rows], old[rows], adv[rows], mask[rows], cfg=cfg, normalizer=norm, weights=w[rows])
        loss.backward()
        total = total + loss.detach()
    assert total.item() == pytest.approx(loss_full.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(micro.grad, full.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_empty_mask_and_nonfinite_padding_give_zero_not_nan(name):
    lp = torch.full((3, 4), float("nan"), dtype=torch.float64, requires_grad=True)
    old = torch.full((3, 4), float("-inf"), dtype=torch.float64)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    for mode in MODES:
        loss, metrics = policy_loss(lp, old, torch.ones(3, dtype=torch.float64), mask,
                                    cfg=LossConfig(name=name, aggregation=mode), normalizer=loss_normalizer(mask, mode))
        loss.backward()
        assert loss.item() == 0.0
        assert torch.isfinite(lp.grad).all() and (lp.grad == 0).all()
        assert all(torch.isfinite(v).all() for v in metrics.values())


def test_entropy_metric_and_unweighted_default():
    lp, old, adv, mask, _ = (torch.tensor(a) for a in make_batch(2))
    ent = torch.rand(B, T, dtype=torch.float64)
    cfg = LossConfig(name="grpo")
    norm = loss_normalizer(mask, "token_mean")
    loss_none, m = policy_loss(lp, old, adv, mask, cfg=cfg, normalizer=norm, entropy=ent)
    loss_ones, _ = policy_loss(lp, old, adv, mask, cfg=cfg, normalizer=norm, weights=torch.ones_like(lp))
    assert loss_none.item() == pytest.approx(loss_ones.item())
    assert m["entropy"].item() == pytest.approx(ent[mask].mean().item())


def test_registry_matches_config_literal_and_lists_choices():
    assert set(POLICY_LOSSES) == set(get_args(LossName))
    with pytest.raises(KeyError, match="choices: .*'cispo'.*'grpo'"):
        get_policy_loss("ppo2")


def test_explicit_clip_overrides_default():
    assert LossConfig(name="dapo").clip_bounds() == (0.2, 0.28)
    assert LossConfig(name="gspo").clip_bounds() == (3e-4, 4e-4)
    assert LossConfig(name="grpo", clip_high=0.3).clip_bounds() == (0.2, 0.3)
    lp, old, adv, mask, w = make_batch(4, spread=0.5)
    want_v, want_g = ref_ppo(lp, old, adv, mask, w, 0.1, 0.3, "token_mean")
    got_v, got_g, _ = run_impl("grpo", lp, old, adv, mask, w, "token_mean", clip_low=0.1, clip_high=0.3)
    assert got_v == pytest.approx(want_v, rel=1e-10)
    np.testing.assert_allclose(got_g, want_g, rtol=1e-9, atol=1e-12)


def gspo_clamped_mean_reference(raw, mask, adv, lo, hi, token_level):
    """float64 GSPO(-token) with seq_mean_token_mean and unit weights: log s_i = clip(mean_t log r_t, -20, 20)
    over the sequence's UNclamped token log-ratios `raw`; (value, d value / d logprobs)."""
    m = mask.astype(np.float64)
    n = np.maximum(m.sum(1, keepdims=True), 1)
    nseq = max((m.sum(1) > 0).sum(), 1)
    mean = np.where(mask, raw, 0.0).sum(1, keepdims=True) / n
    s = np.exp(np.clip(mean, -20.0, 20.0))
    a = adv[:, None]
    unclipped, clipped = -s * a, -np.clip(s, 1 - lo, 1 + hi) * a
    v = np.maximum(unclipped, clipped)                        # each token of row i carries v_i
    d = np.where(unclipped >= clipped, -a * s, 0.0)           # d v_i / d log s_i
    # GSPO: d log s_i / d lp_t = 1/|y_i| inside the clamp, 0 outside; GSPO-token: its token term's 1 (sg[s_i]).
    dlogs = np.ones_like(mean) if token_level else (np.abs(mean) < 20.0) / n
    coef = m / n / nseq if token_level else m / nseq          # the aggregation's weight on each token term
    value = (np.where(mask, v, 0.0) / n).sum() / nseq
    return value, coef * d * dlogs


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_sequence_ratio_uses_unclamped_token_log_ratios(name):
    """s_i = exp(mean_t log r_t) with the +-20 clamp on the MEAN only: token log-ratios 30 and 0 give s = e^15
    (a per-token clamp would give e^10); 50 and 0 give the clamped e^20 (per-token: e^10)."""
    raw = np.array([[30.0, 0.0, 0.0], [50.0, 0.0, 0.0], [1e-3, -2e-3, 5e-4]])
    mask = np.array([[True, True, False], [True, True, False], [True, True, True]])
    adv = np.array([-1.0, -0.5, 0.7])  # A < 0 on the extreme rows: the unclipped s_i A branch is taken
    old = -np.abs(np.random.default_rng(0).normal(1.0, 0.5, raw.shape))
    lp = np.where(mask, old + raw, np.inf)  # padding holds inf: must stay unused
    cfg = LossConfig(name=name, aggregation="seq_mean_token_mean")
    x = torch.tensor(lp, requires_grad=True)
    mask_t = torch.tensor(mask)
    loss, metrics = get_policy_loss(name)(x, torch.tensor(old), torch.tensor(adv), mask_t, cfg=cfg,
                                          normalizer=loss_normalizer(mask_t, "seq_mean_token_mean"))
    loss.backward()
    want_v, want_g = gspo_clamped_mean_reference(raw, mask, adv, *cfg.clip_bounds(), token_level=name == "gspo_token")
    assert loss.item() == pytest.approx(want_v, rel=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), want_g, rtol=1e-12, atol=1e-12)
    s = np.exp(np.array([15.0, 20.0, (1e-3 - 2e-3 + 5e-4) / 3]))
    assert metrics["seq_ratio_mean"].item() == pytest.approx((2 * s[0] + 2 * s[1] + 3 * s[2]) / 7, rel=1e-12)

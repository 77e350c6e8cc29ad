"""MiniRL (arXiv 2512.01374) as configs/minirl.yaml composes it: the trainer's update loss (training/update.py
`make_loss`) against a float64 hand computation of the MiniRL gradient, the study's arms as config overrides, the
current-policy TIS option (`algorithm.corrections.tis.ratio: pi_theta`) and its config checks.

MiniRL per response token t of row i (B rows in the mini-batch, no per-sequence length normalisation):
    grad_{log pi_theta(y_t)} loss = -(1/B) M_t min(pi_theta/mu, 5) A_i,   A_i = R_i - mean_group R,
    M_t = 0 iff (A_i > 0 and r_t > 1.27) or (A_i < 0 and r_t < 0.8),       r_t = pi_theta/pi_old.

    .venv/bin/python -m pytest -q tests/unit/test_minirl.py
"""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_sparse_rl.algorithms import apply_corrections, compute_advantages, loss_normalizer
from megatron_sparse_rl.config import load_config
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.algorithm import (
    AlgorithmConfig, CorrectionsConfig, LossConfig, TISConfig,
)
from megatron_sparse_rl.training.learner_batch import LearnerBatch
from megatron_sparse_rl.training.update import OBJECTIVE, PreparedBatch, make_loss, prepare
from tests.unit.test_training_update import two_sample_batch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "minirl.yaml"
CAP, LOW, HIGH = 5.0, 0.8, 1.27


def minirl(*overrides: str) -> AlgorithmConfig:
    return load_config(CONFIG, list(overrides)).algorithm


# Four rows, columns 1..5 score response tokens (column 0 is the prompt). Per token: (r_t, rho_t) with
# r = pi_theta/pi_old and rho = pi_old/mu; None = padding. Rewards 1, 0 (group 0) and 0.5, 0 (group 1) give
# A = +0.5, -0.5, +0.25, -0.25.
TOKENS = [
    [(1.1, 1.0), (1.35, 1.2), (0.7, 0.9), (1.2, 4.5), (0.9, 6.0)],   # A > 0: r 1.35 masked; cap binds on the last
    [(0.75, 1.1), (1.4, 0.8), (0.95, 1.0), None, None],              # two (5.4 -> 5 and 5.4 -> 5); A < 0: r 0.75
    [(1.26, 1.0), (1.28, 0.9), None, None, None],                    # masked, r 1.4 kept; r 1.28 masked (A > 0)
    [(0.81, 0.3), (0.79, 1.5), (1.0, 2.0), (1.05, 0.5), None],       # r 0.79 masked (A < 0)
]
REWARDS, GROUPS = np.array([1.0, 0.0, 0.5, 0.0]), np.array([0, 0, 1, 1])


def _batch():
    """(PreparedBatch, current logprobs, float64 arrays r, rho, mask, A). Padding holds values that would poison
    a sum (NaN in mu, a huge pi_theta) and must not matter."""
    rows, cols = len(TOKENS), 1 + max(len(t) for t in TOKENS)
    r, rho = np.ones((rows, cols)), np.ones((rows, cols))
    mask = np.zeros((rows, cols), dtype=bool)
    for i, row in enumerate(TOKENS):
        for j, tok in enumerate(row):
            if tok is not None:
                r[i, j + 1], rho[i, j + 1], mask[i, j + 1] = tok[0], tok[1], True
    g = np.random.default_rng(0)
    old = np.where(mask, -g.uniform(0.5, 2.5, mask.shape), 0.0)
    mu = np.where(mask, old - np.log(rho), np.nan)
    lp = np.where(mask, old + np.log(r), 30.0)
    adv = REWARDS - np.array([REWARDS[GROUPS == k].mean() for k in GROUPS])  # R - group mean, no std
    t = torch.tensor
    prep = PreparedBatch(tokens=torch.zeros(rows, cols + 1, dtype=torch.long), mask=t(mask), old_logprobs=t(old),
                         rollout_logprobs=t(mu), advantages=t(adv), weights=torch.ones(rows, cols, dtype=torch.float64),
                         metrics={}, loss_mask=t(mask))
    return prep, lp, r, rho, mask, adv


def _run(cfg: AlgorithmConfig):
    prep, lp, *_ = _batch()
    rows = torch.arange(prep.tokens.shape[0])
    norm = loss_normalizer(prep.mask, cfg.loss.aggregation)
    x = torch.tensor(lp, requires_grad=True)
    loss, metrics = make_loss(prep, rows, cfg, norm)(x, torch.zeros_like(x), rows)
    loss.backward()
    return loss.item(), x.grad.numpy(), metrics


def _keep(r, adv):
    """MiniRL's M_t: the decoupled-PPO mask (1 inside the clip range or moving against the advantage)."""
    a = adv[:, None]
    return ~(((a > 0) & (r > HIGH)) | ((a < 0) & (r < LOW)))


def test_the_config_selects_minirl():
    cfg = minirl()
    assert (cfg.advantage.estimator, cfg.advantage.scale_by_std) == ("grpo", False)
    assert (cfg.loss.name, cfg.loss.clip_bounds(), cfg.loss.aggregation) == ("grpo", (0.2, 0.27),
                                                                              "seq_mean_token_sum")
    tis = cfg.corrections.tis
    assert (tis.enabled, tis.level, tis.cap, tis.ratio) == (True, "token", 5.0, "pi_theta")
    others = [n for n in ("mis", "geo_rs", "veto", "icepop", "opsm", "sparse_rl", "batch_skip")
              if getattr(cfg.corrections, n).enabled]
    assert others == [] and cfg.kl.coef == 0 and cfg.old_logprobs == "learner"
    run = load_config(CONFIG)
    validate(run, run.launch.world_size, cuda=False)


def test_advantages_are_group_centred_without_std():
    _, _, _, _, _, adv = _batch()
    got = compute_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), cfg=minirl().advantage)
    np.testing.assert_allclose(got.numpy(), adv, rtol=0, atol=1e-15)
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.25, -0.25])


def test_update_loss_and_gradient_are_minirl():
    loss, grad, metrics = _run(minirl())
    _, _, r, rho, mask, adv = _batch()
    B, a, keep = len(TOKENS), adv[:, None], _keep(r, adv)
    iw = np.minimum(r * rho, CAP)  # min(pi_theta / mu, 5)
    want_grad = np.where(mask & keep, -iw * a, 0.0) / B
    # The value is PPO's surrogate with the IS weight iw / r outside the clip: -iw A on kept tokens, a constant
    # (-iw clip(r) A / r) on masked ones.
    want_loss = np.where(mask, -iw / r * np.where(keep, r, np.clip(r, LOW, HIGH)) * a, 0.0).sum() / B
    np.testing.assert_allclose(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    # the cases the batch is built to hold: masked tokens of both signs, kept tokens outside the range, the cap
    assert (mask & ~keep).sum() == 4 and (grad[mask & ~keep] == 0).all()
    assert grad[0, 3] != 0 and grad[1, 2] != 0  # r 0.7 with A > 0 and r 1.4 with A < 0 keep their gradient
    np.testing.assert_allclose(grad[0, 4:6], [-CAP * 0.5 / B] * 2, rtol=1e-12)
    sums = metrics[OBJECTIVE]  # means come back times the token count
    assert float(sums.weighted["tis/truncated_frac"]) == pytest.approx(2.0)


def test_pi_old_tis_differs_only_where_the_cap_binds():
    """The pre-existing TIS (w = min(rho, 5) at rollout time, times PPO's r) is MiniRL's weight except where the
    cap binds: min(rho, 5) r = 5.4 and 4.5 on the two capped tokens, MiniRL 5 and 5."""
    _, _, r, rho, mask, adv = _batch()
    cfg = minirl("algorithm.corrections.tis.ratio=pi_old")
    prep, lp, *_ = _batch()
    prep = replace(prep, weights=torch.tensor(np.minimum(rho, CAP) * mask))  # what prepare's rollout-time TIS gives
    rows, x = torch.arange(len(TOKENS)), torch.tensor(lp, requires_grad=True)
    make_loss(prep, rows, cfg, loss_normalizer(prep.mask, "seq_mean_token_sum"))(x, torch.zeros_like(x),
                                                                                 rows)[0].backward()
    _, minirl_grad, _ = _run(minirl())
    B, keep = len(TOKENS), mask & _keep(r, adv)
    np.testing.assert_allclose(x.grad.numpy(), np.where(keep, -np.minimum(rho, CAP) * r * adv[:, None], 0.0) / B,
                               rtol=1e-12, atol=1e-15)
    differs = ~np.isclose(x.grad.numpy(), minirl_grad, rtol=1e-12, atol=1e-15)
    assert np.argwhere(differs).tolist() == [[0, 4], [0, 5]]
    np.testing.assert_allclose(x.grad.numpy()[0, 4:6] * B / -0.5, [5.4, 4.5], rtol=1e-12)


def test_arm_without_the_is_weight():
    _, grad, _ = _run(minirl("algorithm.corrections.tis.enabled=false"))
    _, _, r, _, mask, adv = _batch()
    # PPO's gradient without any weight: M_t r_t A (r_t = 1 on-policy, so M_t A there)
    np.testing.assert_allclose(grad, np.where(mask & _keep(r, adv), -r * adv[:, None], 0.0) / len(TOKENS),
                               rtol=1e-12, atol=1e-15)


def test_arm_with_length_normalisation():
    _, grad, _ = _run(minirl("algorithm.loss.aggregation=seq_mean_token_mean"))
    _, _, r, rho, mask, adv = _batch()
    length = mask.sum(axis=1, keepdims=True)
    want = np.where(mask & _keep(r, adv), -np.minimum(r * rho, CAP) * adv[:, None] / length, 0.0) / len(TOKENS)
    np.testing.assert_allclose(grad, want, rtol=1e-12, atol=1e-15)


def test_arm_without_clipping():
    _, grad, _ = _run(minirl("algorithm.loss.clip_low=1.0", "algorithm.loss.clip_high=1.0e9"))
    _, _, r, rho, mask, adv = _batch()
    np.testing.assert_allclose(grad, np.where(mask, -np.minimum(r * rho, CAP) * adv[:, None], 0.0) / len(TOKENS),
                               rtol=1e-12, atol=1e-15)  # M_t = 1 everywhere


@pytest.mark.parametrize("overrides", [["trainer.updates_per_rollout=8"], ["routing.mode=R2"], ["routing.mode=R3"]])
def test_the_other_arms_load_and_validate(overrides):
    run = load_config(CONFIG, overrides)
    validate(run, run.launch.world_size, cuda=False)


def test_pi_theta_tis_in_apply_corrections_with_and_without_current_logprobs():
    _, lp, r, rho, mask, _ = _batch()
    prep = _batch()[0]
    cfg = CorrectionsConfig(tis=TISConfig(enabled=True, cap=CAP, ratio="pi_theta"))
    old, mu = prep.old_logprobs, prep.rollout_logprobs
    res = apply_corrections(cfg, old, mu, prep.mask, logprobs=torch.tensor(lp))
    np.testing.assert_allclose(res.weights.numpy(), np.where(mask, np.minimum(r * rho, CAP) / r, 0.0), rtol=1e-12)
    at_old = apply_corrections(cfg, old, mu, prep.mask)  # pi_old stands in: the pi_old rule min(rho, C)
    np.testing.assert_allclose(at_old.weights.numpy(), np.where(mask, np.minimum(rho, CAP), 0.0), rtol=1e-12)


def test_prepare_leaves_the_current_policy_tis_to_the_updates():
    batch = two_sample_batch()
    view = LearnerBatch.from_rollout(batch, pad_id=0)
    mask, mu = view.loss_mask, view.rollout_logprobs

    class Learner:
        routing = None
        indexer = None  # no DSA indexer

        def forward_logprobs(self, tokens, *, lengths=None, extras=None):
            return {"logprobs": torch.where(mask, mu + 2.5, torch.zeros(()))}  # rho = e^2.5 > 5 on every token

    prep = prepare(Learner(), batch, minirl(), pad_id=0, dp_group=None)
    assert torch.equal(prep.weights, mask.float())  # no rollout-time TIS weight: the loss applies it
    assert not any(k.startswith("tis/") for k in prep.metrics)
    with_old = prepare(Learner(), batch, minirl("algorithm.corrections.tis.ratio=pi_old"), pad_id=0, dp_group=None)
    torch.testing.assert_close(with_old.weights, mask.float() * CAP)


@pytest.mark.parametrize("make, message", [
    (lambda: TISConfig(enabled=True, level="sequence", ratio="pi_theta"),
     r"algorithm\.corrections\.tis\.ratio = 'pi_theta' needs algorithm\.corrections\.tis\.level = 'token'"),
    (lambda: TISConfig(ratio="pi_new"), r"algorithm\.corrections\.tis\.ratio must be one of"),
    (lambda: AlgorithmConfig(loss=LossConfig(name="gspo"),
                             corrections=CorrectionsConfig(tis=TISConfig(enabled=True, ratio="pi_theta"))),
     r"algorithm\.loss\.name one of \['grpo', 'dapo', 'dual_clip'\] \(got 'gspo'\)"),
])
def test_current_policy_tis_is_refused_where_it_has_no_meaning(make, message):
    with pytest.raises(ValueError, match=message):
        make()

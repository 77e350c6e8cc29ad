"""The options that choose between our conventions and verl's / slime's (docs/from_verl_slime.md), each against a
float64 formula written out here: the k3 cap (algorithm.kl.clamp), the loss denominators of tokens the corrections
drop (algorithm.loss.dropped_tokens_in_denominator), the KL term's correction weights (algorithm.kl.correction_weights)
and the negative-advantage cap (`grpo` has none, `dual_clip` is verl's default PPO loss).

    .venv/bin/python -m pytest -q tests/unit/test_algorithms_conventions.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_sparse_rl.algorithms import kl_loss, loss_normalizer, policy_loss
from megatron_sparse_rl.config.algorithm import (
    AlgorithmConfig, CorrectionsConfig, IcePopConfig, KLConfig, LossConfig, MISConfig,
)
from megatron_sparse_rl.learner.host_metrics import summed_on_host
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.training.update import prepare, update

f64 = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731


# ---- algorithm.kl.clamp: each token's k3 capped from above -----------------------------------------------------
def _kl_batch():
    g = np.random.default_rng(7)
    lp = -np.abs(g.normal(1.0, 1.0, (3, 6)))
    ref = lp + g.normal(0.0, 2.0, (3, 6))  # log(q/p) up to ~+-5: k3 from ~0 to ~100
    ref[0, 0], ref[1, 1] = lp[0, 0] + 4.0, lp[1, 1] - 14.0  # k3 = e^4 - 5 = 49.6 and e^-14 + 13 = 13.0: both capped
    old = lp + g.normal(0.0, 0.3, (3, 6))
    mask = g.random((3, 6)) < 0.8
    mask[:2, :2] = True
    return lp, ref, old, mask


@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("clamp", [None, 10.0, 2.0])
def test_k3_cap_value_and_gradient(clamp, unbiased):
    lp, ref, old, mask = _kl_batch()
    x = ref - lp  # log(q/p)
    k3 = np.exp(x) - 1.0 - x
    dk3 = 1.0 - np.exp(x)  # d k3 / d log p
    r = np.exp(lp - old) if unbiased else np.ones_like(lp)
    est, dest = r * k3, r * k3 + r * dk3  # the unbiased estimate r k3, d/d log p of it: r k3 + r dk3
    if not unbiased:
        dest = dk3
    capped = np.zeros_like(est, dtype=bool) if clamp is None else est > clamp
    per = np.where(capped, clamp if clamp is not None else 0.0, est)
    want = 0.3 * per[mask].sum() / mask.sum()
    want_grad = np.where(mask & ~capped, 0.3 * dest / mask.sum(), 0.0)
    if clamp == 10.0:
        assert capped[0, 0] and capped[1, 1] and (mask & ~capped).any()

    p = f64(lp).requires_grad_(True)
    cfg = KLConfig(coef=0.3, estimator="k3", use_unbiased=unbiased, clamp=clamp)
    m = torch.tensor(mask)
    loss, metrics = kl_loss(p, f64(ref), m, cfg=cfg, aggregation="token_mean",
                            normalizer=loss_normalizer(m, "token_mean"), old_logprobs=f64(old))
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert float(metrics["kl_ref"]) == pytest.approx(per[mask].mean(), rel=1e-12)
    np.testing.assert_allclose(p.grad.numpy(), want_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("make,message", [
    (lambda: KLConfig(clamp=0.0), r"algorithm\.kl\.clamp must be null \(no cap\) or > 0 \(got 0\.0\)"),
    (lambda: KLConfig(clamp=10.0, estimator="k1"), r"algorithm\.kl\.clamp caps the k3 estimate only.*got 'k1'"),
    (lambda: KLConfig(correction_weights="no"), r"algorithm\.kl\.correction_weights must be true or false"),
    (lambda: LossConfig(dropped_tokens_in_denominator=1),
     r"algorithm\.loss\.dropped_tokens_in_denominator must be true or false \(got 1\)"),
])
def test_new_fields_reject_bad_values_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ---- the trainer: dropped tokens in or out of the denominators; the KL term weighted or not ---------------------
# Two groups of two samples, 4 response tokens each (sample 3 has 2). log rho = log pi_old - log mu per token:
# IcePop [0.5, 5] drops -1.0 and 2.0; MIS token [0.8, 1.25] also drops 0.4 (rho 1.49); the rest are kept.
LOG_RHO = np.array([[0.05, -1.0, 0.1, 0.0], [2.0, 0.05, -0.05, 0.4], [0.1, 0.02, -0.1, 0.0], [-1.0, 0.03, 0, 0]])
RESP = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=bool)
REWARD = np.array([0.0, 1.0, 1.0, 0.3])
SHIFT = np.array([[0.3, -0.1, 0.25, -0.4], [0.1, -0.3, 0.05, 0.2], [-0.2, 0.15, 0.3, -0.05], [0.1, 0.4, 0, 0]])
CORR = CorrectionsConfig(icepop=IcePopConfig(enabled=True, alpha=0.5, beta=5.0),
                         mis=MISConfig(enabled=True, low=0.8, high=1.25))
P = 2  # prompt tokens; learner column P - 1 + t scores response token t


class _Learner:
    """Old forward: pi_old; train_step: the loss function on the current logprobs pi_theta, one micro-batch."""

    routing = None
    indexer = None  # no DSA indexer

    def __init__(self, old, current):
        self.old, self.current = old, current

    def forward_logprobs(self, tokens, *, lengths=None, extras=None):
        return {"logprobs": self.old.clone()}

    def train_step(self, tokens, loss_fn, *, lengths=None, extras=None):
        index = torch.arange(tokens.shape[0])
        loss, metrics = loss_fn(self.current.clone(), torch.zeros_like(self.current), index)
        return {"loss": float(loss), **summed_on_host([metrics]), "grad_norm": 0.0, "lr": 0.0}


def _layout(a):
    """[4, 4] response values -> the learner's [4, P - 1 + 4] columns (0 elsewhere), float32 like the learner."""
    out = np.zeros((4, P - 1 + 4))
    out[:, P - 1:] = np.where(RESP, a, 0.0)
    return torch.tensor(out, dtype=torch.float32)


def _run(cfg: AlgorithmConfig):
    g = np.random.default_rng(11)
    mu = np.where(RESP, -np.abs(g.normal(1.0, 0.5, (4, 4))), 0.0)
    old, ref = mu + LOG_RHO, mu + g.normal(0.0, 0.5, (4, 4))
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[1, 5], [1, 5], [1, 6], [1, 6]]), prompt_lens=torch.tensor([P] * 4),
        response_ids=torch.tensor([[7, 8, 9, 2], [4, 4, 4, 2], [3, 3, 3, 2], [8, 2, 0, 0]]),
        response_mask=torch.tensor(RESP), rollout_logprobs=torch.tensor(mu, dtype=torch.float32),
        finish_reasons=("stop",) * 4, group_ids=torch.tensor([0, 0, 1, 1]), reward=torch.tensor(REWARD),
    )
    reference = _Learner(_layout(ref), None)
    prep = prepare(_Learner(_layout(old), None), batch, cfg, pad_id=0, dp_group=None, reference=reference)
    out = update(_Learner(None, _layout(old + SHIFT)), prep, cfg, updates=1, dp_group=None)
    return prep, out, mu, old, ref


def _float64_reference(mu, old, ref, aggregation, in_denominator, kl_weighted):
    """The same step written out: GRPO advantages, IcePop x MIS keep and weights, GRPO token terms, k3 to ref."""
    lr = np.where(RESP, old - mu, 0.0).astype(np.float32).astype(np.float64)  # the learner hands float32 in
    keep = RESP & (lr >= np.log(0.5)) & (lr <= np.log(5.0)) & (lr >= np.log(0.8)) & (lr <= np.log(1.25))
    w = np.where(keep, np.exp(lr), 0.0)  # IcePop's factor rho; MIS without reweight adds 1
    adv = np.zeros(4)
    for grp in ([0, 1], [2, 3]):
        rw = REWARD[grp]
        adv[grp] = (rw - rw.mean()) / (rw.std(ddof=1) + 1e-6)
    r = np.exp(SHIFT)
    a = adv[:, None]
    pg = w * np.maximum(-r * a, -np.clip(r, 0.8, 1.2) * a)
    x = ref - (old + SHIFT)
    kl = (np.exp(x) - 1.0 - x) * (w if kl_weighted else 1.0)
    counted = RESP if in_denominator else keep
    if aggregation == "token_mean":
        total = lambda v: np.where(keep, v, 0.0).sum() / counted.sum()  # noqa: E731
    else:
        total = lambda v: (np.where(keep, v, 0.0).sum(1) / counted.sum(1)).sum() / counted.any(1).sum()  # noqa: E731
    return keep, total(pg) + 0.1 * total(kl), (kl[keep].mean())


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("in_denominator", [False, True])
@pytest.mark.parametrize("kl_weighted", [True, False])
def test_dropped_tokens_and_kl_weights_in_the_update_loss(aggregation, in_denominator, kl_weighted):
    cfg = AlgorithmConfig(
        loss=LossConfig(aggregation=aggregation, dropped_tokens_in_denominator=in_denominator), corrections=CORR,
        kl=KLConfig(coef=0.1, correction_weights=kl_weighted))
    prep, out, mu, old, ref = _run(cfg)
    keep, want_loss, want_kl = _float64_reference(mu, old, ref, aggregation, in_denominator, kl_weighted)

    assert keep.sum() == 10 and (RESP & ~keep).sum() == 4  # 3 IcePop drops (one empties no row), 1 MIS drop
    assert np.array_equal(prep.mask[:, P - 1:].numpy(), keep)
    assert np.array_equal(prep.counted[:, P - 1:].numpy(), RESP if in_denominator else keep)
    assert out["loss/value"] == pytest.approx(want_loss, rel=2e-5)
    assert out["loss/kl_ref"] == pytest.approx(want_kl, rel=2e-5)
    assert out["train/tokens"] == keep.sum()  # the tokens trained on are the kept ones either way


def test_the_denominator_choice_changes_the_loss():
    """The two settings differ by the ratio of the counts (token_mean: 14 response tokens against 10 kept)."""
    runs = [_run(AlgorithmConfig(loss=LossConfig(dropped_tokens_in_denominator=d), corrections=CORR))[1]
            for d in (False, True)]
    assert runs[1]["loss/value"] == pytest.approx(runs[0]["loss/value"] * 10 / 14, rel=1e-5)
    assert runs[0]["loss/value"] != 0.0


# ---- grpo has no negative-advantage cap; dual_clip is verl's default PPO loss ------------------------------------
def _verl_default_ppo(r, a, low, high, c=3.0):
    """verl's default ("vanilla") token loss, from its formula: the PPO clip, and for A < 0 at most -c A."""
    ppo = np.maximum(-a * r, -a * np.clip(r, 1.0 - low, 1.0 + high))
    return np.where(a < 0, np.minimum(ppo, -a * c), ppo), ppo


@pytest.mark.parametrize("clip_high", [None, 0.28])
def test_dual_clip_is_verls_default_loss_and_grpo_has_no_cap(clip_high):
    r = np.array([[0.5, 0.9, 1.1, 2.0, 3.5, 8.0], [0.5, 0.9, 1.1, 2.0, 3.5, 8.0]])
    a = np.array([-1.5, 0.7])
    lp_old = np.full_like(r, -1.0)
    mask = torch.ones(r.shape, dtype=torch.bool)
    want_dual, want_ppo = _verl_default_ppo(r, a[:, None], 0.2, 0.2 if clip_high is None else clip_high)
    norm = loss_normalizer(mask, "token_mean")
    got = {}
    for name in ("dual_clip", "grpo"):
        lp = f64(lp_old + np.log(r)).requires_grad_(True)
        loss, _ = policy_loss(lp, f64(lp_old), f64(a), mask, cfg=LossConfig(name=name, clip_high=clip_high),
                              normalizer=norm)
        loss.backward()
        got[name] = (loss.item(), lp.grad.numpy())
    assert got["dual_clip"][0] == pytest.approx(want_dual.mean(), rel=1e-12)
    assert got["grpo"][0] == pytest.approx(want_ppo.mean(), rel=1e-12)
    # the two differ exactly where A < 0 and r > 3: grpo's term -r A keeps growing and keeps its gradient
    capped = (a[:, None] < 0) & (r > 3.0)
    assert capped.sum() == 2
    assert np.all(got["dual_clip"][1][capped] == 0.0)
    np.testing.assert_allclose(got["grpo"][1][capped], -a[0] * r[capped] / r.size, rtol=1e-12)
    np.testing.assert_allclose(got["grpo"][1][~capped], got["dual_clip"][1][~capped], rtol=1e-14)


# ---- docs/from_verl_slime.md names only fields that exist, and its example loads -------------------------------
def test_the_peer_page_names_real_fields_and_its_example_loads():
    from pathlib import Path

    import yaml

    from megatron_sparse_rl.config.loader import from_dict
    from tests.unit.test_config_docs import FIELD, resolve

    page = (Path(__file__).resolve().parents[2] / "docs" / "from_verl_slime.md").read_text()
    # the name-by-name table: | what | verl | slime / miles | ours | notes |; the peers' names may share our section
    # names (verl's algorithm.adv_estimator), so only the "ours" column is resolved
    rows = [line.split("|")[1:-1] for line in page.splitlines() if line.startswith("|")]
    ours = {n for cells in rows if len(cells) == 5 for n in FIELD.findall(cells[3])}
    assert len(ours) > 20 and {"algorithm.kl.clamp", "algorithm.loss.dropped_tokens_in_denominator",
                               "algorithm.kl.correction_weights", "trainer.updates_per_rollout"} <= ours
    for dotted in ours:
        resolve(dotted)
    example = yaml.safe_load(page.split("```yaml")[1].split("```")[0])
    cfg = from_dict(AlgorithmConfig, example["algorithm"], "algorithm")
    assert cfg.loss.name == "dual_clip" and cfg.kl.clamp == 10.0 and not cfg.kl.correction_weights

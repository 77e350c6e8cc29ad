"""The trainer's alignment of engine samples with the learner's shifted token layout, and OPSM evaluated in
every update's loss with the current policy (against float64 formulas written out here).

    .venv/bin/python -m pytest -q tests/unit/test_training_update.py
"""
import numpy as np
import pytest
import torch

from megatron_sparse_rl.algorithms import loss_normalizer
from megatron_sparse_rl.config.algorithm import AlgorithmConfig, CorrectionsConfig, OPSMConfig
from megatron_sparse_rl.rollout.batch import FeatureRecords, RolloutBatch
from megatron_sparse_rl.training.learner_batch import LearnerBatch
from megatron_sparse_rl.training.update import OBJECTIVE, PreparedBatch, make_loss, prepare, reduce_metrics


def test_rollout_logprobs_land_on_the_learner_positions_that_score_them():
    # sample 0: prompt [1, 5, 6], response [7, 2]; sample 1: prompt [1, 9], response [4, 4, 2]
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[1, 5, 6], [1, 9, 0]]), prompt_lens=torch.tensor([3, 2]),
        response_ids=torch.tensor([[7, 2, 0], [4, 4, 2]]),
        response_mask=torch.tensor([[True, True, False], [True, True, True]]),
        rollout_logprobs=torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]),
        finish_reasons=("stop", "stop"), group_ids=torch.tensor([0, 0]),
    )
    view = LearnerBatch.from_rollout(batch, pad_id=0)
    tokens, mask, lp = view.tokens, view.loss_mask, view.rollout_logprobs
    assert tokens.tolist() == [[1, 5, 6, 7, 2], [1, 9, 4, 4, 2]]
    # learner column t scores token t + 1: sample 0's response tokens sit at 3, 4 -> columns 2, 3
    assert mask.tolist() == [[False, False, True, True], [False, True, True, True]]
    assert torch.equal(lp, torch.tensor([[0.0, 0.0, -0.1, -0.2], [0.0, -0.3, -0.4, -0.5]]))


# ---- OPSM in the updates: evaluated per micro-batch with the current pi_theta ------------------------------
OPSM_ON = AlgorithmConfig(corrections=CorrectionsConfig(opsm=OPSMConfig(enabled=True, delta=0.5)))


def _opsm_batch():
    """Three rows of 3 response tokens (learner columns 1..3). The sampler mu sits 0.1 above pi_old everywhere,
    so at rollout time every row's drift mean(log mu - log pi_old) = 0.1 < delta = 0.5. The current pi_theta
    moved: rows 0 and 1 by log r = [-1.8, 0.1, 0.1] (drift now mean(log mu - log pi_theta) = 1.9/3 > delta),
    row 2 by [0.05, -0.05, 0.02]. Advantages -1, +0.8, -0.6."""
    old = np.array([[0.0, -1.2, -0.7, -2.0], [0.0, -0.4, -1.1, -0.9], [0.0, -1.5, -0.3, -0.8]])
    mask = np.zeros((3, 4), dtype=bool)
    mask[:, 1:] = True
    mu = np.where(mask, old + 0.1, 0.0)
    shift = np.array([[0.0, -1.8, 0.1, 0.1], [0.0, -1.8, 0.1, 0.1], [0.0, 0.05, -0.05, 0.02]])
    adv = np.array([-1.0, 0.8, -0.6])
    t = torch.tensor
    prep = PreparedBatch(tokens=torch.zeros(3, 5, dtype=torch.long), mask=t(mask), old_logprobs=t(old),
                         rollout_logprobs=t(mu), advantages=t(adv), weights=torch.ones(3, 4, dtype=torch.float64),
                         metrics={}, loss_mask=t(mask))
    return prep, old + shift, old, mu, mask, adv


def test_opsm_masks_in_the_update_with_the_current_policy_and_keeps_the_normaliser():
    prep, lp, old, mu, mask, adv = _opsm_batch()
    chunk = torch.arange(3)
    norm = loss_normalizer(prep.mask[chunk], OPSM_ON.loss.aggregation)  # 9 tokens: the masked row still counts
    x = torch.tensor(lp, requires_grad=True)
    loss, metrics = make_loss(prep, chunk, OPSM_ON, norm)(x, torch.zeros_like(x), torch.arange(3))
    loss.backward()

    # float64 reference: drift_i = mean_t (log mu - log pi_theta); drop i iff A_i < 0 and drift_i > 0.5; GRPO
    # token terms -min(r A, clip(r, 0.8, 1.2) A) summed over the kept rows, divided by ALL 9 response tokens.
    drift = np.where(mask, mu - lp, 0.0).sum(1) / mask.sum(1)
    kept = ~((adv < 0) & (drift > 0.5))
    assert kept.tolist() == [False, True, True]  # the negative-advantage row that drifted only now is dropped
    r, a = np.exp(lp - old), adv[:, None]
    unclipped, clipped = -r * a, -np.clip(r, 0.8, 1.2) * a
    m = mask & kept[:, None]
    want_loss = np.where(m, np.maximum(unclipped, clipped), 0.0).sum() / mask.sum()
    want_grad = np.where(m & (unclipped >= clipped), -a * r, 0.0) / mask.sum()
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=1e-12, atol=1e-15)
    assert (x.grad[0] == 0).all() and (x.grad[1] != 0).any()  # row 0: no loss, no gradient; row 1 (A > 0) kept
    sums = metrics[OBJECTIVE]
    assert float(sums.counts["opsm/masked_seqs"]) == 1.0 and float(sums.counts["opsm/seqs"]) == 3.0
    # two updates of this micro-batch: the sums add, the fraction and the token means stay; loss/value averages them
    totals = {"loss": 2 * loss.item(), "grad_norm": 3.0, "lr": 0.5}
    reduced = reduce_metrics(sums + sums, totals, 2, None)
    assert reduced["opsm/masked_seq_frac"] == pytest.approx(1 / 3)
    assert reduced["train/tokens"] == 2 * float(m.sum())  # n = the tokens trained: the kept rows' tokens, twice
    assert reduced["loss/value"] == pytest.approx(loss.item()) and reduced["train/grad_norm"] == 1.5
    assert reduced["loss/ratio_mean"] == pytest.approx(r[m].mean(), rel=1e-6)  # a token mean over the kept tokens


class _FixedLearner:
    """A learner stand-in whose old-logprob forward returns fixed logprobs (no routing)."""

    routing = None
    indexer = None  # no DSA indexer

    def __init__(self, logprobs):
        self.logprobs = logprobs

    def forward_logprobs(self, tokens, *, lengths=None, extras=None):
        return {"logprobs": self.logprobs}


def two_sample_batch() -> RolloutBatch:
    """One group of two 3-token responses: sample 0 rewarded 0, sample 1 rewarded 1."""
    return RolloutBatch(
        prompt_ids=torch.tensor([[1, 5], [1, 6]]), prompt_lens=torch.tensor([2, 2]),
        response_ids=torch.tensor([[7, 8, 2], [4, 4, 2]]), response_mask=torch.ones(2, 3, dtype=torch.bool),
        rollout_logprobs=torch.tensor([[-0.5, -0.6, -0.7], [-0.2, -0.3, -0.4]]),
        finish_reasons=("stop", "stop"), group_ids=torch.tensor([0, 0]), reward=torch.tensor([0.0, 1.0]),
    )


def test_prepare_leaves_opsm_to_the_updates():
    # sample 0 (reward 0: A < 0) and sample 1 (reward 1: A > 0); pi_old is 1.0 below mu on every response
    # token, so OPSM at pi_theta = pi_old would drop sample 0. It must not be applied at rollout time.
    batch = two_sample_batch()
    view = LearnerBatch.from_rollout(batch, pad_id=0)
    mask, mu = view.loss_mask, view.rollout_logprobs
    old = torch.where(mask, mu - 1.0, torch.zeros(()))
    prep = prepare(_FixedLearner(old), batch, OPSM_ON, pad_id=0, dp_group=None)
    assert torch.equal(prep.mask, mask)  # nothing dropped before the updates
    assert prep.advantages[0] < 0 < prep.advantages[1]
    assert prep.metrics["opsm/masked_seq_frac_at_pi_old"] == pytest.approx(0.5)
    assert "opsm/masked_seq_frac" not in prep.metrics  # the updates report the mask they applied


def test_prepare_is_final_it_drops_preempted_compressed_samples_and_aligns_token_versions():
    """A sparse-KV batch's preempted compressed sample leaves the mask prepare returns (no caller changes it); the
    per-token weight versions come back in the learner layout."""
    from dataclasses import FrozenInstanceError

    from megatron_sparse_rl.kv.record import KVKeepRecord

    batch = RolloutBatch(
        prompt_ids=torch.tensor([[1, 5], [1, 6]]), prompt_lens=torch.tensor([2, 2]),
        response_ids=torch.tensor([[7, 8, 2], [4, 4, 2]]), response_mask=torch.ones(2, 3, dtype=torch.bool),
        rollout_logprobs=torch.tensor([[-0.5, -0.6, -0.7], [-0.2, -0.3, -0.4]]),
        finish_reasons=("stop", "stop"), group_ids=torch.tensor([0, 0]), reward=torch.tensor([0.0, 1.0]),
        features=FeatureRecords(kv_keep=(KVKeepRecord(lengths=(3,), preempted=True), KVKeepRecord(lengths=()))),
        token_version=torch.tensor([[0, 0, 1], [0, 1, 1]]),
    )
    view = LearnerBatch.from_rollout(batch, pad_id=0)
    mask, mu = view.loss_mask, view.rollout_logprobs
    prep = prepare(_FixedLearner(mu.clone()), batch, AlgorithmConfig(), pad_id=0, dp_group=None)
    assert mask.tolist() == [[False, True, True, True]] * 2
    assert prep.mask.tolist() == [[False] * 4, [False, True, True, True]]  # row 0 was preempted
    assert torch.equal(prep.loss_mask, mask)  # every model token, before the preempted drop, for the metrics
    assert prep.metrics["kv/preempted_dropped_frac"] == pytest.approx(0.5)
    assert prep.token_version.tolist() == [[0, 0, 0, 1], [0, 0, 1, 1]]
    with pytest.raises(FrozenInstanceError):
        prep.mask = mask

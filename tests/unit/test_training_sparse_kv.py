"""Sparse-KV rollout metrics against values computed by hand."""
import pytest
import torch

from megatron_sparse_rl.kv.record import KVKeepRecord
from megatron_sparse_rl.rollout.batch import FeatureRecords, RolloutBatch
from megatron_sparse_rl.training.sparse_kv import kv_metrics


def test_metrics_split_the_mismatch_at_the_first_compaction():
    # sample 0: 2 prompt + 6 response tokens = 8, compacted once when 5 were stored (budget 3);
    # sample 1: never compacted
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[1, 5], [1, 6]]), prompt_lens=torch.tensor([2, 2]),
        response_ids=torch.ones(2, 6, dtype=torch.long), response_mask=torch.ones(2, 6, dtype=torch.bool),
        rollout_logprobs=torch.zeros(2, 6), finish_reasons=("length", "length"), group_ids=torch.tensor([0, 1]),
        features=FeatureRecords(kv_keep=(KVKeepRecord(lengths=(5,)), KVKeepRecord(lengths=()))),
    )
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[:, 1:] = True                                   # columns 1..6 score the response tokens
    old = torch.zeros(2, 7)
    rollout = torch.zeros(2, 7)
    rollout[0, 5:] = -0.5                                # only the columns querying the compressed cache differ
    m = kv_metrics(batch, old, rollout, mask, budget=3)
    assert m["kv/compressed_frac"] == 0.5
    assert m["kv/retention"] == pytest.approx(((3 + 8 - 5) / 8 + 1.0) / 2)
    assert m["kv/saved_frac"] == pytest.approx(1 - ((3 + 8 - 5) / 8 + 1.0) / 2)  # 2 of 8 entries saved, then none
    assert m["kv/budget"] == 3.0
    assert m["kv/tokens_after_compression_frac"] == pytest.approx(2 / 12)
    assert m["kv/k1_after_compression"] == pytest.approx(-0.5)
    assert m["kv/k1_before_compression"] == pytest.approx(0.0)
    assert m["kv/compression_logprob_delta"] == pytest.approx(-0.5)


def test_missing_records_raise():
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[1]]), prompt_lens=torch.tensor([1]), response_ids=torch.ones(1, 1, dtype=torch.long),
        response_mask=torch.ones(1, 1, dtype=torch.bool), rollout_logprobs=torch.zeros(1, 1),
        finish_reasons=("stop",), group_ids=torch.tensor([0]))
    with pytest.raises(ValueError, match="no kv_keep records"):
        kv_metrics(batch, torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), budget=4)


def test_exact_recompute_splits_the_mismatch_after_compression():
    # one sample, 2 prompt + 4 response tokens, compacted when 3 were stored: columns 3, 4 query the sparse cache
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[1, 5]]), prompt_lens=torch.tensor([2]), response_ids=torch.ones(1, 4, dtype=torch.long),
        response_mask=torch.ones(1, 4, dtype=torch.bool), rollout_logprobs=torch.zeros(1, 4),
        finish_reasons=("length",), group_ids=torch.tensor([0]),
        features=FeatureRecords(kv_keep=(KVKeepRecord(lengths=(3,)),)))
    mask = torch.tensor([[False, True, True, True, True]])
    old = torch.tensor([[0.0, -1.0, -1.0, -1.0, -1.0]])
    sparse = torch.tensor([[0.0, -1.0, -1.0, -1.5, -2.5]])      # dropping KV changed columns 3 and 4
    rollout = torch.tensor([[0.0, -1.0, -1.0, -1.5, -2.4]])     # the engine differs by 0.1 on column 4 (numerics)
    m = kv_metrics(batch, old, rollout, mask, budget=2, sparse=sparse)
    assert m["kv/k1_after_compression"] == pytest.approx((-0.5 - 1.4) / 2)
    assert m["kv/k1_sparse_compression"] == pytest.approx((-0.5 - 1.5) / 2)
    assert m["kv/k1_sparse_numerics"] == pytest.approx(0.1 / 2)
    assert "kv/k1_sparse_numerics" not in kv_metrics(batch, old, rollout, mask, budget=2)


def test_preempted_compressed_samples_leave_the_loss():
    """A compressed sample vLLM preempted (recomputed densely, then sampled on) trains no token; the others keep
    their mask as it was."""
    from megatron_sparse_rl.kv.record import KVKeepRecord
    from megatron_sparse_rl.training.sparse_kv import drop_preempted

    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    records = [KVKeepRecord(lengths=(5,)), KVKeepRecord(lengths=(5,), preempted=True), KVKeepRecord(lengths=())]
    kept, frac = drop_preempted(mask, records)
    assert kept.tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    assert frac == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="2 keep records for 3 rows"):
        drop_preempted(mask, records[:2])

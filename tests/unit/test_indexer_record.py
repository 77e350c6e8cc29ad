"""The DSA indexer record's storage (moe/indexer_storage.py) and comparison metrics (learner/indexer_replay.py),
against hand-built values: 2-byte positions up to 65535 read back exactly, int32 past them; the token hash per row;
flip rate, agreement and applied fraction on a hand-written two-layer example."""
import zlib

import pytest
import torch

from megatron_sparse_rl.learner.indexer_replay import applied_metrics, flip_rate_metrics
from megatron_sparse_rl.moe.indexer_storage import IndexerRecord, IndexerReplayError, pack_positions, row_hashes


def test_positions_round_trip_in_two_bytes_up_to_65535():
    positions = torch.tensor([0, 1, 32767, 32768, 40000, 65535])
    stored = pack_positions(positions, width=65536)
    assert stored.dtype == torch.int16 and stored.element_size() == 2
    record = IndexerRecord(stored.view(1, -1, 1, 1), torch.zeros(1, dtype=torch.int64))
    assert record.positions().flatten().tolist() == [0, 1, 32767, 32768, 40000, 65535]
    wide = pack_positions(torch.tensor([65536, 70000]), width=70001)
    assert wide.dtype == torch.int32 and wide.tolist() == [65536, 70000]


def test_row_hashes_cover_the_real_tokens_only():
    tokens = torch.tensor([[5, 6, 7, 0], [5, 6, 9, 9]])
    want = [zlib.crc32(torch.tensor(row, dtype=torch.int32).numpy().tobytes()) for row in ([5, 6, 7], [5, 6, 9, 9])]
    assert row_hashes(tokens, torch.tensor([3, 4])).tolist() == want


def test_record_shape_checked():
    with pytest.raises(IndexerReplayError, match="one token hash per row"):
        IndexerRecord(torch.zeros(2, 3, 1, 2, dtype=torch.int16), torch.zeros(3, dtype=torch.int64))


def test_flip_rate_agreement_and_applied_by_hand():
    # one row of 4 tokens: 3 real queries (positions 0, 1, 2), two layers, top-2
    old = torch.tensor([[[[0, 0], [0, 0]], [[0, 1], [0, 1]], [[0, 2], [1, 2]]]])  # [1, 3, 2, 2]
    new = torch.tensor([[[[0, 0], [0, 0]], [[1, 0], [0, 1]], [[1, 2], [0, 2]]]])
    m = flip_rate_metrics(old, new, torch.tensor([4]), (0, 1))
    # layer 0: query 2 {0,2} vs {1,2} flips, keeps 1 of 2; layer 1: query 2 {1,2} vs {0,2} flips, keeps 1 of 2
    assert m["indexer/flip_rate/layer_0"] == pytest.approx(1 / 3)
    assert m["indexer/flip_rate/layer_1"] == pytest.approx(1 / 3)
    assert m["indexer/agreement/layer_0"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert m["indexer/agreement"] == pytest.approx((1 + 1 + 0.5) / 3)
    # a padded row (length 2: one real query) counts only its real query
    applied = torch.tensor([[[True, False], [False, False], [False, False]],
                            [[True, True], [False, False], [False, False]]])
    a = applied_metrics(applied, torch.tensor([4, 2]), (0, 1))
    assert a["indexer/replay_applied_fraction/layer_0"] == pytest.approx(2 / 4)
    assert a["indexer/replay_applied_fraction/layer_1"] == pytest.approx(1 / 4)
    assert a["indexer/replay_applied_fraction"] == pytest.approx(3 / 8)

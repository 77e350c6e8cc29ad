"""`RolloutBatch.concat` (rollout/batch.py): two batches with every field set join into what is written out here by
hand, field by field (each feature record too); a field added to RolloutBatch or FeatureRecords fails this test until
concat and the expectation know it.

    .venv/bin/python -m pytest -q tests/unit/test_rollout_batch_concat.py
"""
from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from megatron_sparse_rl.moe.storage import RouteStore
from megatron_sparse_rl.rollout.batch import FeatureRecords, RolloutBatch
from megatron_sparse_rl.rollout.indexer_capture import EngineIndexerRows
from megatron_sparse_rl.rollout.sampling_mask import SamplingSupport

PAD = 99
T, F = True, False


def _routes(lens: list[int], first: int) -> RouteStore:
    """Routes of sequences of `lens` tokens ([tokens, 1 layer, top-2]; expert ids from `first` on)."""
    routes = [torch.tensor([[[(first + i) % 4, (first + i + 1) % 4]]] * n) for i, n in enumerate(lens)]
    return RouteStore.from_sequences(routes, [list(range(n)) for n in lens], num_experts=4, layers=[0], source="t")


def _support(prompt_lens: list[int], counts: list[list[int]], ids: list[list[int]]) -> SamplingSupport:
    return SamplingSupport(prompt_lens=torch.tensor(prompt_lens),
                           counts=tuple(torch.tensor(c, dtype=torch.int32) for c in counts),
                           ids=tuple(torch.tensor(i, dtype=torch.int32) for i in ids))


def _indexer(lens: list[int], hashes: list[int]) -> EngineIndexerRows:
    """DSA indices of sequences of `lens` tokens ([n - 1, 1 layer, top-2]: each query's position and 0)."""
    rows = tuple(torch.tensor([[[q, 0]] for q in range(n - 1)], dtype=torch.int16).reshape(n - 1, 1, 2) for n in lens)
    return EngineIndexerRows(rows, torch.tensor(hashes), layers=(0,), topk=2)


def _usage(peak: float, pool: float, running: float, preempted: float) -> dict[str, float]:
    return {"peak_blocks": peak, "pool_blocks": pool, "mean_running": running, "preemptions": preempted}


def _first() -> RolloutBatch:
    """One sample: prompt [5, 6], response [11], padded wider than needed (pad 0, not the pad id)."""
    return RolloutBatch(
        prompt_ids=torch.tensor([[5, 6]]), prompt_lens=torch.tensor([2]),
        response_ids=torch.tensor([[11, 0]]), response_mask=torch.tensor([[T, F]]),
        rollout_logprobs=torch.tensor([[-0.1, 0.0]]), finish_reasons=("stop",), group_ids=torch.tensor([0]),
        reward=torch.tensor([1.0]),
        features=FeatureRecords(sampling_mask=_support([2], [[2]], [[3, 11]]), routed_experts=_routes([3], 0),
                                indexer_record=_indexer([3], [101]), kv_keep=("a",)),
        rescored_logprobs=torch.tensor([[[-0.15, 0.0], [-0.25, 0.0]]]),
        token_version=torch.tensor([[3, 0]]), kv_usage=_usage(2.0, 10.0, 1.0, 0.0),
        loss_mask=torch.tensor([[T, F]]), episode_stats={"turns": 1.0, "tool_calls": 0.0})


def _second() -> RolloutBatch:
    """Two samples: prompts [7, 8, 9] and [4]; responses [12, 13, 14] and [15, 16]."""
    return RolloutBatch(
        prompt_ids=torch.tensor([[7, 8, 9], [4, 0, 0]]), prompt_lens=torch.tensor([3, 1]),
        response_ids=torch.tensor([[12, 13, 14], [15, 16, 0]]), response_mask=torch.tensor([[T, T, T], [T, T, F]]),
        rollout_logprobs=torch.tensor([[-0.2, -0.3, -0.4], [-0.5, -0.6, 0.0]]), finish_reasons=("length", "stop"),
        group_ids=torch.tensor([1, 1]), reward=torch.tensor([0.0, 0.5]),
        features=FeatureRecords(sampling_mask=_support([3, 1], [[0, 1, 0], [1, 1]], [[13], [15, 16]]),
                                routed_experts=_routes([6, 3], 1), indexer_record=_indexer([6, 3], [102, 103]),
                                kv_keep=("b", "c")),
        rescored_logprobs=torch.tensor([[[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]],
                                       [[-7.0, -8.0, 0.0], [-9.0, -10.0, 0.0]]]),
        token_version=torch.tensor([[3, 4, 4], [4, 4, 0]]), kv_usage=_usage(5.0, 10.0, 2.0, 1.0),
        loss_mask=torch.tensor([[T, F, T], [T, T, F]]), episode_stats={"turns": 3.0, "tool_calls": 2.0})


def _expected() -> dict:
    """The join of `_first` and `_second`, written out by hand (token ids re-padded with PAD, the rest with 0)."""
    every = [(3, 0), (6, 1), (3, 2)]  # the three sequences' route lengths and first expert, as one store packs them
    routes = [torch.tensor([[[(f + 0) % 4, (f + 1) % 4]]] * n) for n, f in every]
    return {
        "prompt_ids": torch.tensor([[5, 6, PAD], [7, 8, 9], [4, PAD, PAD]]),
        "prompt_lens": torch.tensor([2, 3, 1]),
        "response_ids": torch.tensor([[11, PAD, PAD], [12, 13, 14], [15, 16, PAD]]),
        "response_mask": torch.tensor([[T, F, F], [T, T, T], [T, T, F]]),
        "rollout_logprobs": torch.tensor([[-0.1, 0.0, 0.0], [-0.2, -0.3, -0.4], [-0.5, -0.6, 0.0]]),
        "finish_reasons": ("stop", "length", "stop"),
        "group_ids": torch.tensor([0, 1, 1]),
        "reward": torch.tensor([1.0, 0.0, 0.5]),
        "features": FeatureRecords(
            sampling_mask=_support([2, 3, 1], [[2], [0, 1, 0], [1, 1]], [[3, 11], [13], [15, 16]]),
            routed_experts=RouteStore.from_sequences(routes, [list(range(n)) for n, _ in every], num_experts=4,
                                                     layers=[0], source="t"),
            indexer_record=EngineIndexerRows((torch.tensor([[[0, 0]], [[1, 0]]], dtype=torch.int16),
                                              torch.tensor([[[q, 0]] for q in range(5)], dtype=torch.int16),
                                              torch.tensor([[[0, 0]], [[1, 0]]], dtype=torch.int16)),
                                             torch.tensor([101, 102, 103]), layers=(0,), topk=2),
            kv_keep=("a", "b", "c")),
        "rescored_logprobs": torch.tensor([[[-0.15, 0.0, 0.0], [-0.25, 0.0, 0.0]],
                                           [[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]],
                                           [[-7.0, -8.0, 0.0], [-9.0, -10.0, 0.0]]]),
        "token_version": torch.tensor([[3, 0, 0], [3, 4, 4], [4, 4, 0]]),
        "kv_usage": _usage(7.0, 20.0, 3.0, 1.0),
        "loss_mask": torch.tensor([[T, F, F], [T, F, T], [T, T, F]]),
        "episode_stats": {"turns": 4.0, "tool_calls": 2.0},
    }


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, (RouteStore, SamplingSupport, EngineIndexerRows, FeatureRecords)):
        return type(got) is type(want) and all(_same(getattr(got, f.name), getattr(want, f.name)) for f in fields(want))
    if isinstance(want, tuple) and want and isinstance(want[0], torch.Tensor):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    return got == want


def test_concat_of_batches_with_every_field_set_is_the_fieldwise_join():
    parts, want = [_first(), _second()], _expected()
    names = [f.name for f in fields(RolloutBatch)]
    assert set(want) == set(names), "a RolloutBatch field without a hand-written expectation here"
    for p in parts:
        assert [n for n in names if getattr(p, n) is None] == [], "every field must be set in the parts"
        assert [f.name for f in fields(p.features) if getattr(p.features, f.name) is None] == [], "every record too"
    joined = RolloutBatch.concat(parts, pad_id=PAD)
    for name in names:
        assert _same(getattr(joined, name), want[name]), name


def test_concat_of_one_batch_is_that_batch():
    one = _first()
    assert RolloutBatch.concat([one], pad_id=PAD) is one


def test_concat_refuses_parts_that_carry_an_optional_field_and_parts_that_do_not():
    from dataclasses import replace

    with pytest.raises(ValueError, match="some parts carry reward and some do not"):
        RolloutBatch.concat([_first(), replace(_second(), reward=None)], pad_id=PAD)


def test_concat_sums_kv_usage_only_when_every_part_reports_it():
    from dataclasses import replace

    joined = RolloutBatch.concat([_first(), replace(_second(), kv_usage=None)], pad_id=PAD)
    assert joined.kv_usage is None


def test_concat_refuses_parts_that_carry_a_feature_record_and_parts_that_do_not():
    second = _second()
    with pytest.raises(ValueError, match="some parts carry kv_keep and some do not"):
        RolloutBatch.concat([_first(), second.with_features(kv_keep=None)], pad_id=PAD)


def test_select_picks_each_feature_record_by_row():
    sub = RolloutBatch.concat([_first(), _second()], pad_id=PAD).select([2, 0])
    want = _expected()["features"]
    assert _same(sub.features, FeatureRecords(sampling_mask=want.sampling_mask.select(torch.tensor([2, 0])),
                                              routed_experts=want.routed_experts.select(torch.tensor([2, 0])),
                                              indexer_record=want.indexer_record.select(torch.tensor([2, 0])),
                                              kv_keep=("c", "a")))

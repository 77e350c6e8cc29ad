"""KVKeepRecord.attention_mask against masks written out by hand, and the sparse-KV vLLM patch checks.

    .venv/bin/python -m pytest -q tests/unit/test_kv_record.py
"""
from __future__ import annotations

import pytest
import torch

from megatron_sparse_rl.kv.record import KVKeepRecord
from megatron_sparse_rl.kv.settings import CONFIG_KEY, SparseKVSettings


def test_attention_mask_replays_compactions():
    # 1 layer, 2 KV heads; compaction at true length 5 keeping {0, 3, 4} / {1, 2, 4}, then at 7 keeping
    # {0, 5, 6} / {2, 4, 6}; sequence of 9 tokens
    kept = (torch.tensor([[[0, 3, 4], [1, 2, 4]]]), torch.tensor([[[0, 5, 6], [2, 4, 6]]]))
    rec = KVKeepRecord(lengths=(5, 7), kept=kept)
    m = rec.attention_mask(9)
    assert m.shape == (1, 2, 9, 9)
    want0 = {t: set(range(t + 1)) for t in range(5)}
    want0.update({5: {0, 3, 4, 5}, 6: {0, 3, 4, 5, 6}, 7: {0, 5, 6, 7}, 8: {0, 5, 6, 7, 8}})
    want1 = {t: set(range(t + 1)) for t in range(5)}
    want1.update({5: {1, 2, 4, 5}, 6: {1, 2, 4, 5, 6}, 7: {2, 4, 6, 7}, 8: {2, 4, 6, 7, 8}})
    for h, want in enumerate((want0, want1)):
        for t in range(9):
            assert set(m[0, h, t].nonzero()[:, 0].tolist()) == want[t], (h, t)


def test_join_heads_puts_each_ranks_heads_in_rank_order():
    # the record above split as a TP2 engine holds it: rank 0 has KV head 0, rank 1 KV head 1
    kept = (torch.tensor([[[0, 3, 4], [1, 2, 4]]]), torch.tensor([[[0, 5, 6], [2, 4, 6]]]))
    ranks = [KVKeepRecord(lengths=(5, 7), kept=tuple(k[:, h:h + 1] for k in kept), preempted=h == 1)
             for h in range(2)]
    joined = KVKeepRecord.join_heads(ranks)
    assert joined.lengths == (5, 7) and joined.preempted
    assert all(torch.equal(a, b) for a, b in zip(joined.kept, kept))
    assert KVKeepRecord.join_heads([KVKeepRecord(lengths=(5,))] * 2) == KVKeepRecord(lengths=(5,))
    with pytest.raises(RuntimeError, match=r"engine ranks compacted at different steps: \[\(5, 7\), \(5,\)\]"):
        KVKeepRecord.join_heads([ranks[0], KVKeepRecord(lengths=(5,), kept=kept[:1])])


def test_attention_mask_needs_kept_positions():
    with pytest.raises(ValueError, match="record_keep"):
        KVKeepRecord(lengths=(5,)).attention_mask(8)


def test_settings_round_trip_through_additional_config():
    from megatron_sparse_rl.config.rollout import KVConfig

    s = SparseKVSettings.from_kv_config(KVConfig(policy="rkv", budget=64, record_keep=True))
    extra = s.to_additional_config()
    assert list(extra) == [CONFIG_KEY]

    class FakeVllmConfig:
        additional_config = extra

    assert SparseKVSettings.from_vllm_config(FakeVllmConfig()) == s


def test_vllm_patch_checks_every_hook_and_is_idempotent():
    pytest.importorskip("vllm")
    from megatron_sparse_rl.kv import vllm_hooks

    vllm_hooks.check_upstream()
    assert vllm_hooks.apply() and vllm_hooks.apply()
    assert vllm_hooks.is_applied()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert not getattr(GPUModelRunner._update_states._msrl_original, "_msrl_sparse_kv_patched", False)


def test_attention_mask_of_a_prefix():
    kept = (torch.tensor([[[0, 3, 4]]]), torch.tensor([[[0, 5, 6]]]))
    m = KVKeepRecord(lengths=(5, 7), kept=kept).attention_mask(6)
    assert m.shape == (1, 1, 6, 6) and set(m[0, 0, 5].nonzero()[:, 0].tolist()) == {0, 3, 4, 5}

"""The keep record of a multi-turn episode under sparse KV (kv/record.py `KVKeepRecord.next_turn`): two turns'
records merged, replayed as an attention mask written out here by hand, and the bad merges refused by name; the
episode batch refuses a record that does not cover its row (rollout/episodes.py). On the real engine:
tests/e2e/test_episodes_sparse_kv.py.
Run: .venv/bin/python -m pytest -q tests/unit/test_kv_episode_record.py
"""
import pytest
import torch

from megatron_sparse_rl.kv.record import KVKeepRecord, batch_attention_mask
from megatron_sparse_rl.rollout.episodes import _Episode, _record_fields

# A toy episode of 18 tokens: prompt 0..3, turn 1 samples 4..9, the environment answers 10..11, turn 2 (its prompt
# the 12 tokens so far) samples 12..17. Turn 1 compacts at 7, turn 2 (after its dense prefill) at 14.
# 1 layer, 2 KV heads.
TURN1 = KVKeepRecord(lengths=(7,), kept=(torch.tensor([[[0, 5, 6], [1, 2, 6]]]),))
TURN2 = KVKeepRecord(lengths=(14,), kept=(torch.tensor([[[0, 11, 13], [3, 10, 12]]]),), preempted=True)


def merged() -> KVKeepRecord:
    return KVKeepRecord(lengths=()).next_turn(TURN1, 4, 10).next_turn(TURN2, 12, 18)


def hand_mask() -> list[dict[int, set[int]]]:
    """Per KV head, the keys each query row 0..16 (the learner's columns) may attend, written out."""
    heads = []
    for kept1, kept2 in (({0, 5, 6}, {0, 11, 13}), ({1, 2, 6}, {3, 10, 12})):
        rows = {t: set(range(t + 1)) for t in range(17)}  # dense: prompt, turn 1 before 7, turn 2's prefill
        rows[7], rows[8] = kept1 | {7}, kept1 | {7, 8}  # turn 1's decode queries after its compaction
        # row 9 (turn 1's last token) .. 13: computed by turn 2's dense prefill and its decode before compacting
        rows[14], rows[15], rows[16] = kept2 | {14}, kept2 | {14, 15}, kept2 | {14, 15, 16}
        heads.append(rows)
    return heads


def test_two_turn_record_replays_as_the_hand_built_mask():
    rec = merged()
    assert rec.lengths == (7, 14) and rec.turn_ends == (10, 18) and rec.preempted and rec.num_compactions == 2
    mask = rec.attention_mask(17)
    assert mask.shape == (1, 2, 17, 17)
    for h, rows in enumerate(hand_mask()):
        for t in range(17):
            assert set(mask[0, h, t].nonzero()[:, 0].tolist()) == rows[t], (h, t)
    assert rec.compressed_queries(17).nonzero()[:, 0].tolist() == [7, 8, 14, 15, 16]
    causal = torch.ones(17, 17, dtype=torch.bool).tril()
    both = batch_attention_mask([rec, KVKeepRecord(lengths=(), turn_ends=(6, 18))], 17)
    assert torch.equal(both[0], mask) and bool((both[1] == causal).all())


def test_a_turn_without_compaction_leaves_its_queries_dense():
    rec = KVKeepRecord(lengths=()).next_turn(KVKeepRecord(lengths=(), kept=()), 4, 10).next_turn(TURN2, 12, 18)
    assert rec.lengths == (14,) and rec.turn_ends == (10, 18)
    mask = rec.attention_mask(17)
    rows = hand_mask()[0]
    for t in range(17):
        want = set(range(t + 1)) if t < 14 else rows[t]
        assert set(mask[0, 0, t].nonzero()[:, 0].tolist()) == want, t


def test_bad_merges_name_the_problem():
    one = KVKeepRecord(lengths=()).next_turn(TURN1, 4, 10)
    with pytest.raises(ValueError, match=r"the turn's prompt \(8 tokens\) overlaps the episode record, which covers "
                                         r"10 tokens"):
        one.next_turn(KVKeepRecord(lengths=(9,), kept=TURN2.kept), 8, 18)
    with pytest.raises(ValueError, match=r"compactions \(19,\) do not lie within its decode queries 12..16"):
        one.next_turn(KVKeepRecord(lengths=(19,), kept=TURN2.kept), 12, 18)
    with pytest.raises(ValueError, match=r"compactions \(11,\) do not lie within its decode queries 12..16"):
        one.next_turn(KVKeepRecord(lengths=(11,), kept=TURN2.kept), 12, 18)  # before its own prompt ends
    with pytest.raises(ValueError, match=r"end = 12 must exceed prompt_len = 12"):
        one.next_turn(KVKeepRecord(lengths=()), 12, 12)
    with pytest.raises(ValueError, match=r"compaction at 13 keeps position 13, which it had not computed"):
        one.next_turn(KVKeepRecord(lengths=(13,), kept=TURN2.kept), 12, 18)
    with pytest.raises(ValueError, match=r"rollout.kv.record_keep must hold for the whole episode"):
        one.next_turn(KVKeepRecord(lengths=(14,)), 12, 18)
    with pytest.raises(ValueError, match=r"\[layers, kv_heads\] differ between turns: \[\(1, 1\), \(1, 2\)\]"):
        one.next_turn(KVKeepRecord(lengths=(14,), kept=(torch.tensor([[[0, 11, 13]]]),)), 12, 18)
    with pytest.raises(ValueError, match=r"compactions \(9,\) and turn ends \(10,\) overlap"):
        KVKeepRecord(lengths=(9,), kept=TURN1.kept, turn_ends=(10,))  # a compaction at the next turn's prefill


def test_episode_batch_refuses_a_record_that_does_not_cover_its_row():
    def episode(record):
        return _Episode(env=None, group=0, prompt=[1, 2, 3, 4], response=list(range(14)), records={"kv_keep": record})

    whole = episode(merged())
    [got] = _record_fields([whole])["kv_keep"]
    assert got is whole.records["kv_keep"]
    short = KVKeepRecord(lengths=()).next_turn(TURN1, 4, 10)  # the second turn's record missing
    with pytest.raises(ValueError, match=r"episode 1: its KV keep record \(turn ends \(10,\)\) does not cover its 18 "
                                         "tokens"):
        _record_fields([episode(merged()), episode(short)])

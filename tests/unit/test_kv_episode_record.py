"""The keep record of a multi-turn episode under sparse KV (kv/record.py `KVKeepRecord.next_turn`): two turns'
records merged, replayed as one attention mask per compacted turn written out here by hand (and which forward
scores which query), and the bad merges refused by name; the episode batch refuses a record that does not cover
its row (rollout/multi_turn.py). On the real engine:
tests/e2e/test_episodes_sparse_kv.py.
Run: .venv/bin/python -m pytest -q tests/unit/test_kv_episode_record.py
"""
import pytest
import torch

from megatron_sparse_rl.kv.record import KVKeepRecord, batch_replays
from megatron_sparse_rl.rollout.multi_turn import _Episode, _features

# A toy episode of 18 tokens: prompt 0..3, turn 1 samples 4..9, the environment answers 10..11, turn 2 (its prompt
# the 12 tokens so far) samples 12..17. Turn 1 compacts at 7, turn 2 (after its dense prefill) at 14.
# 1 layer, 2 KV heads.
TURN1 = KVKeepRecord(lengths=(7,), kept=(torch.tensor([[[0, 5, 6], [1, 2, 6]]]),))
TURN2 = KVKeepRecord(lengths=(14,), kept=(torch.tensor([[[0, 11, 13], [3, 10, 12]]]),), preempted=True)


def merged() -> KVKeepRecord:
    return KVKeepRecord(lengths=()).next_turn(TURN1, 4, 10).next_turn(TURN2, 12, 18)


def hand_rows(turn: int) -> list[dict[int, set[int]]]:
    """Per KV head, the keys each query row 0..16 (the learner's columns) may attend in the forward that replays
    model turn `turn` (0 or 1) alone, written out: that turn's compressed queries attend what it kept, every other
    query causally (the other turn's compactions are not in it)."""
    heads = []
    for kept1, kept2 in (({0, 5, 6}, {0, 11, 13}), ({1, 2, 6}, {3, 10, 12})):
        rows = {t: set(range(t + 1)) for t in range(17)}
        if turn == 0:  # turn 1's decode queries after its compaction at 7 (its last token 9 is turn 2's prefill)
            rows[7], rows[8] = kept1 | {7}, kept1 | {7, 8}
        else:  # turn 2's decode queries after its compaction at 14
            rows[14], rows[15], rows[16] = kept2 | {14}, kept2 | {14, 15}, kept2 | {14, 15, 16}
        heads.append(rows)
    return heads


def assert_rows(mask: torch.Tensor, heads: list[dict[int, set[int]]]) -> None:
    for h, rows in enumerate(heads):
        for t in range(17):
            assert set(mask[0, h, t].nonzero()[:, 0].tolist()) == rows[t], (h, t)


def test_two_turn_record_replays_as_the_hand_built_masks():
    rec = merged()
    assert rec.lengths == (7, 14) and rec.turn_ends == (10, 18) and rec.preempted and rec.num_compactions == 2
    assert rec.compaction_turns() == (0, 1)
    for turn in (0, 1):
        mask = rec.attention_mask(17, turn=turn)
        assert mask.shape == (1, 2, 17, 17)
        assert_rows(mask, hand_rows(turn))
    with pytest.raises(ValueError, match=r"model turns \[0, 1\] compacted; one forward cannot replay them all, pass "
                                         "turn="):
        rec.attention_mask(17)
    assert rec.compressed_queries(17).nonzero()[:, 0].tolist() == [7, 8, 14, 15, 16]
    # turn 1's forward scores queries 0..8 exactly, turn 2's forward 9..16 (from turn 1's last token on)
    assert [(turn, cols.nonzero()[:, 0].tolist()) for turn, cols in rec.replay_plan(17)] == \
        [(0, list(range(9))), (1, list(range(9, 17)))]
    causal = torch.ones(17, 17, dtype=torch.bool).tril()
    replays = batch_replays([rec, KVKeepRecord(lengths=(), turn_ends=(6, 18))], 17)
    assert len(replays) == 2
    for turn, (mask, cols) in enumerate(replays):
        assert torch.equal(mask[0], rec.attention_mask(17, turn=turn)) and bool((mask[1] == causal).all())
    assert replays[0][1][1].all() and not replays[1][1][1].any()  # the uncompacted row: the first, causal forward


def test_a_turn_without_compaction_is_scored_by_a_causal_forward():
    rec = KVKeepRecord(lengths=()).next_turn(TURN1, 4, 10).next_turn(KVKeepRecord(lengths=(), kept=()), 12, 18)
    assert rec.lengths == (7,) and rec.turn_ends == (10, 18) and not rec.preempted
    assert_rows(rec.attention_mask(17), hand_rows(0))  # one compacted turn: one forward
    assert [(turn, cols.nonzero()[:, 0].tolist()) for turn, cols in rec.replay_plan(17)] == \
        [(0, list(range(9))), (None, list(range(9, 17)))]
    [(mask, _), (dense, cols)] = batch_replays([rec], 17)
    assert dense is None and cols[0].nonzero()[:, 0].tolist() == list(range(9, 17))
    later = KVKeepRecord(lengths=()).next_turn(KVKeepRecord(lengths=(), kept=()), 4, 10).next_turn(TURN2, 12, 18)
    assert later.compaction_turns() == (1,)
    assert_rows(later.attention_mask(17), hand_rows(1))
    assert [(turn, cols.nonzero()[:, 0].tolist()) for turn, cols in later.replay_plan(17)] == [(1, list(range(17)))]


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
    [got] = _features([whole]).kv_keep
    assert got is whole.records["kv_keep"]
    short = KVKeepRecord(lengths=()).next_turn(TURN1, 4, 10)  # the second turn's record missing
    with pytest.raises(ValueError, match=r"episode 1: its KV keep record \(turn ends \(10,\)\) does not cover its 18 "
                                         "tokens"):
        _features([episode(merged()), episode(short)])


def episode_batch(record: KVKeepRecord):
    """The toy episode as a RolloutBatch: prompt 0..3, response 4..17 (the environment's tokens 10, 11)."""
    from megatron_sparse_rl.rollout.batch import FeatureRecords, RolloutBatch

    loss = torch.tensor([[True] * 6 + [False] * 2 + [True] * 6])
    return RolloutBatch(prompt_ids=torch.ones(1, 4, dtype=torch.long), prompt_lens=torch.tensor([4]),
                        response_ids=torch.ones(1, 14, dtype=torch.long), response_mask=torch.ones(1, 14, dtype=bool),
                        rollout_logprobs=torch.zeros(1, 14), finish_reasons=("stop",), group_ids=torch.tensor([0]),
                        loss_mask=loss, features=FeatureRecords(kv_keep=(record,)))


def test_kv_metrics_count_only_the_compressed_queries_of_every_turn():
    from megatron_sparse_rl.training.sparse_kv import kv_metrics

    mask = torch.zeros(1, 17, dtype=torch.bool)
    mask[0, 3:9] = mask[0, 11:17] = True  # the model tokens 4..9 and 12..17, scored by columns 3..8 and 11..16
    rollout = torch.zeros(1, 17)
    rollout[0, [7, 8, 14, 15, 16]] = -0.5  # the compressed queries (turn 1's 7, 8; turn 2's 14..16)
    rollout[0, [11, 12, 13]] = -0.1  # turn 2's dense queries before its compaction: not compression
    m = kv_metrics(episode_batch(merged()), torch.zeros(1, 17), rollout, mask, budget=3)
    assert m["kv/tokens_after_compression_frac"] == pytest.approx(5 / 12)
    assert m["kv/k1_after_compression"] == pytest.approx(-0.5)
    assert m["kv/k1_before_compression"] == pytest.approx(-0.3 / 7)


class ColumnLearner:
    """A stand-in learner whose logprob at every column is the index of the call (0, 1, ...) that scored it, and
    which keeps the masks it was given."""

    def __init__(self):
        self.masks = []

    def forward_logprobs(self, tokens, lengths=None, extras=None):
        self.masks.append(extras.attention_mask)
        return {"logprobs": torch.full((tokens.shape[0], tokens.shape[1] - 1), float(len(self.masks) - 1))}


def test_sparse_logprobs_take_each_column_from_the_forward_that_replays_it():
    from megatron_sparse_rl.training.sparse_kv import sparse_logprobs

    learner, tokens = ColumnLearner(), torch.ones(1, 18, dtype=torch.long)
    got = sparse_logprobs(learner, episode_batch(merged()), tokens)
    assert got[0].tolist() == [0.0] * 9 + [1.0] * 8  # columns 0..8 from turn 1's forward, 9..16 from turn 2's
    assert [m.shape for m in learner.masks] == [(1, 1, 2, 17, 17)] * 2
    assert_rows(learner.masks[0][0], hand_rows(0))
    assert_rows(learner.masks[1][0], hand_rows(1))
    second_dense = KVKeepRecord(lengths=()).next_turn(TURN1, 4, 10).next_turn(KVKeepRecord(lengths=(), kept=()),
                                                                               12, 18)
    learner = ColumnLearner()
    got = sparse_logprobs(learner, episode_batch(second_dense), tokens)
    assert got[0].tolist() == [0.0] * 9 + [1.0] * 8 and learner.masks[1] is None  # then a causal forward

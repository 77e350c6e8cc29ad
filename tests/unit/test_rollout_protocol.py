"""The rollout-rank protocol (placement/protocol.py, placement/disaggregated.py) in one process, over a
stand-in bridge: the commands are frozen dataclasses that survive pickling, a rollout rank dispatches them by type
(`serve`), the learner side cuts a `RolloutRequest` into one part per engine, and the commands sent while the
rollout ranks sample ahead travel as words.

    .venv/bin/python -m pytest -q tests/unit/test_rollout_protocol.py
"""
from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError, dataclass

import pytest
import torch

from megatron_sparse_rl.config.rollout import SamplingConfig
from megatron_sparse_rl.placement import disaggregated as D
from megatron_sparse_rl.placement.protocol import (Collect, Failure, Generate, Probe, RunAhead, Stop, SyncWeights,
                                                   Word, empty_word, from_word, to_word)
from megatron_sparse_rl.placement.rollout import RolloutRequest
from megatron_sparse_rl.weight_sync import WeightSyncError


class Bridge:
    """A stand-in weight-sync bridge: `commands` are what rank 0 broadcasts to a rollout rank, `answers` what the
    rollout ranks gather back to rank 0; what rank 0 sends is recorded."""

    def __init__(self, commands=(), answers=()):
        self.commands, self.answers = list(commands), list(answers)
        self.sent, self.gathered, self.words = [], [], []

    def broadcast_object(self, obj, src):
        if obj is None:  # a rollout rank receives
            return pickle.loads(pickle.dumps(self.commands.pop(0)))  # as it crosses the process boundary
        self.sent.append(obj)
        return obj

    def broadcast(self, tensor, src):
        self.words.append(tensor.clone())

    def gather_object(self, obj, dst):
        if obj is not None or not self.answers:  # a rollout rank answers (or confirms with None)
            self.gathered.append(obj)
            return None
        return [None] + self.answers.pop(0)


@dataclass(frozen=True)
class _Batch:
    """A stand-in RolloutBatch (frozen: re-scorings come back `dataclasses.replace`d)."""

    rows: int
    rescored_logprobs: object = None


class Engine:
    """A stand-in RolloutEngine: records its calls."""

    def __init__(self):
        self.calls, self.down = [], False

    def generate(self, prompts, sampling, group_ids=None, *, between_steps=None):
        self.calls.append(("generate", prompts, sampling.seed, group_ids))
        return _Batch(rows=len(prompts))

    def rescore(self, batch, n):
        self.calls.append(("rescore", batch.rows, n))
        return f"{n} scorings"

    def prompt_logprobs(self, rows):
        self.calls.append(("probe", rows))
        return [torch.full((len(r) - 1,), -1.0) for r in rows]

    def shutdown(self):
        self.down = True


def test_commands_are_frozen_and_cross_a_pickle_unchanged():
    part = RolloutRequest([[1, 2]], SamplingConfig(seed=3), [0], 1)
    for command in (Generate((part,)), SyncWeights(4), RunAhead(((part,),), recompute=True), Collect(),
                    Probe([[1, 2]]), Stop()):
        assert pickle.loads(pickle.dumps(command)) == command
    with pytest.raises(FrozenInstanceError):
        SyncWeights(4).version = 5


def test_the_commands_sent_while_sampling_ahead_round_trip_as_words():
    assert to_word(SyncWeights(7)).tolist() == [Word.SYNC_WEIGHTS, 7]
    assert from_word(to_word(SyncWeights(7))) == SyncWeights(7) and from_word(to_word(Stop())) == Stop()
    assert from_word(empty_word().copy_(to_word(Stop()))) == Stop()
    assert from_word(to_word(Probe([[1]]))) is Word.OBJECT  # the pickled Probe follows
    with pytest.raises(TypeError, match="str is not a command"):
        to_word("probe")
    with pytest.raises(ValueError, match="not a command word"):
        from_word(torch.tensor([9, 0]))


def test_a_rollout_rank_serves_commands_by_type_until_stop():
    part = RolloutRequest([[5, 6, 7]], SamplingConfig(seed=11), [3], 2)
    bridge = Bridge([Generate((RolloutRequest([], SamplingConfig(), [], 0), part)), Probe([[1, 2, 3]]), "generate",
                     Stop()])
    engine = Engine()
    out = D.serve(D.RolloutRank(engine, bridge, rank=2, index=1))
    assert engine.calls == [("generate", [[5, 6, 7]], 11, [3]), ("rescore", 1, 2), ("probe", [[1, 2, 3]])]
    generated, probed, failed, confirmed = bridge.gathered
    assert generated.rescored_logprobs == "2 scorings" and torch.equal(probed, torch.full((1, 2), -1.0))
    assert isinstance(failed, Failure) and "unknown command str" in failed.message and not failed.sync
    assert confirmed is None and engine.down and out == {"rank": 2, "role": "rollout", "commands": 3}


def test_the_learner_side_sends_one_part_per_engine_and_stops_with_a_word_while_sampling_ahead(monkeypatch):
    monkeypatch.setattr(D.dist, "get_rank", lambda: 0)
    bridge = Bridge(answers=[[None, None]])
    remote = D.RemoteEngine(bridge, [2, 3], pad_id=0)
    remote.run_ahead([RolloutRequest([[1], [2], [3]], SamplingConfig(seed=10, n=2))], recompute=False)
    (command,) = bridge.sent  # the first batch: an ordinary command
    assert isinstance(command, RunAhead) and command.recompute is False and not bridge.words
    assert [[p.prompts for p in parts] for parts in command.parts] == [[[[1], [2]]], [[[3]]]]
    assert [parts[0].sampling.seed for parts in command.parts] == [10, 14]  # seed + start * n, as one engine
    assert [parts[0].group_ids for parts in command.parts] == [[0, 1], [2]]
    second = RolloutRequest([[4]], SamplingConfig(seed=20))
    remote.run_ahead([second], recompute=False)  # the next ones: an OBJECT word, then the pickled batch
    assert [from_word(w) for w in bridge.words] == [Word.OBJECT] and bridge.sent[1].parts[0][0].prompts == [[4]]
    remote.shutdown()
    assert [from_word(w) for w in bridge.words] == [Word.OBJECT, Stop()] and remote.stopped
    with pytest.raises(RuntimeError, match="stopped"):
        remote.probe_logprobs([[1, 2]])


def test_an_episode_call_carries_each_engines_examples_and_reward_across_a_pickle(monkeypatch):
    """env.kind on rollout ranks: each engine's part holds its slice of the examples, the env section and the
    trainer's scorer, all of which survive the pickle (the rollout rank runs the environments and their rewards)."""
    from megatron_sparse_rl.config.data import RewardConfig
    from megatron_sparse_rl.config.env import EnvConfig
    from megatron_sparse_rl.data.types import Example
    from megatron_sparse_rl.rewards import make_scorer
    from megatron_sparse_rl.placement.rollout import MultiTurn

    monkeypatch.setattr(D.dist, "get_rank", lambda: 0)
    bridge = Bridge(answers=[[None, None]])
    remote = D.RemoteEngine(bridge, [2, 3], pad_id=0)
    examples = [Example(prompt=f"q: {i}", answer=str(i), ids=(1, 40 + i)) for i in range(3)]
    env = EnvConfig(kind="tools", max_turns=2)
    score = make_scorer(RewardConfig(partial_credit=0.5))
    call = MultiTurn(score, score, env).request(examples, SamplingConfig(n=2), seed=10)
    remote.run_ahead([call], recompute=True)
    (command,) = bridge.sent
    parts = [engine_parts[0] for engine_parts in pickle.loads(pickle.dumps(command)).parts]
    assert [p.prompts for p in parts] == [[[1, 40], [1, 41]], [[1, 42]]]
    assert [[e.answer for e in p.examples] for p in parts] == [["0", "1"], ["2"]]
    assert all(p.env == env for p in parts) and [p.sampling.seed for p in parts] == [10, 14]
    assert parts[1].score(["12", "2"], ["2", "2"]) == [0.25, 1.0]  # partial credit 0.5 * 1/2, exact
    remote.shutdown()


def test_a_failure_is_made_of_the_exception_and_raised_on_the_learner_side_by_kind(monkeypatch):
    assert Failure.of(ValueError("bad row")) == Failure("ValueError: bad row", sync=False)
    assert Failure.of(WeightSyncError("checksum")).sync
    monkeypatch.setattr(D.dist, "get_rank", lambda: 0)
    remote = D.RemoteEngine(Bridge(answers=[[Failure.of(WeightSyncError("checksum"))]]), [2], pad_id=0)
    with pytest.raises(WeightSyncError, match="rollout rank 2 failed: WeightSyncError: checksum"):
        remote.probe_logprobs([[1, 2]])

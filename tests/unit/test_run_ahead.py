"""A rollout rank sampling ahead (placement/run_ahead.py `AheadRank`, trainer.max_staleness >= 1) against a scripted
learner rank 0: words arrive after given engine steps, and the answers it gathers back are checked against the
order the protocol promises (docs/async.md): Collect answered with the oldest batch once sampled, a Probe run
between two batches, weights loaded in flight, a failed batch answered as a Failure while the weights that follow
are still drained, Stop leaving. The engine and the bridge are stand-ins (no vLLM, no process group).

    .venv/bin/python -m pytest -q tests/unit/test_run_ahead.py
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from megatron_sparse_rl.config.rollout import SamplingConfig
from megatron_sparse_rl.placement import run_ahead
from megatron_sparse_rl.placement.protocol import (AheadBatches, Collect, Failure, Probe, RunAhead, Stop, SyncWeights,
                                                   to_word)
from megatron_sparse_rl.placement.rollout import RolloutRequest


@dataclass(frozen=True, eq=False)
class _Batch:
    """A stand-in batch: its prompts' first tokens, and the re-scorings `dataclasses.replace` gives it (as a
    RolloutBatch, it is frozen); equal to the list of those first tokens."""

    firsts: list
    rescored_logprobs: torch.Tensor | None = None

    def __eq__(self, other) -> bool:
        return self.firsts == (other.firsts if isinstance(other, _Batch) else other)

    def __getitem__(self, i):
        return self.firsts[i]


class _Engine:
    """Three engine steps per generate call; a batch is the list of its prompts."""

    def __init__(self, fail: bool = False):
        self.steps, self.fail, self.log = 0, fail, []

    def generate(self, prompts, sampling, group_ids, *, between_steps):
        self.log.append(("generate", prompts[0][0]))
        for _ in range(3):
            self.steps += 1
            if self.fail:
                raise RuntimeError("engine step failed")
            between_steps()
        self.log.append(("done", prompts[0][0]))
        return _Batch([p[0] for p in prompts])

    def update_in_flight(self, load, version, *, recompute):
        load()
        self.log.append(("in flight", version, recompute))

    def rescore(self, batch, n):
        self.log.append(("rescore", batch[0]))
        return torch.zeros(1)


class _Bridge:
    """Rank 0's side, scripted: (engine step after which it is sent, command) in order; what the rank gathers.
    Like rank 0 it sends nothing after a request (Collect, Probe) until the answer came back."""

    def __init__(self, engine: _Engine, script: list[tuple[int, object]]):
        self.engine, self.script, self.answers, self.following = engine, list(script), [], None
        self.waiting = False

    def broadcast_async(self, word, src):
        bridge = self

        class Arrival:
            def is_completed(self):
                ready = bool(bridge.script) and not bridge.waiting and bridge.script[0][0] <= bridge.engine.steps
                if ready:
                    bridge._deliver(word)
                return ready

            def wait(self):
                assert bridge.script and not bridge.waiting, "the rank waits for a word that never comes"
                bridge._deliver(word)

        return Arrival()

    def _deliver(self, word):
        _, command = self.script.pop(0)
        word.copy_(to_word(command))
        self.following, self.waiting = command, isinstance(command, (Collect, Probe))

    def broadcast_object(self, obj, src):
        return self.following

    def gather_object(self, answer, dst):
        assert self.waiting, "an answer nobody asked for"
        self.answers.append(answer)
        self.waiting = False


def _part(first: int, rescore: int = 0) -> RolloutRequest:
    return RolloutRequest([[first, 0]], SamplingConfig(), [0], rescore)


def _run(monkeypatch, engine: _Engine, script, *, rescore: int = 0):
    bridge = _Bridge(engine, script)
    rr = SimpleNamespace(engine=engine, sync_group=bridge, weights_group=None, rank=1, index=0)
    loads = []
    monkeypatch.setattr(run_ahead, "receive", lambda rr, version: loads.append(version))
    rank = run_ahead.AheadRank(rr, RunAhead(((_part(100, rescore),),), True), handle=lambda rr, c: ("probed", c.rows))
    with pytest.raises(run_ahead.Stopped):
        rank.run()
    assert not bridge.script  # every word was taken
    return bridge.answers, loads


def test_collect_probe_and_in_flight_weights_in_protocol_order(monkeypatch):
    engine = _Engine()
    script = [(1, SyncWeights(1)), (1, RunAhead(((_part(200),),), True)), (2, Collect()), (2, Probe([[7]])),
              (2, Collect()), (2, Stop())]
    answers, loads = _run(monkeypatch, engine, script)
    first, probed, second = answers
    assert isinstance(first, AheadBatches) and first.batches == [[100]]
    assert first.seconds["in_flight"] == 1.0 and second.seconds["in_flight"] == 0.0
    assert probed == ("probed", [[7]]) and second.batches == [[200]]
    # version 1 loaded between engine steps of the first batch, by the engine's in-flight update (KV recomputed)
    assert loads == [1] and engine.log == [("generate", 100), ("in flight", 1, True), ("done", 100),
                                   ("generate", 200), ("done", 200)]


def test_collect_of_the_batch_being_sampled_waits_for_it(monkeypatch):
    """The last batch handed over, collected while it is sampled (nothing queued behind it): answered once done."""
    engine = _Engine()
    answers, loads = _run(monkeypatch, engine, [(1, Collect()), (3, Stop())])
    assert [a.batches for a in answers] == [[[100]]] and engine.log == [("generate", 100), ("done", 100)]


def test_collect_with_rescorings_waits_for_the_weights_and_the_end_of_the_batch(monkeypatch):
    """engine_mean: the oldest batch is re-scored after the weights the learner trains it with were loaded, and
    between two batches (the engine runs one generate at a time)."""
    engine = _Engine()
    script = [(1, RunAhead(((_part(200, rescore=2),),), True)), (4, SyncWeights(1)), (4, Collect()), (6, Collect()),
              (6, Stop())]
    answers, loads = _run(monkeypatch, engine, script, rescore=2)
    assert [a.batches for a in answers] == [[[100]], [[200]]]
    # the first Collect came while the second batch was sampled: answered after it, re-scored at version 1
    assert engine.log == [("generate", 100), ("done", 100), ("generate", 200), ("in flight", 1, True),
                          ("done", 200), ("rescore", 100), ("rescore", 200)]
    assert loads == [1]


def test_a_failed_batch_is_answered_as_a_failure_and_the_weights_are_still_drained(monkeypatch):
    drained = []
    monkeypatch.setattr(run_ahead, "receive_weights", lambda engine, group, src: drained.append(engine))
    answers, loads = _run(monkeypatch, _Engine(fail=True), [(0, SyncWeights(1)), (0, Collect()), (0, Stop())])
    assert answers == [Failure("RuntimeError: engine step failed")]
    assert drained == [None] and loads == []  # received into nothing, so the bridge stays in step


def test_one_batch_ahead_is_a_queue_of_depth_one(monkeypatch):
    """trainer.max_staleness 1, as rank 0 drives it: each batch is handed over after the previous one was collected;
    weights that arrive after the batch was sampled load at once (not in flight) and its re-scorings follow them;
    weights that arrive while the next batch samples load in flight."""
    engine = _Engine()
    script = [(4, SyncWeights(1)), (4, Collect()), (4, RunAhead(((_part(200, rescore=1),),), True)),
              (5, SyncWeights(2)), (6, Collect()), (6, Stop())]
    answers, loads = _run(monkeypatch, engine, script, rescore=1)
    assert [a.batches for a in answers] == [[[100]], [[200]]]
    assert [a.seconds["in_flight"] for a in answers] == [0.0, 1.0]
    assert loads == [1, 2]  # version 1 loaded idle; version 2 inside the engine's in-flight update
    assert engine.log == [("generate", 100), ("done", 100), ("rescore", 100), ("generate", 200),
                          ("in flight", 2, True), ("done", 200), ("rescore", 200)]

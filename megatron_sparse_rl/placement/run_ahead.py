"""A rollout rank sampling ahead of the learner (trainer.max_staleness k >= 1, docs/async.md): it samples the
batches learner rank `SRC` hands it one after another, up to k of them ahead of the one the learner trains, and
never waits for the learner between two of them. k = 1 is a queue of depth one.

The first `RunAhead` arrives as an ordinary command (placement/disaggregated.py `serve`); from then on everything
from rank `SRC` arrives as a word (placement/protocol.py), polled between engine steps while sampling and
waited for when nothing is left to sample:

    SyncWeights(v)      the weights follow; loaded between engine steps without draining the running requests
                        (`RolloutEngine.update_in_flight`: partial rollouts, per-token versions), or at once when
                        idle
    OBJECT + RunAhead   one more batch, queued
    Collect             answered with the oldest batch sampled (`AheadBatches`) as soon as it is complete; its
                        engine_mean re-scorings run first, between two batches, at the weights just loaded (the
                        version the learner trains that batch with)
    OBJECT + Probe / Generate
                        run between two batches (the engine runs one generate at a time), then answered
    Stop                the rank leaves (`Stopped`), its unfinished batches dropped

Rank `SRC` waits for each answer before it sends anything else, so at most one request is open. A batch that
fails to sample leaves the rank failed: it keeps to the protocol (takes every word, drains the weights) and
answers every request with the `Failure`, which rank `SRC` raises.
"""
from __future__ import annotations

import logging
import time
import traceback
from collections import deque

from megatron_sparse_rl.placement.protocol import (SRC, AheadBatches, Collect, Failure, RunAhead, Stop, SyncWeights,
                                                   Word, empty_word, from_word)
from megatron_sparse_rl.placement.rollout import RolloutRequest
from megatron_sparse_rl.weight_sync import receive_weights

log = logging.getLogger(__name__)


class Stopped(Exception):
    """Learner rank `SRC` stopped the run while this rank sampled ahead."""


def receive(rr, version: int) -> None:
    """The weight stream from rank `SRC` into rollout rank `rr`'s engine (checksummed, `receive_weights`), loaded as
    weight version `version`."""
    receive_weights(rr.engine, rr.weights_group or rr.sync_group, src=SRC, version=version)


class AheadRank:
    """The state of one rollout rank sampling ahead: the batches queued and sampled, the open request. `handle` runs
    a command for the engine (Probe, Generate) as placement/disaggregated.py serves it."""

    def __init__(self, rr, first: RunAhead, *, handle):
        self.rr, self.recompute, self.handle = rr, first.recompute, handle
        self.queue: deque[tuple[RolloutRequest, ...]] = deque([first.parts[rr.index]])  # this engine's part of
        # each share's request, per batch not sampled yet
        self.done: deque[tuple[tuple[RolloutRequest, ...], AheadBatches]] = deque()  # sampled, not collected
        self.open = None                             # Collect() or a command, until answered
        self.failure: Failure | None = None
        self.sampling = False                        # a batch is being sampled (taken off the queue)
        self.load_s, self.loads, self.idle_s = 0.0, 0, 0.0
        self._listen()

    def _listen(self) -> None:
        self.word = empty_word()
        self.arrival = self.rr.sync_group.broadcast_async(self.word, src=SRC)

    def run(self) -> None:
        """Sample, answer and load until Stop (raises `Stopped`)."""
        while True:
            self._answer(between_batches=True)
            if self.queue and self.failure is None:
                self._sample(self.queue.popleft())
            else:
                start = time.perf_counter()
                self.arrival.wait()
                self.idle_s += time.perf_counter() - start
                try:
                    self._take(in_flight=False)
                except Stopped:
                    raise
                except Exception as e:  # noqa: BLE001 - e.g. a weight checksum: reported on the next request
                    log.error("rollout rank %d: %s", self.rr.rank, traceback.format_exc())
                    self.failure = Failure.of(e)

    def _sample(self, requests: tuple[RolloutRequest, ...]) -> None:
        """One batch, this engine's part of each share's request; the words that arrive meanwhile are taken between
        engine steps. Re-scored when collected."""
        start, load_before, loads_before = time.perf_counter(), self.load_s, self.loads
        self.sampling = True
        try:
            batches = [r.sample(self.rr.engine, between_steps=self._between_steps) for r in requests]
        except Stopped:
            raise
        except Exception as e:  # noqa: BLE001 - reported on the next request
            log.error("rollout rank %d: sampling ahead failed:\n%s", self.rr.rank, traceback.format_exc())
            self.failure = Failure.of(e)
            return
        finally:
            self.sampling = False
        load_s = self.load_s - load_before
        seconds = {"generate_s": time.perf_counter() - start - load_s, "wait_s": self.idle_s, "load_s": load_s,
                   "in_flight": float(self.loads > loads_before)}
        self.idle_s = 0.0
        self.done.append((requests, AheadBatches(batches, seconds)))

    def _between_steps(self) -> None:
        while self.arrival.is_completed():
            self._take(in_flight=True)
        self._answer(between_batches=False)

    def _take(self, *, in_flight: bool) -> None:
        """The word that arrived, and what follows it; then listen for the next one."""
        command = from_word(self.word)
        if isinstance(command, Stop):
            raise Stopped
        try:
            if command is Word.OBJECT:
                command = self.rr.sync_group.broadcast_object(None, src=SRC)
            if isinstance(command, SyncWeights):
                self._load(command.version, in_flight)
            elif isinstance(command, RunAhead):
                self.queue.append(command.parts[self.rr.index])
            else:  # Collect, Probe, Generate: one request at a time
                self.open = command
        finally:
            self._listen()

    def _load(self, version: int, in_flight: bool) -> None:
        if self.failure is not None:  # keep the bridge in step
            receive_weights(None, self.rr.weights_group or self.rr.sync_group, src=SRC)
            return
        start = time.perf_counter()
        if in_flight:
            self.rr.engine.update_in_flight(lambda: receive(self.rr, version), version, recompute=self.recompute)
        else:
            receive(self.rr, version)
        self.load_s += time.perf_counter() - start
        self.loads += 1

    def _answer(self, *, between_batches: bool) -> None:
        """Answer the open request when it can be: a failure at once; Collect once the oldest batch is sampled
        (between batches when it has re-scorings to run); a command between batches."""
        if self.open is None:
            return
        if self.failure is None and isinstance(self.open, Collect) and not (self.done or self.sampling or self.queue):
            self.failure = Failure("Collect with no batch sampled or queued")
        if self.failure is not None:
            answer = self.failure
        elif isinstance(self.open, Collect):
            if not self.done or (not between_batches and any(r.rescore for r in self.done[0][0])):
                return
            answer = self._rescored(*self.done.popleft())
        elif between_batches:
            try:
                answer = self.handle(self.rr, self.open)
            except Exception as e:  # noqa: BLE001 - reported to rank SRC, which raises it
                answer = Failure.of(e)
        else:
            return
        self.open = None
        self.rr.sync_group.gather_object(answer, dst=SRC)

    def _rescored(self, requests: tuple[RolloutRequest, ...], ahead: AheadBatches) -> AheadBatches:
        """engine_mean's pi_old estimates, at the weights the learner trains this batch with (loaded by now)."""
        return AheadBatches([r.rescored(self.rr.engine, b) for r, b in zip(requests, ahead.batches)], ahead.seconds)

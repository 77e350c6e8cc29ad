"""The messages between learner rank `SRC` and the rollout ranks of a disaggregated run (placement/disaggregated.py
sends and serves them): one frozen dataclass per command, dispatched by type.

Each command is one `Bridge.broadcast_object` from rank `SRC` to every rollout rank; each answer one
`gather_object` back to it. Engine e (rollout ranks [e t, (e + 1) t), t = rollout.tensor_parallel_size) serves
part e of a command that carries parts (a `RolloutRequest`, placement/rollout.py, cut by `RolloutRequest.parts`):

    Generate(parts)               engine e runs parts[e] (a slice of the prompts, and with env.kind their examples,
                                  run as multi-turn episodes there, re-scored when asked); its first rank answers
                                  the `RolloutBatch` (None: an empty part, or another rank of it)
    SyncWeights(version)          every learner rank runs `send_weights`, every rollout rank `receive_weights`
                                  (checksummed buckets); answer None once loaded
    RunAhead(parts, recompute)    asynchronous RL, trainer.max_staleness k >= 1 (placement/run_ahead.py): one more
                                  batch for the queue, engine e samples each share's parts[e] while the learner
                                  trains. The first one makes the rank sample ahead; from then on every command
                                  arrives as a word, and each Collect is answered with the oldest batch
                                  (`AheadBatches`)
    Collect()                     (sampling ahead) answer the oldest batch once sampled
    Probe(rows)                   each engine's prompt logprobs of the rows (float32 [B, S-1])
    Stop()                        the rollout ranks shut their engines down; answer None once down

A command that raises on a rollout rank is answered with a `Failure` instead (`Failure.of`), which rank `SRC`
raises.

While it samples ahead, a rollout rank is inside the engine's step loop and can only poll between engine steps.
A pickled object cannot be polled for: `broadcast_object` is two blocking broadcasts (size, then bytes). So every
command rank `SRC` sends then travels as a `word`: two int64 (a `Word` code and the version), broadcast by
`Bridge.broadcast_async`, whose completion the rank polls (`to_word` / `from_word`): SyncWeights, Stop and Collect
themselves, and OBJECT, which says a pickled command follows at once (`broadcast_object`: a RunAhead batch, or a
Probe / Generate that the rank runs between two batches).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from megatron_sparse_rl.placement.rollout import RolloutRequest
from megatron_sparse_rl.weight_sync import WeightSyncError

SRC = 0
"""The learner rank that drives the rollout ranks and sends the weights."""


@dataclass(frozen=True, slots=True)
class Generate:
    parts: tuple[RolloutRequest, ...]
    """One per engine."""


@dataclass(frozen=True, slots=True)
class SyncWeights:
    version: int
    """The weight version the engines hold once loaded (RolloutBatch.token_version)."""


@dataclass(frozen=True, slots=True)
class RunAhead:
    """One more batch for the rollout ranks' queue of batches sampled ahead (trainer.max_staleness >= 1)."""

    parts: tuple[tuple[RolloutRequest, ...], ...]
    """Per engine, its part of each data-parallel share's request."""
    recompute: bool
    """Weights loaded while requests run: recompute their KV under the new weights (trainer.in_flight_kv)."""


@dataclass(frozen=True, slots=True)
class Collect:
    """Answer the oldest batch sampled ahead (once sampled), as `AheadBatches`."""


@dataclass(frozen=True, slots=True)
class Probe:
    rows: list[list[int]]


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Generate | SyncWeights | RunAhead | Collect | Probe | Stop


@dataclass(frozen=True, slots=True)
class AheadBatches:
    """A rollout rank's answer to Collect: one batch sampled ahead."""

    batches: list
    """One RolloutBatch (None: an empty part) per data-parallel share."""
    seconds: dict[str, float]
    """generate_s, wait_s (idle before this batch began, waiting to be handed one or for the weights), load_s, and
    in_flight (1.0: weights loaded while sampling it)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """A rollout rank's answer to a command that raised there."""

    message: str
    sync: bool = False
    """The error was a WeightSyncError (rank `SRC` raises one too)."""

    @classmethod
    def of(cls, error: Exception) -> Failure:
        """The answer that reports `error` to rank `SRC`: its type and message, and whether it is a WeightSyncError."""
        return cls(f"{type(error).__name__}: {error}", sync=isinstance(error, WeightSyncError))


class Word(IntEnum):
    """The code of a command sent as a word (module docstring)."""

    SYNC_WEIGHTS = 1
    STOP = 2
    COLLECT = 3
    OBJECT = 4
    """A pickled command follows."""


FOLLOWS = (RunAhead, Probe, Generate)
"""The commands that travel as an OBJECT word and then pickled, while the rollout ranks sample ahead."""


def to_word(command: Command) -> torch.Tensor:
    """`command` as the int64 [2] word a rollout rank sampling ahead polls for (OBJECT for the commands of
    `FOLLOWS`, which the caller then sends pickled)."""
    if isinstance(command, SyncWeights):
        return torch.tensor([Word.SYNC_WEIGHTS, command.version], dtype=torch.int64)
    if isinstance(command, Stop):
        return torch.tensor([Word.STOP, 0], dtype=torch.int64)
    if isinstance(command, Collect):
        return torch.tensor([Word.COLLECT, 0], dtype=torch.int64)
    if isinstance(command, FOLLOWS):
        return torch.tensor([Word.OBJECT, 0], dtype=torch.int64)
    raise TypeError(f"{type(command).__name__} is not a command of placement/protocol.py")


def empty_word() -> torch.Tensor:
    """The buffer a word is received into."""
    return torch.zeros(2, dtype=torch.int64)


def from_word(word: torch.Tensor) -> SyncWeights | Stop | Collect | Word:
    """The command a received word holds (`Word.OBJECT`: receive the pickled command that follows)."""
    code, version = word.tolist()
    if code == Word.SYNC_WEIGHTS:
        return SyncWeights(version)
    if code == Word.STOP:
        return Stop()
    if code == Word.COLLECT:
        return Collect()
    if code == Word.OBJECT:
        return Word.OBJECT
    raise ValueError(f"not a command word: {word.tolist()}")

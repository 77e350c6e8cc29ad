"""Host memory of the DSA indexer replay record per learner rank (issue 33: R2/R3 indexer replay).

    rec = indexer_record(shape, layout=(8, 1, 256), gpus=256, seq_len=65536, batch=1024)
    rec.bytes_per_token, rec.rank_bytes

Replay stores, for every token of every sequence and every layer that runs the indexer, the `index_topk` positions
that token attends to; the old-policy forward records them, every update forward (and activation recompute) replays
them, so a learner rank holds the records of its sequences from the old forward to its last update. Counted:
- every token of the sequence (prompt + response) at `seq_len` tokens, topk indices each: an upper bound, as the
  tokens before position topk attend to every earlier token and a store could skip them (3% of 64K tokens);
- each index in the smallest unsigned type that holds position seq_len - 1: uint16 up to 65,536 tokens, else int32
  (`index_bytes`);
- a rank holds its data-parallel share of the step's sequences, ceil(batch / dp), for the DSA layers of its
  pipeline stage, ceil(layers / pp) (the worst stage); TP ranks of one group each hold the same copy.
Not counted: the per-sequence checksum and offsets (bytes per sequence), context parallelism (which would split
each sequence's tokens over its ranks).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from megatron_sparse_rl.planner.shapes import ModelShape


def index_bytes(seq_len: int) -> int:
    """Bytes of one recorded position: uint16 while every position (0 .. seq_len - 1) is below 2**16, else int32."""
    return 2 if seq_len <= 2 ** 16 else 4


@dataclass(kw_only=True, frozen=True, slots=True)
class IndexerRecord:
    seq_len: int
    """Tokens per sequence (prompt + response)."""
    batch: int
    """Sequences per RL step, all ranks (trainer.prompts_per_step x rollout.sampling.n)."""
    dp: int
    """Data-parallel size of the learner layout: the step's sequences are split over it."""
    topk: int
    """Recorded positions per token per layer (index_topk)."""
    index_bytes: int
    """Bytes per position (index_bytes(seq_len))."""
    layers: int
    """DSA layers of the whole model."""
    stage_layers: int
    """DSA layers of the worst pipeline stage: the ones a rank records."""

    @property
    def layer_bytes_per_token(self) -> int:
        """One token in one layer: topk positions."""
        return self.topk * self.index_bytes

    @property
    def bytes_per_token(self) -> int:
        """One token, every DSA layer of the model."""
        return self.layers * self.layer_bytes_per_token

    @property
    def sequences_per_rank(self) -> int:
        return ceil(self.batch / self.dp)

    @property
    def rank_bytes(self) -> int:
        """Host bytes one learner rank holds for a step: its sequences x tokens x its stage's layers x topk."""
        return self.sequences_per_rank * self.seq_len * self.stage_layers * self.layer_bytes_per_token


def indexer_record(shape: ModelShape, *, layout: tuple[int, int, int], gpus: int, seq_len: int,
                   batch: int) -> IndexerRecord | None:
    """The replay record of `shape` under learner `layout` (tp, pp, ep) on `gpus` GPUs; None without DSA."""
    if shape.dsa is None:
        return None
    tp, pp, _ = layout
    return IndexerRecord(seq_len=seq_len, batch=batch, dp=gpus // (tp * pp), topk=shape.dsa.topk,
                         index_bytes=index_bytes(seq_len), layers=shape.dsa.layers,
                         stage_layers=min(ceil(shape.layers / pp), shape.dsa.layers))

"""`IndexerRecord`: the compact storage of DSA indexer choices (DeepSeek-V3.2 / GLM-5 lightning-indexer top-k per
query and layer), as `RouteStore` (moe/storage.py) is for MoE routes: what the learner's old forward records for R2
(learner/indexer_replay.py) and what the engine's capture fills for R3 (rollout/indexer_capture.py).

    record = IndexerRecord(pack_positions(positions, width), row_hashes(tokens, lengths))
    record.positions()          # int64 [B, S-1, DSA layers, index_topk]
    record.select(rows)         # the record of some rows

Positions take 2 bytes up to 65536 (int16 read as unsigned; int32 past that); each row carries the crc32 of its
real tokens, which a replay checks against the tokens it runs on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sparse_rl.moe.storage import token_hash


class IndexerReplayError(RuntimeError):
    """Indices missing, misshapen, or for another batch; or a request the learner cannot serve."""


def _rows(index) -> torch.Tensor:
    return torch.as_tensor(index, dtype=torch.long).reshape(-1)


@dataclass(frozen=True, slots=True)
class IndexerRecord:
    """The DSA layers' top-k of one call's rows: `indices` [B, S-1, DSA layers, index_topk], per row, query position
    and layer, each entry clamped to <= its query position, stored as int16 read as unsigned (2 bytes for positions
    up to 65535; int32 past them: `pack_positions`; read them with `positions()`); `token_hash` int64 [B], the crc32
    of each row's real tokens (`row_hashes`), which a replay checks against the tokens it runs on."""

    indices: torch.Tensor
    token_hash: torch.Tensor

    def __post_init__(self):
        if self.indices.dim() != 4 or self.token_hash.shape != (self.indices.shape[0],):
            raise IndexerReplayError(f"IndexerRecord needs indices [rows, seq-1, DSA layers, index_topk] and one "
                                     f"token hash per row (got {list(self.indices.shape)} and "
                                     f"{list(self.token_hash.shape)})")

    def positions(self) -> torch.Tensor:
        """The indices as int64 positions."""
        return unpack_positions(self.indices)

    def select(self, index) -> IndexerRecord:
        """The record of rows `index`."""
        rows = _rows(index)
        return IndexerRecord(self.indices[rows], self.token_hash[rows])

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * self.indices.element_size() + self.token_hash.numel() * 8


UNSIGNED16 = 2 ** 16
"""Positions below this are stored in 2 bytes: int16 holding the unsigned 16-bit value (torch's uint16 lacks
index_put on CPU)."""


def pack_positions(positions: torch.Tensor, width: int) -> torch.Tensor:
    """int positions (< width) as the record stores them: int16 read as unsigned while width <= 65536, else int32."""
    if width <= UNSIGNED16:
        return torch.where(positions >= 2 ** 15, positions - UNSIGNED16, positions).to(torch.int16)
    return positions.to(torch.int32)


def unpack_positions(stored: torch.Tensor) -> torch.Tensor:
    """int64 positions of `pack_positions`' output."""
    out = stored.long()
    return out & (UNSIGNED16 - 1) if stored.dtype == torch.int16 else out


def row_hashes(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 [B]: `token_hash` of each row's first lengths[b] tokens."""
    return torch.tensor([token_hash(tokens[b, :int(n)]) for b, n in enumerate(lengths)], dtype=torch.int64)

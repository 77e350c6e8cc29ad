"""R3 indexer capture on the rollout engine: the tokens each DeepSeek Sparse Attention layer of vLLM attended.

UNTESTED HERE: vLLM 0.32 serves DSA (DeepSeek-V3.2, GLM-5) on GPU only (its CPU platform refuses sparse attention)
and no GPU run of this capture has been made. It is written against vLLM's interface as read in its source:

- `vllm.model_executor.models.deepseek_v2.Indexer`, one per DSA layer that computes its own top-k, returns the
  model's shared int32 `topk_indices_buffer` [max_num_batched_tokens, index_topk]; its first rows are the step's
  flat tokens in the runner's batch order, and each value is a position within that token's own request (the
  sparse MLA backend maps them through the block table: `triton_convert_req_index_to_global_index`), -1 where a
  query has fewer earlier tokens than index_topk. A forward hook on every `Indexer` (vllm_access `dsa_indexers`,
  `on_indexer_output`; feature "dsa_indexer" of its NEEDS table) copies the first n rows of the buffer per step
  (the buffer is shared, so each layer's rows are copied before the next layer overwrites them).
- The per-step batch (request ids, row offsets, token ids, positions) comes from the `StepCapture` base, as for
  the MoE route capture (rollout/routes.py): each row is filed under (request, position) with its token id.

After `generate`, `collect` gives every output row (prompt + response, RolloutBatch order) the indices of its n - 1
input positions (`engine_indexer_rows`, a pure function): -1 entries and entries above the query are replaced by
the query position (the learner's convention: learner/indexer_replay.py `clamp_causal`), packed with
`pack_positions`, with the crc32 of the row's n tokens (what the learner's `row_hashes` covers for a row of length
n); a position the indexers never ran, a token that differs, or a value below -1 raises naming sequence and
position. The batch carries them as `EngineIndexerRows` (`RolloutBatch.features.indexer_record`); training/update.py
pads them to the learner's [B, T-1] layout (`padded`) for the old forward.

    engine = RolloutEngine(model_dir, cfg, extensions=[EngineIndexerCapture()])   # a CUDA engine, enforce_eager
    batch = engine.generate(prompts, sampling)        # batch.features.indexer_record: EngineIndexerRows, one per row

Limits: eager engines only (vLLM's enforce_eager turns torch.compile and CUDA graphs off; a graph replay runs
no Python hook); no prefix caching (a cached prefix is not run again, so its indices would be missing); no
multi-turn episodes (`follows_turns` is off: the engine refuses it); layers that reuse an earlier layer's top-k
(IndexCache's `index_topk_freq`) build no `Indexer` and are not recorded, so the learner then refuses the record's
layer count.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.moe.indexer_storage import (
    IndexerRecord, IndexerReplayError, pack_positions, unpack_positions,
)
from megatron_sparse_rl.moe.storage import token_hash
from megatron_sparse_rl.rollout.step_capture import LayerStepCapture


@dataclass(frozen=True)
class EngineIndexerRows:
    """The engine's DSA indexer choices per output row: `rows[b]` [n_b - 1, DSA layers, topk] positions packed with
    `pack_positions` (each entry <= its query position), `token_hash[b]` the crc32 of the row's n_b tokens,
    `layers` the engine's layer ids of its indexers."""

    rows: tuple[torch.Tensor, ...]
    token_hash: torch.Tensor
    layers: tuple[int, ...]
    topk: int

    def __post_init__(self):
        if self.token_hash.shape != (len(self.rows),):
            raise IndexerReplayError(f"EngineIndexerRows: {len(self.rows)} rows and {list(self.token_hash.shape)} "
                                     "token hashes")
        for b, r in enumerate(self.rows):
            if r.dim() != 3 or tuple(r.shape[1:]) != (len(self.layers), self.topk):
                raise IndexerReplayError(f"EngineIndexerRows: row {b} has shape {list(r.shape)}, want [positions, "
                                         f"{len(self.layers)}, {self.topk}]")

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, index) -> EngineIndexerRows:
        idx = torch.as_tensor(index, dtype=torch.long).reshape(-1).tolist()
        return EngineIndexerRows(tuple(self.rows[i] for i in idx), self.token_hash[idx], self.layers, self.topk)

    @classmethod
    def concat(cls, parts: list[EngineIndexerRows]) -> EngineIndexerRows:
        shapes = {(p.layers, p.topk) for p in parts}
        if len(shapes) > 1:
            raise IndexerReplayError(f"EngineIndexerRows.concat: parts of other (layers, topk): {sorted(shapes)}")
        return cls(sum((p.rows for p in parts), ()), torch.cat([p.token_hash for p in parts]), parts[0].layers,
                   parts[0].topk)

    def padded(self, width: int) -> IndexerRecord:
        """The learner's layout: an `IndexerRecord` [B, width, DSA layers, topk], each row's positions past its
        n - 1 filled with the query position (the learner never reads them: not a real query)."""
        pos = torch.arange(width).view(1, -1, 1, 1)
        out = pos.expand(len(self.rows), width, len(self.layers), self.topk).clone()
        for b, r in enumerate(self.rows):
            if r.shape[0] > width:
                raise IndexerReplayError(f"sequence {b}: {r.shape[0]} indexed positions do not fit the learner's "
                                         f"width {width}")
            out[b, :r.shape[0]] = unpack_positions(r)
        return IndexerRecord(pack_positions(out, width), self.token_hash.clone())


def row_positions(row: int, seq: list[int], seen: dict[int, tuple[int, torch.Tensor]], layers: int,
                  topk: int) -> torch.Tensor:
    """int64 [n - 1, layers, topk]: the indices filed for the n - 1 input positions of `seq` (`seen`: position ->
    (token id, int [layers, topk] per-request positions)), -1 entries and entries above the query replaced by the
    query position. Raises naming sequence `row` and the position when one is missing, was indexed for another
    token, is misshapen or holds a value below -1."""
    n_in = max(len(seq) - 1, 0)
    out = torch.empty(n_in, layers, topk, dtype=torch.long)
    for pos in range(n_in):
        got = seen.get(pos)
        if got is None:
            raise IndexerReplayError(f"sequence {row}: the engine's indexers never ran position {pos}")
        tok, idx = got
        if tok != seq[pos]:
            raise IndexerReplayError(f"sequence {row}: position {pos} was indexed for token {tok}, the sequence "
                                     f"has {seq[pos]}")
        if tuple(idx.shape) != (layers, topk):
            raise IndexerReplayError(f"sequence {row}: position {pos} has indices of shape {list(idx.shape)}, want "
                                     f"[{layers}, {topk}]")
        out[pos] = idx
    low = (out < -1).any(-1).any(-1).nonzero().flatten()
    if low.numel():
        raise IndexerReplayError(f"sequence {row}: position {int(low[0])} has indices below -1 "
                                 f"({int(out[low[0]].min())}); the engine's values are positions or -1")
    query = torch.arange(n_in).view(-1, 1, 1)
    return torch.where((out == -1) | (out > query), query, out)


def engine_indexer_rows(seqs: list[list[int]], seens: list[dict], layers: tuple[int, ...],
                        topk: int) -> EngineIndexerRows:
    """Per row (prompt + response tokens `seqs[b]`, its filed indices `seens[b]`) the packed positions of its
    n - 1 input positions (`row_positions`) and the crc32 of its n tokens."""
    rows = tuple(pack_positions(row_positions(b, s, seen, len(layers), topk), max(len(s) - 1, 1))
                 for b, (s, seen) in enumerate(zip(seqs, seens)))
    hashes = torch.tensor([token_hash(s) for s in seqs], dtype=torch.int64)
    return EngineIndexerRows(rows, hashes, tuple(layers), topk)


class EngineIndexerCapture(LayerStepCapture):
    """Indexer capture bound to one RolloutEngine's in-process worker (see the module docstring)."""

    provides = "indexer"
    field = "indexer_record"
    features = ("step", "dsa_indexer")
    error = IndexerReplayError
    no_rows = ("indexer capture", "returned no indices")

    def __init__(self):
        super().__init__()
        self.layers: tuple[int, ...] = ()
        self.topk = 0
        self._hooks: list = []
        # self._seen: internal request id -> position -> (token id, int32 [layers, topk])

    def on_started(self, engine) -> None:
        if not engine.vllm_args.get("enforce_eager"):
            raise IndexerReplayError("routing.indexer_replay = R3 captures the indexers with forward hooks, which a "
                                     "CUDA graph does not replay: set rollout.enforce_eager = true")
        if engine.cfg.prefix_caching:
            raise IndexerReplayError("routing.indexer_replay = R3 needs every position run by the engine: set "
                                     "rollout.prefix_caching = false (a cached prefix is not indexed again)")
        super().on_started(engine)

    # ---- worker side (runs in the engine's process) -------------------------------------------------
    def _install_hooks(self, runner) -> None:
        indexers = vllm_access.dsa_indexers(vllm_access.model(runner))
        if not indexers:
            raise IndexerReplayError("indexer capture: the engine's model has no DeepSeek Sparse Attention indexer")
        self.layers, self.topk = tuple(d.layer_id for d in indexers), indexers[0].topk
        self._hooks = [vllm_access.on_indexer_output(d, partial(self._on_indices, j)) for j, d in enumerate(indexers)]

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_indices(self, j: int, buffer: torch.Tensor) -> None:
        self._keep_layer(j, buffer[:, :self.topk], torch.int32)

    # ---- driver side -------------------------------------------------------------------------------
    def collect(self, outputs, prompts: list[list[int]]) -> EngineIndexerRows:
        """Stop capturing; the indices of every (prompt, response) row of vLLM's `outputs`, in RolloutBatch order."""
        self._flush()
        seqs, seens = self._rows_seen(outputs, prompts, "indices")
        rows = engine_indexer_rows(seqs, seens, self.layers, self.topk)
        self._seen.clear()
        return rows

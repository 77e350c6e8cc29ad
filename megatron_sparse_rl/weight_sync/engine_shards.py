"""The slice of each HF tensor that one rank of a tensor-parallel vLLM engine keeps (disaggregated sync).

    shards = EngineShards(spec, tp=2)
    piece, cut = shards.cut("model.layers.0.self_attn.q_proj.weight", full, rank=1)  # sender, per engine rank
    whole = expand(piece, cut)                                                       # receiver, before load_weights

vLLM's weight loaders take full checkpoint tensors and narrow each to the rank's slice. To send each engine
rank only its slice, the sender cuts the same slice here, by HF name (the adapters' names, models/base.py and
models/mixtral.py), following vLLM 0.32's loaders:
- rows (dim 0), t equal parts: `q_proj` (weight, bias), `gate_proj`/`up_proj` (dense MLP, routed and shared
  experts; Mixtral `w1`/`w3`);
- rows by KV head: `k_proj`/`v_proj` (weight, bias); with more ranks than KV heads each head is replicated
  on t / kv_heads consecutive ranks (QKVParallelLinear's `num_kv_head_replicas`);
- columns (dim 1), t equal parts: `o_proj`, `down_proj` (Mixtral `w2`);
- vocab rows: `embed_tokens`, `lm_head`: the vocab padded to a multiple of 64, t equal parts of the padded
  range, clipped to the real vocab (VocabParallelEmbedding; the last part may be short or empty);
- everything else (norms, router, q/k norms): whole.
A tensor whose split dimension does not divide evenly is sent whole (vLLM narrows it as before).

The receiver rebuilds a full-shape tensor filled with NaN around the slice (`expand`) and hands it to the
engine's own `load_weights`, so the loaders run unchanged; if a rule here ever disagreed with a loader, the
loader would read NaN and the engine's weights would show it (`receive_weights` scans for NaN after a sliced
sync and raises). On the wire an engine rank receives 1/t of every split tensor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_sparse_rl.models.spec import ModelSpec

VOCAB_PADDING = 64
"""vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py), which the supported models use."""

_ROWS = re.compile(r"\.(q_proj|gate_proj|up_proj|w1|w3)\.(weight|bias)$")
_KV = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
_COLS = re.compile(r"\.(o_proj|down_proj|w2)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


@dataclass(frozen=True)
class Cut:
    """Where a slice sits in its full tensor: `full_shape`, and `length` entries from `start` along `dim`."""

    full_shape: tuple[int, ...]
    dim: int
    start: int
    length: int


class EngineShards:
    """Slice rules for the ranks of one vLLM engine of tensor-parallel size `tp` serving `spec`."""

    def __init__(self, spec: ModelSpec, tp: int):
        if tp < 1:
            raise ValueError(f"engine tensor-parallel size must be >= 1 (got {tp})")
        self.spec, self.tp = spec, tp

    def slice_of(self, name: str, shape: tuple[int, ...], rank: int) -> Cut | None:
        """The part of the full tensor `name` (of `shape`) that engine rank `rank` keeps; None: all of it."""
        if not 0 <= rank < self.tp:
            raise ValueError(f"engine rank must be in [0, {self.tp}) (got {rank})")
        shape, t = tuple(shape), self.tp
        if t == 1 or not shape:
            return None
        if _ROWS.search(name):
            return _even(shape, 0, rank, t)
        if _KV.search(name):
            return self._kv(shape, rank)
        if _COLS.search(name) and len(shape) == 2:
            return _even(shape, 1, rank, t)
        if _VOCAB.search(name):
            return self._vocab(shape, rank)
        return None

    def _kv(self, shape: tuple[int, ...], rank: int) -> Cut | None:
        heads, t = self.spec.num_kv_heads, self.tp
        if heads >= t:
            return _even(shape, 0, rank, t)
        if t % heads or shape[0] % heads:
            return None
        per_head = shape[0] // heads
        head = rank // (t // heads)
        return Cut(shape, 0, head * per_head, per_head)

    def _vocab(self, shape: tuple[int, ...], rank: int) -> Cut | None:
        vocab = shape[0]
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        if padded % self.tp:
            return None
        per = padded // self.tp
        start, end = min(rank * per, vocab), min((rank + 1) * per, vocab)
        return Cut(shape, 0, start, end - start)

    def cut(self, name: str, tensor: torch.Tensor, rank: int) -> tuple[torch.Tensor, Cut | None]:
        """(the slice of `tensor` engine rank `rank` needs, where it sits); the tensor itself when kept whole."""
        where = self.slice_of(name, tuple(tensor.shape), rank) if tensor.is_floating_point() else None
        if where is None:
            return tensor, None
        return tensor.narrow(where.dim, where.start, where.length), where


def _even(shape: tuple[int, ...], dim: int, rank: int, t: int) -> Cut | None:
    if shape[dim] % t:
        return None
    per = shape[dim] // t
    return Cut(shape, dim, rank * per, per)


def expand(piece: torch.Tensor, where: Cut) -> torch.Tensor:
    """A tensor of `where.full_shape`, NaN outside the slice, `piece` inside it (what vLLM's loaders narrow)."""
    expected = list(where.full_shape)
    expected[where.dim] = where.length
    if list(piece.shape) != expected:
        raise ValueError(f"a slice of shape {tuple(piece.shape)} does not fit {where}")
    if not piece.is_floating_point():
        raise ValueError(f"only floating-point tensors are sent as slices (got {piece.dtype})")
    whole = torch.full(where.full_shape, float("nan"), dtype=piece.dtype, device=piece.device)
    whole.narrow(where.dim, where.start, where.length).copy_(piece)
    return whole

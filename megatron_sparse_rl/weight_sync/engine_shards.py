"""The slice of each HF tensor that one rank of a tensor-parallel vLLM engine keeps (disaggregated sync).

    shards = EngineShards(spec, tp=2)
    piece, cut = shards.cut("model.layers.0.self_attn.q_proj.weight", full, rank=1)  # sender, per engine rank
    whole = expand(piece, cut)                                                       # receiver, before load_weights

vLLM's weight loaders take full checkpoint tensors and narrow each to the rank's slice. To send each engine
rank only its slice, the sender cuts the same slice here. Which split each HF tensor takes is the model
adapter's fact: every tensor map entry names its tensors' `EngineSplit` (models/tensor_map.py says what each
split means in vLLM 0.32's loaders; models/base.py and the adapters assign them), and `EngineShards` reads them
from the adapter of `spec` (`GPTAdapter.engine_splits`); a name the model does not have goes whole. A tensor
whose split dimension does not divide evenly, and any non-floating-point tensor, is sent whole (vLLM narrows it
as before).

The receiver rebuilds a full-shape tensor filled with NaN around the slice (`expand`) and hands it to the
engine's own `load_weights`, so the loaders run unchanged; if a rule ever disagreed with a loader, the loader
would read NaN (`receive_weights` watches the loaders' copies out of the rebuilt tensors and raises). On the
wire an engine rank receives 1/t of every split tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sparse_rl.models import adapter_for
from megatron_sparse_rl.models.spec import ModelSpec

VOCAB_PADDING = 64
"""vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py), which the supported models use."""


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
        self.splits = adapter_for(spec).engine_splits(spec)
        """HF name -> its `EngineSplit`, from the model adapter's tensor maps."""

    def slice_of(self, name: str, shape: tuple[int, ...], rank: int) -> Cut | None:
        """The part of the full tensor `name` (of `shape`) that engine rank `rank` keeps; None: all of it."""
        if not 0 <= rank < self.tp:
            raise ValueError(f"engine rank must be in [0, {self.tp}) (got {rank})")
        shape, t = tuple(shape), self.tp
        if t == 1 or not shape:
            return None
        split = self.splits.get(name, "replicated")
        if split == "column":
            return _even(shape, 0, rank, t)
        if split == "kv_heads":
            return self._kv(shape, rank)
        if split == "row" and len(shape) == 2:
            return _even(shape, 1, rank, t)
        if split == "vocab":
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

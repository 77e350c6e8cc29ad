"""Name/shape maps between Hugging Face tensors and full (unsharded) Megatron-Core parameters.

A `TensorMap` says which HF tensors one Megatron parameter is made of and how they combine:
- copy: one HF tensor, same layout;
- qkv: q, k, v projections fused into Megatron's grouped [groups, q_per_group + 2, head_dim, ...] layout;
- glu: gate and up projections stacked into one fc1 weight ([gate; up]);
- rows: one HF tensor with its rows (dim 0) reordered: Megatron row j is HF row `rows[j]` (a DSA indexer's rope
  dims, which Megatron keeps last and reads interleaved; models/dsa.py).
"Full" Megatron names use the GLOBAL layer number (0-based) and GLOBAL expert index; `learner/params.py`
maps them to a rank's local shards. Each map also carries the shape of each HF tensor, derived from the config by
the adapter (`GPTAdapter.hf_shapes`): conversion checks checkpoint headers against it; and how a rank of a
tensor-parallel vLLM engine slices each HF tensor (`EngineSplit`, `GPTAdapter.engine_splits`): the sliced
disaggregated weight sync cuts by it (weight_sync/engine_shards.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_sparse_rl.models.spec import ModelSpec

Kind = Literal["copy", "qkv", "glu", "rows"]

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)(?=\.|$)")

EngineSplit = Literal["replicated", "column", "kv_heads", "row", "vocab"]
"""How one rank of a tensor-parallel vLLM engine (t ranks) slices an HF tensor, named after the vLLM 0.32 layer
whose weight loader reads it (engine_shards.py cuts the slices; a split dimension that does not divide goes whole):
- "column": ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear's q, FusedMoE's w1/w3: dim 0
  (the output features; weight or bias) in t equal parts;
- "kv_heads": QKVParallelLinear's k and v: dim 0 by KV head, each head on t / kv_heads consecutive ranks when t
  exceeds the KV heads;
- "row": RowParallelLinear, FusedMoE's w2: dim 1 (the input features) of a 2-D weight in t equal parts;
- "vocab": VocabParallelEmbedding, ParallelLMHead: dim 0, the vocab padded to a multiple of 64 and cut in t,
  clipped to the real vocab;
- "replicated": whole (norms, routers, and what vLLM loads whole or narrows itself)."""


@dataclass(frozen=True)
class TensorMap:
    mcore: str
    hf: tuple[str, ...]
    kind: Kind = "copy"
    shapes: tuple[tuple[int, ...], ...] = ()
    """The shape of each tensor of `hf` (same order), derived from the model config by the adapter."""
    engine: tuple[EngineSplit, ...] = ()
    """How an engine tensor-parallel rank slices each tensor of `hf` (same order); empty: all "replicated"."""
    rows: tuple[int, ...] = ()
    """kind "rows": the HF row of each Megatron row (a permutation of range(dim 0))."""

    def __post_init__(self):
        if self.engine and len(self.engine) != len(self.hf):
            raise ValueError(f"tensor map {self.mcore}: {len(self.engine)} engine splits for {len(self.hf)} HF tensors")
        if (self.kind == "rows") != bool(self.rows) or (self.rows and sorted(self.rows) != list(range(len(self.rows)))):
            raise ValueError(f"tensor map {self.mcore}: kind 'rows' needs `rows`, a permutation of range(dim 0), and "
                             f"only it takes one (kind {self.kind!r}, {len(self.rows)} rows)")

    @property
    def engine_splits(self) -> tuple[EngineSplit, ...]:
        """`engine`, one per tensor of `hf`."""
        return self.engine or ("replicated",) * len(self.hf)


def to_mcore(tm: TensorMap, tensors: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """Combine the HF tensors of `tm` (in `tm.hf` order) into the full Megatron tensor."""
    if tm.kind == "copy":
        return tensors[0]
    if tm.kind == "rows":
        return tensors[0][torch.tensor(tm.rows)]
    if tm.kind == "glu":
        return torch.cat(tensors, dim=0)
    q, k, v = tensors
    groups, hd = spec.num_kv_heads, spec.head_dim
    qpg = spec.num_heads // groups
    tail = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, qpg, hd, *tail), k.reshape(groups, 1, hd, *tail), v.reshape(groups, 1, hd, *tail)], dim=1
    )
    return fused.reshape(groups * (qpg + 2) * hd, *tail)


def to_hf(tm: TensorMap, tensor: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """Split a full Megatron tensor back into the HF tensors of `tm` (in `tm.hf` order)."""
    if tm.kind == "copy":
        return [tensor]
    if tm.kind == "rows":
        return [tensor[torch.argsort(torch.tensor(tm.rows))]]
    if tm.kind == "glu":
        return list(torch.chunk(tensor, 2, dim=0))
    groups, hd = spec.num_kv_heads, spec.head_dim
    qpg = spec.num_heads // groups
    tail = tensor.shape[1:]
    fused = tensor.reshape(groups, qpg + 2, hd, *tail)
    q = fused[:, :qpg].reshape(groups * qpg * hd, *tail)
    k = fused[:, qpg].reshape(groups * hd, *tail)
    v = fused[:, qpg + 1].reshape(groups * hd, *tail)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def global_layer_names(chunk):
    """`name -> full name` for the parameters and modules of one model chunk (a GPTModel): a pipeline stage numbers its
    layers from 0 and a layer's `layer_number` (1-based) is global, so `decoder.layers.<local>...` becomes
    `decoder.layers.<global>...`, the names the tensor maps use; other names are kept."""
    decoder = getattr(chunk, "decoder", None)
    numbers = {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)} if decoder is not None else {}

    def full(name: str) -> str:
        m = _LOCAL_LAYER.match(name)
        return name if m is None else f"decoder.layers.{numbers[int(m.group(1))]}{name[m.end():]}"
    return full

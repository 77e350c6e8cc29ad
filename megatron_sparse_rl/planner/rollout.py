"""Rollout-side numbers: KV cache per sequence (dense vs a fixed sparse budget) and the concurrent sequences an
engine can hold (the weight-sync estimate is planner/sync.py).

    kv = rollout_plan(shape, gpu_mem_gib=80, engine_gpus=8, seq_len=32768, budget=2048, interval=128)
    kv = rollout_plan(..., weight_bytes=1, gpus_per_node=8)   # fp8 engine weights; flag engines across nodes

Assumptions: bf16 (or fp8: 1 byte per parameter, every parameter) engine weights sharded evenly over the engine's
GPUs; an engine over more GPUs than a node has is tensor parallel across nodes (flagged, not refused); a
dense-attention KV cache is split over the engine's TP ranks by KV head (a head is replicated when there are fewer
heads than ranks); an MLA cache holds one latent row per token per layer (kv_lora_rank + qk_rope_head_dim values,
shared by every head), kept whole on every TP rank (vLLM's MLA cache), so an engine holds as many sequences as one of
its GPUs; vLLM pages of 16 tokens. A sparse sequence holds at most budget + interval tokens (the policy compresses
back to `budget` every `interval` new tokens), so its KV no longer grows with the response length; for MLA that is
budget + interval latent rows per layer. Sparse KV on the MLA latent runs on single-rank engines only
(`MLA_SPARSE_SINGLE_RANK`): on a multi-GPU MLA engine the sparse numbers are what the budget would buy, flagged
(`RolloutPlan.sparse_runs` False), and whether the engine fits is judged on the dense cache.

DSA models (DeepSeek-V3.2, GLM-5; vLLM serves them on GPUs only): each token also leaves the indexer's key in every
layer (`DsaShape.cache_bytes`, 132 B, fp8 with its scale whatever the cache dtype), and an fp8 cache is vLLM's
fp8_ds_mla row (`dsa_latent_bytes`: 656 B, not 576); the indexer's weights are whole on every engine GPU. KV
compression never runs on a DSA engine (`DSA_SPARSE_WHY`): its sparse numbers are what the budget would buy.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from math import ceil

from megatron_sparse_rl.planner.memory import one_of
from megatron_sparse_rl.planner.shapes import ModelShape

GiB = 1024 ** 3
BLOCK = 16
MLA_SPARSE_SINGLE_RANK = "sparse KV on the MLA latent runs on single-rank engines only (rollout.tensor_parallel_size 1)"
MLA_SPARSE_WHY = "each TP rank would score the shared latent rows with its own heads only"
"""Why a multi-rank MLA engine cannot compact: one keep set per layer would need the ranks' scores combined, which
is not implemented (validation/validate.py and the engine refuse such a run)."""
DSA_SPARSE_WHY = ("KV compression does not run on a DSA engine: it would have to drop the indexer's cached keys "
                  "with the latent rows, which it does not (and the indexer already keeps attention to top-k tokens)")


def dsa_latent_bytes(shape: ModelShape, kv_bytes: int) -> int:
    """Bytes of one latent row of a DSA model in vLLM: bf16 2 B per value; an fp8 cache is vLLM's sparse-MLA
    'fp8_ds_mla' row (flashmla_sparse.py): kv_lora_rank fp8 values, one fp32 scale per 128 of them and the rope key
    in bf16 (656 B for kv_lora_rank 512 + qk_rope_head_dim 64)."""
    spec = shape.spec
    if kv_bytes == 2:
        return 2 * spec.latent_width
    return spec.kv_lora_rank + spec.kv_lora_rank // 128 * 4 + 2 * spec.qk_rope_head_dim


def engine_params_per_gpu(shape: ModelShape, engine_gpus: int) -> float:
    """Parameters one engine GPU holds: an even share of the model, and a DSA indexer whole (vLLM replicates it)."""
    replicated = shape.layers * shape.indexer_params
    return (shape.total_params() - replicated) / engine_gpus + replicated


@dataclass(frozen=True)
class RolloutPlan:
    engine_gpus: int
    weights_gib_per_gpu: float
    kv_free_gib_per_gpu: float
    dense_tokens: int
    sparse_tokens: int
    dense_mib_per_seq: float
    """KV of one sequence over the whole engine (MLA: on each GPU, which holds the whole latent row)."""
    sparse_mib_per_seq: float
    dense_max_seqs: int
    sparse_max_seqs: int
    kv_layers: int
    """Layers with a KV cache."""
    kv_values: int
    """Cached values per token per layer on one GPU of the engine: 2 x (KV heads on that GPU) x head_dim, or for MLA
    the whole latent row (kv_lora_rank + qk_rope_head_dim)."""
    kv_dtype_bytes: int
    """Bytes per cached value (2 bf16, 1 fp8)."""
    kv_row_bytes: int
    """Bytes of `kv_values` on one GPU per token per layer: kv_values x kv_dtype_bytes, but a DSA model's fp8 latent
    is vLLM's fp8_ds_mla row (656 B: fp8 values, their fp32 scales, the rope key in bf16)."""
    weight_bytes: int = 2
    """Bytes per engine weight (2 bf16, 1 fp8)."""
    engine_nodes: int = 1
    """Nodes the engine's GPUs span (its tensor-parallel all-reduces leave NVLink when > 1)."""
    notes: tuple[str, ...] = ()
    """What to know that does not stop the engine (it spans nodes)."""
    mla: bool = False
    """The cache is MLA's latent: one row per token per layer, whole on every GPU of the engine."""
    indexer_bytes: int = 0
    """DSA: the indexer's key cache per token per layer on each GPU (vLLM: index_head_dim fp8 values + one fp32 scale
    per 128 = 132 B, whatever the KV dtype); 0 without DSA."""
    sparse_runs: bool = True
    """This engine can run sparse KV: always for per-head caches; for MLA only on a single-rank engine (engine_gpus
    1). When False the sparse numbers are what the budget would buy, not what this engine runs."""
    problems: tuple[str, ...] = ()
    """Why the engine cannot generate at all ([] when it can): no KV room left by the weights, or not one
    sequence fits even with the sparse budget (with the dense cache where sparse KV does not run)."""

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes on one GPU of the engine, all layers (with a DSA indexer's keys)."""
        return self.kv_layers * (self.kv_row_bytes + self.indexer_bytes)


def default_engine_gpus(shape: ModelShape, gpu_mem_gib: float, total_gpus: int, weight_bytes: int = 2) -> int:
    """The smallest power of two whose weight shard (`weight_bytes` per parameter) takes at most half of a GPU."""
    g = 1
    while weight_bytes * engine_params_per_gpu(shape, g) > gpu_mem_gib * GiB / 2 and g < total_gpus:
        g *= 2
    return g


def _remedies(kv_bytes: int, weight_bytes: int) -> list[str]:
    """Rollout options that free KV room and are not on yet (a hint never names one that is)."""
    return ((["use fp8 engine weights (--engine-weights fp8)"] if weight_bytes > 1 else [])
            + (["use an fp8 cache (--kv-dtype fp8)"] if kv_bytes > 1 else []))


def _problems(weights: float, free: float, max_seqs: int, engine_gpus: int, tokens: int, *, usable: float,
              sparse_runs: bool, kv_bytes: int, weight_bytes: int, dsa: bool = False) -> tuple[str, ...]:
    """Why an engine cannot generate: the weights leave no KV room, or the room holds not one sequence (`max_seqs`,
    `tokens`: the sparse cache, or the dense one where sparse KV does not run: a multi-rank MLA engine, a DSA one)."""
    if free <= 0:
        fixes = ["spread the engine over more GPUs (--rollout-gpus)"] + _remedies(1, weight_bytes) + ["use larger GPUs"]
        return (f"the engine's weights ({weights:.1f} GiB/GPU on {engine_gpus} GPU(s)) leave no KV room in the "
                f"{usable:.1f} GiB usable per GPU: " + one_of(fixes),)
    if max_seqs == 0:
        why = "KV compression does not run on a DSA engine" if dsa else MLA_SPARSE_SINGLE_RANK
        kind = "even sparse" if sparse_runs else f"dense ({why})"
        fixes = (["spread the engine over more GPUs (--rollout-gpus)", "lower the KV budget (--kv-budget)"
                  if sparse_runs else "shorten --seq-len"] + _remedies(kv_bytes, weight_bytes))
        return (f"the KV room ({free:.2f} GiB/GPU) holds not one sequence, {kind} ({tokens} tokens): "
                + one_of(fixes),)
    return ()


def rollout_plan(shape: ModelShape, *, gpu_mem_gib: float, engine_gpus: int, seq_len: int, budget: int,
                 interval: int, kv_bytes: int = 2, weight_bytes: int = 2, gpus_per_node: int = 8,
                 gpu_util: float = 0.9, reserve_gib: float = 4.0) -> RolloutPlan:
    """Weights, KV room and sequences per engine of `engine_gpus` GPUs, dense (`seq_len` tokens) and sparse
    (`budget` + `interval` tokens, or latent rows for MLA). The per-token values come from the model's spec
    (`kv_values_per_rank`: K and V of a rank's KV heads, or MLA's whole latent row)."""
    for name, value in (("gpu_mem_gib", gpu_mem_gib), ("gpu_util", gpu_util), ("reserve_gib", reserve_gib)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite (got {value})")
    weights = weight_bytes * engine_params_per_gpu(shape, engine_gpus) / GiB
    free = max(0.0, gpu_mem_gib * gpu_util - weights - reserve_gib)
    sparse_tokens = min(seq_len, budget + interval)
    values = shape.spec.kv_values_per_rank(engine_gpus)
    row = dsa_latent_bytes(shape, kv_bytes) if shape.dsa else values * kv_bytes
    indexer = shape.dsa.cache_bytes if shape.dsa else 0
    per_token_gpu = shape.layers * (row + indexer)
    # a per-head cache is split over the engine; MLA's latent row is whole on each GPU (the per-GPU bytes)
    per_token_seq = per_token_gpu if shape.mla else shape.layers * shape.kv_elems * kv_bytes
    sparse_runs = (not shape.mla or engine_gpus == 1) and shape.dsa is None

    def max_seqs(tokens: int) -> int:
        return int(free * GiB // (ceil(tokens / BLOCK) * BLOCK * per_token_gpu))

    def seq_mib(tokens: int) -> float:
        return ceil(tokens / BLOCK) * BLOCK * per_token_seq / 2 ** 20

    dense_max_seqs, sparse_max_seqs = max_seqs(seq_len), max_seqs(sparse_tokens)
    problems = _problems(weights, free, sparse_max_seqs if sparse_runs else dense_max_seqs, engine_gpus,
                         sparse_tokens if sparse_runs else seq_len, usable=gpu_mem_gib * gpu_util - reserve_gib,
                         sparse_runs=sparse_runs, kv_bytes=kv_bytes, weight_bytes=weight_bytes,
                         dsa=shape.dsa is not None)
    nodes = ceil(engine_gpus / gpus_per_node)
    notes = (f"the engine's {engine_gpus} GPUs span {nodes} nodes of {gpus_per_node}: its tensor-parallel "
             "all-reduces (two per layer and token step) cross the inter-node network",) if nodes > 1 else ()
    return RolloutPlan(
        engine_gpus=engine_gpus, weights_gib_per_gpu=weights, kv_free_gib_per_gpu=free,
        dense_tokens=seq_len, sparse_tokens=sparse_tokens,
        dense_mib_per_seq=seq_mib(seq_len), sparse_mib_per_seq=seq_mib(sparse_tokens),
        dense_max_seqs=dense_max_seqs, sparse_max_seqs=sparse_max_seqs, kv_layers=shape.layers,
        kv_values=values, kv_dtype_bytes=kv_bytes, kv_row_bytes=row, weight_bytes=weight_bytes, engine_nodes=nodes,
        notes=notes, mla=shape.mla, indexer_bytes=indexer, sparse_runs=sparse_runs, problems=problems,
    )

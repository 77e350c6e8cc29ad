"""Rollout-side numbers: KV cache per sequence (dense vs a fixed sparse budget), the concurrent sequences an
engine can hold, and the weight-sync volume per update.

    kv = rollout_plan(shape, gpu_mem_gib=80, engine_gpus=8, seq_len=32768, budget=2048, interval=128)
    sync = weight_sync(shape, link_gbps=400, learner_nodes=32)

Assumptions: bf16 engine weights sharded evenly over the engine's GPUs; a dense-attention KV cache is split
over the engine's TP ranks by KV head (a head is replicated when there are fewer heads than ranks); an MLA
latent is kept whole on every TP rank (vLLM's MLA cache); vLLM pages of 16 tokens. A sparse sequence holds
at most budget + interval tokens (the policy compresses back to `budget` every `interval` new tokens), so
its KV no longer grows with the response length.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from megatron_sparse_rl.planner.shapes import ModelShape

GiB = 1024 ** 3
BLOCK = 16


@dataclass(frozen=True)
class RolloutPlan:
    engine_gpus: int
    weights_gib_per_gpu: float
    kv_free_gib_per_gpu: float
    dense_tokens: int
    sparse_tokens: int
    dense_mib_per_seq: float
    """KV of one sequence over the whole engine."""
    sparse_mib_per_seq: float
    dense_max_seqs: int
    sparse_max_seqs: int
    problems: tuple[str, ...] = ()
    """Why the engine cannot generate at all ([] when it can): no KV room left by the weights, or not one
    sequence fits even with the sparse budget."""

    @property
    def fits(self) -> bool:
        return not self.problems


def _kv_elems_per_gpu(shape: ModelShape, gpus: int) -> float:
    if shape.kv_heads == 0:  # MLA latent: replicated on every TP rank
        return shape.kv_elems
    heads_per_gpu = max(1, shape.kv_heads // gpus)
    return shape.kv_elems * heads_per_gpu / shape.kv_heads


def default_engine_gpus(shape: ModelShape, gpu_mem_gib: float, total_gpus: int) -> int:
    """The smallest power of two whose bf16 weight shard takes at most half of a GPU."""
    g = 1
    while 2 * shape.total_params() / g > gpu_mem_gib * GiB / 2 and g < total_gpus:
        g *= 2
    return g


def _problems(weights: float, free: float, sparse_max_seqs: int, engine_gpus: int, sparse_tokens: int, *,
              usable: float) -> tuple[str, ...]:
    """Why an engine cannot generate: the weights leave no KV room, or the room holds not one sequence."""
    if free <= 0:
        return (f"the engine's weights ({weights:.1f} GiB/GPU on {engine_gpus} GPU(s)) leave no KV room in the "
                f"{usable:.1f} GiB usable per GPU: spread the engine over more GPUs (--rollout-gpus) or use "
                "larger GPUs",)
    if sparse_max_seqs == 0:
        return (f"the KV room ({free:.2f} GiB/GPU) holds not one sequence, even sparse ({sparse_tokens} tokens): "
                "spread the engine over more GPUs (--rollout-gpus), lower the KV budget or use an fp8 cache",)
    return ()


def rollout_plan(shape: ModelShape, *, gpu_mem_gib: float, engine_gpus: int, seq_len: int, budget: int,
                 interval: int, kv_bytes: int = 2, gpu_util: float = 0.9, reserve_gib: float = 4.0) -> RolloutPlan:
    weights = 2 * shape.total_params() / engine_gpus / GiB
    free = max(0.0, gpu_mem_gib * gpu_util - weights - reserve_gib)
    sparse_tokens = min(seq_len, budget + interval)

    def per_gpu_bytes(tokens: int) -> float:
        return ceil(tokens / BLOCK) * BLOCK * shape.layers * _kv_elems_per_gpu(shape, engine_gpus) * kv_bytes

    def engine_mib(tokens: int) -> float:
        return ceil(tokens / BLOCK) * BLOCK * shape.layers * shape.kv_elems * kv_bytes / 2 ** 20

    sparse_max_seqs = int(free * GiB // per_gpu_bytes(sparse_tokens))
    problems = _problems(weights, free, sparse_max_seqs, engine_gpus, sparse_tokens,
                         usable=gpu_mem_gib * gpu_util - reserve_gib)
    return RolloutPlan(
        engine_gpus=engine_gpus, weights_gib_per_gpu=weights, kv_free_gib_per_gpu=free,
        dense_tokens=seq_len, sparse_tokens=sparse_tokens,
        dense_mib_per_seq=engine_mib(seq_len), sparse_mib_per_seq=engine_mib(sparse_tokens),
        dense_max_seqs=int(free * GiB // per_gpu_bytes(seq_len)), sparse_max_seqs=sparse_max_seqs,
        problems=problems,
    )


@dataclass(frozen=True)
class SyncPlan:
    bytes_per_update: int
    link_gbps: float
    seconds_one_link: float
    seconds_all_learner_links: float
    learner_nodes: int


def weight_sync(shape: ModelShape, *, link_gbps: float, learner_nodes: int, bytes_per_param: int = 2) -> SyncPlan:
    """Every engine needs the whole bf16 model after each update. One link: a single sender streams it;
    all learner links: each learner node sends its own shard at once (the lower bound a bucketed, sharded
    sync approaches)."""
    total = shape.total_params() * bytes_per_param
    one = total * 8 / (link_gbps * 1e9)
    return SyncPlan(bytes_per_update=total, link_gbps=link_gbps, seconds_one_link=one,
                    seconds_all_learner_links=one / max(1, learner_nodes), learner_nodes=learner_nodes)

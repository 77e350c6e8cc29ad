"""vLLM internals of the model's layers and of the sparse-KV scheduler's messages: MoE routers (R3 route capture),
the attention layers' KV caches, K/V and latent writers and queries (sparse KV, `RunnerKV`), and the rider a
`SchedulerOutput` carries to the worker. Part of `vllm_access` (re-exported there; its `NEEDS` table lists what this
relies on, under the features "moe", "dsa_indexer", "sparse_kv" and "sparse_kv_mla")."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_sparse_rl.vllm_access.base import RIDER


# ---- MoE layers ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoELayer:
    """One MoE layer of a vLLM model. reports_topk: its router hands its top-k to a capture callback (false
    for a monolithic kernel or a router of another kind); router_name: the router's class name."""

    layer_id: int
    num_experts: int
    router: Any
    reports_topk: bool
    router_name: str


def moe_layers(model_: torch.nn.Module) -> list[MoELayer]:
    """The MoE layers of a vLLM model, by layer id (empty for a dense model)."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runners = sorted((m for m in model_.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)
    return [MoELayer(layer_id=int(m.layer_id), num_experts=int(m.router.global_num_experts), router=m.router,
                     reports_topk=not m.is_monolithic and isinstance(m.router, BaseRouter),
                     router_name=type(m.router).__name__) for m in runners]


def set_route_callback(layer: MoELayer, fn: Callable[[torch.Tensor], None] | None) -> None:
    """`fn(topk_ids)` right after the router computes them, before the experts run (None removes it)."""
    layer.router.set_capture_fn(fn)


# ---- DeepSeek Sparse Attention indexers ----------------------------------------------------------------------
@dataclass(frozen=True)
class DsaIndexer:
    """One DSA layer's lightning indexer in a vLLM model (deepseek_v2.py `Indexer`): its forward returns the model's
    shared int32 `topk_indices_buffer` [max_num_batched_tokens, index_topk], whose first rows are the step's flat
    tokens and whose values are positions within each token's own request (-1: no token)."""

    layer_id: int
    topk: int
    module: Any


def dsa_indexers(model_: torch.nn.Module) -> list[DsaIndexer]:
    """The vLLM model's DSA indexers by layer id (empty without DSA; layers that reuse an earlier layer's top-k,
    IndexCache's `index_topk_freq` / `index_topk_pattern`, build none)."""
    from vllm.model_executor.models.deepseek_v2 import Indexer
    from vllm.model_executor.models.utils import extract_layer_index

    found = [m for m in model_.modules() if isinstance(m, Indexer)]
    return sorted((DsaIndexer(layer_id=int(extract_layer_index(m.prefix)), topk=int(m.topk_tokens), module=m)
                   for m in found), key=lambda d: d.layer_id)


def on_indexer_output(indexer: DsaIndexer, fn: Callable[[torch.Tensor], None]) -> Any:
    """`fn(topk_indices_buffer)` after every forward of the indexer (eager mode: a CUDA graph replays no hook);
    returns the handle."""
    return indexer.module.register_forward_hook(lambda module, args, output: fn(output))


# ---- sparse KV, worker side --------------------------------------------------------------------------------
class RunnerKV:
    """The KV side of one V1 model runner as the sparse-KV hooks read and edit it. groups: (block size,
    attention layer names) per KV cache group; table_block_size: the first group's block-table block size."""

    def __init__(self, runner):
        self.runner = runner
        groups = runner.kv_cache_config.kv_cache_groups
        self.groups = [(g.kv_cache_spec.block_size, list(g.layer_names)) for g in groups]
        self.table = runner.input_batch.block_table[0]
        self.table_block_size = self.table.block_size

    def attention_layers(self, names: Iterable[str]) -> list:
        """The runner's attention layers of `names`, by layer index."""
        from vllm.model_executor.models.utils import extract_layer_index

        ctx = self.runner.compilation_config.static_forward_context
        return sorted((ctx[n] for n in names), key=lambda m: extract_layer_index(m.layer_name))

    def block_ids(self, req_id: str) -> list[int]:
        """The worker's block list of a request (vLLM's own list: edits are seen by vLLM)."""
        return self.runner.requests[req_id].block_ids[0]

    def set_table_row(self, req_id: str, block_ids: list[int]) -> None:
        """Rewrite the request's block-table row, if the request is in the batch."""
        row = self.runner.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            self.table.clear_row(row)
            self.table.add_row(block_ids, row)

    def batch(self) -> tuple[list[str], Any]:
        """(internal request ids, int numpy computed-token counts) of the requests in this step's batch."""
        batch = self.runner.input_batch
        return list(batch.req_ids[:batch.num_reqs]), batch.num_computed_tokens_cpu[:batch.num_reqs]

    def shorten_seq_lens(self, rows: torch.Tensor, by: torch.Tensor) -> None:
        """Subtract `by` from the attention lengths of batch rows `rows` (both of the runner's copies)."""
        optimistic, seq_lens = self.runner.optimistic_seq_lens_cpu, self.runner.seq_lens
        optimistic[rows] -= by.to(optimistic.dtype)
        seq_lens[rows.to(seq_lens.device)] -= by.to(seq_lens.device, seq_lens.dtype)

    def slot_tables(self) -> tuple[Any, torch.Tensor]:
        """(the block table, numpy [max requests, max blocks per request]; the slot of every token of the step,
        the tensor the attention backend reads)."""
        return self.table.block_table.np, self.table.slot_mapping.gpu


def layer_kv(layer) -> tuple[str, torch.Tensor | None, int]:
    """(name, KV cache tensor or None, query heads) of an attention layer."""
    cache = getattr(layer, "kv_cache", None)
    return layer.layer_name, cache if isinstance(cache, torch.Tensor) else None, layer.impl.num_heads


def write_kv(layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store `key`/`value` [tokens, kv_heads, head_dim] at `slots` of `kv_cache` with the backend's own writer."""
    layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slots)


def is_latent_layer(layer) -> bool:
    """Whether an attention layer is vLLM's multi-head latent attention (one shared latent row per token)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return isinstance(layer, MLAAttention)


@dataclass(frozen=True)
class LatentDims:
    """A latent attention layer's shape: the cached row is [c_kv (kv_lora_rank), k_pe (rope)]; `scale` is the
    softmax scale its attention uses (YaRN's mscale included)."""

    heads: int
    qk_nope: int
    rope: int
    kv_lora_rank: int
    scale: float


def latent_dims(layer) -> LatentDims:
    return LatentDims(heads=layer.num_heads, qk_nope=layer.qk_nope_head_dim, rope=layer.qk_rope_head_dim,
                      kv_lora_rank=layer.kv_lora_rank, scale=float(layer.scale))


def write_latent(layer, rows: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store latent rows [tokens, kv_lora_rank + rope] at `slots` of `kv_cache` with the backend's own writer."""
    lora = layer.kv_lora_rank
    layer.impl.do_kv_cache_update(rows[:, :lora].contiguous(), rows[:, None, lora:].contiguous(), kv_cache, slots,
                                  "auto", getattr(layer, "_k_scale", None))  # unused by an unquantised cache


def on_latent_query(layer, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """Call `fn(q, w_uk)` before each latent attention forward with metadata: q [tokens, heads, qk_nope + rope]
    (the rope part rotated), w_uk [heads, qk_nope, kv_lora_rank] (vLLM's W_UK_T, the absorbed up-projection)."""
    original = layer.forward_impl

    def forward_impl(q, k_c_normed, k_pe, kv_cache, attn_metadata, *args, **kwargs):
        if attn_metadata is not None:
            fn(q, layer.W_UK_T)
        return original(q, k_c_normed, k_pe, kv_cache, attn_metadata, *args, **kwargs)

    layer.forward_impl = forward_impl


def on_attention_query(layer, fn: Callable[[torch.Tensor], None]) -> None:
    """Call `fn(query)` ([tokens, q_heads * head_dim], after RoPE) before each attention forward with metadata."""
    impl, original = layer.impl, layer.impl.forward

    def forward(attn_layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if attn_metadata is not None:
            fn(query)
        return original(attn_layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    impl.forward = forward


# ---- sparse KV, scheduler side ---------------------------------------------------------------------------
def set_rider(scheduler_output, message: dict) -> None:
    """Attach `message` to a SchedulerOutput; it travels to every worker with it (pickled when multi-process)."""
    setattr(scheduler_output, RIDER, message)


def rider(scheduler_output) -> dict | None:
    return getattr(scheduler_output, RIDER, None)


def step_requests(out) -> tuple[Iterable[str], Iterable[str], Iterable[str]]:
    """(scheduled, finished, resumed after a preemption) request ids of a SchedulerOutput."""
    return out.num_scheduled_tokens, out.finished_req_ids, out.scheduled_cached_reqs.resumed_req_ids


def preempted_requests(out) -> Iterable[str]:
    return getattr(out, "preempted_req_ids", ()) or ()


def kv_coordinator(sched):
    """The scheduler's KV cache coordinator and its per-group managers (`block_size`, `req_to_blocks`)."""
    coord = sched.kv_cache_manager.coordinator
    return coord, list(coord.single_type_managers)


def swap_coordinator(coord, subclass: type) -> None:
    """Make KV cache coordinator `coord` an instance of `subclass`, a direct subclass of its class that only
    overrides methods."""
    if type(coord) not in subclass.__bases__:
        raise TypeError(f"{subclass.__name__} does not directly subclass the coordinator's {type(coord).__name__}")
    coord.__class__ = subclass

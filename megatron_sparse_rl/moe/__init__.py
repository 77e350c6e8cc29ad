"""MoE routing machinery, importable on its own (torch; Megatron-Core only for `replay`): route recording,
compact route storage, replay into Megatron's RouterReplay (R2/R3), and routing agreement statistics. Installed
as `megatron_sparse_rl.moe` (setup.py maps this folder). See docs/routing.md.

    from megatron_sparse_rl.moe import RouteStore, RoutingError  # packed uint8/uint16 routes, safetensors I/O
    from megatron_sparse_rl.moe.replay import ModelRouting        # record / replay on one Megatron model
    from megatron_sparse_rl.moe.stats import agreement, routing_metrics
    from megatron_sparse_rl.moe.indexer_storage import IndexerRecord  # the same for DSA indexer top-k (replay R2/R3)
"""
from megatron_sparse_rl.moe.storage import RouteStore, RoutingError, index_dtype, token_hash

__all__ = ["RouteStore", "RoutingError", "index_dtype", "token_hash"]

"""MoE routing machinery, importable on its own (torch; Megatron-Core only for `moe.replay`): route
recording, compact route storage, replay into Megatron's RouterReplay (R2/R3), and routing agreement
statistics. See docs/routing.md.

    from moe import RouteStore, RoutingError        # packed uint8/uint16 routes per sequence, safetensors I/O
    from moe.replay import ModelRouting              # record / replay on one Megatron model
    from moe.stats import agreement, routing_metrics
"""
from moe.storage import RouteStore, RoutingError, index_dtype, token_hash

__all__ = ["RouteStore", "RoutingError", "index_dtype", "token_hash"]

"""Parallel layout (layout.py, the only module that touches megatron.core.parallel_state; its degrees are
config/degrees.py's) and the torch.distributed world on the configured backend (world.py)."""
from megatron_sparse_rl.parallel.layout import ParallelGroups, ParallelLayout
from megatron_sparse_rl.parallel.world import join_world

__all__ = ["ParallelGroups", "ParallelLayout", "join_world"]

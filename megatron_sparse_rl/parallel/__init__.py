"""Parallel layout (layout.py, the only module that touches megatron.core.parallel_state) and the
torch.distributed world on the configured backend (world.py)."""
from megatron_sparse_rl.parallel.layout import ParallelGroups, ParallelLayout
from megatron_sparse_rl.parallel.world import join_world, resolve_backend

__all__ = ["ParallelGroups", "ParallelLayout", "join_world", "resolve_backend"]

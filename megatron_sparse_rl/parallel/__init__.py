"""Parallel layout: the only module that touches megatron.core.parallel_state."""
from megatron_sparse_rl.parallel.layout import ParallelGroups, ParallelLayout

__all__ = ["ParallelGroups", "ParallelLayout"]

"""Memory and layout planner for large MoE runs (`msrl plan`; docs/scale.md has the reasoning).

    from megatron_sparse_rl.planner import load_shape, PlanOptions, rank_layouts, rollout_plan, sync_volume
"""
from megatron_sparse_rl.planner.indexer_record import IndexerRecord, indexer_record
from megatron_sparse_rl.planner.memory import LayoutPlan, PlanOptions, plan_layout
from megatron_sparse_rl.planner.ranking import chosen_reason, rank_layouts
from megatron_sparse_rl.planner.rollout import default_engine_gpus, rollout_plan
from megatron_sparse_rl.planner.shapes import DsaShape, ModelShape, bundled_models, load_shape
from megatron_sparse_rl.planner.sync import SyncCosts, SyncEstimate, SyncVolume, as_built, shard_to_shard, sync_volume

__all__ = ["DsaShape", "IndexerRecord", "LayoutPlan", "ModelShape", "PlanOptions", "SyncCosts", "SyncEstimate",
           "SyncVolume", "as_built", "bundled_models", "chosen_reason", "default_engine_gpus", "indexer_record",
           "load_shape", "plan_layout", "rank_layouts", "rollout_plan", "shard_to_shard", "sync_volume"]

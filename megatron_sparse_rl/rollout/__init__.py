"""rollout: the vLLM rollout engine (`RolloutEngine`), its sampling config and the `RolloutBatch` it returns.

Importing this package does not import vLLM; constructing a `RolloutEngine` does.
"""
from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig, SamplingConfig
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.rollout.engine import RolloutEngine

__all__ = ["KVConfig", "RolloutBatch", "RolloutConfig", "RolloutEngine", "SamplingConfig"]

"""weight_sync: learner shards -> HF-named tensor stream -> checksummed buckets -> engine, verified.

See docs/weight_sync.md. `export.iter_hf_tensors`, `buckets.pack_buckets`/`verify_bucket`,
`colocated.sync_to_engine`, `disaggregated.send_weights`/`receive_weights`, `verify.verify_logprobs`/
`compare_engines`/`probe_metrics` (the one engine-vs-learner check), `engine_weights.EngineWeights` (the
engines' precision and FP8 format).
"""
from megatron_sparse_rl.weight_sync.buckets import PHASES, Bucket, SyncStats, pack_buckets, verify_bucket
from megatron_sparse_rl.weight_sync.colocated import sync_to_engine
from megatron_sparse_rl.weight_sync.disaggregated import receive_weights, send_weights
from megatron_sparse_rl.weight_sync.export import WeightSyncError, iter_hf_tensors
from megatron_sparse_rl.weight_sync.engine_weights import EngineWeights
from megatron_sparse_rl.weight_sync.verify import compare_engines, probe_metrics, verify_logprobs

__all__ = ["PHASES", "Bucket", "EngineWeights", "SyncStats", "WeightSyncError", "compare_engines", "iter_hf_tensors",
           "pack_buckets", "probe_metrics", "receive_weights", "send_weights", "sync_to_engine", "verify_bucket",
           "verify_logprobs"]

"""kv: fixed-budget KV cache compression for rollouts (Sparse-RL).

- `policies`: R-KV, SnapKV, H2O, StreamingLLM as pure torch functions (scores, per-KV-head keep sets).
- `latent`: the same policies on the MLA latent cache (one shared row per token): absorbed-query scores,
  one keep set per layer.
- `record`: the `KVKeepRecord` returned per sample in `RolloutBatch.features.kv_keep` and the attention mask
  that replays it.
- `engine_extension`: `SparseKV`, the extension a `RolloutEngine` is built with for sparse KV (its vLLM arguments,
  the keep records per generate, the scheduler's counters and the worker's timing).
- `vllm_scheduler`, `vllm_worker`: the vLLM 0.32.0 integration (compaction with real block freeing);
  `vllm_hooks`: the model-runner hooks that install the worker half (`apply()`); `vllm_plugin`: the vLLM entry
  point that installs them in an engine's spawned processes, inert unless our engine asked for it.
Importing this package imports neither vLLM nor the integration.
"""

"""Patch: sparse (fixed-budget, compacted) KV cache inside vLLM 0.32.0's V1 model runner.

The gap it covers
-----------------
vLLM has no way to drop KV entries of a running request and give their blocks back: block counts are
derived from the token count, and the model runner writes token t of a request to slot t. The
scheduler half of the integration is a `scheduler_cls` (megatron_sparse_rl.kv.vllm_scheduler, no patch
needed); the worker half needs three hooks in `GPUModelRunner` (which `CPUModelRunner` subclasses):
- `_update_states`: apply the scheduler's compaction commands BEFORE the original (K/V copy to the
  front slots, block list and block-table row cut);
- `_prepare_inputs`: AFTER the original, attention lengths and slot mapping on the compacted length;
- `execute_model`: clear the per-step query-capture context at the end.
The hooks are no-ops for an engine whose VllmConfig has no `additional_config["msrl_sparse_kv"]`, so
dense engines in the same process are untouched.

`apply()` checks the vLLM version and the signature of every method it patches or overrides
(scheduler, coordinator, block table, attention backend), fails loudly on any difference, and is
idempotent. Requires the V1 model runner (on GPU set VLLM_USE_V2_MODEL_RUNNER=0; the CPU runner is V1).
In a multi-process vLLM the workers apply it through the `vllm.general_plugins` entry point
`msrl_sparse_kv` (setup.py), which vLLM calls in every process it starts; `VLLM_PLUGINS` selects plugins.
"""
from __future__ import annotations

import functools
import inspect
import logging

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
_MARK = "_msrl_sparse_kv_patched"

# (import path, attribute, expected parameter names) of everything the integration relies on.
_SIGNATURES = [
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_update_states", ["self", "scheduler_output"]),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_prepare_inputs",
     ["self", "scheduler_output", "num_scheduled_tokens"]),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "execute_model",
     ["self", "scheduler_output", "intermediate_tensors"]),
    ("vllm.v1.core.sched.scheduler:Scheduler", "schedule", ["self", "throttle_prefills"]),
    ("vllm.v1.core.sched.scheduler:Scheduler", "_preempt_request",
     ["self", "request", "timestamp", "drop_stale_output"]),
    ("vllm.v1.core.sched.scheduler:Scheduler", "_free_request_blocks", ["self", "request"]),
    ("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinatorNoPrefixCache", "get_num_blocks_to_allocate",
     ["self", "request_id", "num_tokens", "new_computed_blocks", "num_encoder_tokens", "total_computed_tokens",
      "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap", "prefill_end"]),
    ("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinatorNoPrefixCache", "allocate_new_blocks",
     ["self", "request_id", "num_tokens", "num_tokens_main_model", "num_encoder_tokens"]),
    ("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinatorNoPrefixCache", "remove_skipped_blocks",
     ["self", "request_id", "processed_computed_tokens", "num_prompt_tokens"]),
    ("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinatorNoPrefixCache", "cache_blocks",
     ["self", "request", "num_computed_tokens"]),
    ("vllm.v1.core.block_pool:BlockPool", "free_blocks", ["self", "ordered_blocks"]),
    ("vllm.v1.worker.block_table:BlockTable", "add_row", ["self", "block_ids", "row_idx"]),
    ("vllm.v1.worker.block_table:BlockTable", "clear_row", ["self", "row_idx"]),
    ("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl", "forward",
     ["self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
      "output_block_scale"]),
    ("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl", "do_kv_cache_update",
     ["self", "layer", "key", "value", "kv_cache", "slot_mapping"]),
]


def _resolve(path: str):
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def check_upstream() -> None:
    """Raise RuntimeError unless vLLM is 0.32.0 and every relied-on method has the expected parameters."""
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"patches.vllm_sparse_kv was written for vllm {VLLM_VERSION} (found {vllm.__version__}): "
                           "re-check the hooks listed in megatron_sparse_rl/patches/vllm_sparse_kv.py")
    for path, attr, expected in _SIGNATURES:
        fn = getattr(_resolve(path), attr, None)
        if fn is None:
            raise RuntimeError(f"sparse KV: {path}.{attr} no longer exists in vllm {vllm.__version__}")
        fn = getattr(fn, "_msrl_original", fn)
        got = list(inspect.signature(fn).parameters)
        if got[: len(expected)] != expected:
            raise RuntimeError(f"sparse KV: {path}.{attr} has parameters {got}, expected {expected}")


def _state(runner):
    """The runner's SparseKVWorkerState, created on first use; None for a dense engine."""
    state = runner.__dict__.get("_msrl_sparse_kv", False)
    if state is False:
        from megatron_sparse_rl.kv.settings import SparseKVSettings

        settings = SparseKVSettings.from_vllm_config(runner.vllm_config)
        state = None
        if settings is not None:
            from megatron_sparse_rl.kv.vllm_worker import SparseKVWorkerState

            state = SparseKVWorkerState(runner, settings)
        runner._msrl_sparse_kv = state
    return state


def is_applied() -> bool:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return getattr(GPUModelRunner._update_states, _MARK, False)


def apply() -> bool:
    """Install the runner hooks (idempotent). Returns True. Raises RuntimeError on a vLLM mismatch."""
    check_upstream()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if is_applied():
        return True
    update, prepare, execute = GPUModelRunner._update_states, GPUModelRunner._prepare_inputs, GPUModelRunner.execute_model

    @functools.wraps(update)
    def _update_states(self, scheduler_output):
        state = _state(self)
        if state is not None:
            state.before_update_states(scheduler_output)
        return update(self, scheduler_output)

    @functools.wraps(prepare)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = prepare(self, scheduler_output, num_scheduled_tokens)
        state = self.__dict__.get("_msrl_sparse_kv")
        if state is not None:
            state.after_prepare_inputs(num_scheduled_tokens)
        return out

    @functools.wraps(execute)
    def execute_model(self, *args, **kwargs):
        try:
            return execute(self, *args, **kwargs)
        finally:
            state = self.__dict__.get("_msrl_sparse_kv")
            if state is not None:
                state.end_step()

    for new, old in ((_update_states, update), (_prepare_inputs, prepare), (execute_model, execute)):
        setattr(new, _MARK, True)
        new._msrl_original = old
    GPUModelRunner._update_states = _update_states
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.execute_model = execute_model
    logger.info("patched vllm GPUModelRunner (_update_states, _prepare_inputs, execute_model) for sparse KV")
    return True


def revert() -> None:
    """Remove the runner hooks if installed (tests)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if is_applied():
        for name in ("_update_states", "_prepare_inputs", "execute_model"):
            setattr(GPUModelRunner, name, getattr(GPUModelRunner, name)._msrl_original)

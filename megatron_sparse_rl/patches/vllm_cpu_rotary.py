"""Patch: vLLM 0.32.0's CPU rotary op rotates 3-D, multi-head inputs wrongly; send those to its PyTorch path.

The CPU gap it covers
---------------------
`RotaryEmbedding.forward_cpu` (model_executor/layers/rotary_embedding/base.py) calls the CPU kernel
`torch.ops._C.rotary_embedding` in place. Given a query laid out as `[tokens, heads, rot_dim]` with more than one
head, the kernel rotates it wrongly (measured on this stack: up to 4.8 off against the op's own `forward_native`
on a contiguous `[7, 4, 64]` query); the same values flattened to `[tokens, heads * rot_dim]` come out right, as
does a 3-D input with one head. Most models pass the flat layout; DeepSeek-V2/V3 and Kimi-K2 attention (MLA and
its MHA fallback) pass the 3-D `q_pe`, so with `rope_type: default` the engine's logprobs were off by up to 4.5
and greedy tokens diverged. (YaRN RoPE, what the released models use, is `DeepseekScalingRotaryEmbedding`, a
pure PyTorch op, and is right without this patch.)

The fix
-------
`apply()` wraps `RotaryEmbedding.forward_cpu` so that a query or key of more than two dimensions goes through
`forward_native` (the same rotation in PyTorch), written back into the caller's tensors so that the op stays in
place as the kernel is; 2-D inputs still take the kernel. Subclasses that inherit `forward_cpu` (YaRN, Llama-3,
linear, NTK scaling...) are covered too.

It must be applied BEFORE the model is built: a vLLM custom op binds its platform forward when constructed
(`CustomOp.dispatch_forward`), so modules built earlier keep the unpatched method. The entry points apply it
(`patches.vllm_cpu.apply()`) before any engine starts, and a CPU `RolloutEngine` refuses to start without it. Idempotent; checks the vLLM version (0.32.0) and, through
`megatron_sparse_rl.vllm_access` (feature "cpu_rotary"), the methods it wraps. `revert()` exists for tests
that demonstrate the gap.
"""
from __future__ import annotations

import functools
import logging

from megatron_sparse_rl import vllm_access

logger = logging.getLogger(__name__)

_MARK = "_msrl_cpu_rotary_patched"


def _target():
    vllm_access.require_version("vllm_cpu_rotary", "check whether RotaryEmbedding.forward_cpu still rotates 3-D "
                                "[tokens, heads, rot_dim] inputs wrongly")
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    vllm_access.check(features=("cpu_rotary",))  # forward_cpu / forward_native(self, positions, query, key)
    return RotaryEmbedding


def is_applied() -> bool:
    """True when `RotaryEmbedding.forward_cpu` currently carries this patch."""
    return getattr(_target().forward_cpu, _MARK, False)


def apply() -> bool:
    """Install the patch (idempotent). Returns True when installed (CPU platform), False elsewhere.

    Raises RuntimeError when the installed vLLM is not 0.32.0, VLLMInternalsError when a wrapped method changed.
    """
    cls = _target()
    if not vllm_access.is_cpu_platform():
        return False
    if is_applied():
        return True
    original = cls.forward_cpu

    @functools.wraps(original)
    def forward_cpu(self, positions, query, key=None):
        if query.dim() <= 2 and (key is None or key.dim() <= 2):
            return original(self, positions, query, key)
        # the kernel's flat layout is right, its [tokens, heads, rot_dim] one is not: rotate in PyTorch, then
        # write back so callers that rely on the in-place kernel see the same
        new_query, new_key = self.forward_native(positions, query, key)
        query.copy_(new_query)
        if key is not None:
            key.copy_(new_key)
        return query, key

    setattr(forward_cpu, _MARK, True)
    forward_cpu._msrl_original = original
    cls.forward_cpu = forward_cpu
    logger.debug("patched vllm RotaryEmbedding.forward_cpu: inputs of more than 2 dims use forward_native")
    return True


def revert() -> None:
    """Remove the patch if installed (for tests that show the unpatched behaviour; models built while it was
    installed keep it)."""
    cls = _target()
    if is_applied():
        cls.forward_cpu = cls.forward_cpu._msrl_original

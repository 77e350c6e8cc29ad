"""The vLLM CPU patches a `RolloutEngine` needs, applied together by the entry points before any engine starts.

- `vllm_cpu_moe_reload`: fused-MoE experts repacked when new weights are loaded in place;
- `vllm_cpu_rotary`: the rotary op of multi-head latent attention models (it binds its CPU forward when the
  model is built, so it must be in place before);
- `vllm_cpu_seeded_chunks`: seeded sampling of a chunked prefill (every rollout is seeded).

The trainer's set-up (training/context.py), the benchmarks, the experiments and the tests' fixtures call
`apply()`; `RolloutEngine` only checks `is_applied()` and names this function when it is not. On a GPU (or any
non-CPU vLLM platform) each patch does nothing.
"""
from __future__ import annotations

import torch

from megatron_sparse_rl.patches import vllm_cpu_moe_reload, vllm_cpu_rotary, vllm_cpu_seeded_chunks

PATCHES = (vllm_cpu_moe_reload, vllm_cpu_rotary, vllm_cpu_seeded_chunks)


def apply() -> None:
    """Apply every vLLM CPU patch an engine in this process needs (idempotent; nothing when CUDA is present)."""
    if not torch.cuda.is_available():
        for patch in PATCHES:
            patch.apply()


def is_applied() -> bool:
    """Whether every vLLM CPU patch is installed."""
    return all(patch.is_applied() for patch in PATCHES)

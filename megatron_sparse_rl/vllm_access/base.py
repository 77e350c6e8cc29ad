"""The ground of `vllm_access`: the vLLM version it was written for, its features, the names it leaves on vLLM's
objects, and how a missing piece fails. Imported by the package's modules (__init__, runtime, layers), re-exported
by the package."""
from __future__ import annotations

import importlib

VLLM_VERSION = "0.32.0"
RIDER = "msrl_sparse_kv"  # the attribute our message rides on a SchedulerOutput
STATE = "_msrl_sparse_kv"  # the attribute our sparse-KV state sits in on a model runner

FEATURES = {
    "engine": "every RolloutEngine (engine core, scheduler lookup, model access, weight reload)",
    "step": "the per-step batch that the route and sampling-mask captures read",
    "moe": "MoE layers: ids, expert counts, the routers' top-k callback (R3 route capture and output)",
    "dsa_indexer": "DeepSeek Sparse Attention indexers: their layer ids, top-k and the per-step top-k buffer they "
                   "return (R3 indexer capture, GPU engines only)",
    "sampling_mask": "the keep-sampling-mask record (a wrapper around the sampler)",
    "sparse_kv": "sparse KV (scheduler subclass, coordinator swap, model-runner hooks)",
    "cpu_moe_reload": "the CPU fused-MoE reload patch",
    "cpu_rotary": "the CPU rotary-embedding patch (DeepSeek / Kimi-K2 default RoPE)",
    "cpu_seeded_chunks": "the CPU patch for seeded sampling of chunked prefills (no generator offset rewind)",
    "registry_session": "the patch that starts the model-registry inspection child in a session of its own (a stop "
                        "signal to the trainer's process group during engine start-up)",
    "sparse_kv_mla": "sparse KV on the multi-head latent attention cache (the latent layer's dimensions, its KV "
                     "writer and its query, absorbed with W_UK_T)",
    "in_flight": "weights loaded between engine steps while requests run (asynchronous RL): each running sample's "
                 "output tokens so far, and the optional recompute of the running requests' KV",
    "mla": "multi-head latent attention engines (DeepSeek-V3 / Kimi-K2): which attention vLLM runs, and the "
           "reload's recompute of the absorbed projections",
}


class VLLMInternalsError(RuntimeError):
    """A vLLM internal the project relies on is missing or changed."""

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"  # the V1 runner (the CPU runner subclasses it)


def fail(piece: str, problem: str, feature: str):
    import vllm

    raise VLLMInternalsError(f"vLLM {vllm.__version__}: {piece} {problem}; needed for {FEATURES[feature]} "
                             f"(megatron_sparse_rl/vllm_access/ was written for vLLM {VLLM_VERSION})")


def resolve(path: str):
    module, _, name = path.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, name) if name else obj

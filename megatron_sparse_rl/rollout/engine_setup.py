"""What a `RolloutEngine` settles in its process before vLLM starts: the executor backend, the environment vLLM reads,
the torch state vLLM would change, the MLA check, and that the entry point applied the CPU patches and handed in
the extensions the rollout config asks for.

The environment is written at engine construction (never at import): VLLM_ENABLE_V1_MULTIPROCESSING=0 (the
engine core runs in this process), VLLM_CACHE_ROOT, and on CPU VLLM_CPU_KVCACHE_SPACE from rollout.kv_cache_gb.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.config.rollout import RolloutConfig
from megatron_sparse_rl.validation.families import mla_rollout_problems
from megatron_sparse_rl.patches import vllm_cpu
from megatron_sparse_rl.rollout.extension import EngineExtension

# what a rollout config asks of the extensions, and the extension that serves it
_SERVED_BY = {
    "sparse_kv": ("rollout.kv.policy", "megatron_sparse_rl.kv.engine_extension.SparseKV()"),
    "sampling_mask": ("rollout.record_sampling_mask", "megatron_sparse_rl.rollout.sampling_mask.SamplingMaskCapture()"),
}


def check_extensions(cfg: RolloutConfig, extensions: Sequence[EngineExtension]) -> None:
    """Raise ValueError when the rollout config asks for a feature (sparse KV, the sampling-mask record) that no
    extension handed to the engine provides: the engine would run without it silently."""
    asked = {"sparse_kv": cfg.kv.policy != "none", "sampling_mask": cfg.record_sampling_mask}
    provided = {e.provides for e in extensions}
    for feature, wanted in asked.items():
        if wanted and feature not in provided:
            field, extension = _SERVED_BY[feature]
            raise ValueError(f"{field} asks for {feature}, but no engine extension provides it: build the engine "
                             f"with RolloutEngine(..., extensions=[{extension}, ...])")


def check_patches(on_gpu: bool) -> None:
    """Raise RuntimeError when a CPU engine would start without the vLLM CPU patches (the entry point applies
    them: megatron_sparse_rl.patches.vllm_cpu.apply())."""
    if not on_gpu and vllm_access.is_cpu_platform() and not vllm_cpu.is_applied():
        raise RuntimeError("a CPU RolloutEngine needs vLLM's CPU patches (fused-MoE reload, rotary, seeded chunked "
                           "prefill) before it starts: call megatron_sparse_rl.patches.vllm_cpu.apply() in the entry "
                           "point first (the trainer's set-up, the benchmarks and the tests' fixtures do)")


def executor_backend(cfg: RolloutConfig, on_gpu: bool) -> str:
    """The vLLM executor for this process.

    Engine TP 1 on CPU: "uni" (one engine per process). Inside an initialised torch.distributed world
    (colocated learner ranks) vLLM adopts that WORLD group but builds TP/PP/DP groups of 1, so every
    rank runs its own engine with no collectives (measured: 2 gloo ranks, uneven workloads, no hang).
    Engine TP t > 1 (CPU or GPU), or any engine inside a GPU world of more than one rank:
    "external_launcher". vLLM joins the torchrun world (reads RANK, LOCAL_RANK) and splits it into
    world / t engines of t consecutive ranks (its "external data parallel" dimension); the ranks of one
    engine must call `generate` together with the same prompts and get the same outputs.
    """
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    tp = cfg.tensor_parallel_size
    if tp > 1:
        if world % tp:
            raise ValueError(f"rollout.tensor_parallel_size = {tp} needs a torch.distributed world whose size is a "
                             f"multiple of it (each engine spans {tp} consecutive ranks; got a world of {world})")
        for var in ("RANK", "LOCAL_RANK"):
            if var not in os.environ:
                raise ValueError(f"rollout.tensor_parallel_size = {tp}: vLLM's external_launcher reads ${var}, "
                                 "which is unset (start the ranks with torchrun or msrl launch)")
        return "external_launcher"
    return "external_launcher" if on_gpu and world > 1 else "uni"


def shared_cache_dir() -> Path:
    """The vLLM cache the runs of this machine share: $VLLM_CACHE_ROOT if set, else <tmp>/msrl_vllm_cache_<uid>
    (vLLM keeps its model-registry answers there, keyed by its model file's hash: docs/runs.md)."""
    return Path(os.environ.get("VLLM_CACHE_ROOT") or Path(tempfile.gettempdir()) / f"msrl_vllm_cache_{os.getuid()}")


def set_vllm_env(cfg: RolloutConfig, cache_dir: str | Path | None, on_gpu: bool) -> None:
    """Environment vLLM reads at engine construction; set here, never at import."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cache_dir is None:
        cache_dir = shared_cache_dir()
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_CACHE_ROOT"] = str(cache_dir)
    if not on_gpu:
        # vLLM's CPU platform turns this (integer GiB) into cache_config.kv_cache_memory_bytes and it
        # overrides the engine argument; unset, it sizes the cache from gpu_memory_utilization.
        if cfg.kv_cache_gb is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gb)


@contextlib.contextmanager
def keep_torch_threading():
    """vLLM's CPU worker replaces `torch.set_num_threads` with a no-op process-wide and may change the
    thread count; a colocated learner in this process must keep both."""
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)


@contextlib.contextmanager
def keep_default_process_group():
    """Make `torch.distributed.destroy_process_group()` (no group: the default one) a no-op meanwhile;
    vLLM's own subgroups are still destroyed."""
    destroy = torch.distributed.destroy_process_group

    def destroy_subgroups_only(group=None):
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_subgroups_only
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def mla_latent_checked(cfg: RolloutConfig, model_dir: Path, on_gpu: bool) -> int | None:
    """The model's MLA latent width (`latent_kv_rank`, None for per-head attention); an MLA engine the worker could
    not run (validation/families.py `mla_rollout_problems`: sparse KV on a multi-rank engine, a CPU block size other
    than 16) is refused before vLLM starts."""
    latent = latent_kv_rank(model_dir)
    if latent is not None:
        problems = mla_rollout_problems(cfg, f"{model_dir} (kv_lora_rank {latent})", cuda=on_gpu)
        if problems:
            raise ValueError("; ".join(problems))
    return latent


def latent_kv_rank(model_dir: str | Path) -> int | None:
    """`kv_lora_rank` of the HF model in `model_dir` (its text config for a multimodal one): the width of the KV
    latent of a multi-head latent attention model (DeepSeek-V2/V3, Kimi-K2); None for per-head K/V attention."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None  # vLLM reports the missing config itself
    cfg = json.loads(path.read_text())
    rank = cfg.get("kv_lora_rank", (cfg.get("text_config") or {}).get("kv_lora_rank"))
    return None if rank is None else int(rank)

"""Runtime values a run leaves to its model, resolved once the model is known (`validate` returns its ModelSpec):
`rollout.max_model_len` (unset: the model's positions, capped to what `rollout.kv_cache_gb` holds).

    spec = validate(run, world_size=4)       # validation/validate.py: the checks
    run = resolve(run, spec)                 # rollout.max_model_len filled in
    describe_max_model_len(run.rollout, spec)   # "2048 (the model's max_position_embeddings)", for summaries
    rollout = resolve_rollout(rollout, model_dir)   # an engine built outside a run (tests, benchmarks)
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megatron_sparse_rl.config.rollout import RolloutConfig
from megatron_sparse_rl.config.schema import RunConfig


_CACHE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes per cached value: vLLM's KV cache dtype "auto" is the engine's dtype (`rollout.dtype`)."""
_DEFAULT_BLOCK = 128
"""vLLM's largest default KV block (CPU; GPU and CPU MLA use 16, which divides it): a max_model_len capped by the
cache is counted in blocks of this many tokens (or rollout.kv.block_size), so one sequence of it fills whole blocks
whichever default vLLM picks."""


def kv_bytes_per_token(spec, rollout: RolloutConfig) -> int:
    """KV-cache bytes one token takes on one engine rank, all layers, in `rollout.dtype`: MLA's latent row
    (kv_lora_rank + qk_rope_head_dim values, kept whole on every engine TP rank), else K and V of the KV heads of
    one engine TP rank (a head is replicated when there are fewer heads than ranks)."""
    return spec.num_layers * spec.kv_values_per_rank(rollout.tensor_parallel_size) * _CACHE_DTYPE_BYTES[rollout.dtype]


def max_model_len(rollout: RolloutConfig, spec) -> int | None:
    """`rollout.max_model_len` resolved against the model (`spec`; None when the model is not known here).

    Set: that value. None: the model's max_position_embeddings, capped, when `rollout.kv_cache_gb` sizes the KV
    cache, to the longest sequence that cache holds on one engine rank (whole KV blocks, less the one block vLLM's
    block pool holds back), since vLLM refuses to start an engine whose cache cannot hold one sequence of
    max_model_len (vllm/v1/core/kv_cache_utils.py `get_kv_cache_configs`). With kv_cache_gb None
    (GPU, sized from gpu_memory_utilization) the size is only known once vLLM has loaded the model: the model's
    positions are used, uncapped. Returns None when the value is unset and the model unknown.
    """
    if rollout.max_model_len is not None or spec is None:
        return rollout.max_model_len
    if rollout.kv_cache_gb is None:
        return spec.max_position_embeddings
    block = rollout.kv.block_size or _DEFAULT_BLOCK
    blocks = rollout.kv_cache_gb * 2**30 // (block * kv_bytes_per_token(spec, rollout)) - 1  # less the null block
    return min(spec.max_position_embeddings, max(blocks, 0) * block)


def max_model_len_origin(rollout: RolloutConfig, spec) -> str:
    """Where a max_model_len resolved from the model comes from, for messages and summaries; '' when the config
    sets it (or the model is unknown)."""
    if rollout.max_model_len is not None or spec is None:
        return ""
    if max_model_len(rollout, spec) == spec.max_position_embeddings:
        return "the model's max_position_embeddings"
    return (f"the longest sequence rollout.kv_cache_gb = {rollout.kv_cache_gb} GiB holds on one engine rank at "
            f"{kv_bytes_per_token(spec, rollout):,} bytes per token; the model's max_position_embeddings is "
            f"{spec.max_position_embeddings}")


def describe_max_model_len(rollout: RolloutConfig, spec) -> str:
    """The resolved value and where it comes from, for summaries: "2048 (the model's max_position_embeddings)",
    "8192 (set)"."""
    value = max_model_len(rollout, spec)
    if value is None:
        return "unknown here (unset: the model's max_position_embeddings, whose config.json is not here)"
    return f"{value} ({max_model_len_origin(rollout, spec) or 'set'})"


def resolve(run: RunConfig, spec) -> RunConfig:
    """`run` with the values it leaves to the model filled in from `spec` (`rollout.max_model_len`; see
    `max_model_len`). `run` itself when nothing is left or the model is unknown (spec None). Call it after
    `validate`, which checks the resolved values (resolving re-runs the dataclass checks, which raise ValueError)."""
    if run.rollout.max_model_len is not None or spec is None:
        return run
    return replace(run, rollout=replace(run.rollout, max_model_len=max_model_len(run.rollout, spec)))


def resolve_rollout(rollout: RolloutConfig, model_dir: str | Path) -> RolloutConfig:
    """`rollout` with max_model_len resolved from the model at `model_dir` (its config.json): for an engine built
    outside a run (tests, benchmarks); a run's engines get the config `resolve` filled in."""
    if rollout.max_model_len is not None:
        return rollout
    from megatron_sparse_rl.models import load_spec  # lazy: importing the config package stays free of torch

    return replace(rollout, max_model_len=max_model_len(rollout, load_spec(model_dir)[1]))

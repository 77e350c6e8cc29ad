"""Model adapters, one per architecture, looked up by the exact HF `architectures` string."""
from __future__ import annotations

import logging

from megatron_sparse_rl.models.base import GPTAdapter
from megatron_sparse_rl.models.deepseek import DeepseekV3Adapter
from megatron_sparse_rl.models.dsa import DeepseekV32Adapter, GlmMoeDsaAdapter
from megatron_sparse_rl.models.mixtral import MixtralAdapter
from megatron_sparse_rl.models.qwen import Qwen2Adapter, Qwen3Adapter, Qwen3MoeAdapter
from megatron_sparse_rl.models.spec import ModelSpec, read_hf_config

log = logging.getLogger(__name__)
ADAPTERS: dict[str, type[GPTAdapter]] = {
    cls.architecture: cls for cls in (Qwen3MoeAdapter, Qwen3Adapter, Qwen2Adapter, MixtralAdapter, DeepseekV3Adapter,
                                      DeepseekV32Adapter, GlmMoeDsaAdapter)
}


def get_adapter(hf_config: dict) -> GPTAdapter:
    """The adapter for `hf_config["architectures"][0]`, or a ValueError listing the supported ones."""
    archs = hf_config.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(f"config.json must name exactly one architecture in 'architectures' (got {archs!r}); "
                         f"supported: {', '.join(sorted(ADAPTERS))}")
    if archs[0] not in ADAPTERS:
        raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[archs[0]]()


def adapter_for(spec: ModelSpec) -> GPTAdapter:
    """The adapter of `spec`'s architecture (the one that made it)."""
    return get_adapter({"architectures": [spec.architecture]})


def engine_config_defaults(model_dir) -> dict:
    """What the engine adds to `model_dir`'s config.json (vLLM's hf_overrides; the file is not written): the keys
    its adapter assumes and the file leaves out (`GPTAdapter.config_defaults`, e.g. DeepSeek-V3's router)."""
    cfg = read_hf_config(model_dir)
    defaults = get_adapter(cfg).config_defaults(cfg)
    if defaults:
        log.info("%s/config.json lacks %s: read as %s, as the model adapter does", model_dir, ", ".join(defaults),
                 ", ".join(f"{k}: {v!r}" for k, v in defaults.items()))
    return defaults


def load_spec(model_dir) -> tuple[GPTAdapter, ModelSpec]:
    """Read config.json at `model_dir` and return (adapter, spec)."""
    cfg = read_hf_config(model_dir)
    adapter = get_adapter(cfg)
    return adapter, adapter.spec_from_hf(cfg)


__all__ = ["ADAPTERS", "GPTAdapter", "ModelSpec", "adapter_for", "engine_config_defaults", "get_adapter",
           "load_spec"]

"""A run's `model.tiny` (config/schema.py `TinyModelConfig`) as its builder's keyword arguments, and as the Hugging
Face config dict that builder would write, derived without weights or transformers (validation/validate.py reads the
run's ModelSpec from it when no config.json is there yet).

    tiny_fields(run.model.tiny)          # {"hidden": 64, ..., "seed": 0}: build_tiny_hf_model / build_tiny_deepseek
    tiny_hf_config(run.model.tiny)       # {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, ...}

`tiny` is read by attribute only: models/ sits below config/ and does not import it.
"""
from __future__ import annotations

from megatron_sparse_rl.models.tiny import hf_config_kwargs
from megatron_sparse_rl.models.tiny_families import deepseek_config_kwargs

_QWEN_KWARGS = {n: n for n in ("hidden", "layers", "heads", "kv_heads", "head_dim", "experts", "topk", "moe_ffn",
                               "ffn", "init_std")}
_DEEPSEEK_KWARGS = {
    "hidden": "hidden", "layers": "layers", "heads": "heads", "experts": "experts", "topk": "topk",
    "moe_ffn": "moe_ffn", "ffn": "ffn", "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank",
    "qk_nope_head_dim": "qk_nope", "qk_rope_head_dim": "qk_rope", "v_head_dim": "v_head",
    "first_k_dense": "first_k_dense", "shared_experts": "shared", "n_group": "n_group", "topk_group": "topk_group",
    "rope_type": "rope", "init_std": "init_std",
}
BUILDER_KWARGS = {"qwen3_moe": _QWEN_KWARGS, "qwen3": _QWEN_KWARGS, "deepseek_v3": _DEEPSEEK_KWARGS}
"""`model.tiny.arch` -> {`model.tiny` field -> keyword of its builder}: `build_tiny_hf_model` (models/tiny.py) for
the Qwen3 archs, `deepseek_config_kwargs` / `build_tiny_deepseek` (models/tiny_families.py) for deepseek_v3."""


def tiny_hf_config(tiny) -> dict:
    """The Hugging Face config dict the tiny builder of `tiny.arch` would write (no weights, no transformers):
    models/tiny.py's `hf_config_kwargs` (Qwen3) or models/tiny_families.py's `deepseek_config_kwargs`
    (DeepSeek-V3), plus the keys transformers fills in with their defaults.

    `tests/unit/test_config_validate.py` checks the resulting ModelSpec against a model really built.
    """
    common = {"hidden_act": "silu", "attention_bias": False}
    if tiny.arch == "deepseek_v3":
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
                **deepseek_config_kwargs(**tiny_fields(tiny, seed=False))}
    family, kwargs = hf_config_kwargs(tiny.arch, **tiny_fields(tiny, seed=False))
    return {"architectures": ["Qwen3MoeForCausalLM" if family == "qwen3_moe" else "Qwen3ForCausalLM"],
            "model_type": family, **common, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            **kwargs}


def tiny_fields(tiny, *, seed: bool = True) -> dict:
    """`model.tiny` as the keyword arguments of its builder, less `arch` and (without `seed`) the seed:
    `build_tiny_hf_model` for the Qwen3 archs, `build_tiny_deepseek` (= `deepseek_config_kwargs` + seed) for
    deepseek_v3."""
    names = BUILDER_KWARGS[tiny.arch]
    return {kw: getattr(tiny, n) for n, kw in names.items()} | ({"seed": tiny.seed} if seed else {})

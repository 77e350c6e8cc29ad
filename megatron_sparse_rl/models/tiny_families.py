"""Tiny random Hugging Face Mixtral, DeepSeek-V3-style and DSA (DeepSeek-V3.2, GLM-5) checkpoints, built with
transformers' own classes.

Like `models/tiny.py` (Qwen3): config.json, model.safetensors, generation_config.json and the character
tokenizer of `models/char_tokenizer.py`, so transformers and the adapters load them as they would a hub model.

    python -c "from megatron_sparse_rl.models.tiny_families import build_tiny_mixtral as b; print(b('/tmp/mx'))"
"""
from __future__ import annotations

from pathlib import Path

from megatron_sparse_rl.models import char_tokenizer as char_tok


def _common(hidden: int, layers: int, heads: int, kv_heads: int, init_std: float, max_position: int) -> dict:
    if min(hidden, layers, heads, kv_heads) < 1 or heads % kv_heads:
        raise ValueError(f"need hidden, layers, heads, kv_heads >= 1 and kv_heads | heads "
                         f"(got {hidden}, {layers}, {heads}, {kv_heads})")
    return dict(vocab_size=char_tok.vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position,
                initializer_range=init_std, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=char_tok.BOS_ID, eos_token_id=char_tok.EOS_ID, pad_token_id=char_tok.PAD_ID,
                dtype="float32")


def _save(model, out_dir) -> Path:
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=char_tok.BOS_ID, eos_token_id=char_tok.EOS_ID,
                                               pad_token_id=char_tok.PAD_ID, do_sample=False)
    model.save_pretrained(str(out), safe_serialization=True)
    char_tok.build_tokenizer(out)
    return out


def build_tiny_mixtral(out_dir, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                       head_dim: int = 32, experts: int = 4, topk: int = 2, ffn: int = 64, init_std: float = 0.2,
                       rope_theta: float = 1e6, max_position: int = 2048, seed: int = 0) -> Path:
    """A random `MixtralForCausalLM` (every layer MoE, softmax router renormalised over the top-k), fp32."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    if not 1 <= topk <= experts:
        raise ValueError(f"topk must be in [1, experts] (got {topk}, experts={experts})")
    config = MixtralConfig(**_common(hidden, layers, heads, kv_heads, init_std, max_position), head_dim=head_dim,
                           intermediate_size=ffn, num_local_experts=experts, num_experts_per_tok=topk,
                           sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MixtralForCausalLM(config)
    return _save(model, out_dir)


MLA_CPU_LATENT = (512, 64)
"""(kv_lora_rank, qk_rope_head_dim): the only MLA latent shape vLLM 0.32's CPU decode kernel runs (576 values)."""

YARN_TINY = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
"""YaRN parameters shaped like DeepSeek-V3's (factor 40 over 4096 there), scaled to a tiny context."""


def deepseek_config_kwargs(*, hidden: int = 64, layers: int = 3, heads: int = 4, experts: int = 8, topk: int = 2,
                           n_group: int = 2, topk_group: int = 1, shared: int = 1, first_k_dense: int = 1,
                           moe_ffn: int = 32, ffn: int = 64, kv_lora_rank: int = MLA_CPU_LATENT[0],
                           q_lora_rank: int | None = None, qk_nope: int = 32, qk_rope: int = MLA_CPU_LATENT[1],
                           v_head: int = 32, scaling: float = 2.5, init_std: float = 0.2,
                           rope: str = "yarn", max_position: int = 2048) -> dict:
    """The keyword arguments of a tiny `DeepseekV3Config`: the one definition of what its config.json holds (the
    run's ModelSpec is derived from it without building anything). Writes `topk_method: noaux_tc` and
    `scoring_func: sigmoid`, which the released configs carry and vLLM needs (transformers does not write them)."""
    if rope not in ("yarn", "default"):
        raise ValueError(f"rope must be 'yarn' or 'default' (got {rope!r})")
    if not 1 <= topk <= experts:
        raise ValueError(f"topk must be in [1, experts] (got {topk}, experts={experts})")
    return dict(
        **_common(hidden, layers, heads, heads, init_std, max_position), intermediate_size=ffn,
        moe_intermediate_size=moe_ffn, n_routed_experts=experts, num_experts_per_tok=topk, n_shared_experts=shared,
        first_k_dense_replace=first_k_dense, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scaling,
        norm_topk_prob=True, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope,
        qk_rope_head_dim=qk_rope, v_head_dim=v_head, num_nextn_predict_layers=0,
        topk_method="noaux_tc", scoring_func="sigmoid",
        rope_parameters=dict(YARN_TINY) if rope == "yarn" else {"rope_type": "default", "rope_theta": 10000.0})


def build_tiny_deepseek(out_dir, *, seed: int = 0, bias_std: float = 0.1, **config) -> Path:
    """A random `DeepseekV3ForCausalLM` (MLA attention, `first_k_dense` dense layers, then MoE layers with
    `shared` shared experts and a sigmoid group-limited router); `config` goes to `deepseek_config_kwargs`. The
    default latent (kv_lora_rank 512 + rope 64) is the one vLLM's CPU MLA runs; everything else is tiny.
    `e_score_correction_bias` is a zero buffer in transformers; it is drawn with std `bias_std` here so that it
    changes routing and tests see it."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kwargs = deepseek_config_kwargs(**config)
    first_k_dense = kwargs["first_k_dense_replace"]
    hf_config = DeepseekV3Config(**kwargs)
    # transformers drops keys its config class does not define; the released config.json files carry these
    for key in ("topk_method", "scoring_func"):
        setattr(hf_config, key, kwargs[key])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(hf_config)
        for layer in model.model.layers[first_k_dense:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, bias_std)
    return _save(model, out_dir)


def build_tiny_dsa(out_dir, *, arch: str = "deepseek_v32", seed: int = 0, bias_std: float = 0.1,
                   index_heads: int = 16, index_head_dim: int = 128, index_topk: int = 4, q_lora_rank: int = 32,
                   **config) -> Path:
    """A random DeepSeek Sparse Attention model: `arch` "deepseek_v32" (`DeepseekV32ForCausalLM`, half-split indexer
    rope) or "glm_moe_dsa" (`GlmMoeDsaForCausalLM`, interleaved indexer rope), the DeepSeek-V3 body of
    `deepseek_config_kwargs(**config)` with a q latent, and an indexer of `index_heads` x `index_head_dim` (a power
    of two: the Hadamard rotation) choosing `index_topk` tokens per query: a sequence longer than that really
    selects. The indexer's key LayerNorm is drawn (weight 1 + N(0, 0.2), bias N(0, 0.2)) so its layout is tested."""
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    classes = {"deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM),
               "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM)}
    if arch not in classes:
        raise ValueError(f"arch must be one of {', '.join(classes)} (got {arch!r})")
    kwargs = deepseek_config_kwargs(q_lora_rank=q_lora_rank, **config)
    kwargs.update(index_n_heads=index_heads, index_head_dim=index_head_dim, index_topk=index_topk)
    config_cls, model_cls = classes[arch]
    hf_config = config_cls(**kwargs)
    for key in ("topk_method", "scoring_func"):  # as build_tiny_deepseek: the released router's keys
        setattr(hf_config, key, kwargs[key])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(hf_config)
        for layer in model.model.layers:
            norm = layer.self_attn.indexer.k_norm
            norm.weight.data.normal_(1.0, 0.2)
            norm.bias.data.normal_(0.0, 0.2)
        for layer in model.model.layers[kwargs["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, bias_std)
    return _save(model, out_dir)

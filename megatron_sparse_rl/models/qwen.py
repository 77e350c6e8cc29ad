"""Qwen adapters: Qwen3-MoE (`Qwen3MoeForCausalLM`), dense Qwen3 (`Qwen3ForCausalLM`) and Qwen2
(`Qwen2ForCausalLM`, q/k/v biases, no QK-norm).

HF checkpoints store experts one tensor each (`mlp.experts.{e}.gate_proj.weight`); that on-disk naming is
the single naming truth for conversion and weight sync.
"""
from __future__ import annotations

from megatron_sparse_rl.models.base import GPTAdapter
from megatron_sparse_rl.models.spec import ModelSpec, rope_theta_of


def _dense_fields(cfg: dict) -> dict:
    heads = cfg["num_attention_heads"]
    return dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn_hidden_size=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope_theta_of(cfg),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
    )


def _check_act(cfg: dict) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r} is not supported (only 'silu')")


class Qwen3MoeAdapter(GPTAdapter):
    architecture = "Qwen3MoeForCausalLM"

    def spec_from_hf(self, cfg: dict) -> ModelSpec:
        _check_act(cfg)
        fields = _dense_fields(cfg)
        n = fields["num_layers"]
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0
        dense_only = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step", 1) or 1
        moe_layers = tuple(experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(n))
        return ModelSpec(
            architecture=self.architecture, qk_norm=True, qkv_bias=bool(cfg.get("attention_bias", False)),
            num_experts=experts, moe_topk=cfg.get("num_experts_per_tok", 0),
            moe_ffn_hidden_size=cfg.get("moe_intermediate_size", 0), moe_layers=moe_layers,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), **fields,
        )


class Qwen3Adapter(GPTAdapter):
    architecture = "Qwen3ForCausalLM"

    def spec_from_hf(self, cfg: dict) -> ModelSpec:
        _check_act(cfg)
        fields = _dense_fields(cfg)
        return ModelSpec(architecture=self.architecture, qk_norm=True,
                         qkv_bias=bool(cfg.get("attention_bias", False)),
                         moe_layers=(False,) * fields["num_layers"], **fields)


class Qwen2Adapter(GPTAdapter):
    architecture = "Qwen2ForCausalLM"

    def spec_from_hf(self, cfg: dict) -> ModelSpec:
        _check_act(cfg)
        fields = _dense_fields(cfg)
        return ModelSpec(architecture=self.architecture, qk_norm=False, qkv_bias=True,
                         moe_layers=(False,) * fields["num_layers"], **fields)

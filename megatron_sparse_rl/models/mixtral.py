"""Mixtral adapter (`MixtralForCausalLM`): every layer a softmax-routed MoE, no QK-norm, no shared experts.

transformers 5 fuses the experts in memory (`experts.gate_up_proj`) but `save_pretrained` writes them one
tensor each, which is the naming this adapter maps (checked against transformers 5.19):
`model.layers.{i}.block_sparse_moe.gate.weight` (router) and
`model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (w1 = gate, w3 = up, w2 = down).

Routing: HF softmaxes over all experts, takes the top-k and renormalises over them; Megatron's
`moe_router_pre_softmax=False` (top-k of logits, then softmax over the k) computes the same function.
"""
from __future__ import annotations

from megatron_sparse_rl.models.base import GPTAdapter
from megatron_sparse_rl.models.qwen import _check_act, _dense_fields
from megatron_sparse_rl.models.spec import ModelSpec


def check_family(cfg: dict, arch: str, model_type: str, keys: tuple[str, ...]) -> None:
    """ValueError naming the architecture when config.json's model_type is another family's or it lacks keys
    that family always has (a relabelled `architectures` must not half-convert)."""
    if cfg.get("model_type", model_type) != model_type:
        raise ValueError(f"config.json says {arch!r} but model_type {cfg['model_type']!r} "
                         f"(expected {model_type!r}): the config does not match the architecture")
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise ValueError(f"config.json says {arch!r} but lacks {', '.join(missing)}: "
                         "the config does not match the architecture")


class MixtralAdapter(GPTAdapter):
    architecture = "MixtralForCausalLM"
    hf_experts = "block_sparse_moe.experts.{e}"
    hf_router = "block_sparse_moe.gate.weight"
    hf_expert_names = ("w1", "w3", "w2")

    def spec_from_hf(self, cfg: dict) -> ModelSpec:
        check_family(cfg, self.architecture, "mixtral", ("num_local_experts", "num_experts_per_tok", "intermediate_size"))
        _check_act(cfg)
        if cfg.get("sliding_window") is not None:
            raise NotImplementedError(f"Mixtral with sliding_window={cfg['sliding_window']} is not supported "
                                      "(only full attention, sliding_window: null)")
        if cfg.get("attention_bias"):
            raise NotImplementedError("Mixtral with attention_bias is not supported")
        fields = _dense_fields(cfg)
        experts, topk = cfg["num_local_experts"], cfg["num_experts_per_tok"]
        if not 1 <= topk <= experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_local_experts] (got {topk}, {experts})")
        return ModelSpec(
            architecture=self.architecture, qk_norm=False, qkv_bias=False, num_experts=experts, moe_topk=topk,
            moe_ffn_hidden_size=cfg["intermediate_size"], moe_layers=(True,) * fields["num_layers"],
            norm_topk_prob=True, **fields,
        )

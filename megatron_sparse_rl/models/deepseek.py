"""DeepSeek-V3-style adapter (`DeepseekV3ForCausalLM`): shared experts, first-k dense layers, sigmoid router with
`e_score_correction_bias`, group-limited routing, routed scaling factor and MLA attention.

What works: the config mapping of the MoE parts (`moe_kwargs`, verified against HF's `DeepseekV3MoE` in
`tests/distributed/test_adapters_more.py`) and the full HF <-> Megatron name map (`tensor_maps`, covering every
tensor `save_pretrained` writes exactly once).

The router's `e_score_correction_bias` maps to Megatron's `router.expert_bias`, a persistent buffer (not a
parameter): `learner/params.py:local_params` lists persistent buffers, so the learner's HF loader, the
converter's load/gather and the torch_dist save/load carry it bit-exactly (tested on DeepSeek's MoE layers in
`tests/distributed/test_convert.py`).

What does not yet: MLA (multi-latent attention, `q_lora_rank` / `kv_lora_rank`). transformers' DeepSeek-V3
always uses MLA, and the Megatron MLA path (MLATransformerConfig and its RoPE variants) is not verified here, so
`transformer_config` raises NotImplementedError rather than build a model that might silently differ. The MLA
names in `tensor_maps` follow Megatron's MLASelfAttention local spec and are unverified against a forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_sparse_rl.models.base import GPTAdapter, mlp_maps
from megatron_sparse_rl.models.mixtral import check_family
from megatron_sparse_rl.models.qwen import _check_act
from megatron_sparse_rl.models.spec import ModelSpec
from megatron_sparse_rl.models.tensor_map import TensorMap


@dataclass(frozen=True)
class DeepseekSpec(ModelSpec):
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


class DeepseekV3Adapter(GPTAdapter):
    architecture = "DeepseekV3ForCausalLM"

    def spec_from_hf(self, cfg: dict) -> DeepseekSpec:
        check_family(cfg, self.architecture, "deepseek_v3", ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                              "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
        _check_act(cfg)
        n, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        experts, topk = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
        shared = cfg.get("n_shared_experts") or 0
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        return DeepseekSpec(
            architecture=self.architecture, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_layers=n, num_heads=heads, num_kv_heads=heads,
            head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], ffn_hidden_size=cfg["intermediate_size"],
            num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_layers=tuple(i >= (cfg.get("first_k_dense_replace") or 0) for i in range(n)),
            shared_expert_ffn_hidden_size=cfg["moe_intermediate_size"] * shared,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
        )

    # ---- Megatron side -------------------------------------------------------------------------
    def moe_kwargs(self, spec: DeepseekSpec) -> dict[str, Any]:
        """TransformerConfig MoE overrides that make Megatron's router compute HF's DeepseekV3TopkRouter."""
        if spec.moe_topk > 1 and not spec.norm_topk_prob:
            raise NotImplementedError("DeepSeek-V3 with norm_topk_prob=false is not supported: Megatron's sigmoid "
                                      "router always renormalises over the top-k")
        if spec.num_experts % spec.n_group or spec.moe_topk % spec.topk_group:
            raise ValueError(f"n_group={spec.n_group} must divide n_routed_experts={spec.num_experts} and "
                             f"topk_group={spec.topk_group} must divide num_experts_per_tok={spec.moe_topk}")
        grouped = spec.n_group > 1
        if grouped and spec.moe_topk // spec.topk_group != 2:
            # HF scores a group by its top-2 experts; Megatron by its top-(topk // group_topk)
            raise NotImplementedError(f"group-limited routing needs num_experts_per_tok // topk_group == 2 to match "
                                      f"HF's top-2 group score (got {spec.moe_topk} // {spec.topk_group})")
        return dict(
            moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
            moe_router_enable_expert_bias=True,
            # frozen for post-training: the aux-loss-free balancing update would move the checkpoint's bias
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=spec.routed_scaling_factor,
            moe_router_num_groups=spec.n_group if grouped else None,
            moe_router_group_topk=spec.topk_group if grouped else None,
        )

    def transformer_config(self, spec: DeepseekSpec, **kw: Any):
        raise NotImplementedError(
            f"{self.architecture}: MLA attention (multi-latent attention, q_lora_rank={spec.q_lora_rank}, "
            f"kv_lora_rank={spec.kv_lora_rank}) is not supported yet, so no Megatron model can be built for it; "
            "the MoE mapping (shared experts, first-k dense layers, sigmoid router) exists but MLA does not")

    # ---- name map ------------------------------------------------------------------------------
    def _attention_maps(self, spec: DeepseekSpec, hf: str, mc: str) -> list[TensorMap]:
        # engine slices: q_proj by rows, o_proj by columns; the low-rank MLA projections go whole (vLLM narrows
        # them itself; MLA is unverified here)
        att, sa = f"{hf}.self_attn", f"{mc}.self_attention"
        h, heads, lora = spec.hidden_size, spec.num_heads, spec.kv_lora_rank
        q = heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        if spec.q_lora_rank is None:
            maps = [TensorMap(f"{sa}.linear_q_proj.weight", (f"{att}.q_proj.weight",), shapes=((q, h),),
                              engine=("column",))]
        else:
            r = spec.q_lora_rank
            maps = [TensorMap(f"{sa}.linear_q_down_proj.weight", (f"{att}.q_a_proj.weight",), shapes=((r, h),)),
                    TensorMap(f"{sa}.q_layernorm.weight", (f"{att}.q_a_layernorm.weight",), shapes=((r,),)),
                    TensorMap(f"{sa}.linear_q_up_proj.weight", (f"{att}.q_b_proj.weight",), shapes=((q, r),))]
        kv_up = heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        return maps + [
            TensorMap(f"{sa}.linear_kv_down_proj.weight", (f"{att}.kv_a_proj_with_mqa.weight",),
                      shapes=((lora + spec.qk_rope_head_dim, h),)),
            TensorMap(f"{sa}.kv_layernorm.weight", (f"{att}.kv_a_layernorm.weight",), shapes=((lora,),)),
            TensorMap(f"{sa}.linear_kv_up_proj.weight", (f"{att}.kv_b_proj.weight",), shapes=((kv_up, lora),)),
            TensorMap(f"{sa}.linear_proj.weight", (f"{att}.o_proj.weight",), shapes=((h, heads * spec.v_head_dim),),
                      engine=("row",)),
        ]

    def _layer_maps(self, spec: DeepseekSpec, i: int) -> list[TensorMap]:
        if spec.qkv_bias:
            raise NotImplementedError("DeepSeek-V3 with attention_bias is not supported")
        hf, mc, h = self.hf_layer.format(i=i), f"decoder.layers.{i}", spec.hidden_size
        maps = [TensorMap(f"{mc}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",), shapes=((h,),))]
        maps += self._attention_maps(spec, hf, mc)
        maps.append(TensorMap(f"{mc}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",),
                              shapes=((h,),)))
        names = ("gate_proj", "up_proj", "down_proj")
        if not spec.moe_layers[i]:
            return maps + mlp_maps(f"{mc}.mlp", f"{hf}.mlp", names, h, spec.ffn_hidden_size)
        experts = spec.num_experts
        maps += [TensorMap(f"{mc}.mlp.router.weight", (f"{hf}.mlp.gate.weight",), shapes=((experts, h),)),
                 TensorMap(f"{mc}.mlp.router.expert_bias", (f"{hf}.mlp.gate.e_score_correction_bias",),
                           shapes=((experts,),))]
        for e in range(experts):
            maps += mlp_maps(f"{mc}.mlp.experts.local_experts.{e}", f"{hf}.mlp.experts.{e}", names, h,
                             spec.moe_ffn_hidden_size)
        if spec.shared_expert_ffn_hidden_size:
            maps += mlp_maps(f"{mc}.mlp.shared_experts", f"{hf}.mlp.shared_experts", names, h,
                             spec.shared_expert_ffn_hidden_size)
        return maps

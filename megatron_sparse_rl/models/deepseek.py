"""DeepSeek-V3 / Kimi-K2 adapter (`DeepseekV3ForCausalLM`, `model_type` deepseek_v3 or kimi_k2): multi-head latent
attention (MLA), shared experts, first-k dense layers, sigmoid router with `e_score_correction_bias`, group-limited
routing, routed scaling factor, default or YaRN RoPE.

Megatron side: `MLATransformerConfig` (q_lora_rank or none, kv_lora_rank, qk_head_dim = nope, qk_pos_emb_head_dim =
rope, v_head_dim, rope or yarn) with `qk_layernorm` on, which is what gives the local spec its q/kv latent norms;
without Transformer Engine the MLA shims of `patches/megatron_mla.py` are needed. Megatron's MLA RoPE always reads
the rope dims interleaved (as HF's `rope_interleave: true` and vLLM do), so `rope_interleave: false` is refused.

The router's `e_score_correction_bias` maps to Megatron's `router.expert_bias`, a persistent buffer (not a
parameter): `learner/params.py:local_params` lists persistent buffers, so the learner's HF loader, the converter's
load/gather and the torch_dist save/load carry it bit-exactly. Multi-token-prediction layers of a release checkpoint
(`num_nextn_predict_layers`, stored as layers numbered after the last decoder layer) are not part of the model:
`mtp_layer_names` names them so import can skip them; export never writes them.
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
    rope_type: str = "default"
    """"default" or "yarn"."""
    rope_factor: float = 1.0
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    mtp_layers: int = 0
    """Multi-token-prediction layers in a release checkpoint (`num_nextn_predict_layers`); skipped on import."""

    @property
    def latent_width(self) -> int:
        """Values per token per layer in MLA's KV cache: the normalised latent plus the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_values_per_rank(self, tp: int) -> int:
        """One latent row per token per layer, shared by all heads and kept whole on every engine TP rank."""
        return self.latent_width

    def parameter_count(self) -> int:
        h, heads, r = self.hidden_size, self.num_heads, self.qk_rope_head_dim
        qk = self.qk_nope_head_dim + r
        q = h * heads * qk if self.q_lora_rank is None else \
            h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        attn = q + h * self.latent_width + self.kv_lora_rank \
            + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim) + heads * self.v_head_dim * h
        dense_mlp = 3 * h * self.ffn_hidden_size
        moe_mlp = self.num_experts * (3 * h * self.moe_ffn_hidden_size + h + 1) + 3 * h * self.shared_expert_ffn_hidden_size
        total = sum(attn + 2 * h + (moe_mlp if m else dense_mlp) for m in self.moe_layers)
        return total + self.vocab_size * h * (1 if self.tie_embeddings else 2) + h


MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ROPE_TYPES = ("default", "yarn")
RELEASE_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
"""The router of DeepSeek-V3's (and Kimi-K2's) released config.json: sigmoid scores, top-k chosen with
`e_score_correction_bias`. It is what this adapter builds and what transformers' DeepseekV3 model computes, but
transformers' `DeepseekV3Config` does not write these keys, and vLLM reads their absence as softmax scores and no
bias (then fails on the checkpoint's bias tensors): absent keys are filled with these values (`config_defaults`),
other values are refused."""


def _rope(cfg: dict) -> dict:
    """The RoPE fields of DeepseekSpec from `rope_parameters` (transformers 5) or `rope_scaling` (release
    config.json files), with a clear error for a type Megatron's MLA cannot compute."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise NotImplementedError(f"DeepSeek-V3 rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    out = dict(rope_type=kind, rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if kind == "yarn":
        if "factor" not in params:
            raise ValueError("config.json: YaRN rope parameters lack 'factor'")
        out.update(rope_factor=float(params["factor"]),
                   rope_original_max_position=int(params.get("original_max_position_embeddings",
                                                             cfg.get("max_position_embeddings", 4096))),
                   rope_beta_fast=float(params.get("beta_fast", 32.0)), rope_beta_slow=float(params.get("beta_slow", 1.0)),
                   rope_mscale=float(params.get("mscale", 1.0)), rope_mscale_all_dim=float(params.get("mscale_all_dim", 0.0)))
    return out


def _check_router(cfg: dict) -> None:
    """NotImplementedError naming the config.json key when the router it describes is not DeepSeek-V3's."""
    release = ", ".join(f"{k}: {v!r}" for k, v in RELEASE_ROUTER.items())
    for key, value in RELEASE_ROUTER.items():
        if cfg.get(key) is not None and cfg[key] != value:
            raise NotImplementedError(f"config.json: {key} {cfg[key]!r} is not supported: the DeepSeek-V3 adapter "
                                      f"builds the released router ({release}); remove the key or set it to {value!r}")


class DeepseekV3Adapter(GPTAdapter):
    architecture = "DeepseekV3ForCausalLM"

    def config_defaults(self, cfg: dict) -> dict[str, Any]:
        """The release router keys (`RELEASE_ROUTER`) `cfg` lacks, e.g. in a config.json written by transformers'
        `DeepseekV3Config`, with the release values the adapter builds."""
        return {k: v for k, v in RELEASE_ROUTER.items() if cfg.get(k) is None}

    def spec_from_hf(self, cfg: dict) -> DeepseekSpec:
        if cfg.get("model_type") in MODEL_TYPES:  # Kimi-K2 ships this architecture under its own model_type
            cfg = {**cfg, "model_type": "deepseek_v3"}
        check_family(cfg, self.architecture, "deepseek_v3", ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                              "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                              # absent, transformers would default it to 1536: say it explicitly
                                              "q_lora_rank"))
        _check_act(cfg)
        _check_router(cfg)
        n, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        experts, topk = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
        shared = cfg.get("n_shared_experts") or 0
        if cfg.get("rope_interleave", True) is False:
            raise NotImplementedError("DeepSeek-V3 with rope_interleave: false is not supported (Megatron's MLA and "
                                      "vLLM read the rope dims interleaved, as the released models store them)")
        if cfg.get("attention_bias"):
            raise NotImplementedError("DeepSeek-V3 with attention_bias is not supported")
        if cfg.get("moe_layer_freq", 1) != 1:
            raise NotImplementedError(f"DeepSeek-V3 with moe_layer_freq={cfg['moe_layer_freq']} is not supported "
                                      "(only 1: every layer from first_k_dense_replace on is MoE)")
        return DeepseekSpec(
            architecture=self.architecture, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_layers=n, num_heads=heads, num_kv_heads=heads,
            head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], ffn_hidden_size=cfg["intermediate_size"],
            num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_layers=tuple(i >= (cfg.get("first_k_dense_replace") or 0) for i in range(n)),
            shared_expert_ffn_hidden_size=cfg["moe_intermediate_size"] * shared,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), norm_eps=cfg.get("rms_norm_eps", 1e-6),
            qk_norm=True, **_rope(cfg),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"], mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        )

    def mtp_layer_names(self, spec: DeepseekSpec, names) -> list[str]:
        """The names among `names` that belong to multi-token-prediction layers (layer index >= num_layers)."""
        out = []
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit() \
                    and int(parts[2]) >= spec.num_layers:
                out.append(name)
        return out

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

    def config_class(self) -> type:
        from megatron.core.transformer import MLATransformerConfig

        return MLATransformerConfig

    def config_kwargs(self, spec: DeepseekSpec, **kw: Any) -> dict[str, Any]:
        kwargs = super().config_kwargs(spec, **kw)
        kwargs.update(
            multi_latent_attention=True, q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
            qk_head_dim=spec.qk_nope_head_dim, qk_pos_emb_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim,
            kv_channels=spec.qk_nope_head_dim + spec.qk_rope_head_dim, qk_layernorm=True,
            rope_type="rope" if spec.rope_type == "default" else "yarn", rotary_base=spec.rope_theta,
            rotary_scaling_factor=spec.rope_factor, original_max_position_embeddings=spec.rope_original_max_position,
            beta_fast=spec.rope_beta_fast, beta_slow=spec.rope_beta_slow, mscale=spec.rope_mscale,
            mscale_all_dim=spec.rope_mscale_all_dim,
        )
        if spec.is_moe:
            kwargs.update(self.moe_kwargs(spec))
        return kwargs

    # ---- name map ------------------------------------------------------------------------------
    def _attention_maps(self, spec: DeepseekSpec, hf: str, mc: str) -> list[TensorMap]:
        # engine slices (vLLM's DeepseekV2MLAAttention): the per-head up projections (q_proj / q_b_proj, kv_b_proj)
        # by rows, o_proj by columns; the down projections and the latent norms are replicated
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
                    TensorMap(f"{sa}.linear_q_up_proj.weight", (f"{att}.q_b_proj.weight",), shapes=((q, r),),
                              engine=("column",))]
        kv_up = heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        return maps + [
            TensorMap(f"{sa}.linear_kv_down_proj.weight", (f"{att}.kv_a_proj_with_mqa.weight",),
                      shapes=((lora + spec.qk_rope_head_dim, h),)),
            TensorMap(f"{sa}.kv_layernorm.weight", (f"{att}.kv_a_layernorm.weight",), shapes=((lora,),)),
            TensorMap(f"{sa}.linear_kv_up_proj.weight", (f"{att}.kv_b_proj.weight",), shapes=((kv_up, lora),),
                      engine=("column",)),
            TensorMap(f"{sa}.linear_proj.weight", (f"{att}.o_proj.weight",), shapes=((h, heads * spec.v_head_dim),),
                      engine=("row",)),
        ]

    def _layer_maps(self, spec: DeepseekSpec, i: int) -> list[TensorMap]:
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

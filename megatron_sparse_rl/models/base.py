"""The model adapter interface and the shared GPT-family implementation.

An adapter turns a Hugging Face `config.json` into a `ModelSpec`, a Megatron-Core `TransformerConfig` and
layer spec, and the HF <-> Megatron tensor name map. Adapters are looked up by the exact HF
`architectures` string (see `models/__init__.py`).
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_sparse_rl.models.spec import ModelSpec
from megatron_sparse_rl.models.tensor_map import EngineSplit, TensorMap

QKV_SPLITS: tuple[EngineSplit, ...] = ("column", "kv_heads", "kv_heads")
"""q, k, v projections in an engine: vLLM's QKVParallelLinear splits q by rows, k and v by KV head."""


class GPTAdapter:
    """Decoder-only RoPE transformer with RMSNorm and SwiGLU MLPs, optionally routed-expert MoE layers.

    Subclasses implement `spec_from_hf` and the HF name prefixes; the Megatron side is shared.
    """

    architecture: str = ""
    hf_layer = "model.layers.{i}"
    hf_experts = "mlp.experts.{e}"
    hf_router = "mlp.gate.weight"
    hf_expert_names = ("gate_proj", "up_proj", "down_proj")

    def spec_from_hf(self, cfg: dict) -> ModelSpec:
        raise NotImplementedError

    def config_defaults(self, cfg: dict) -> dict[str, Any]:
        """Keys the config.json `cfg` leaves out that the engine would read differently from this adapter, with
        the values the adapter assumes; the engine is started with them (vLLM's hf_overrides) and an export writes
        them, the user's file is never written. Empty for most families."""
        return {}

    def mtp_layer_names(self, spec: ModelSpec, names) -> list[str]:
        """The names among `names` of multi-token-prediction layers, which import skips (none in this family)."""
        return []

    # ---- Megatron side -------------------------------------------------------------------------
    def transformer_config(self, spec: ModelSpec, *, tp: int, pp: int, ep: int, etp: int,
                           sequence_parallel: bool = False, dtype: torch.dtype = torch.float32,
                           recompute: bool = False, aux_loss_coeff: float = 0.0, **extra: Any):
        kwargs = self.config_kwargs(spec, tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=sequence_parallel,
                                    dtype=dtype, recompute=recompute, aux_loss_coeff=aux_loss_coeff)
        kwargs.update(extra)
        return self.config_class()(**kwargs)

    def config_class(self) -> type:
        """The Megatron-Core config class this family is built from."""
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig

    def config_kwargs(self, spec: ModelSpec, *, tp: int, pp: int, ep: int, etp: int, sequence_parallel: bool,
                      dtype: torch.dtype, recompute: bool, aux_loss_coeff: float) -> dict[str, Any]:
        """The keyword arguments of `config_class()` that make Megatron compute this family's HF forward."""
        kwargs: dict[str, Any] = dict(
            num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
            num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
            normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, qk_layernorm=spec.qk_norm,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
            add_qkv_bias=spec.qkv_bias, attention_dropout=0.0, hidden_dropout=0.0,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, sequence_parallel=sequence_parallel,
            params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=not torch.cuda.is_available(),
            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            pipeline_dtype=dtype,
        )
        if recompute:
            kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if spec.is_moe:
            kwargs.update(
                num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk,
                moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_token_dispatcher_type="alltoall",
                moe_grouped_gemm=False, moe_router_score_function="softmax",
                # top-k of logits then softmax over the k == softmax, top-k, renormalise (norm_topk_prob)
                moe_router_pre_softmax=not spec.norm_topk_prob,
                moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
                moe_aux_loss_coeff=aux_loss_coeff, moe_layer_freq=[int(m) for m in spec.moe_layers],
                moe_router_dtype="fp32", moe_permute_fusion=False,
            )
            if spec.shared_expert_ffn_hidden_size:
                kwargs.update(moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size)
        return kwargs

    def layer_spec(self, config, use_te: bool, vp_stage: int | None = None):
        """The decoder block spec of this rank's layers (of model chunk `vp_stage` under an interleaved pipeline)."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                          vp_stage=vp_stage)

    # ---- name map ------------------------------------------------------------------------------
    def tensor_maps(self, spec: ModelSpec) -> list[TensorMap]:
        """Every Megatron parameter of the full model with its HF sources and their shapes, in HF checkpoint
        order."""
        h, vocab = spec.hidden_size, spec.vocab_size
        maps = [TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), shapes=((vocab, h),),
                          engine=("vocab",))]
        for i in range(spec.num_layers):
            maps += self._layer_maps(spec, i)
        maps.append(TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), shapes=((h,),)))
        if not spec.tie_embeddings:
            maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), shapes=((vocab, h),), engine=("vocab",)))
        return maps

    def hf_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """Every HF tensor name of the full model -> its shape, as the config implies (from `tensor_maps`)."""
        out: dict[str, tuple[int, ...]] = {}
        for tm in self.tensor_maps(spec):
            if len(tm.shapes) != len(tm.hf):
                raise AssertionError(f"{type(self).__name__}: tensor map {tm.mcore} has no shape for each HF tensor")
            out.update(zip(tm.hf, tm.shapes))
        return out

    def engine_splits(self, spec: ModelSpec) -> dict[str, EngineSplit]:
        """Every HF tensor name of the full model -> how a tensor-parallel vLLM engine rank slices it (from
        `tensor_maps`)."""
        return {name: split for tm in self.tensor_maps(spec) for name, split in zip(tm.hf, tm.engine_splits)}

    def _layer_maps(self, spec: ModelSpec, i: int) -> list[TensorMap]:
        hf = self.hf_layer.format(i=i)
        mc = f"decoder.layers.{i}"
        att = f"{hf}.self_attn"
        h, hd = spec.hidden_size, spec.head_dim
        q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
        maps = [
            TensorMap(f"{mc}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",), shapes=((h,),)),
            TensorMap(f"{mc}.self_attention.linear_qkv.weight",
                      (f"{att}.q_proj.weight", f"{att}.k_proj.weight", f"{att}.v_proj.weight"), "qkv",
                      shapes=((q, h), (kv, h), (kv, h)), engine=QKV_SPLITS),
            TensorMap(f"{mc}.self_attention.linear_proj.weight", (f"{att}.o_proj.weight",), shapes=((h, q),),
                      engine=("row",)),
            TensorMap(f"{mc}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",), shapes=((h,),)),
        ]
        if spec.qkv_bias:
            maps.append(TensorMap(f"{mc}.self_attention.linear_qkv.bias",
                                  (f"{att}.q_proj.bias", f"{att}.k_proj.bias", f"{att}.v_proj.bias"), "qkv",
                                  shapes=((q,), (kv,), (kv,)), engine=QKV_SPLITS))
        if spec.qk_norm:
            maps += [TensorMap(f"{mc}.self_attention.q_layernorm.weight", (f"{att}.q_norm.weight",), shapes=((hd,),)),
                     TensorMap(f"{mc}.self_attention.k_layernorm.weight", (f"{att}.k_norm.weight",), shapes=((hd,),))]
        if not (spec.moe_layers and spec.moe_layers[i]):
            return maps + mlp_maps(f"{mc}.mlp", f"{hf}.mlp", ("gate_proj", "up_proj", "down_proj"), h,
                                   spec.ffn_hidden_size)
        maps.append(TensorMap(f"{mc}.mlp.router.weight", (f"{hf}.{self.hf_router}",),
                              shapes=((spec.num_experts, h),)))
        for e in range(spec.num_experts):
            maps += mlp_maps(f"{mc}.mlp.experts.local_experts.{e}", f"{hf}.{self.hf_experts.format(e=e)}",
                             self.hf_expert_names, h, spec.moe_ffn_hidden_size)
        return maps


def mlp_maps(mcore: str, hf: str, names: tuple[str, str, str], hidden: int, ffn: int) -> list[TensorMap]:
    """The two maps of a SwiGLU MLP: fc1 = [gate; up] ((ffn, hidden) each), fc2 = down ((hidden, ffn)); `names`
    are the HF (gate, up, down) projection names under prefix `hf`. In an engine (dense MLP, routed or shared
    experts) gate and up split by rows, down by columns."""
    gate, up, down = names
    return [TensorMap(f"{mcore}.linear_fc1.weight", (f"{hf}.{gate}.weight", f"{hf}.{up}.weight"), "glu",
                      shapes=((ffn, hidden), (ffn, hidden)), engine=("column", "column")),
            TensorMap(f"{mcore}.linear_fc2.weight", (f"{hf}.{down}.weight",), shapes=((hidden, ffn),), engine=("row",))]

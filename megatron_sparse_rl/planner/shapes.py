"""`ModelShape`: the parameter groups and cache sizes the planner needs, read from a Hugging Face config.

    shape = load_shape("kimi-k2")                   # a bundled config (assets/model_configs/<name>.json)
    shape = load_shape("/models/Qwen3-30B-A3B")     # a model directory or a config.json path
    shape.total_params(), shape.active_params()

Every architecture is read through its training adapter (models/: `get_adapter(cfg).spec_from_hf`), so the
planner and the learner see one shape. `DeepseekV3ForCausalLM` (DeepSeek-V3, Kimi-K2): MLA attention (q/kv
low-rank projections; the cache holds ONE latent row per token per layer, `DeepseekSpec.latent_width` =
kv_lora_rank + qk_rope_head_dim values shared by every head), shared experts, the first
`first_k_dense_replace` layers dense, the router's correction bias. Multi-token-prediction layers are left out
of the totals, as in the published counts (DeepSeek-V3: 671B main model + 14B MTP module).

DeepSeek Sparse Attention models (`DeepseekV32ForCausalLM`: DeepSeek-V3.2; `GlmMoeDsaForCausalLM`: GLM-5) are read
through their adapter (models/dsa.py) like the rest; `DsaShape` is the lightning indexer's part (its parameters, the
key cache an engine keeps for it, the top-k a replay record stores).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "model_configs"
INDEXER_QUANT_BLOCK = 128
"""Values per fp32 scale in vLLM's indexer key cache (DeepseekV32Indexer.quant_block_size)."""


def bundled_models() -> list[str]:
    return sorted(p.stem for p in ASSETS.glob("*.json"))


@dataclass(frozen=True)
class DsaShape:
    """DeepSeek Sparse Attention's lightning indexer: per query, `n_heads` heads of `head_dim` score every earlier
    token against ONE key per token (ReLU, weighted sum over heads), and attention reads only the `topk` best."""

    n_heads: int
    """config.json index_n_heads."""
    head_dim: int
    """config.json index_head_dim: the indexer key of one token in one layer."""
    topk: int
    """config.json index_topk: tokens each query attends to, and indices per token per layer in a replay record."""
    layers: int
    """Layers that run the indexer: all of them (per-layer index sharing, GLM-5.2's 'shared' layers, is refused)."""
    q_rank: int
    """The indexer query's input width: q_lora_rank (hidden size without a q LoRA, as Megatron's DSAIndexer)."""
    hidden: int

    @property
    def params(self) -> int:
        """One layer's indexer (transformers' DeepseekV32Indexer, Megatron's DSAIndexer): wq_b [n_heads x head_dim,
        q_rank], wk [head_dim, hidden], k_norm (a LayerNorm: weight and bias), weights_proj [n_heads, hidden].
        Megatron builds the three projections `duplicated`: whole on every TP rank; vLLM replicates them too."""
        return (self.q_rank * self.n_heads * self.head_dim + self.hidden * self.head_dim + 2 * self.head_dim
                + self.hidden * self.n_heads)

    @property
    def cache_bytes(self) -> int:
        """The indexer key cache per token per layer in vLLM (DeepseekV32Indexer's uint8 cache of head_dim +
        head_dim // 128 * 4 bytes): head_dim fp8 e4m3 values and one float32 power-of-two (ue8m0) scale per 128,
        whatever the KV cache's dtype; one 'head', whole on every TP rank of the engine."""
        return self.head_dim + self.head_dim // INDEXER_QUANT_BLOCK * 4

    @property
    def activation_bytes(self) -> int:
        """Learner activations per token per layer kept for the backward, whole on every TP rank (the indexer gathers
        the sequence-parallel input): its q, k and head weights (bf16) and the top-k indices (int64). A fused indexer
        kernel is assumed: no [s, s] score tensor (docs/scale.md "DSA models")."""
        return 2 * (self.n_heads * self.head_dim + self.head_dim + self.n_heads) + 8 * self.topk


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts per group (elements) and the per-token sizes activations and KV caches need."""

    name: str
    architecture: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    attn_params: int
    """Attention of one layer, with its two RMSNorms (q/k norms, MLA latent norms included)."""
    dense_mlp_params: int
    """The MLP of one dense layer."""
    expert_params: int
    """One routed expert."""
    shared_params: int
    """All shared experts of one MoE layer."""
    router_params: int
    """Router of one MoE layer (gate weight, correction bias)."""
    num_experts: int
    topk: int
    moe_layers: tuple[bool, ...]
    embed_params: int
    head_params: int
    """Output projection (0 when tied to the embedding)."""
    kv_elems: int
    """Cached elements per token per layer: 2 * kv_heads * head_dim, or the MLA latent."""
    kv_heads: int
    """KV heads a TP engine splits (0 for MLA: every TP rank keeps the whole latent)."""
    act_attn: int
    """Elements of attention activations per token per layer kept for the backward (q, k, v, output, ...)."""
    ffn: int
    moe_ffn: int
    shared_ffn: int
    notes: tuple[str, ...] = ()
    dsa: DsaShape | None = None
    """DeepSeek Sparse Attention's indexer; None for models without one."""
    spec: Any = field(default=None, compare=False, repr=False)
    """The adapter's ModelSpec it was read from: the learner's own layout check runs on it (memory.learner_limits)."""

    @property
    def mla(self) -> bool:
        """Multi-head latent attention: `kv_elems` is one latent row per token per layer, not per head."""
        return self.kv_heads == 0

    @property
    def indexer_params(self) -> int:
        """Indexer parameters of one layer (0 without DSA): not in `attn_params`, as they are not split by TP."""
        return self.dsa.params if self.dsa else 0

    @property
    def n_moe(self) -> int:
        return sum(self.moe_layers)

    @property
    def n_dense(self) -> int:
        return self.layers - self.n_moe

    def total_params(self) -> int:
        moe = self.num_experts * self.expert_params + self.shared_params + self.router_params
        return (self.layers * (self.attn_params + self.indexer_params) + self.n_dense * self.dense_mlp_params
                + self.n_moe * moe + self.embed_params + self.head_params + self.hidden)

    def expert_total(self) -> int:
        """Routed-expert parameters (sharded by EP); everything else is 'dense' (sharded by TP)."""
        return self.n_moe * self.num_experts * self.expert_params

    def active_params(self) -> int:
        """Parameters one token passes through (top-k routed experts + shared + dense parts)."""
        return self.total_params() - self.n_moe * (self.num_experts - self.topk) * self.expert_params


def _gqa_attention(spec) -> dict:
    """Attention fields of a grouped-query model: K and V of every KV head cached, split by KV head over TP."""
    h, hd = spec.hidden_size, spec.head_dim
    attn = h * hd * (2 * spec.num_heads + 2 * spec.num_kv_heads) + 2 * h
    attn += hd * (spec.num_heads + 2 * spec.num_kv_heads) if spec.qkv_bias else 0
    attn += 2 * hd if spec.qk_norm else 0
    return dict(attn_params=attn, kv_elems=2 * spec.num_kv_heads * hd, kv_heads=spec.num_kv_heads,
                act_attn=hd * (spec.num_heads * 2 + spec.num_kv_heads * 2), notes=())


def _mla_attention(spec) -> dict:
    """Attention fields of multi-head latent attention (`DeepseekSpec`): q (full or low-rank with its norm), the
    joint KV down projection to the latent + rope key, the latent norm, the per-head K/V up projection, the output
    projection, plus the layer's two RMSNorms. Cached per token per layer: the latent row (`latent_width`)."""
    h, heads, q_lora, kv_lora = spec.hidden_size, spec.num_heads, spec.q_lora_rank, spec.kv_lora_rank
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    q = h * heads * qk if q_lora is None else h * q_lora + q_lora + q_lora * heads * qk
    kv = h * spec.latent_width + kv_lora + kv_lora * heads * (spec.qk_nope_head_dim + spec.v_head_dim)
    notes = (f"{spec.mtp_layers} multi-token-prediction layer(s) not counted (as in the published total)",) \
        if spec.mtp_layers else ()
    notes += (f"MLA: the KV cache holds one latent row per token per layer, {spec.latent_width} values "
              f"(kv_lora_rank {kv_lora} + qk_rope_head_dim {spec.qk_rope_head_dim}) shared by all {heads} heads and "
              "kept whole on every TP rank of an engine",)
    return dict(attn_params=q + kv + heads * spec.v_head_dim * h + 2 * h, kv_elems=spec.latent_width, kv_heads=0,
                act_attn=(q_lora or 0) + spec.latent_width + heads * (2 * qk + 2 * spec.v_head_dim), notes=notes)


def _from_spec(name: str, spec) -> ModelShape:
    """The shape of `spec` (an adapter's ModelSpec), with the indexer of a DSA model (models/dsa.py DsaSpec)."""
    from megatron_sparse_rl.models.deepseek import DeepseekSpec
    from megatron_sparse_rl.models.dsa import DsaSpec

    h, deepseek = spec.hidden_size, isinstance(spec, DeepseekSpec)
    # DeepSeek's sigmoid router has a correction bias per expert (Megatron's router.expert_bias)
    router = spec.num_experts * (h + 1 if deepseek else h)
    attention = _mla_attention(spec) if deepseek else _gqa_attention(spec)
    dsa = None
    if isinstance(spec, DsaSpec):
        dsa = DsaShape(n_heads=spec.index_n_heads, head_dim=spec.index_head_dim, topk=spec.index_topk,
                       layers=spec.num_layers, q_rank=spec.q_lora_rank, hidden=h)
        attention["notes"] += _dsa_notes(dsa)
    return ModelShape(
        name=name, architecture=spec.architecture, hidden=h, layers=spec.num_layers,
        vocab=spec.vocab_size, heads=spec.num_heads, dense_mlp_params=3 * h * spec.ffn_hidden_size,
        expert_params=3 * h * spec.moe_ffn_hidden_size, shared_params=3 * h * spec.shared_expert_ffn_hidden_size,
        router_params=router, num_experts=spec.num_experts, topk=spec.moe_topk,
        moe_layers=tuple(spec.moe_layers), embed_params=spec.vocab_size * h,
        head_params=0 if spec.tie_embeddings else spec.vocab_size * h, ffn=spec.ffn_hidden_size,
        moe_ffn=spec.moe_ffn_hidden_size, shared_ffn=spec.shared_expert_ffn_hidden_size, spec=spec, dsa=dsa,
        **attention,
    )


def _dsa_notes(dsa: DsaShape) -> tuple[str, ...]:
    return (f"DSA indexer: {dsa.n_heads} heads x {dsa.head_dim}, top-{dsa.topk}, on all {dsa.layers} layers; "
            f"{dsa.params:,} parameters per layer (wq_b {dsa.q_rank}x{dsa.n_heads * dsa.head_dim}, wk "
            f"{dsa.hidden}x{dsa.head_dim}, k_norm 2x{dsa.head_dim}, weights_proj {dsa.hidden}x{dsa.n_heads}), "
            "whole on every TP rank (Megatron builds them duplicated)",
            f"DSA: the engine caches the indexer key beside the latent row: {dsa.cache_bytes} B per token per layer "
            f"(vLLM: {dsa.head_dim} fp8 values + one fp32 scale per {INDEXER_QUANT_BLOCK}), whole on every TP rank")


def shape_from_config(cfg: dict, name: str = "model") -> ModelShape:
    """A ModelShape from an HF config dict, through the architecture's training adapter; ValueError naming the
    architecture when nothing reads it."""
    from megatron_sparse_rl.models import ADAPTERS, get_adapter

    archs = cfg.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(f"{name}: config must name exactly one architecture (got {archs!r})")
    if archs[0] not in ADAPTERS:
        raise ValueError(f"{name}: architecture {archs[0]!r} is not supported by the planner; supported: "
                         f"{', '.join(sorted(ADAPTERS))}")
    return _from_spec(name, get_adapter(cfg).spec_from_hf(cfg))


class _NonFinite(ValueError):
    pass


def _no_constant(name: str):
    """json's hook for the non-standard NaN / Infinity / -Infinity: a size is never one."""
    raise _NonFinite(f"{name} is not a number a model config may hold (sizes must be finite)")


def load_shape(model: str) -> ModelShape:
    """`model`: a bundled name (see bundled_models()), a model directory or a config.json path."""
    bundled = ASSETS / f"{model}.json"
    path = bundled if bundled.is_file() else Path(model)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"model {model!r} is neither a bundled config ({', '.join(bundled_models())}) "
                         "nor a model directory / config.json")
    try:
        cfg = json.loads(file.read_text(), parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    except _NonFinite as e:
        raise ValueError(f"{file}: {e}") from None
    return shape_from_config(cfg, model if bundled.is_file() else str(file))

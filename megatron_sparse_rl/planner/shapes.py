"""`ModelShape`: the parameter groups and cache sizes the planner needs, read from a Hugging Face config.

    shape = load_shape("kimi-k2")                   # a bundled config (assets/model_configs/<name>.json)
    shape = load_shape("/models/Qwen3-30B-A3B")     # a model directory or a config.json path
    shape.total_params(), shape.active_params()

Architectures with a training adapter (models/) are read through it (`get_adapter(cfg).spec_from_hf`).
`DeepseekV3ForCausalLM` (DeepSeek-V3, Kimi-K2) has no adapter yet; it is read here: MLA attention
(q/kv low-rank projections, a cached latent of kv_lora_rank + qk_rope_head_dim per token), shared experts,
the first `first_k_dense_replace` layers dense. Multi-token-prediction layers are left out of the totals,
as in the published counts (DeepSeek-V3: 671B main model + 14B MTP module).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "model_configs"


def bundled_models() -> list[str]:
    return sorted(p.stem for p in ASSETS.glob("*.json"))


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

    @property
    def n_moe(self) -> int:
        return sum(self.moe_layers)

    @property
    def n_dense(self) -> int:
        return self.layers - self.n_moe

    def total_params(self) -> int:
        moe = self.num_experts * self.expert_params + self.shared_params + self.router_params
        return (self.layers * self.attn_params + self.n_dense * self.dense_mlp_params + self.n_moe * moe
                + self.embed_params + self.head_params + self.hidden)

    def expert_total(self) -> int:
        """Routed-expert parameters (sharded by EP); everything else is 'dense' (sharded by TP)."""
        return self.n_moe * self.num_experts * self.expert_params

    def active_params(self) -> int:
        """Parameters one token passes through (top-k routed experts + shared + dense parts)."""
        return self.total_params() - self.n_moe * (self.num_experts - self.topk) * self.expert_params


def _from_spec(name: str, spec) -> ModelShape:
    h, hd = spec.hidden_size, spec.head_dim
    attn = h * hd * (2 * spec.num_heads + 2 * spec.num_kv_heads) + 2 * h
    attn += hd * (spec.num_heads + 2 * spec.num_kv_heads) if spec.qkv_bias else 0
    attn += 2 * hd if spec.qk_norm else 0
    return ModelShape(
        name=name, architecture=spec.architecture, hidden=h, layers=spec.num_layers, vocab=spec.vocab_size,
        heads=spec.num_heads, attn_params=attn, dense_mlp_params=3 * h * spec.ffn_hidden_size,
        expert_params=3 * h * spec.moe_ffn_hidden_size, shared_params=3 * h * spec.shared_expert_ffn_hidden_size,
        router_params=spec.num_experts * h, num_experts=spec.num_experts, topk=spec.moe_topk,
        moe_layers=tuple(spec.moe_layers), embed_params=spec.vocab_size * h,
        head_params=0 if spec.tie_embeddings else spec.vocab_size * h,
        kv_elems=2 * spec.num_kv_heads * hd, kv_heads=spec.num_kv_heads,
        act_attn=hd * (spec.num_heads * 2 + spec.num_kv_heads * 2), ffn=spec.ffn_hidden_size,
        moe_ffn=spec.moe_ffn_hidden_size, shared_ffn=spec.shared_expert_ffn_hidden_size,
    )


def _deepseek_v3(name: str, cfg: dict) -> ModelShape:
    h, heads, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    nope, rope, vdim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    q = (h * q_lora + q_lora + q_lora * heads * (nope + rope)) if q_lora else h * heads * (nope + rope)
    kv = h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + vdim)
    attn = q + kv + heads * vdim * h + 2 * h
    experts, moe_ffn = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    first_dense, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    moe_layers = tuple(i >= first_dense and i % freq == 0 for i in range(L))
    bias = experts if cfg.get("topk_method") == "noaux_tc" else 0  # e_score_correction_bias
    shared = cfg.get("n_shared_experts") or 0
    mtp = cfg.get("num_nextn_predict_layers") or 0
    notes = (f"{mtp} multi-token-prediction layer(s) not counted (as in the published total)",) if mtp else ()
    return ModelShape(
        name=name, architecture=cfg["architectures"][0], hidden=h, layers=L, vocab=cfg["vocab_size"], heads=heads,
        attn_params=attn, dense_mlp_params=3 * h * cfg["intermediate_size"], expert_params=3 * h * moe_ffn,
        shared_params=shared * 3 * h * moe_ffn, router_params=experts * h + bias, num_experts=experts,
        topk=cfg["num_experts_per_tok"], moe_layers=moe_layers, embed_params=cfg["vocab_size"] * h,
        head_params=0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * h,
        kv_elems=kv_lora + rope, kv_heads=0,
        act_attn=(q_lora or 0) + kv_lora + rope + heads * (2 * (nope + rope) + 2 * vdim),
        ffn=cfg["intermediate_size"], moe_ffn=moe_ffn, shared_ffn=shared * moe_ffn,
        notes=notes + ("MLA: the KV cache holds the latent (kv_lora_rank + qk_rope_head_dim) per token per layer",),
    )


READERS = {"DeepseekV3ForCausalLM": _deepseek_v3}


def shape_from_config(cfg: dict, name: str = "model") -> ModelShape:
    """A ModelShape from an HF config dict; ValueError naming the architecture when it cannot be read."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(f"{name}: config must name exactly one architecture (got {archs!r})")
    if archs[0] in READERS:
        return READERS[archs[0]](name, cfg)
    from megatron_sparse_rl.models import ADAPTERS, get_adapter

    if archs[0] not in ADAPTERS:
        raise ValueError(f"{name}: architecture {archs[0]!r} is not supported by the planner; supported: "
                         f"{', '.join(sorted(set(ADAPTERS) | set(READERS)))}")
    return _from_spec(name, get_adapter(cfg).spec_from_hf(cfg))


def load_shape(model: str) -> ModelShape:
    """`model`: a bundled name (see bundled_models()), a model directory or a config.json path."""
    bundled = ASSETS / f"{model}.json"
    path = bundled if bundled.is_file() else Path(model)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"model {model!r} is neither a bundled config ({', '.join(bundled_models())}) "
                         "nor a model directory / config.json")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    return shape_from_config(cfg, model if bundled.is_file() else str(file))

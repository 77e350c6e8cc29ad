"""`ModelSpec`: the architecture facts the project needs, read from a Hugging Face `config.json`.

Adapters fill it from their family's config keys; everything downstream (TransformerConfig, name maps,
layout checks, the planner) reads this one object.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    """Per layer: True where the MLP is a routed-expert MoE layer."""
    shared_expert_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = False
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.moe_layers)

    def kv_values_per_rank(self, tp: int) -> int:
        """KV-cache values one token takes per layer on one rank of a `tp`-way engine: K and V of that rank's KV
        heads (a head is replicated when there are fewer heads than ranks)."""
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim

    def parameter_count(self) -> int:
        """Total parameters (all experts), computed from the shapes."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        dense_mlp = 3 * h * self.ffn_hidden_size
        moe_mlp = self.num_experts * 3 * h * self.moe_ffn_hidden_size + self.num_experts * h
        moe_mlp += 3 * h * self.shared_expert_ffn_hidden_size
        total = 0
        for is_moe in self.moe_layers:
            total += attn + 2 * h + (moe_mlp if is_moe else dense_mlp)
        total += self.vocab_size * h * (1 if self.tie_embeddings else 2) + h
        return total


def read_hf_config(path: str | Path) -> dict:
    """Read `config.json` from a model directory (or the file itself) with a clear error."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no Hugging Face config.json at {str(file)!r}")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: "[[[[..." nesting
        raise ValueError(f"{file}: not valid JSON ({e})") from None


def rope_theta_of(cfg: dict) -> float:
    """rope theta from either the transformers 5 `rope_parameters` block or the older top-level key."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise NotImplementedError(f"rope type {params.get('rope_type')!r} is not supported yet (only default RoPE)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))

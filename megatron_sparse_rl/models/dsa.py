"""DeepSeek Sparse Attention adapters: DeepSeek-V3.2 (`DeepseekV32ForCausalLM`, model_type deepseek_v32) and GLM-5
(`GlmMoeDsaForCausalLM`, model_type glm_moe_dsa).

Both are the DeepSeek-V3 architecture (models/deepseek.py: MLA, shared experts, first-k dense layers, sigmoid router
with correction bias) plus a lightning indexer in every layer: `index_n_heads` query heads of `index_head_dim`
(wq_b from the q latent), one key per token (wk, then a LayerNorm k_norm), per-head weights (weights_proj); each
query attends to the `index_topk` earlier tokens of highest score sum_h w_h relu(q_h . k). Megatron side:
`MLATransformerConfig` with `experimental_attention_variant="dsa"` and `dsa_indexer_*`, and the layer spec of
models/dsa_layers.py. The indexer's Hadamard rotation needs `patches/megatron_dsa_hadamard.py` on CPU.

The indexer's rope dims (`qk_rope_head_dim` of the `index_head_dim`, position from the model's rotary embedding):
transformers keeps them FIRST in each head; Megatron's DSAIndexer keeps them LAST and, with MLA, reads them
interleaved (rope_utils de-interleaves x[0::2], x[1::2] and rotates half-split). GLM-5's indexer is interleaved in
transformers too, so only the block moves; DeepSeek-V3.2's is half-split (dims i and i + rope/2 pair), so the
tensor map also interleaves the halves. `indexer_row_order` is that permutation; it is applied to the rows of wq_b
(per head), wk, and k_norm's weight and bias. Dot products, the LayerNorm and the Hadamard rotation (orthogonal) are
indifferent to it, so the scores are the same function; the map is exact both ways (tensor kind "rows").

Refused: GLM-5.2's shared index layers (`indexer_types` with "shared", `index_topk_pattern`, `index_topk_freq` > 1):
Megatron-Core 0.16.1's DSA runs an indexer in every layer; and configs without q_lora_rank (the indexer reads the q
latent). The indexer's own training loss (Megatron's KL loss, `dsa_indexer_loss_coeff`) is 0.0 here, i.e. off; the
learner turns it on from `model.dsa_indexer_loss_coeff` (learner/dsa_indexer_loss.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from megatron_sparse_rl.models.deepseek import DeepseekSpec, DeepseekV3Adapter
from megatron_sparse_rl.models.mixtral import check_family
from megatron_sparse_rl.models.tensor_map import TensorMap

INDEXER_KEYS = ("index_n_heads", "index_head_dim", "index_topk")


@dataclass(frozen=True)
class DsaSpec(DeepseekSpec):
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_rope_interleaved: bool = False
    """True where the HF indexer rotates its rope dims as interleaved pairs (GLM-5), False for half-split
    (DeepSeek-V3.2)."""

    @property
    def indexer_params(self) -> int:
        """One layer's indexer: wq_b, wk, k_norm (weight and bias), weights_proj."""
        return (self.q_lora_rank * self.index_n_heads * self.index_head_dim + self.hidden_size * self.index_head_dim
                + 2 * self.index_head_dim + self.hidden_size * self.index_n_heads)

    def parameter_count(self) -> int:
        return super().parameter_count() + self.num_layers * self.indexer_params


def indexer_loss_problem(spec, coeff: float) -> str | None:
    """Why `model.dsa_indexer_loss_coeff = coeff` cannot run on `spec`'s model (a coefficient > 0 on a model without
    an indexer), or None; `msrl validate` and the learner ask the same."""
    if coeff == 0 or isinstance(spec, DsaSpec):
        return None
    return (f"model.dsa_indexer_loss_coeff = {coeff} trains a DeepSeek Sparse Attention indexer, but "
            f"{spec.architecture} has none (DSA models: DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM); set it to 0")


def indexer_row_order(head_dim: int, rope: int, heads: int, interleaved: bool) -> tuple[int, ...]:
    """The HF row of each Megatron row of a `heads` x `head_dim` indexer projection: per head, Megatron's
    [nope | rope] from HF's [rope | nope], the rope dims interleaved from HF's two halves unless HF's already are."""
    half = rope // 2
    rope_rows = list(range(rope)) if interleaved else [r for i in range(half) for r in (i, half + i)]
    one = [rope + j for j in range(head_dim - rope)] + rope_rows
    return tuple(h * head_dim + r for h in range(heads) for r in one)


def _positive(cfg: dict, key: str, arch: str) -> int:
    value = cfg.get(key)
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"config.json {key} must be a positive integer for {arch} (got {value!r})")
    return value


class DeepseekV32Adapter(DeepseekV3Adapter):
    architecture = "DeepseekV32ForCausalLM"
    model_type = "deepseek_v32"
    indexer_rope_interleaved = False

    def spec_from_hf(self, cfg: dict) -> DsaSpec:
        arch = self.architecture
        check_family(cfg, arch, self.model_type, INDEXER_KEYS)
        self._check_layer_types(cfg)
        base = DeepseekV3Adapter().spec_from_hf({**cfg, "architectures": [DeepseekV3Adapter.architecture],
                                                 "model_type": "deepseek_v3"})
        heads, dim, topk = (_positive(cfg, k, arch) for k in INDEXER_KEYS)
        if base.q_lora_rank is None:
            raise NotImplementedError(f"{arch} without q_lora_rank is not supported: the DSA indexer reads the q "
                                      "latent")
        rope = base.qk_rope_head_dim
        if dim <= rope or dim & (dim - 1):
            raise ValueError(f"config.json index_head_dim must be a power of two (the Hadamard rotation) above "
                             f"qk_rope_head_dim {rope} (got {dim})")
        self._check_mlp_types(cfg, base.moe_layers)
        values = {f.name: getattr(base, f.name) for f in fields(base)}
        return DsaSpec(**{**values, "architecture": arch}, index_n_heads=heads, index_head_dim=dim, index_topk=topk,
                       indexer_rope_interleaved=self.indexer_rope_interleaved)

    def _check_layer_types(self, cfg: dict) -> None:
        """NotImplementedError naming the key when a layer would not run its own indexer (GLM-5.2's sharing)."""
        kinds = cfg.get("layer_types")
        if kinds is not None and any(k != "indexed_attention" for k in kinds):
            raise NotImplementedError(f"config.json layer_types other than 'indexed_attention' are not supported "
                                      f"for {self.architecture} (got {sorted(set(kinds))})")

    def _check_mlp_types(self, cfg: dict, moe_layers: tuple[bool, ...]) -> None:
        kinds = cfg.get("mlp_layer_types")
        if kinds is not None and list(kinds) != ["sparse" if m else "dense" for m in moe_layers]:
            raise NotImplementedError(f"config.json mlp_layer_types {kinds} is not supported: the adapter builds "
                                      f"first_k_dense_replace ({cfg.get('first_k_dense_replace')}) dense layers, "
                                      "then MoE layers")

    # ---- Megatron side -------------------------------------------------------------------------
    def transformer_config(self, spec: DsaSpec, **kw: Any):
        """The parent's config; `context_parallel_size` > 1 is set after it is built: Megatron-Core's
        `TransformerConfig.__post_init__` asserts cp == 1 for DSA, as its `DSAttention` sees only a rank's own
        positions. At cp > 1 the layers are `SDPADSAttention` with `ContextParallelIndexer` (models/dsa_context.py),
        which gather every rank's keys; learner/model.py refuses the local kernels there."""
        cp = kw.pop("context_parallel_size", 1)
        config = super().transformer_config(spec, **kw)
        config.context_parallel_size = cp
        return config

    def config_kwargs(self, spec: DsaSpec, **kw: Any) -> dict[str, Any]:
        kwargs = super().config_kwargs(spec, **kw)
        kwargs.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=spec.index_n_heads,
                      dsa_indexer_head_dim=spec.index_head_dim, dsa_indexer_topk=spec.index_topk,
                      dsa_indexer_loss_coeff=0.0, dsa_indexer_use_sparse_loss=False)
        return kwargs

    def layer_spec(self, config, use_te: bool, vp_stage: int | None = None):
        """The local DSA spec on every machine (models/dsa_layers.py says why TE's would differ)."""
        from megatron_sparse_rl.models.dsa_layers import dsa_block_spec

        return dsa_block_spec(config, vp_stage)

    # ---- name map ------------------------------------------------------------------------------
    def _attention_maps(self, spec: DsaSpec, hf: str, mc: str) -> list[TensorMap]:
        ix, mx = f"{hf}.self_attn.indexer", f"{mc}.self_attention.core_attention.indexer"
        d, heads, h = spec.index_head_dim, spec.index_n_heads, spec.hidden_size
        one, every = (indexer_row_order(d, spec.qk_rope_head_dim, n, spec.indexer_rope_interleaved) for n in (1, heads))
        return super()._attention_maps(spec, hf, mc) + [
            TensorMap(f"{mx}.linear_wq_b.weight", (f"{ix}.wq_b.weight",), "rows",
                      shapes=((heads * d, spec.q_lora_rank),), rows=every),
            TensorMap(f"{mx}.linear_wk.weight", (f"{ix}.wk.weight",), "rows", shapes=((d, h),), rows=one),
            TensorMap(f"{mx}.k_norm.weight", (f"{ix}.k_norm.weight",), "rows", shapes=((d,),), rows=one),
            TensorMap(f"{mx}.k_norm.bias", (f"{ix}.k_norm.bias",), "rows", shapes=((d,),), rows=one),
            TensorMap(f"{mx}.linear_weights_proj.weight", (f"{ix}.weights_proj.weight",), shapes=((heads, h),)),
        ]


class GlmMoeDsaAdapter(DeepseekV32Adapter):
    """GLM-5: DeepSeek-V3.2's adapter with an interleaved-rope indexer, and `indexer_types` (every layer 'full')."""

    architecture = "GlmMoeDsaForCausalLM"
    model_type = "glm_moe_dsa"
    indexer_rope_interleaved = True

    def _check_layer_types(self, cfg: dict) -> None:
        super()._check_layer_types(cfg)
        shared = [i for i, kind in enumerate(indexer_types(cfg, cfg.get("num_hidden_layers") or 0)) if kind != "full"]
        if shared:
            raise NotImplementedError(f"{self.architecture}: layers {shared[:8]} reuse another layer's top-k (GLM-5.2 "
                                      "index sharing: indexer_types / index_topk_pattern / index_topk_freq): not "
                                      "supported, as Megatron-Core 0.16.1's DSA runs an indexer in every layer")


def indexer_types(cfg: dict, layers: int) -> list[str]:
    """Per layer 'full' (runs the indexer) or 'shared' (reuses a full layer's top-k), as transformers'
    GlmMoeDsaConfig derives them: indexer_types, else index_topk_pattern ('F'/'S'), else index_topk_freq (1) and
    index_skip_topk_offset (2). GLM-5 has none of these keys: every layer is 'full'."""
    if cfg.get("indexer_types") is not None:
        return list(cfg["indexer_types"])
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(cfg.get("index_topk_freq") or 1, 1), cfg.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]

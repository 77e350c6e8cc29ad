"""The Megatron-Core 0.16.1 layer spec of a DeepSeek Sparse Attention model (DeepSeek-V3.2, GLM-5): MLA whose core
attention is Megatron's `DSAttention` with its lightning indexer `DSAIndexer`
(`megatron/core/transformer/experimental_attention_variant/dsa.py`).

Why this module builds the spec instead of calling Megatron's `get_dsa_module_spec_for_backend`:
- that helper wants a backend with `linear()` (the indexer's three projections are built `parallel_mode=
  "duplicated"`, a Transformer Engine `TELinear` argument); the local backend has none. `IndexerLinear` is the
  local stand-in: a plain bias-free linear, whole on every TP rank (no `tensor_model_parallel` attribute), that
  takes TELinear's arguments and returns `(output, None)` as Megatron's linears do;
- with Transformer Engine it fuses the q latent norm into `linear_q_up_proj` (`q_layernorm` is IdentityOp), so the
  `qr` MLA hands to the indexer is the q latent BEFORE its RMSNorm, while DeepSeek's reference and transformers
  feed the normalised latent (`q_a_layernorm(q_a_proj(x))`). The local MLA spec keeps `q_layernorm` separate and
  hands over the normalised latent (multi_latent_attention.py, "Apply norm" before the up projections). So the
  DSA layer spec is the local one on every machine, GPU included;
- Megatron builds the indexer's key norm as `torch.nn.LayerNorm` through `WrappedTorchNorm` with eps =
  `layernorm_epsilon` (the model's rms_norm_eps), which asserts `not sequence_parallel`; DeepSeek's reference,
  transformers and vLLM use eps 1e-6 whatever rms_norm_eps (GLM-5: 1e-5). `IndexerKeyNorm` is that LayerNorm
  with eps `INDEXER_KEY_NORM_EPS` and no sequence-parallel assertion (the indexer gathers its input first).

`dsa_indexer_loss_coeff` must be a number (Megatron multiplies by it whenever it trains); the adapter sets 0.0, the
learner `model.dsa_indexer_loss_coeff` (learner/dsa_indexer_loss.py).
"""
from __future__ import annotations

import torch

INDEXER_KEY_NORM_EPS = 1e-6
"""The indexer key LayerNorm's eps in DeepSeek-V3.2's reference, transformers' DeepseekV32Indexer and vLLM."""


class IndexerLinear(torch.nn.Module):
    """A bias-free linear layer held whole on every tensor-parallel rank (Megatron's `parallel_mode="duplicated"`),
    with the constructor of Megatron's TELinear as `DSAIndexer` calls it; forward returns `(x @ W^T, None)`."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool, skip_bias_add: bool,
                 skip_weight_param_allocation: bool, parallel_mode: str | None = None, **_):
        super().__init__()
        if bias or skip_weight_param_allocation or parallel_mode != "duplicated":
            raise ValueError(f"IndexerLinear is the DSA indexer's duplicated bias-free projection (got bias={bias}, "
                             f"skip_weight_param_allocation={skip_weight_param_allocation}, "
                             f"parallel_mode={parallel_mode!r})")
        device = None if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x: torch.Tensor):
        return torch.nn.functional.linear(x, self.weight), None


class IndexerKeyNorm(torch.nn.LayerNorm):
    """The indexer key's LayerNorm (weight and bias) with eps `INDEXER_KEY_NORM_EPS` (module docstring)."""

    def __init__(self, config, hidden_size: int, eps: float = INDEXER_KEY_NORM_EPS, **_):
        super().__init__(hidden_size, eps=INDEXER_KEY_NORM_EPS, dtype=config.params_dtype)


def dsa_block_spec(config, vp_stage: int | None = None):
    """The local GPT decoder block spec of `config` (MLA, MoE pattern from moe_layer_freq) with every layer's core
    attention replaced by DSAttention + DSAIndexer (models/dsa_context.py's `ContextParallelIndexer`: Megatron's at
    cp 1) built from `IndexerLinear` and `IndexerKeyNorm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerSubmodules,
        DSAttention,
        DSAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_sparse_rl.models.dsa_context import ContextParallelIndexer

    if config.experimental_attention_variant != "dsa" or not config.multi_latent_attention:
        raise ValueError("dsa_block_spec needs an MLA config with experimental_attention_variant 'dsa'")
    indexer = ModuleSpec(module=ContextParallelIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=IndexerLinear, linear_wk=IndexerLinear, k_norm=IndexerKeyNorm, linear_weights_proj=IndexerLinear))
    core = ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer))
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage)
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = core
    return block

"""The learner's kernel choice (`learner.kernels`): which modules compute routed experts and core attention in the
Megatron-Core layer spec the model adapter builds.

    local   Megatron-Core 0.16.1's local spec: `SequentialMLP` (a Python loop over experts, one host sync on the
            token counts) and `DotProductAttention` (a materialised s x s softmax).
    fast    `GroupedExperts` (models/grouped_experts.py: two `torch._grouped_mm` calls) and `SDPAttention`
            (models/sdpa_attention.py: `scaled_dot_product_attention`); DSA layers' `DSAttention` becomes
            `SDPADSAttention` (models/dsa_attention.py: its sparse attention in one SDPA call); on CUDA also Megatron's torch.compile'd
            SwiGLU and bias-dropout-add fusions (`bias_activation_fusion`, `bias_dropout_fusion`; never on CPU,
            where torch.compile would need a compiler and the fusions gain nothing).
    auto    the faster of the two on this machine's device (`AUTO`, from the measurements in docs/performance.md).

Both choices hold the same parameters under the same names and torch_dist keys: checkpoints (optimizer state
included), HF <-> Megatron conversion, weight sync and resume work across them. Where the spec has no such module
(a dense model has no experts), that module stays as it is.
"""
from __future__ import annotations

from typing import get_args

from megatron_sparse_rl.config.schema import KernelChoice

KERNEL_CHOICES: tuple[str, ...] = get_args(KernelChoice)

AUTO: dict[str, str] = {"cpu": "fast", "cuda": "fast"}
"""`auto` per device type. CPU: `msrl bench learner` measured fast 1.25x and 1.39x local in two runs
(docs/performance.md). CUDA: fast, pending tests/gpu/test_cuda_kernels.py (docs/gpu.md, Outstanding): the local
spec loops over experts with a host sync per MoE layer and materialises every s x s score matrix."""


def check_choice(choice: str, field: str = "learner.kernels") -> None:
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{field} must be one of {list(KERNEL_CHOICES)} (got {choice!r})")


def resolve(choice: str, device_type: str) -> str:
    """`local` or `fast` for `choice` on a `device_type` ("cpu" or "cuda") machine."""
    check_choice(choice)
    return AUTO.get(device_type, "local") if choice == "auto" else choice


def check_context_parallel(kernels: str, use_te: bool, field: str = "learner.kernels",
                           sparse_attention: bool = False) -> None:
    """ValueError when the resolved `kernels` choice cannot run context parallelism: Megatron-Core's local
    `DotProductAttention` asserts context_parallel_size == 1; `SDPAttention` (fast) all-gathers K/V over the
    context-parallel group, and Transformer Engine's attention (GPU with TE) runs its own CP. DeepSeek Sparse
    Attention layers (`sparse_attention`) run CP in `SDPADSAttention` (fast) only: Megatron's `DSAttention` (local,
    also with TE: the DSA spec is local) would attend to this rank's positions alone."""
    if kernels == "local" and sparse_attention:
        raise ValueError(f"{field} = 'local' runs Megatron-Core's DSAttention, whose indexer and sparse attention see "
                         "only this rank's positions at context parallelism (parallel.cp > 1); use 'fast' or 'auto' "
                         "(SDPADSAttention, which gathers the keys of every context-parallel rank)")
    if kernels == "local" and not use_te:
        raise ValueError(f"{field} = 'local' runs Megatron-Core's local DotProductAttention, which refuses context "
                         "parallelism (parallel.cp > 1; Megatron runs it only in Transformer Engine's attention, absent "
                         "here); use 'fast' or 'auto' (the SDPA attention, which all-gathers K/V over the "
                         "context-parallel group)")


def config_kwargs(kernels: str, cuda: bool) -> dict:
    """TransformerConfig settings of a resolved kernel choice: the fused SwiGLU / bias-dropout-add on CUDA only."""
    if kernels == "fast" and cuda:
        return {"bias_activation_fusion": True, "bias_dropout_fusion": True}
    return {}


def apply(block_spec, kernels: str, config):
    """`block_spec` (a Megatron TransformerBlockSubmodules, changed in place and returned) with the resolved
    `kernels` choice's experts and core attention; checks first that `config` is one they compute."""
    if kernels == "local":
        return block_spec
    if kernels != "fast":
        raise ValueError(f"kernel choice {kernels!r} is not resolved (local or fast)")
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_sparse_rl.models.dsa_attention import SDPADSAttention
    from megatron_sparse_rl.models.grouped_experts import GroupedExperts, check_grouped_config
    from megatron_sparse_rl.models.sdpa_attention import SDPAttention, check_sdpa_config

    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        core = attention.core_attention
        if core is DotProductAttention:
            check_sdpa_config(config)
            attention.core_attention = SDPAttention
        elif getattr(core, "module", None) is DSAttention:  # a ModuleSpec with the indexer (models/dsa_layers.py)
            core.module = SDPADSAttention
        experts = getattr(getattr(layer.submodules.mlp, "submodules", None), "experts", None)
        if experts is not None and experts.module is SequentialMLP:
            check_grouped_config(config)
            experts.module = GroupedExperts
    return block_spec

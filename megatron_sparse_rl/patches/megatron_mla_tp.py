"""The gradient of multi-latent attention's shared RoPE key at tensor parallel > 1, on Megatron-Core 0.16.1's local
(torch) MLA spec, where `linear_kv_down_proj` is a `ColumnParallelLinear` (the spec every DeepSeek-V3 / Kimi-K2
learner uses without Transformer Engine, and every DeepSeek Sparse Attention learner: models/dsa_layers.py).

Upstream bug (NVIDIA/Megatron-LM issue #1699, open; fix proposed in PR #6839): `MLASelfAttention.
get_query_key_value_tensors` all-gathers the column-parallel down projection's shards with
`gather_from_tensor_model_parallel_region`, whose backward only takes this rank's slice of the gradient. The latent
part's gradient is already whole (the column-parallel up projection all-reduces its input's gradient), but the
decoupled RoPE key `k_pos_emb`, one per token and shared by every head, is expanded over this rank's heads only, so
its gradient is this rank's heads' share and the other ranks' shares are dropped. Every gradient upstream of
`linear_kv_down_proj` (the down projection itself, the input norm, earlier layers, the embedding) came out 10-36%
off HF transformers at tp 2, with or without sequence parallelism; logprobs were right.

The fix: a forward hook on each such `linear_kv_down_proj` hands MLA the gathered `[.., kv_lora_rank + rope]`
output, so MLA takes its branch for a whole (duplicated) down projection, and gives the RoPE key a backward that
sums over the tensor-parallel ranks:
- sequence parallel on: the output is scattered back to this rank's sequence chunk; that branch then all-gathers
  `k_pos_emb` over the sequence, whose backward reduce-scatters (sums over the ranks);
- sequence parallel off: the RoPE columns pass through an identity whose backward all-reduces (`_SumGradOverGroup`;
  Megatron's `copy_to_tensor_model_parallel_region` would leave this non-contiguous gradient unreduced); that
  branch adds nothing.
The latent's path is unchanged (the same values and gradients as upstream's gather-then-scatter). Megatron's
Transformer Engine spec (a duplicated `TELinear`) is left alone: no hook is attached to it.

`apply()` checks the Megatron version and is idempotent; `megatron_cpu.apply()` calls it on every machine.
Tested by tests/distributed/test_deepseek.py::test_learner_tp2_gradients_match_transformers.
"""
from __future__ import annotations

import functools

import torch

MEGATRON_VERSION = "0.16.1"
_APPLIED: set[str] = set()


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over `group`. Not Megatron's
    `copy_to_tensor_model_parallel_region`: its backward all-reduces `grad.contiguous()` and returns `grad`, so a
    non-contiguous gradient (this one is a slice of the concatenation's) comes back unreduced."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _whole_kv_latent(module, args, output):
    """Forward hook of a column-parallel `linear_kv_down_proj` (module docstring)."""
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    shard, bias = output
    group = module.tp_group
    whole = gather_from_tensor_model_parallel_region(shard, group=group)
    if module.sequence_parallel:
        return scatter_to_sequence_parallel_region(whole, group=group), bias
    rope = module.config.qk_pos_emb_head_dim
    latent, k_pos_emb = torch.split(whole, [whole.size(-1) - rope, rope], dim=-1)
    return torch.cat([latent, _SumGradOverGroup.apply(k_pos_emb, group)], dim=-1), bias


def _attach(attention) -> None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    down = attention.linear_kv_down_proj
    if type(down) is ColumnParallelLinear and down.tp_group.size() > 1:
        down.register_forward_hook(_whole_kv_latent)


def apply() -> None:
    """Attach the hook to every MLASelfAttention built from now on (idempotent)."""
    import megatron.core
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if megatron.core.__version__ != MEGATRON_VERSION:
        raise RuntimeError(f"megatron_sparse_rl's MLA tensor-parallel fix was written for megatron-core "
                           f"{MEGATRON_VERSION}, found {megatron.core.__version__}; install "
                           f"megatron-core=={MEGATRON_VERSION}")
    if "kv_rope_grad" in _APPLIED:
        return
    original = MLASelfAttention.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _attach(self)

    MLASelfAttention.__init__ = __init__
    _APPLIED.add("kv_rope_grad")

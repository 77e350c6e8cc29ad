"""`GroupedExperts`: Megatron's `SequentialMLP` with its per-expert Python loop replaced by two grouped GEMMs
(`torch._grouped_mm`), the `fast` choice of `learner.kernels` (models/kernels.py).

What stays Megatron's: the expert modules themselves. Each local expert is still the `MLP` that `SequentialMLP`
builds (`local_experts.{i}.linear_fc1.weight` [2F/etp, H], `linear_fc2.weight` [H, F/etp], expert-TP shards
under expert tensor parallelism), so the parameter names, the torch_dist keys (`SequentialMLP.sharded_state_dict`),
the HF <-> Megatron name maps, the weight sync, the expert-DP gradient marking and the optimizer state are the
same under both kernel choices: a checkpoint saved under one loads under the other, optimizer state included,
with no conversion. The token dispatcher (expert parallelism, expert-TP all-gathers) is untouched.

What changes is the forward: the local experts' weights are stacked ([E, H, 2F] and [E, F, H], one copy per
forward, whose gradient is split back to each expert's weight by autograd) and the permuted tokens (grouped by
expert, `tokens_per_expert` rows each) go through

    h = grouped_mm(x, W1^T, offs)          # [tokens, 2F/etp]
    h = silu(gate) * up, scaled by the routing probability (MLP.forward's order and dtypes)
    y = grouped_mm(h, W2^T, offs)          # [tokens, H]

with `offs` = the cumulative token counts, an int32 tensor on the device: no `tokens_per_expert.tolist()` host
sync, no per-expert kernel launches. On CPU `torch._grouped_mm` is bit-identical to the per-expert matmul loop
in fp32 and bf16, forward and backward, empty experts included (tests/distributed/test_fast_kernels.py); on an
sm90 GPU it is CUTLASS's grouped GEMM (bf16).

Memory: the stacked weights are saved for the backward, one extra copy of the layer's local expert weights per
micro-batch in flight (activation recompute drops it with the rest). Efficiency: a grouped GEMM is as good as its
groups are large; tokens per local expert = micro-batch tokens x topk / experts (docs/performance.md).
"""
from __future__ import annotations

import torch

_ALIGN_BYTES = 16
"""`torch._grouped_mm` needs every row stride of its operands to be a multiple of 16 bytes."""


def _sequential_mlp():
    from megatron.core.transformer.moe.experts import SequentialMLP

    return SequentialMLP


def check_grouped_config(config) -> None:
    """ValueError naming the setting when `config`'s experts are not what `GroupedExperts` computes."""
    if not hasattr(torch, "_grouped_mm"):
        raise ImportError(f"learner.kernels: fast (grouped-GEMM experts) needs torch._grouped_mm, which torch "
                          f"{torch.__version__} lacks; install torch >= 2.8 or use learner.kernels: local")
    problems = []
    if config.add_bias_linear:
        problems.append("expert linear biases (add_bias_linear)")
    if not config.gated_linear_unit:
        problems.append("a non-gated expert MLP (gated_linear_unit false)")
    if config.fp8 or getattr(config, "fp4", None):
        problems.append("fp8/fp4 experts")
    if config.use_te_activation_func:
        problems.append("use_te_activation_func")
    if config.moe_apply_probs_on_input:
        problems.append("moe_apply_probs_on_input")
    element = torch.empty((), dtype=config.params_dtype).element_size()
    etp = config.expert_tensor_parallel_size or 1
    for name, width in (("hidden size", config.hidden_size),
                        ("expert FFN size / expert TP", config.moe_ffn_hidden_size // etp)):
        if width * element % _ALIGN_BYTES:
            problems.append(f"{name} {width} (x {element} bytes is not a multiple of {_ALIGN_BYTES}, which "
                            f"torch._grouped_mm needs)")
    if problems:
        raise ValueError("learner.kernels: fast runs routed experts as grouped GEMMs, which do not support "
                         f"{'; '.join(problems)}; use learner.kernels: local")


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: `torch._grouped_mm`'s backward refuses an expanded one
    (stride 0, e.g. the gradient of a `.sum()`)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_mm(x: torch.Tensor, weights: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _DenseGrad.apply(torch._grouped_mm(x.contiguous(), weights, offs=offs))


class GroupedExperts(_sequential_mlp()):
    """`SequentialMLP` (same constructor, submodules, parameters and sharded state dict) whose forward runs all
    local experts as two `torch._grouped_mm` calls (module docstring)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        check_grouped_config(config)
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)

    def _stacked(self, name: str) -> torch.Tensor:
        """[E, in, out]: the local experts' `name` weights ([out, in] each) stacked and transposed (a copy)."""
        return torch.stack([getattr(e, name).weight for e in self.local_experts]).transpose(1, 2)

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """MLP.forward's unfused gated activation and probability scaling, in its order and dtypes; on CUDA with
        Megatron's bias-activation fusion on, its fused weighted SwiGLU (models/kernels.py turns it on)."""
        config = self.config
        if config.bias_activation_fusion and h.is_cuda and config.activation_func is torch.nn.functional.silu:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), config.activation_func_fp8_input_store)
        gate, linear = torch.chunk(h, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate, linear = gate.clamp(min=None, max=clamp), linear.clamp(min=-clamp, max=clamp)
        h = config.activation_func(gate) * (linear + config.glu_linear_offset)
        return (h * probs.unsqueeze(-1)).to(h.dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        if self.num_local_experts == 1 or x.shape[0] == 0:
            # one expert is one matmul already; no tokens at all: torch._grouped_mm's backward refuses 0 rows
            return super().forward(x, tokens_per_expert, permuted_probs)
        offs = torch.as_tensor(tokens_per_expert).to(x.device, non_blocking=True).cumsum(0).to(torch.int32)
        h = self._activation(_grouped_mm(x, self._stacked("linear_fc1"), offs), permuted_probs)
        return _grouped_mm(h, self._stacked("linear_fc2"), offs), None

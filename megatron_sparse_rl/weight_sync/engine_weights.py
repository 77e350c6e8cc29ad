"""What an engine's weights are: the learner's, rounded to the engine's precision (`rollout.dtype`) and, with
`rollout.quantization: fp8`, block-quantised at every sync.

    weights = EngineWeights.of(run.rollout)                  # one per run, held by the placement
    for name, tensor in iter_hf_tensors(learner, convert=weights.sent): ...   # what a sync sends
    with weights.held_by(learner):                            # the learner holding exactly the engine's weights
        logprobs = learner.forward_logprobs(probe)            # (the probe's reference), restored on exit

FP8: every tensor `formats/fp8.py` names quantisable (the 2-D attention and MLP/expert weights of a release
checkpoint; not embeddings, lm_head, norms or routers) is quantised to float8_e4m3fn with 128x128 block scales, the
format of DeepSeek-V3 and Qwen3 FP8 releases (weights only; activations are not quantised), and the engine computes
with the dequantised values of exactly those FP8 weights, sent in the engine's dtype (`rollout.dtype`) like every
other weight. vLLM's FP8 kernels are not used: on this CPU
they need AMX (docs/routing_stability.md, "Low-precision rollouts").

The engine's precision: a bf16 engine holds the learner's weights rounded to bf16 (the sync sends them so), and
computes in bf16. `held_by` rounds the learner's weights the same way but the learner still computes in its own
dtype, so the probe's remaining difference is the engine's arithmetic, which `sync_tolerance` allows for.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from megatron_sparse_rl.formats.fp8 import RELEASE_BLOCK, BlockFp8, fp8_quantizable

Convert = Callable[[str, torch.Tensor], torch.Tensor]
"""(HF name, full tensor) -> the tensor to use instead (same shape and dtype)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class EngineWeights:
    """The engines' precision and weight format; the default is an fp32 engine holding the learner's weights."""

    dtype: torch.dtype = torch.float32
    """What the engine computes in and holds its weights as (rollout.dtype)."""
    fp8: BlockFp8 | None = None
    """The block FP8 format the sync quantises to (rollout.quantization: fp8), or None."""

    @classmethod
    def of(cls, rollout) -> EngineWeights:
        """From a `RolloutConfig`."""
        fp8 = BlockFp8(block=RELEASE_BLOCK) if rollout.quantization == "fp8" else None
        return cls(dtype=DTYPES[rollout.dtype], fp8=fp8)

    @property
    def quantized(self) -> bool:
        return self.fp8 is not None

    def sent(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What a sync sends for HF tensor `name`: its FP8 round trip when quantised, in the engine's dtype (the
        engine would cast it to that on loading anyway; sending it so halves a bf16 engine's bytes)."""
        if self.fp8 is not None and fp8_quantizable(name, tuple(tensor.shape)):
            tensor = self.fp8.quant_dequant(name, tensor)
        return tensor.to(self.dtype)

    def held(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The value the engine holds for `name`, in `tensor`'s dtype."""
        return self.sent(name, tensor).to(tensor.dtype)

    @property
    def convert(self) -> Convert | None:
        """The sync's conversion (`sent`), or None when it sends the learner's fp32 tensors unchanged."""
        return None if self == EngineWeights() else self.sent

    @contextmanager
    def held_by(self, learner) -> Iterator[None]:
        """Within the block, the learner's parameters are the engine's weights (`held`), converted in HF form and
        loaded back into this rank's shards; on exit the exact previous values are restored. Every learner rank
        enters it (the full tensors are gathered: collectives). Costs one copy of this rank's parameters.

        A LoRA learner (model.lora): the engine holds each adapted weight merged (W + scale x B A, rounded as
        `held`), so the base takes those values and its adapters are off within the block (lora/layers.py
        `adapters_off`); on exit the base and the adapters are as before."""
        from megatron_sparse_rl.learner.params import load_full_tensors
        from megatron_sparse_rl.lora.layers import adapters_off
        from megatron_sparse_rl.models.tensor_map import to_hf, to_mcore
        from megatron_sparse_rl.weight_sync.export import iter_full_mcore

        saved = {name: lp.param.detach().clone() for name, lp in learner.named_full_parameters()}
        spec = learner.spec

        def engine_held():
            for tm, full in iter_full_mcore(learner):
                hf = [self.held(n, t) for n, t in zip(tm.hf, to_hf(tm, full, spec))]
                yield tm.mcore, to_mcore(tm, hf, spec)

        try:
            with torch.no_grad():
                load_full_tensors(learner.model, learner.groups, engine_held())
            with adapters_off(learner.model):  # a no-op without LoRA
                yield
        finally:
            with torch.no_grad():
                for name, lp in learner.named_full_parameters():
                    lp.param.copy_(saved[name])

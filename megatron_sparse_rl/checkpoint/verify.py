"""Forward-pass parity between a Megatron learner and HF transformers on a few tokens (`--verify`).

The learner's next-token log-probabilities (every rank takes part) are compared on rank 0 with those of
`AutoModelForCausalLM.from_pretrained(hf_dir)` in float32; a difference above the tolerance raises on
every rank. transformers reads the safetensors files only (`use_safetensors=True`), never a pickled
`pytorch_model.bin` that may sit beside them.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_sparse_rl.parallel.world import on_rank0

log = logging.getLogger(__name__)

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-1}


def hf_logprobs(hf_dir, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | <= t) from HF transformers (float32 forward, float64 softmax): [B, S-1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, use_safetensors=True)
    with torch.no_grad():
        logits = model(tokens).logits[:, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def check_forward_parity(learner, hf_dir, *, batch: int = 2, length: int = 16, seed: int = 0) -> float:
    """Max |logprob difference| Megatron vs HF on random tokens; raises ValueError above the tolerance."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, learner.spec.vocab_size, (batch, length), generator=g)
    ours = learner.forward_logprobs(tokens)["logprobs"].double()
    dtype = next(learner.model.parameters()).dtype
    tol = TOLERANCE.get(dtype, 1e-1)

    def compare():
        diff = (ours - hf_logprobs(hf_dir, tokens)).abs().max().item()
        if not diff <= tol:
            raise ValueError(f"--verify: Megatron and HF transformers log-probabilities differ by {diff:.3g} "
                             f"(> {tol:g}) on {batch}x{length} tokens")
        return diff

    diff = on_rank0(compare)
    if dist.get_rank() == 0:
        log.info("verify: max |logprob diff| Megatron vs HF = %.3g", diff)
    return diff

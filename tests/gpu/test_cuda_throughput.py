"""Learner throughput on one device (issue 37, item 5): tokens/s and model TFLOP/s of the project's own Learner
(learner/learner.py, Megatron-Core local spec, no Transformer Engine) training a Qwen3-MoE-shaped model in bf16,
and its fraction of the GPU's dense bf16 peak.

The model is built from a config.json alone (written here from models/tiny_config.py's `tiny_hf_config`, vocab
overridden), with Megatron's random init (`load=False`): no checkpoint is written or read.

cuda: hidden 1024, 16 layers, 16 query / 4 KV heads of head_dim 128 (QK-norm), every layer MoE with 32 experts of
ffn 512 and top-4 (renormalised), vocab 32768, untied embeddings:
    per layer: 2 RMSNorms 2 * 1024 + q/k norms 2 * 128 + qkv 1024 * (16 + 2 * 4) * 128 + out 16 * 128 * 1024
               + router 32 * 1024 + experts 32 * 3 * 1024 * 512                       = 55,609,600
    total  = 16 * 55,609,600 + embedding and output 2 * 32768 * 1024 + final norm 1024 = 956,863,488 (0.96 B)
    active = total - 16 * (32 - 4) * 3 * 1024 * 512                                    = 252,220,416 (0.25 B)
Batch: 8 rows x 2048 input tokens (2049-token rows: position t scores token t + 1), micro-batches of 2.
cpu: the same code at a tiny shape (hidden 64, 2 layers, 4 / 2 heads of 32, 4 experts of 64 top-2, vocab 512) and
2 rows x 64 tokens, so it runs here in well under 60 s; its figures only show the test is right.

Figures: total_params, active_params (counted on the built model, checked against the formula above), step_s
(mean wall time of a timed train step: forward + backward + optimizer, torch.cuda.synchronize around the timed
steps, after warm-up steps), tokens_per_s = rows * seq / step_s, and
    model_tflops = tokens_per_s * (6 * (active_params - vocab * hidden) + 6 * layers * seq * heads * head_dim) / 1e12
(6 FLOPs per matmul weight per token for forward + backward, the input embedding being a lookup and the norms
counted though they are no matmul (< 0.03 %); the attention term counts QK^T and AV, 4 * seq * heads * head_dim
FLOPs per token and layer forward, times 3 for forward + backward, halved for the causal mask);
peak_tflops = the GPU's dense bf16 peak by name (H100 SXM / HBM3 and H200: 989.4; any other GPU: not recorded) and
fraction_of_peak = model_tflops / peak_tflops. On cuda also peak_memory_gib (torch.cuda.max_memory_allocated).
Asserted: the losses are finite and fall over the steps on the repeated batch; no speed bound.

    .venv/bin/python -m pytest -q tests/gpu/test_cuda_throughput.py                           # cuda (needs CUDA)
    MSRL_GPU_TESTS_ON_CPU=1 .venv/bin/python -m pytest -q tests/gpu/test_cuda_throughput.py   # the cpu variant
"""
import json
import math
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import pytest
import torch

from tests.gpu.devices import run_on

WARMUP_STEPS = 2
TIMED_STEPS = 3


@dataclass(frozen=True)
class Shape:
    """A Qwen3-MoE model's shape and the batch it trains on."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    topk: int
    moe_ffn: int
    vocab: int
    rows: int
    seq: int
    micro_batch: int

    def params(self) -> tuple[int, int]:
        """(total, active) parameter counts by formula (see the module docstring)."""
        h, d = self.hidden, self.head_dim
        expert = 3 * h * self.moe_ffn
        layer = (2 * h + 2 * d + h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h
                 + self.experts * h + self.experts * expert)
        total = self.layers * layer + 2 * self.vocab * h + h
        return total, total - self.layers * (self.experts - self.topk) * expert

    def flops_per_token(self, active_params: int) -> int:
        """Model FLOPs of one trained token (forward + backward; the formula of the module docstring)."""
        return 6 * (active_params - self.vocab * self.hidden) + 6 * self.layers * self.seq * self.heads * self.head_dim


SHAPES = {
    "cuda": Shape(hidden=1024, layers=16, heads=16, kv_heads=4, head_dim=128, experts=32, topk=4, moe_ffn=512,
                  vocab=32768, rows=8, seq=2048, micro_batch=2),
    "cpu": Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=32, experts=4, topk=2, moe_ffn=64,
                 vocab=512, rows=2, seq=64, micro_batch=2),
}

DENSE_BF16_PEAK_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 SXM": 989.4}
"""Dense bf16 peak (TFLOP/s, no sparsity) by a piece of torch.cuda.get_device_name()."""


def peak_tflops(gpu_name: str) -> float | None:
    """The dense bf16 peak of the GPU called `gpu_name`, or None for a GPU not in DENSE_BF16_PEAK_TFLOPS."""
    return next((v for k, v in DENSE_BF16_PEAK_TFLOPS.items() if k in gpu_name), None)


def write_config(model_dir, shape: Shape) -> None:
    """config.json of a Qwen3-MoE model of `shape` (no weights)."""
    from megatron_sparse_rl.models.tiny_config import tiny_hf_config

    tiny = SimpleNamespace(arch="qwen3_moe", hidden=shape.hidden, layers=shape.layers, heads=shape.heads,
                           kv_heads=shape.kv_heads, head_dim=shape.head_dim, experts=shape.experts, topk=shape.topk,
                           moe_ffn=shape.moe_ffn, ffn=shape.moe_ffn, init_std=0.02)
    cfg = tiny_hf_config(tiny) | {"vocab_size": shape.vocab, "max_position_embeddings": max(2048, shape.seq)}
    (model_dir / "config.json").write_text(json.dumps(cfg))


def throughput_worker(rank, world, model_dir, shape_fields, device):
    """Build a bf16 Learner from model_dir's config.json (random init), run warm-up then timed train steps on one
    repeated random batch; returns parameter counts, losses, timed step seconds and the GPU's name and memory."""
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from tests import learner_workers as W

    shape = Shape(**shape_fields)
    learner = W.make_learner(world, model_dir, dtype="bfloat16", load=False, mbs=shape.micro_batch, lr=1e-3)
    params = dict(learner.model.module.named_parameters())
    total = sum(p.numel() for p in params.values())
    experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    active = total - experts + experts * shape.topk // shape.experts
    tokens = torch.randint(0, shape.vocab, (shape.rows, shape.seq + 1), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(shape.rows, shape.seq)
    loss_fn = make_sft_loss(mask, mask.sum().item())
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    losses = [learner.train_step(tokens, loss_fn)["loss"] for _ in range(WARMUP_STEPS)]
    sync()
    t0 = time.perf_counter()
    losses += [learner.train_step(tokens, loss_fn)["loss"] for _ in range(TIMED_STEPS)]
    sync()
    step_s = (time.perf_counter() - t0) / TIMED_STEPS
    out = {"total": total, "active": active, "losses": losses, "step_s": step_s, "gpu": None, "memory_gib": None}
    if device == "cuda":
        out.update(gpu=torch.cuda.get_device_name(), memory_gib=torch.cuda.max_memory_allocated() / 2**30)
    return out


@pytest.fixture(scope="module")
def measured(device, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("qwen3_moe_throughput")
    write_config(model_dir, SHAPES[device])
    return run_on(device, throughput_worker, (str(model_dir), asdict(SHAPES[device]), device))


def test_learner_throughput(measured, device, figure):
    shape, got = SHAPES[device], measured
    tokens_per_s = shape.rows * shape.seq / got["step_s"]
    model_tflops = tokens_per_s * shape.flops_per_token(got["active"]) / 1e12
    figure("total_params", got["total"])
    figure("active_params", got["active"])
    figure("step_s", got["step_s"], "s")
    figure("tokens_per_s", tokens_per_s, "tokens/s")
    figure("model_tflops", model_tflops, "TFLOP/s")
    peak = peak_tflops(got["gpu"]) if got["gpu"] else None
    if peak is not None:
        figure("peak_tflops", peak, "TFLOP/s")
        figure("fraction_of_peak", model_tflops / peak)
    if got["memory_gib"] is not None:
        figure("peak_memory_gib", got["memory_gib"], "GiB")
    assert (got["total"], got["active"]) == shape.params(), (got["total"], got["active"], shape.params())
    losses = got["losses"]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses

"""learner.kernels on one device: the `local` and the `fast` learner (models/kernels.py) train the same model from the
same random init; per choice and shape: tokens/s, model TFLOP/s, fraction of the GPU's dense bf16 peak, peak memory,
and a profile of two train steps (the top operators by device time, a text table per run in the results folder).

Shapes (Qwen3-MoE, the `Shape` and FLOP count of tests/gpu/test_cuda_throughput.py):
- cuda "1b": that test's 0.96 B model (hidden 1024, 16 layers, 32 experts of 512, top-4), 8 rows x 2048 tokens,
  micro-batches of 2 (512 routed tokens per expert per micro-batch), bf16;
- cuda "2b": hidden 2048, 12 layers, 16 / 4 heads of 128, 32 experts of 768, top-4 (2.07 B, 0.53 B active),
  8 rows x 4096 tokens, micro-batches of 1 (512 tokens per expert), bf16;
- cpu "tiny": hidden 64, 2 layers, 4 experts of 64 (top-2), 2 rows x 64 tokens, fp32 (so the two choices can be
  held to 1e-4); it runs in make test without a GPU (the `device` fixture here, unlike the other tests/gpu files,
  runs the cpu variant wherever CUDA is absent) and checks only that this test is right.

Per run: one warm-up step, two timed steps (torch.cuda.synchronize around them), two profiled steps. Figures per
choice: step_s, tokens_per_s, model_tflops, fraction_of_peak (H100 / H200), peak_memory_gib; per shape: speedup
(local step time / fast step time) and the max and mean |logprob fast - local| of the first forward (bf16: not
equal, reported). A run that runs out of memory records oom = 1 instead of its figures. Asserted: losses finite
and falling under both choices; on cpu the logprobs agree within 1e-4.

    MSRL_GPU_TOTAL_S=480 MSRL_GPU_TEST_TIMEOUT=300 bash scripts/gpu_check.sh -k cuda_kernels   # on the GPU machine
    .venv/bin/python -m pytest -q tests/gpu/test_cuda_kernels.py                             # the cpu variant
"""
import math
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tests.gpu.devices import run_on
from tests.gpu.test_cuda_throughput import Shape, peak_tflops, write_config

SHAPES = {
    "cuda": {"1b": Shape(hidden=1024, layers=16, heads=16, kv_heads=4, head_dim=128, experts=32, topk=4, moe_ffn=512,
                         vocab=32768, rows=8, seq=2048, micro_batch=2),
             "2b": Shape(hidden=2048, layers=12, heads=16, kv_heads=4, head_dim=128, experts=32, topk=4, moe_ffn=768,
                         vocab=32768, rows=8, seq=4096, micro_batch=1)},
    "cpu": {"tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=32, experts=4, topk=2, moe_ffn=64,
                          vocab=512, rows=2, seq=64, micro_batch=2)},
}
DTYPES = {"cuda": "bfloat16", "cpu": "float32"}
CHOICES = ("local", "fast")
TIMED_STEPS = PROFILED_STEPS = 2


@pytest.fixture(scope="module", params=[
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the cuda variant "
                                                 "runs"), id="cpu")])
def device(request):
    return request.param


def _profile_table(steps, device: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        steps()
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=25)


def kernels_worker(rank, world, model_dir, shape_fields, device, kernels, profile_path):
    """One choice on one shape: first logprobs, warm-up, timed and profiled train steps (module docstring)."""
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from tests import learner_workers as W

    shape = Shape(**shape_fields)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)  # Megatron's host-side random init draws from the global generator: same weights per choice
    try:
        learner = W.make_learner(world, model_dir, dtype=DTYPES[device], load=False, mbs=shape.micro_batch, lr=1e-3,
                                 kernels=kernels)
        params = dict(learner.model.module.named_parameters())
        total = sum(p.numel() for p in params.values())
        experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
        tokens = torch.randint(0, shape.vocab, (shape.rows, shape.seq + 1), generator=torch.Generator().manual_seed(0))
        logprobs = learner.forward_logprobs(tokens[:2])["logprobs"]
        mask = torch.ones(shape.rows, shape.seq)
        loss_fn = make_sft_loss(mask, mask.sum().item())
        losses = [learner.train_step(tokens, loss_fn)["loss"]]
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        losses += [learner.train_step(tokens, loss_fn)["loss"] for _ in range(TIMED_STEPS)]
        sync()
        step_s = (time.perf_counter() - t0) / TIMED_STEPS

        def profiled():
            losses.extend(learner.train_step(tokens, loss_fn)["loss"] for _ in range(PROFILED_STEPS))
            sync()
        Path(profile_path).write_text(_profile_table(profiled, device))
    except torch.OutOfMemoryError as e:
        return {"oom": str(e).splitlines()[0]}
    out = {"total": total, "active": total - experts + experts * shape.topk // shape.experts, "losses": losses,
           "step_s": step_s, "logprobs": logprobs, "gpu": None, "memory_gib": None}
    if device == "cuda":
        out.update(gpu=torch.cuda.get_device_name(), memory_gib=torch.cuda.max_memory_allocated() / 2**30)
    return out


def _cases():
    return [pytest.param(device, name, id=f"{device}-{name}") for device, shapes in SHAPES.items() for name in shapes]


@pytest.mark.parametrize("shape_device,shape_name", _cases())
def test_kernel_choices_throughput(device, shape_device, shape_name, figure, tmp_path):
    if shape_device != device:
        pytest.skip(f"the {shape_name} shape is for {shape_device}")
    shape = SHAPES[device][shape_name]
    write_config(tmp_path, shape)
    results = Path(os.environ.get("MSRL_GPU_SUMMARY_DIR") or tempfile.mkdtemp())
    got = {}
    for kernels in CHOICES:
        profile = results / f"profile_{shape_name}_{kernels}.txt"
        got[kernels] = run_on(device, kernels_worker, (str(tmp_path), asdict(shape), device, kernels, str(profile)))
        r = got[kernels]
        if "oom" in r:
            figure(f"{kernels}_oom", 1)
            continue
        tokens_per_s = shape.rows * shape.seq / r["step_s"]
        tflops = tokens_per_s * shape.flops_per_token(r["active"]) / 1e12
        figure(f"{kernels}_step_s", r["step_s"], "s")
        figure(f"{kernels}_tokens_per_s", tokens_per_s, "tokens/s")
        figure(f"{kernels}_model_tflops", tflops, "TFLOP/s")
        peak = peak_tflops(r["gpu"]) if r["gpu"] else None
        if peak is not None:
            figure(f"{kernels}_fraction_of_peak", tflops / peak)
        if r["memory_gib"] is not None:
            figure(f"{kernels}_peak_memory_gib", r["memory_gib"], "GiB")
        assert (r["total"], r["active"]) == shape.params()
        assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][-1] < r["losses"][0], (kernels, r["losses"])
    if all("oom" not in r for r in got.values()):
        figure("speedup", got["local"]["step_s"] / got["fast"]["step_s"])
        diff = (got["fast"]["logprobs"] - got["local"]["logprobs"]).abs()
        figure("max_logprob_diff", diff.max())
        figure("mean_logprob_diff", diff.mean())
        if device == "cpu":
            assert diff.max() < 1e-4

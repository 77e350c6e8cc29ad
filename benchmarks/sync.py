"""Colocated weight-sync throughput: bytes/s learner -> engine over the bytes/s of a plain tensor copy of the
same bytes (every weight tensor `copy_`-ed into a preallocated buffer of the same shape).

    msrl bench sync [--hidden 256 --layers 4 --experts 8 --bucket-mb 64 --repeats 3]
    .venv/bin/python benchmarks/sync.py [same options]

One process (a single-rank gloo world, TP1), a tiny random Qwen3-MoE, fp32, real Megatron learner and real
vLLM engine on CPU. The sync time includes the HF-name export, bucket packing, checksums and verification
and vLLM's in-place reload (with the CPU MoE repack); the best of `--repeats` runs is reported for both.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time


def plain_copy_bytes_per_s(tensors, repeats: int) -> float:
    import torch

    dst = [torch.empty_like(t) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def build_learner(model_dir):
    """A TP1 fp32 learner loaded from `model_dir` (in the already initialised world of one rank)."""
    from megatron_sparse_rl.config.schema import LearnerConfig, ModelConfig, ParallelConfig
    from megatron_sparse_rl.learner.learner import Learner
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    adapter, spec = load_spec(model_dir)
    layout = ParallelLayout.from_config(ParallelConfig(), world_size=1)
    layout.check_model(spec)
    learner = Learner(adapter, spec, layout, layout.initialize(), model_cfg=ModelConfig(path=str(model_dir)),
                      cfg=LearnerConfig())
    learner.load_hf(model_dir)
    return learner


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    run(p.parse_args())


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.weight_sync import iter_hf_tensors, sync_to_engine, verify_logprobs

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)  # the learner's world first, then the engine
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_hf_model(f"{tmp}/m", hidden=args.hidden, layers=args.layers, experts=args.experts,
                                        moe_ffn=args.hidden, ffn=2 * args.hidden, seed=0)
        learner = build_learner(model_dir)
        engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1))
        runs = [sync_to_engine(learner, engine, bucket_mb=args.bucket_mb) for _ in range(args.repeats)]
        best = min(runs, key=lambda s: s.seconds)
        diff = verify_logprobs(learner, engine, [list(range(1, 17))], tol=1e-4)
        copy_bps = plain_copy_bytes_per_s([t.clone() for _, t in iter_hf_tensors(learner)], args.repeats)
        engine.shutdown()
    print(f"model: {best.tensors} tensors, {best.bytes / 2**20:.1f} MiB fp32, {best.buckets} buckets of "
          f"<= {args.bucket_mb} MiB; engine vs learner max |dlogprob| {diff:.1e}")
    print(f"sync:       {best.bytes_per_s / 1e9:.3f} GB/s ({best.seconds * 1e3:.1f} ms)")
    print(f"plain copy: {copy_bps / 1e9:.3f} GB/s")
    print(f"sync / plain copy = {best.bytes_per_s / copy_bps:.3f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()

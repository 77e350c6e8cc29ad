"""Conversion throughput: HF -> Megatron torch_dist and back, in GB/s of HF tensor bytes, over the GB/s of a
raw read + write of the same bytes (reading the safetensors file and writing a copy, no conversion).

    .venv/bin/python benchmarks/convert.py [--hidden 256 --layers 4 --experts 8]

Runs in one process (a single-rank gloo world, TP1); both directions include their sha256 manifest/read-back
checks, the dist-checkpoint save/load and the Megatron model build.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path


def raw_copy_seconds(files: list[Path], dst: Path) -> float:
    t = time.perf_counter()
    for f in files:
        data = f.read_bytes()
        (dst / f.name).write_bytes(data)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--moe-ffn", type=int, default=256)
    args = ap.parse_args()

    import torch.distributed as dist

    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf
    from megatron_sparse_rl.checkpoint.launch import _free_port
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    root = Path(tempfile.mkdtemp(prefix="msrl_bench_convert_"))
    try:
        hf = build_tiny_hf_model(root / "hf", hidden=args.hidden, layers=args.layers, experts=args.experts,
                                 moe_ffn=args.moe_ffn, heads=4, kv_heads=2, head_dim=64)
        files = sorted(hf.glob("*.safetensors"))
        nbytes = sum(f.stat().st_size for f in files)
        (root / "raw").mkdir()
        raw = min(raw_copy_seconds(files, root / "raw") for _ in range(3))
        t = time.perf_counter()
        hf_to_mcore(hf, root / "mc", tp=1, ep=1)
        to_mcore = time.perf_counter() - t
        t = time.perf_counter()
        mcore_to_hf(root / "mc", root / "back")
        to_hf = time.perf_counter() - t
        gb = nbytes / 1e9
        print(f"model: {gb * 1e3:.1f} MB of HF tensors ({len(files)} file(s))")
        print(f"raw read+write:  {gb / raw:8.3f} GB/s")
        print(f"hf-to-mcore:     {gb / to_mcore:8.3f} GB/s  ratio {raw / to_mcore:.3f} of raw")
        print(f"mcore-to-hf:     {gb / to_hf:8.3f} GB/s  ratio {raw / to_hf:.3f} of raw")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

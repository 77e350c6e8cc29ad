"""Conversion throughput and peak memory: HF -> Megatron torch_dist and back, in GB/s of HF tensor bytes, over
the GB/s of a raw read + write of the same bytes (reading the safetensors files and writing a copy, no
conversion), plus each direction's peak resident memory over the model's size.

    .venv/bin/python benchmarks/convert.py [--hidden 512 --layers 6 --experts 8 --moe-ffn 1024]

The default model is a random Qwen3-MoE of about 80M parameters (~320 MB fp32), built locally in a temporary
directory, so the fixed start-up cost (Megatron model build, process group) does not dominate. Each direction
runs in a fresh single-rank process (TP1, gloo) so its peak RSS is its own; the timed span is the conversion
call (model build, reads, sha256 manifest / read-back checks, torch_dist save or load, writes), not the Python
start-up and imports.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from megatron_sparse_rl.config.checks import positive


def raw_copy_seconds(files: list[Path], dst: Path) -> float:
    t = time.perf_counter()
    for f in files:
        data = f.read_bytes()
        (dst / f.name).write_bytes(data)
    return time.perf_counter() - t


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _child(direction: str, src: str, dst: str, port: int, out, rank_init) -> None:
    if rank_init is not None:  # `msrl bench`: the libraries' lines go to its log file (tools/bench_cmd.py)
        rank_init(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    dist.init_process_group("gloo", rank=0, world_size=1)
    base = _peak_rss_mb()
    t = time.perf_counter()
    if direction == "hf-to-mcore":
        hf_to_mcore(src, dst, tp=1, ep=1)
    else:
        mcore_to_hf(src, dst)
    seconds = time.perf_counter() - t
    dist.destroy_process_group()
    out.put((seconds, base, _peak_rss_mb()))


def run_direction(direction: str, src: Path, dst: Path, rank_init=None) -> tuple[float, float, float]:
    """(seconds, RSS MB after imports, peak RSS MB) of one conversion in a fresh process, set up first by
    `rank_init(0)` when given."""
    from megatron_sparse_rl.parallel.ports import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_child, args=(direction, str(src), str(dst), free_port(), out, rank_init))
    p.start()
    result = out.get(timeout=1800)
    p.join()
    if p.exitcode:
        raise RuntimeError(f"{direction} child exited with {p.exitcode}")
    return result



def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hidden", type=positive(), default=512)
    ap.add_argument("--layers", type=positive(), default=6)
    ap.add_argument("--experts", type=positive(), default=8)
    ap.add_argument("--moe-ffn", type=positive(), default=1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    root = Path(tempfile.mkdtemp(prefix="msrl_bench_convert_"))
    try:
        hf = build_tiny_hf_model(root / "hf", hidden=args.hidden, layers=args.layers, experts=args.experts,
                                 moe_ffn=args.moe_ffn, heads=8, kv_heads=4, head_dim=64)
        files = sorted(hf.glob("*.safetensors"))
        nbytes = sum(f.stat().st_size for f in files)
        (root / "raw").mkdir()
        raw = min(raw_copy_seconds(files, root / "raw") for _ in range(3))
        shutil.rmtree(root / "raw")
        gb = nbytes / 1e9
        print(f"model: {nbytes / 4e6:.1f}M fp32 parameters, {gb * 1e3:.1f} MB of HF tensors ({len(files)} file(s))")
        print(f"raw read+write:  {gb / raw:8.3f} GB/s")
        for direction, src, dst in (("hf-to-mcore", hf, root / "mc"), ("mcore-to-hf", root / "mc", root / "back")):
            seconds, base, peak = run_direction(direction, src, dst, getattr(args, "rank_logging", None))
            print(f"{direction}:     {gb / seconds:8.3f} GB/s  ratio {raw / seconds:.3f} of raw  ({seconds:.1f} s); "
                  f"peak RSS {peak:.0f} MB ({peak - base:+.0f} MB over the {base:.0f} MB after imports; "
                  f"model {gb * 1e3:.0f} MB)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    main()

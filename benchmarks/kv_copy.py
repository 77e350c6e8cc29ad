"""Sparse-KV compaction copy: element path vs row path (kv/slots.py `SlotIndex.copy`) on one CPU. Prints both times
and their ratio, measured in one run.

    .venv/bin/python benchmarks/kv_copy.py [--layers 4 --tokens 4096 --heads 8 --head-dim 128 --budget 1024
                                           --block-size 32 --pairs 5]

A bf16 cache of `--layers` x [blocks, heads, block_size, K | V of D] (each token's K and V side by side per head, the
layout of tests/gpu/test_cuda_sparse_kv.py, where both K and V are aligned rows of D) holding one request of
`--tokens` tokens on a shuffled block table, each head keeping a random ascending set of `--budget` of them. One
compaction = per layer, K then V moved to the front slots, as the worker's `_compact` does (the indices built inside,
as there). The two paths run back to back `--pairs` times, the order alternating; printed: the median seconds of
each, the median and range of the per-pair ratios (element / row), and each path's rate (K and V of the kept
entries read and written). The compacted caches of the two paths are checked bit-identical first.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_sparse_rl.config.checks import positive
from megatron_sparse_rl.kv.slots import SlotIndex


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--layers", type=positive(), default=4)
    ap.add_argument("--tokens", type=positive(), default=4096)
    ap.add_argument("--heads", type=positive(), default=8)
    ap.add_argument("--head-dim", type=positive(), default=128)
    ap.add_argument("--budget", type=positive(), default=1024)
    ap.add_argument("--block-size", type=positive(), default=32)
    ap.add_argument("--pairs", type=positive(), default=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))


def _compact(index: tuple[SlotIndex, SlotIndex], cache, blocks, keep, dst) -> float:
    """Seconds of one compaction of every layer of `cache` [layers, blocks, block_len]."""
    start = time.perf_counter()
    for flat in cache:
        for i in index:
            i.copy(flat, blocks, keep, dst)
    return time.perf_counter() - start


def run(a: argparse.Namespace) -> int:
    if a.budget > a.tokens or a.tokens % a.block_size:
        print(f"--budget must be <= --tokens and --tokens a multiple of --block-size (got {a.budget}, {a.tokens}, "
              f"{a.block_size})")
        return 2
    g = torch.Generator().manual_seed(0)
    h, bs, d, nb = a.heads, a.block_size, a.head_dim, a.tokens // a.block_size
    element = torch.arange(h * bs * 2 * d).view(h, bs, 2 * d)
    k, v = element[..., :d].contiguous(), element[..., d:].contiguous()
    rows = (SlotIndex.of(k, element.numel()), SlotIndex.of(v, element.numel()))
    elements = (SlotIndex(k, None, element.numel()), SlotIndex(v, None, element.numel()))
    assert all(i.row is not None for i in rows)
    cache = torch.randn(a.layers, nb, element.numel(), generator=g).to(torch.bfloat16)
    blocks = torch.randperm(nb, generator=g)[None]
    keep = torch.stack([torch.randperm(a.tokens, generator=g)[:a.budget].sort().values for _ in range(h)])[None]
    dst = torch.arange(a.budget).expand(1, h, a.budget)
    by_row, by_element = cache.clone(), cache.clone()
    _compact(rows, by_row, blocks, keep, dst)
    _compact(elements, by_element, blocks, keep, dst)
    if not torch.equal(by_row.view(torch.int16), by_element.view(torch.int16)):
        print("the row path's compacted cache differs from the element path's")
        return 1
    times = {"element": [], "row": []}
    for pair in range(a.pairs):
        order = (("element", elements), ("row", rows)) if pair % 2 == 0 else (("row", rows), ("element", elements))
        for name, index in order:
            times[name].append(_compact(index, cache, blocks, keep, dst))
    ratios = [e / r for e, r in zip(times["element"], times["row"])]
    moved_gb = 2 * 2 * a.layers * h * a.budget * d * 2 / 1e9  # K and V, read + write, bf16
    print(f"cache: {a.layers} layers x {a.tokens} tokens x {h} KV heads x D={d} bf16 "
          f"({cache.numel() * 2 / 1e6:.0f} MB), budget {a.budget}, block size {bs}; bit-identical: yes")
    for name in ("element", "row"):
        s = statistics.median(times[name])
        print(f"{name:>8} copy: {s * 1e3:8.2f} ms (median of {a.pairs}), {moved_gb / s:6.2f} GB/s")
    print(f"element / row: {statistics.median(ratios):.1f}x (range {min(ratios):.1f}-{max(ratios):.1f})")
    return 0


if __name__ == "__main__":
    main()

"""Run a benchmark function on N gloo ranks in fresh processes and collect each rank's return value.

    results = run_ranks(fn, world_size=2, args=(x,), timeout=1200)

`fn(rank, world_size, *args)` must be a module-level function of an importable module (it is pickled into
spawned processes). Each rank runs with OMP_NUM_THREADS=1 and one torch thread (on a small machine the
ranks would otherwise fight over the cores), in a gloo world on a free loopback port, destroyed after `fn`.
A failure on any rank raises here with that rank's traceback; a hang past `timeout` kills every rank.
(The benchmarks' own copy of the pattern of tests/spawn.py: benchmarks do not import from tests/.)
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from typing import Any, Callable


def _rank_main(fn, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 1200) -> list[Any]:
    from megatron_sparse_rl.parallel.ports import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, out = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"benchmark ranks did not finish in {timeout} s (ranks done: {sorted(outs)})")
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{out}")
            outs[rank] = pickle.loads(out)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [outs[r] for r in range(world_size)]

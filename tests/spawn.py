"""Run a function on N gloo ranks in fresh processes and collect each rank's return value.

    results = run_distributed(fn, world_size=2, args=(x,), timeout=120)

`fn(rank, world_size, *args)` must be a module-level function (it is pickled into a spawned process).
The process group is initialised (gloo, a free loopback port) before `fn` runs and destroyed after.
A failure on any rank raises here with that rank's traceback; a hang past `timeout` kills all ranks.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from typing import Any, Callable

from megatron_sparse_rl.parallel.ports import free_port


def _worker(fn, rank, world_size, port, args, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # plain pickle bytes: torch's queue reductions share memory that dies with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 300) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, out = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"distributed test did not finish in {timeout} s (ranks done: {sorted(outs)})")
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{out}")
            outs[rank] = pickle.loads(out)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [outs[r] for r in range(world_size)]

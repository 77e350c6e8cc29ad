"""Run a conversion on N local ranks when no launcher (torchrun, srun) started us.

    errors = run_local(fn, world_size=2, args=(...))     # [] when every rank succeeded

`fn(*args)` is a module-level function run on every rank inside an initialised process group (gloo on CPU,
nccl with CUDA, one GPU per rank). Under torchrun/srun (WORLD_SIZE set) call `init_from_env()` instead.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Callable

import torch
import torch.distributed as dist
from megatron_sparse_rl.parallel.ports import free_port as _free_port


def min_world_size(tp: int, ep: int, pp: int = 1, etp: int = 1) -> int:
    """Smallest world that fits the layout: a multiple of tp*pp whose per-stage part EP*ETP divides."""
    from math import lcm

    return pp * lcm(tp, ep * etp)


def init_from_env() -> None:
    """Initialise the default process group from torchrun's environment (a no-op if already initialised)."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def _worker(fn, rank: int, world: int, port: int, args: tuple, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        init_from_env()
        fn(*args)
        errors.put((rank, None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        errors.put((rank, f"{type(e).__name__}: {e}" if isinstance(e, (ValueError, OSError, RuntimeError))
                    else traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn: Callable, world_size: int, args: tuple = (), timeout: float | None = None) -> list[str]:
    """Run `fn(*args)` on `world_size` spawned ranks; returns the error messages (rank 0's first)."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, errors)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, err = errors.get(timeout=timeout)
            results[rank] = err
            if err is not None:  # the other ranks may be stuck in a collective with the failed one
                break
    finally:
        failed = any(v is not None for v in results.values())
        for p in procs:
            p.join(timeout=5 if failed else None)
            if p.is_alive():
                p.kill()
    return [f"rank {r}: {e}" for r, e in sorted(results.items()) if e is not None]

"""Run a function on N local gloo ranks in fresh processes and collect each rank's return value.

    results = run_ranks(fn, world_size=2, args=(x,), timeout=300)

`fn(rank, world_size, *args)` must be a module-level function of an importable module (it is pickled into
spawned processes). Each rank runs with OMP_NUM_THREADS=1 and one torch thread (on a small machine ranks
would otherwise fight over the cores) in a gloo world on a free loopback port, destroyed after `fn`.
A failure on any rank raises here with that rank's traceback; a hang past `timeout` kills every rank. A
rendezvous port taken between `free_port()` and the bind (other jobs on the machine) is retried, twice.
Used by the distributed tests (tests/spawn.py) and the multi-rank benchmarks.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from typing import Any, Callable

from megatron_sparse_rl.parallel.ports import free_port

_PORT_TAKEN = "port taken"


class _PortTaken(Exception):
    pass


def _rank_main(fn, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        except Exception as e:  # noqa: BLE001 - a taken port is retried by the parent
            if "EADDRINUSE" in str(e):
                results.put((rank, False, _PORT_TAKEN))
                return
            raise
        # plain pickle bytes: torch's queue reductions share memory that dies with this process
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 300) -> list[Any]:
    """[fn's return value on rank 0, rank 1, ...] (see the module docstring)."""
    for _ in range(3):
        try:
            return _run_once(fn, world_size, args, timeout)
        except _PortTaken:
            continue
    raise RuntimeError("could not bind a free rendezvous port in 3 attempts")


def _run_once(fn, world_size: int, args: tuple, timeout: float) -> list[Any]:
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
                raise TimeoutError(f"{world_size} ranks did not finish in {timeout} s (ranks done: {sorted(outs)})")
            if not ok and out == _PORT_TAKEN:
                raise _PortTaken()
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{out}")
            outs[rank] = pickle.loads(out)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [outs[r] for r in range(world_size)]

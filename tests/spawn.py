"""Run a function on N gloo ranks in fresh processes and collect each rank's return value.

    results = run_distributed(fn, world_size=2, args=(x,), timeout=120)

`fn(rank, world_size, *args)` must be a module-level function (it is pickled into a spawned process).
The process group is initialised (gloo, a free loopback port) before `fn` runs and destroyed after.
A failure on any rank raises here with that rank's traceback; a hang past `timeout` kills all ranks. A
rendezvous port taken between `free_port()` and the bind (other jobs on the machine) is retried, twice.
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
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        except Exception as e:  # noqa: BLE001 - a taken port is retried by the parent
            if "EADDRINUSE" in str(e):
                results.put((rank, False, _PORT_TAKEN))
                return
            raise
        out = fn(rank, world_size, *args)
        # plain pickle bytes: torch's queue reductions share memory that dies with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_PORT_TAKEN = "port taken"  # the rendezvous port was grabbed between free_port() and the bind: start again


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 300) -> list[Any]:
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout)
        except _PortTaken:
            if attempt == 2:
                raise RuntimeError("could not bind a free rendezvous port in 3 attempts") from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


def _run_once(fn, world_size: int, args: tuple, timeout: float) -> list[Any]:
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

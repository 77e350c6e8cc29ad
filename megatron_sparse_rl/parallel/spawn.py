"""Run a function on N local ranks in fresh processes and collect each rank's return value: the one spawner
of the project (distributed tests through tests/spawn.py, multi-rank benchmarks, `msrl convert` without a
launcher through checkpoint/launch.py).

    results = run_ranks(fn, world_size=2, args=(x,), timeout=300)

`fn(rank, world_size, *args)` must be a module-level function of an importable module (it is pickled into
spawned processes). Each rank joins a world (parallel/world.py `join_world`; gloo by default, `backend="auto"`
picks nccl with one GPU per rank when CUDA is there), destroyed after `fn`. As torchrun's agent does, this
process serves the world's store, on 127.0.0.1 only (bound before any rank starts, so no other job can take the
port in between), and tells the ranks so (TORCHELASTIC_USE_AGENT_STORE): every rank is its client. With
`threads=1` (the default) a rank runs with OMP_NUM_THREADS=1 and one torch thread (on a small machine ranks would
otherwise fight over the cores). `rank_init(rank)`, when given (a picklable callable, e.g. observability/logging.py
`RankLogging` for `msrl bench` and `msrl convert`), runs first in each rank, before torch is imported, so it sees
every line the libraries log in the rank. A failure on any rank raises `RankFailed` here with that rank's error and
traceback; a hang past `timeout` kills every rank.

`RankPool` keeps a world's rank processes between calls (the test suite's `run_distributed`): each call joins a
fresh world on a fresh store with the caller's working directory and environment, and leaves it after `fn` (Megatron's
parallel state destroyed, the process group destroyed), so a call sees what a fresh rank sees except for modules
already imported. Ranks that imported vLLM (whose distributed state lives for the process) or failed are not reused.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue
import sys
import traceback
from typing import Any, Callable

from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.parallel.ports import LOOPBACK, store_server


class RankFailed(RuntimeError):
    """A spawned rank raised: `rank`, `summary` (`Type: message`), `kinds` (the names of the exception's classes,
    most derived first) and the rank's `traceback`."""

    def __init__(self, rank: int, summary: str, kinds: tuple[str, ...], trace: str):
        super().__init__(f"rank {rank} failed:\n{trace}")
        self.rank, self.summary, self.kinds, self.traceback = rank, summary, kinds, trace


def _join(rank: int, world_size: int, port: int, backend: str, threads: int | None) -> None:
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True")
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch  # here, after OMP_NUM_THREADS is set for this rank

    from megatron_sparse_rl.parallel.world import join_world  # imports torch

    if threads is not None:
        torch.set_num_threads(threads)
    join_world(ParallelConfig(backend=backend))


def _rank_main(fn, rank: int, world_size: int, port: int, args: tuple, results, backend: str,
               threads: int | None, rank_init: Callable[[int], None] | None) -> None:
    try:
        if rank_init is not None:  # first: joining the world imports torch; fn, the libraries
            rank_init(rank)
        _join(rank, world_size, port, backend, threads)
        # plain pickle bytes: torch's queue reductions share memory that dies with this process
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        kinds = tuple(c.__name__ for c in type(e).__mro__)
        results.put((rank, False, (f"{type(e).__name__}: {e}", kinds, traceback.format_exc())))
    finally:
        dist = sys.modules.get("torch.distributed")  # absent when the rank failed before importing torch
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


def _leave_world() -> None:
    """Undo `_join` and whatever `fn` set up on top of the world, so that the process can join another."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    gc.freeze()  # what survives (the imports) is not scanned again: the next task's collection walks its own objects


def _pool_rank_main(rank: int, world_size: int, tasks, results, backend: str, threads: int | None) -> None:
    """A pooled rank: runs (port, cwd, env, payload) tasks until it gets None; answers each with
    (rank, ok, out, reusable)."""
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    while (task := tasks.get()) is not None:
        port, cwd, env, payload = task
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        try:
            fn, args = pickle.loads(payload)
            _join(rank, world_size, port, backend, threads)
            answer = (True, pickle.dumps(fn(rank, world_size, *args)))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent with its traceback
            kinds = tuple(c.__name__ for c in type(e).__mro__)
            answer = (False, (f"{type(e).__name__}: {e}", kinds, traceback.format_exc()))
        try:
            _leave_world()
            reusable = answer[0] and "vllm" not in sys.modules
        except BaseException:  # noqa: BLE001 - a rank that cannot leave its world is not reused
            reusable = False
        results.put((rank, *answer, reusable))
        if not reusable:
            return


class RankPool:
    """`world_size` rank processes reused across `run` calls (see the module docstring). `run` raises `RankFailed`
    or `TimeoutError` as `run_ranks` does; after either, or after a rank said it cannot be reused, the ranks are
    ended and the next call starts new ones."""

    def __init__(self, world_size: int, *, backend: str = "gloo", threads: int | None = 1):
        self.world_size, self.backend, self.threads = world_size, backend, threads
        self._procs: list = []

    def run(self, fn: Callable[..., Any], args: tuple = (), timeout: float | None = 300) -> list[Any]:
        if not self._procs:
            self._start()
        store = store_server(LOOPBACK, world_size=self.world_size)
        payload = pickle.dumps((fn, args))
        for q in self._tasks:
            q.put((store.port, os.getcwd(), dict(os.environ), payload))
        outs: dict[int, Any] = {}
        keep = True
        try:
            for _ in range(self.world_size):
                try:
                    rank, ok, out, reusable = self._results.get(timeout=timeout)
                except queue.Empty:
                    keep = False
                    raise TimeoutError(f"{self.world_size} ranks did not finish in {timeout} s "
                                       f"(ranks done: {sorted(outs)})")
                keep = keep and reusable
                if not ok:
                    keep = False
                    raise RankFailed(rank, *out)
                outs[rank] = pickle.loads(out)
        finally:
            if not keep:
                self.close()
            del store
        return [outs[r] for r in range(self.world_size)]

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_pool_rank_main,
                                   args=(r, self.world_size, self._tasks[r], self._results, self.backend,
                                         self.threads))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def close(self) -> None:
        """End the ranks (those still waiting for a task leave at once; the others are killed)."""
        for q, p in zip(self._tasks if self._procs else [], self._procs):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float | None = 300, *,
              backend: str = "gloo", threads: int | None = 1,
              rank_init: Callable[[int], None] | None = None) -> list[Any]:
    """[fn's return value on rank 0, rank 1, ...] (see the module docstring)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = store_server(LOOPBACK, world_size=world_size)  # lives until every rank has ended (below)
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, store.port, args, results, backend, threads,
                                                    rank_init))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, out = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{world_size} ranks did not finish in {timeout} s (ranks done: {sorted(outs)})")
            if not ok:  # the other ranks may be stuck in a collective with the failed one: killed below
                raise RankFailed(rank, *out)
            outs[rank] = pickle.loads(out)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    return [outs[r] for r in range(world_size)]

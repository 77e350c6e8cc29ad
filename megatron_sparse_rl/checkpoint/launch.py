"""Run a conversion on N local ranks when no launcher (torchrun, srun) started us.

    errors = run_local(fn, world_size=2, args=(...))     # [] when every rank succeeded

`fn(*args)` is a module-level function run on every rank inside an initialised process group (gloo on CPU,
nccl with CUDA, one GPU per rank). Under torchrun/srun (WORLD_SIZE set) call `init_from_env()` instead.
"""
from __future__ import annotations

from math import lcm
from typing import Callable

from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.parallel.spawn import RankFailed, run_ranks
from megatron_sparse_rl.parallel.world import join_world


def min_world_size(tp: int, ep: int, pp: int = 1, etp: int = 1) -> int:
    """Smallest world that fits the layout: a multiple of tp*pp whose per-stage part EP*ETP divides."""
    return pp * lcm(tp, ep * etp)


def init_from_env() -> None:
    """Join torchrun's/srun's world from the environment (a no-op if already joined): nccl with CUDA (one GPU per
    local rank), gloo without (parallel/world.py)."""
    join_world(ParallelConfig(backend="auto"))


def _call(rank: int, world: int, fn: Callable, args: tuple) -> None:
    fn(*args)


def run_local(fn: Callable, world_size: int, args: tuple = (), timeout: float | None = None, *,
              rank_init: Callable[[int], None] | None = None) -> list[str]:
    """Run `fn(*args)` on `world_size` spawned ranks (parallel/spawn.py), each set up first by `rank_init(rank)`
    when given (`msrl convert`: its tool logging); returns the error messages ([] when every rank succeeded):
    `Type: message` for the input errors conversion raises (ValueError, OSError, RuntimeError), the traceback for
    anything else."""
    try:
        run_ranks(_call, world_size, args=(fn, args), timeout=timeout, backend="auto", threads=None,
                  rank_init=rank_init)
    except RankFailed as e:
        known = {"ValueError", "OSError", "RuntimeError"} & set(e.kinds)
        return [f"rank {e.rank}: {e.summary if known else e.traceback}"]
    return []

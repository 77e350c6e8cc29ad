"""Run a function on N gloo ranks and collect each rank's return value.

    results = run_distributed(fn, world_size=2, args=(x,), timeout=120)

`fn(rank, world_size, *args)` must be a module-level function (it is pickled into the ranks). The process group
is initialised (gloo, its store served on 127.0.0.1 by this process) before `fn` runs and destroyed after; a
failure on any rank raises here with that rank's traceback; a hang past `timeout` kills all ranks.

The ranks are kept between calls of the same world size (`megatron_sparse_rl.parallel.spawn.RankPool`): a spawned
rank spends seconds importing torch and Megatron-Core, and the suite makes over a hundred such calls. A call
with `rank_init` or non-default threads or backend, and `MSRL_TEST_FRESH_RANKS=1` for every call, uses fresh
processes (`run_ranks`). A call that fails in reused ranks runs again in fresh ones: their result is the test's
(a warning names a call that passed only there, i.e. state a reused rank kept).
"""
from __future__ import annotations

import atexit
import os
import warnings

from megatron_sparse_rl.parallel.spawn import RankFailed, RankPool, run_ranks

__all__ = ["run_distributed"]

_pool: RankPool | None = None


def _close_pool() -> None:
    if _pool is not None:
        _pool.close()


atexit.register(_close_pool)


def run_distributed(fn, world_size, args=(), timeout=300, **options):
    global _pool
    if options or os.environ.get("MSRL_TEST_FRESH_RANKS") == "1":
        return run_ranks(fn, world_size, args, timeout, **options)
    if _pool is None or _pool.world_size != world_size:
        _close_pool()
        _pool = RankPool(world_size)
    try:
        return _pool.run(fn, args, timeout)
    except RankFailed as reused:
        outs = run_ranks(fn, world_size, args, timeout)  # raises the fresh ranks' failure, if they fail too
        warnings.warn(f"{fn.__module__}.{fn.__name__} failed in reused ranks and passed in fresh ones: "
                      f"rank {reused.rank}: {reused.summary}")
        return outs

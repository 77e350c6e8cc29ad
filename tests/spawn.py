"""Run a function on N gloo ranks in fresh processes and collect each rank's return value.

    results = run_distributed(fn, world_size=2, args=(x,), timeout=120)

`fn(rank, world_size, *args)` must be a module-level function (it is pickled into a spawned process).
The library's `megatron_sparse_rl.parallel.spawn.run_ranks` under the name the tests use: the process group
is initialised (gloo, its store served on 127.0.0.1 by this process) before `fn` runs and destroyed after; a
failure on any rank raises here with that rank's traceback; a hang past `timeout` kills all ranks.
"""
from megatron_sparse_rl.parallel.spawn import run_ranks as run_distributed

__all__ = ["run_distributed"]

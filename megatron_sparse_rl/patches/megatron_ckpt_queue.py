"""A dist-checkpoint results queue inside the rank's own process: no server process for a stop signal to kill, and
none to start.

The gap: Megatron-Core 0.16.1's filesystem writer (`megatron/core/dist_checkpointing/strategies/filesystem_async.py`)
collects every save's write results through one queue per process, `_get_write_results_queue()`: made on the first
save as `mp.get_context("spawn").Manager().Queue()`, so a manager server process that lives as long as the trainer,
in the trainer's process group, with Python's default SIGTERM handler.
- torchrun's agent stops its workers by signalling each worker's process group, so a stop (SIGTERM to `msrl launch
  local`, `scancel`) also killed that server, and the checkpoint the stop asks for failed with BrokenPipeError
  (`global_results_queue.put`) whenever the process had saved once before (the SFT warm start's checkpoint, or any
  periodic one). Seen: a 1 + 1 asynchronous run (max_staleness 2) stopped with SIGTERM after RL step 4 exited 143 with
  "could not write the checkpoint ... Broken pipe"; its resume started over from the SFT checkpoint.
- The server is a fresh Python that unpickles the write results, so the first save of every process waited for it
  to import torch: about 2 s on 2 CPU cores, once per rank and run.

What `apply()` changes, and nothing else: before the process's first save it sets the module's `_results_queue` to a
`queue.Queue` of this process. Every save here is synchronous (`dist_checkpointing.save` without
`async_sharded_save`: `AsyncRequest.execute_sync` runs the writer in the calling process, which puts the results in
the queue and then reads them back with `get_nowait`), so the queue never crosses a process; an asynchronous save,
which would run the writer in another process, is not used by this project. It checks the Megatron-Core version it
was written for and is idempotent; `learner/checkpoint.py` and `checkpoint/shard.py` call it before every save.
"""
from __future__ import annotations

import queue

MEGATRON_VERSION = "0.16.1"


def _check(module) -> None:
    import megatron.core

    if megatron.core.__version__ != MEGATRON_VERSION:
        raise RuntimeError(f"megatron_sparse_rl's checkpoint results-queue patch was written for megatron-core "
                           f"{MEGATRON_VERSION}, found {megatron.core.__version__}; install "
                           f"megatron-core=={MEGATRON_VERSION}")
    missing = [name for name in ("_results_queue", "_get_write_results_queue") if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"megatron.core.dist_checkpointing.strategies.filesystem_async lacks {', '.join(missing)}, "
                           f"which the checkpoint results-queue patch relies on (written for megatron-core "
                           f"{MEGATRON_VERSION})")


def apply() -> None:
    """Give this process's dist-checkpoint writer an in-process results queue (module docstring), unless it already
    has a queue (this patch's, or Megatron's own from a save before the patch was applied)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _check(filesystem_async)
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def in_process() -> bool:
    """Whether this process's dist-checkpoint results queue is this patch's in-process one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return isinstance(filesystem_async._results_queue, queue.Queue)

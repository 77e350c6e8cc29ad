"""A dist-checkpoint results queue that survives the stop signal a launcher sends to a rank's process group.

The gap: Megatron-Core 0.16.1's filesystem writer (`megatron/core/dist_checkpointing/strategies/filesystem_async.py`)
collects every save's write results through one queue per process, `_get_write_results_queue()`: made on the first
save as `mp.get_context("spawn").Manager().Queue()`, so a manager server process that lives as long as the trainer,
in the trainer's process group, with Python's default SIGTERM handler. torchrun's agent stops its workers by
signalling each worker's process group, so a stop (SIGTERM to `msrl launch local`, `scancel`) also kills that server,
and the checkpoint the stop asks for fails with BrokenPipeError (`global_results_queue.put`) whenever the process
had saved once before (the SFT warm start's checkpoint, or any periodic one). Seen: a 1 + 1 asynchronous run
(max_staleness 2) stopped with SIGTERM after RL step 4 exited 143 with "could not write the checkpoint ... Broken
pipe"; its resume started over from the SFT checkpoint.

What `apply()` changes, and nothing else: before the process's first save it sets the module's `_results_queue` to
a queue of the same kind (a spawn-context `SyncManager`'s `Queue`) whose server process ignores SIGTERM and SIGINT
(the trainer itself decides when to stop) and exits on its own once its parent process is gone (checked every
`PARENT_POLL_S`), so no server outlives a killed trainer. It checks the Megatron-Core version it was written for and
is idempotent; `learner/checkpoint.py` calls it before every save.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.managers import SyncManager

MEGATRON_VERSION = "0.16.1"
PARENT_POLL_S = 1.0
"""How often the queue's server process checks that the process that started it still exists."""

_manager: SyncManager | None = None  # kept alive with the process: the queue's server


def _serve_until_orphaned(parent: int) -> None:
    """The manager server's initializer (runs in the server process): ignore stop signals, exit when `parent` is
    gone (the server is then reparented)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)
    threading.Thread(target=watch, name="msrl-orphan-watch", daemon=True).start()


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
    """Give this process's dist-checkpoint writer the stop-proof results queue (module docstring), unless it
    already has a queue (this patch's, or Megatron's own from a save before the patch was applied)."""
    global _manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _check(filesystem_async)
    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(_serve_until_orphaned, (os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _manager = manager


def server_pid() -> int | None:
    """The pid of the server process of this process's dist-checkpoint results queue (this patch's, or Megatron's
    own), or None before the first save."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    manager = getattr(queue, "_manager", None)
    return None if manager is None else manager._process.pid

"""Process-wide logging set-up: one `init_logging(rank)` with a rank prefix, INFO on rank 0 only."""
from __future__ import annotations

import logging
import sys


def init_logging(rank: int = 0, level: int | None = None) -> None:
    """Configure the root logger once per process: `[rank N] LEVEL name: message` on stderr.

    Rank 0 logs at INFO, the others at WARNING unless `level` is given.
    """
    if level is None:
        level = logging.INFO if rank == 0 else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)

"""Throttled conversion progress: tensors and bytes done of the total, MB/s and ETA, on one line per update.

    p = TransferProgress("mcore-to-hf write", total_tensors=400, total_bytes=2_000_000_000, stream=sys.stderr)
    for t in tensors:
        ...
        p.add(t.numel() * t.element_size())    # prints at most once every `interval` seconds
    p.finish()                                  # always prints the final line

    mcore-to-hf write [########............] 160/400 tensors 800.00/2000.00 MB 85.3 MB/s eta 14s

MB are 10**6 bytes; MB/s is the mean rate since construction. Only the rank that is given `enabled=True`
(rank 0 in the converter) prints; the others count silently. The bar and ETA reuse observability/progress.py.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from megatron_sparse_rl.observability.progress import format_duration, progress_bar


class TransferProgress:
    def __init__(self, label: str, *, total_tensors: int, total_bytes: int, stream: TextIO | None = None,
                 interval: float = 2.0, enabled: bool = True, clock: Callable[[], float] = time.monotonic):
        if total_tensors < 0 or total_bytes < 0 or interval < 0:
            raise ValueError(f"totals and interval must be >= 0 (got {total_tensors}, {total_bytes}, {interval})")
        self.label = label
        self.total_tensors, self.total_bytes = total_tensors, total_bytes
        self.tensors = 0
        self.bytes = 0
        self.stream = stream
        self.interval = interval
        self.enabled = enabled
        self.clock = clock
        self._t0 = clock()
        self._last_print: float | None = None
        self.lines = 0

    def rate(self) -> float:
        """Mean bytes per second since construction (0 before any time has passed)."""
        dt = self.clock() - self._t0
        return self.bytes / dt if dt > 0 else 0.0

    def line(self) -> str:
        rate = self.rate()
        left = self.total_bytes - self.bytes
        eta = left / rate if rate > 0 else (0.0 if left <= 0 else float("nan"))
        n = len(str(self.total_tensors))
        return (f"{self.label} {progress_bar(self.bytes, self.total_bytes)} {self.tensors:>{n}}/{self.total_tensors} "
                f"tensors {self.bytes / 1e6:.2f}/{self.total_bytes / 1e6:.2f} MB {rate / 1e6:.1f} MB/s "
                f"eta {format_duration(eta)}")

    def _print(self) -> str:
        text = self.line()
        if self.enabled:
            print(text, file=self.stream if self.stream is not None else sys.stderr, flush=True)
            self.lines += 1
        self._last_print = self.clock()
        return text

    def add(self, nbytes: int, tensors: int = 1) -> str | None:
        """Count `tensors` tensors of `nbytes` bytes in all; print if `interval` passed since the last line."""
        self.tensors += tensors
        self.bytes += nbytes
        since = self.clock() - (self._last_print if self._last_print is not None else self._t0)
        if since >= self.interval:
            return self._print()
        return None

    def finish(self) -> str:
        """Print (and return) the final line."""
        return self._print()


def report_phase(label: str, nbytes: int, seconds: float, *, stream: TextIO | None = None,
                 enabled: bool = True) -> str:
    """One line for a step done in one call (a torch_dist save or load): bytes, seconds, MB/s."""
    rate = nbytes / seconds / 1e6 if seconds > 0 else 0.0
    text = f"{label}: {nbytes / 1e6:.2f} MB in {seconds:.2f} s ({rate:.1f} MB/s)"
    if enabled:
        print(text, file=stream if stream is not None else sys.stderr, flush=True)
    return text

"""Overlap of the two ends of a bucket stream: the items of an iterator produced by a background thread, up to
`depth` ahead of the consumer.

    for bucket in prefetched(_receive_buckets(...)):   # bucket k+1 arrives while bucket k is loaded
        load(bucket)

A disaggregated sync uses it on both sides (weight_sync/disaggregated.py): the sender exports, packs and digests
bucket k+1 while bucket k is on the wire, the receiver receives bucket k+1 while the engine loads bucket k. The
producer runs the source's collectives (gathers, broadcasts) in its own thread, in the source's order; the
consumer must not run collectives on the same groups meanwhile (neither side does: the consumer sends on the
bridge while the producer gathers on the learner's groups, or loads into the engine while the producer receives).
At most depth + 2 items are alive: the consumer's, `depth` queued, and the one the producer holds.

The stream is always produced to its end: when the consumer stops early (an exception, a failed checksum), the
rest is drained before the error goes on, because the other ranks wait on the collectives it runs. An exception
in the producer is raised in the consumer, at the position of the item that failed.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")
_END = object()


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def prefetched(items: Iterable[T], *, depth: int = 1, name: str = "weight-sync-prefetch") -> Iterator[T]:
    """`items` in order, produced by a daemon thread at most `depth` (>= 1) items ahead of the consumer."""
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1 (got {depth})")
    ready: queue.Queue = queue.Queue(maxsize=depth)

    def produce() -> None:
        try:
            for item in items:
                ready.put(item)
            ready.put(_END)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
            ready.put(_Raised(error))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    finished = False
    try:
        while True:
            item = ready.get()
            if item is _END:
                finished = True
                return
            if isinstance(item, _Raised):
                finished = True
                raise item.error
            yield item
    finally:
        while not finished:  # the consumer stopped early: run the producer's collectives to their end
            item = ready.get()
            finished = item is _END or isinstance(item, _Raised)
        thread.join()

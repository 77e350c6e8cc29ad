"""weight_sync/pipeline.py `prefetched`: same items in the same order, the producer at most `depth` ahead, its
exceptions raised in the consumer, and the stream produced to its end when the consumer stops early.

    .venv/bin/python -m pytest -q tests/unit/test_sync_pipeline.py
"""
from __future__ import annotations

import threading

import pytest

from megatron_sparse_rl.weight_sync.pipeline import prefetched


def test_same_items_in_order():
    assert list(prefetched(iter(range(100)), depth=3)) == list(range(100))
    assert list(prefetched([])) == []


def test_producer_runs_at_most_depth_plus_one_ahead_in_its_own_thread():
    produced, threads = [], set()

    def source():
        for i in range(10):
            produced.append(i)
            threads.add(threading.get_ident())
            yield i

    stream = prefetched(source(), depth=2)
    assert next(stream) == 0
    # consumer holds 0; queue holds up to 2; the producer may hold one more, blocked on the full queue
    for _ in range(100):
        if len(produced) >= 4:
            break
        threading.Event().wait(0.01)
    assert len(produced) == 4
    assert list(stream) == list(range(1, 10))
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_producer_error_is_raised_in_the_consumer_after_the_good_items():
    def source():
        yield 1
        yield 2
        raise RuntimeError("gather failed on rank 3")

    got = []
    with pytest.raises(RuntimeError, match="gather failed on rank 3"):
        for item in prefetched(source()):
            got.append(item)
    assert got == [1, 2]


def test_consumer_stopping_early_still_drains_the_producer():
    produced = []

    def source():
        for i in range(20):
            produced.append(i)
            yield i

    with pytest.raises(ValueError, match="bad bucket"):
        for item in prefetched(source()):
            if item == 3:
                raise ValueError("bad bucket")
    assert produced == list(range(20))  # every collective of the stream ran


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="prefetch depth must be >= 1 \\(got 0\\)"):
        list(prefetched([1], depth=0))

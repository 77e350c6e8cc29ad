"""Buckets and the one bucket feed both placements load engines through (weight_sync/buckets.py), with a stand-in
engine: packing groups whole tensors by their 16-byte-aligned size, a corrupted bucket is refused by name after
the rest of the stream was pulled, an engine that stops early or raises still has the stream drained, `keep`
filters, and sliced tensors reach the engine full-shape with NaN around the slice.

    .venv/bin/python -m pytest -q tests/unit/test_weight_sync_buckets.py
"""
import pytest
import torch

from megatron_sparse_rl.weight_sync import WeightSyncError
from megatron_sparse_rl.weight_sync.buckets import Feed, pack_buckets, seal
from megatron_sparse_rl.weight_sync.engine_shards import Cut

KIB = 1024 / 2**20  # bucket_mb of one KiB


def _stream(pulled):
    """Five float32 tensors: 256, 260 (272 packed), 512, 2048 and 64 bytes; `pulled` records what was produced."""
    for i, n in enumerate((64, 65, 128, 512, 16)):
        pulled.append(f"t{i}")
        yield f"t{i}", torch.arange(n, dtype=torch.float32) + 1000 * i


class Engine:
    def __init__(self, stop_after=None, fail_after=None):
        self.got, self.stop_after, self.fail_after = {}, stop_after, fail_after

    def load_weights(self, weights):
        for i, (name, tensor) in enumerate(weights):
            if i == self.fail_after:
                raise RuntimeError("loader failed")
            if i == self.stop_after:
                return
            self.got[name] = tensor.clone()


def test_buckets_group_by_aligned_size_and_a_large_tensor_goes_alone():
    buckets = list(pack_buckets(_stream([]), bucket_mb=KIB))
    # 256 + 272 + 512 = 1040 > 1024: t2 starts the second bucket; t3 (2048) alone; t4 after it
    assert [[m.name for m in b.metas] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    assert [m.offset for m in buckets[0].metas] == [0, 256] and buckets[0].nbytes == 528
    assert buckets[0].payload == 516


def test_feed_hands_every_tensor_once_and_counts():
    engine, pulled = Engine(), []
    feed = Feed(pack_buckets(_stream(pulled), bucket_mb=KIB))
    feed.load_into(engine)
    assert list(engine.got) == ["t0", "t1", "t2", "t3", "t4"]
    assert torch.equal(engine.got["t3"], torch.arange(512, dtype=torch.float32) + 3000)
    stats = feed.stats(1.0)
    assert (stats.buckets, stats.tensors, stats.bytes) == (4, 5, 256 + 260 + 512 + 2048 + 64)


def _flip_bucket_1(bucket):
    if bucket.index == 1:
        bucket.tensors()[0][1].view(-1)[0] += 1.0


def test_corrupt_bucket_is_refused_after_the_stream_is_drained():
    engine, pulled = Engine(), []
    feed = Feed(pack_buckets(_stream(pulled), bucket_mb=KIB), corrupt=_flip_bucket_1)
    with pytest.raises(WeightSyncError, match=r"bucket 1: checksum mismatch in 1 of 1 tensors \['t2'\]"):
        feed.load_into(engine)
    assert pulled == ["t0", "t1", "t2", "t3", "t4"], "the other ranks' gathers must all run"
    assert list(engine.got) == ["t0", "t1"]


@pytest.mark.parametrize("engine", [Engine(stop_after=2), Engine(fail_after=2), None])
def test_an_engine_that_stops_or_fails_or_none_still_drains(engine):
    pulled = []
    feed = Feed(pack_buckets(_stream(pulled), bucket_mb=KIB))
    if engine is None:
        feed.load_into(None)
    elif engine.stop_after is not None:
        with pytest.raises(WeightSyncError, match="the engine stopped reading after 3 of 5 tensors"):
            feed.load_into(engine)
    else:
        with pytest.raises(RuntimeError, match="loader failed"):
            feed.load_into(engine)
    assert pulled == ["t0", "t1", "t2", "t3", "t4"]


def test_keep_filters_and_slices_are_rebuilt_with_nan_around_them():
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    where = Cut((4, 3), 0, 2, 2)
    bucket = seal(0, [("sliced", full[2:]), ("whole", full), ("dropped", full)], {"sliced": where})
    engine = Engine()
    feed = Feed([bucket], keep=lambda name: name != "dropped")
    feed.load_into(engine)
    assert list(engine.got) == ["sliced", "whole"] and feed.handed == 2 and feed.tensors == 3
    got = engine.got["sliced"]
    assert got.shape == (4, 3) and torch.isnan(got[:2]).all() and torch.equal(got[2:], full[2:])
    assert torch.equal(engine.got["whole"], full)

"""Buckets and the one bucket feed both placements load engines through (weight_sync/buckets.py), with a stand-in
engine: packing groups whole tensors by their 16-byte-aligned size, a corrupted bucket is refused by name after
the rest of the stream was pulled, an engine that stops early or raises still has the stream drained, `keep`
filters, and sliced tensors reach the engine full-shape with NaN around the slice. The XXH3-128 digests: every
payload byte of a bucket, flipped, is refused naming its tensor; a digest equals xxhash of the exported C-order
bytes; a packing copy that differs from the export is caught. Sync stats carry every timed phase.

    .venv/bin/python -m pytest -q tests/unit/test_weight_sync_buckets.py
"""
import pytest
import torch
import xxhash

from megatron_sparse_rl.weight_sync import WeightSyncError
from megatron_sparse_rl.weight_sync.buckets import PHASES, Feed, PhaseTimes, pack_buckets, seal, timed, verify_bucket
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

    def load_weights(self, weights, *, version=None):
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


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_flipped_payload_byte_is_refused_naming_its_tensor(mask):
    """Exhaustive over one bucket: each payload byte of each tensor, xor-ed with `mask`, fails verification naming
    exactly that tensor; restored, the bucket verifies again."""
    items = [("a.weight", torch.randn(7, 3)), ("b.bias", torch.randn(5).to(torch.bfloat16)),
             ("c.weight", torch.arange(9, dtype=torch.int64))]
    bucket = seal(0, items)
    verify_bucket(bucket)
    flat = bucket.buffer
    for meta in bucket.metas:
        for at in range(meta.offset, meta.offset + meta.nbytes):
            before = int(flat[at])
            flat[at] = before ^ mask
            with pytest.raises(WeightSyncError, match=rf"checksum mismatch in 1 of 3 tensors \['{meta.name}'\]"):
                verify_bucket(bucket)
            flat[at] = before
    verify_bucket(bucket)


def test_digest_is_xxh3_128_of_the_exported_bytes_in_c_order():
    """Independent reference: xxhash over the tensor's C-order bytes (numpy), for a non-contiguous export too."""
    base = torch.randn(6, 4)
    bucket = seal(0, [("t", base.t()), ("u", base[:, 1])])
    for meta, tensor in zip(bucket.metas, (base.t(), base[:, 1])):
        assert meta.digest == xxhash.xxh3_128_digest(tensor.numpy().tobytes(order="C"))
    assert torch.equal(dict(bucket.tensors())["t"], base.t())


def test_a_packing_copy_that_differs_from_the_export_is_refused():
    """The digest is taken over the exported tensor, not the packed copy: a bad copy into the bucket is caught."""
    bucket = seal(0, [("t", torch.ones(8))])
    bucket.buffer[0] ^= 0x01  # as if the pack had copied one byte wrong
    with pytest.raises(WeightSyncError, match=r"\['t'\]"):
        verify_bucket(bucket)


def test_stats_carry_every_phase_and_the_expert_share():
    """Structure only (no timed assertion): every phase of PHASES is reported, none negative; routed experts'
    time is a part of the export + load time."""
    clock = PhaseTimes()
    stream = [("model.layers.0.mlp.experts.3.up_proj.weight", torch.ones(4)), ("model.norm.weight", torch.ones(4))]
    feed = Feed(pack_buckets(timed(stream, clock), bucket_mb=KIB, clock=clock), clock=clock)
    feed.load_into(Engine())
    stats = feed.stats(1.0)
    assert tuple(stats.phases) == PHASES and all(v >= 0 for v in stats.phases.values())
    assert stats.phases["transport"] == 0.0 and stats.phases["rebuild"] == 0.0
    assert 0 <= stats.expert_seconds <= stats.phases["export"] + stats.phases["load"]

"""Disaggregated weight sync: learner ranks broadcast checksummed buckets over a process group to rollout ranks.

    # learner ranks [0, L) (every one of them: the TP/EP gathers are collective)
    stats = send_weights(learner, group, src=0, bucket_mb=256)
    # rollout ranks [L, L+R) (each owns one engine, or None to receive and drop)
    stats = receive_weights(engine, group, src=0)

`group` holds the sender `src` (a global rank, usually learner rank 0) and every rollout rank
(`ParallelLayout.weight_sync_group(src)`, which also builds Megatron's groups over the learner ranks only);
None means the default (world) group, right only when `src` is the sole learner rank. Learner ranks other than `src` take part in the gathers of `iter_hf_tensors`
and drop the stream. Per bucket the sender broadcasts its metadata (index, names, dtypes, shapes, offsets,
BLAKE2b digests) with `broadcast_object_list`, then the flat uint8 buffer with `broadcast`; a `None`
header ends the stream. gloo on CPU; on GPU the buffer travels as-is if it is on the group's device.

Receive side: each bucket is checksum-verified (`verify_bucket`) before its tensors reach
`engine.load_weights` (one call, fed lazily: at most one bucket beyond the engine's weights is alive).
`keep(name) -> bool` filters by name (default: all). An engine of tensor-parallel size > 1 needs every
tensor too: each of its ranks receives the full tensors and vLLM's weight loaders keep that rank's slice
(one broadcast serves every engine rank; the sender sends each byte once).
On a failed checksum the receiver drains the rest of the stream (the sender never blocks) and raises
WeightSyncError naming the bucket; the engine then holds partly updated weights: sync again.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_sparse_rl.weight_sync.buckets import Bucket, pack_buckets, verify_bucket
from megatron_sparse_rl.weight_sync.colocated import SyncStats
from megatron_sparse_rl.weight_sync.export import WeightSyncError, iter_hf_tensors

log = logging.getLogger(__name__)


def _payload(bucket: Bucket) -> int:
    return sum(m.nbytes for m in bucket.metas)


def send_weights(learner, group=None, *, src: int, bucket_mb: float = 256.0) -> SyncStats:
    """Every learner rank calls it; global rank `src` broadcasts the buckets to `group`, the others drop them."""
    start = time.perf_counter()
    sender = dist.get_rank() == src
    nbytes = count = tensors = 0
    for bucket in pack_buckets(iter_hf_tensors(learner), bucket_mb=bucket_mb):
        count, nbytes, tensors = count + 1, nbytes + _payload(bucket), tensors + len(bucket.metas)
        if sender:
            dist.broadcast_object_list([(bucket.index, bucket.metas)], src=src, group=group)
            dist.broadcast(bucket.buffer, src=src, group=group)
    if sender:
        dist.broadcast_object_list([None], src=src, group=group)
    stats = SyncStats(nbytes, time.perf_counter() - start, count, tensors)
    if sender:
        log.info("weight sync sent: %d tensors, %.1f MB in %d buckets, %.3f s (%.1f MB/s)", stats.tensors,
                 stats.bytes / 1e6, stats.buckets, stats.seconds, stats.bytes_per_s / 1e6)
    return stats


def _receive_buckets(group, src: int, device: torch.device) -> Iterator[Bucket]:
    while True:
        header = [None]
        dist.broadcast_object_list(header, src=src, group=group)
        if header[0] is None:
            return
        index, metas = header[0]
        end = metas[-1].offset + metas[-1].nbytes if metas else 0
        buffer = torch.empty((end + 15) // 16 * 16, dtype=torch.uint8, device=device)
        dist.broadcast(buffer, src=src, group=group)
        yield Bucket(index, buffer.cpu(), list(metas))


class _Received:
    """Verified, filtered tensors of the received buckets as one (name, tensor) stream, with counters."""

    def __init__(self, buckets: Iterator[Bucket], verify: bool, keep: Callable[[str], bool] | None, corrupt):
        self.buckets, self.verify, self.keep, self.corrupt = buckets, verify, keep, corrupt
        self.bytes = self.count = self.tensors = self.handed = 0

    def drain(self) -> int:
        """Receive (and discard) whatever the sender still broadcasts; returns the buckets drained."""
        return sum(1 for _ in self.buckets)

    def __iter__(self):
        for bucket in self.buckets:
            if self.corrupt is not None:  # test hook: damage a bucket in transit, after the sender's digests
                self.corrupt(bucket)
            if self.verify:
                try:
                    verify_bucket(bucket)
                except WeightSyncError:
                    self.drain()
                    raise
            self.count += 1
            self.bytes += _payload(bucket)
            self.tensors += len(bucket.metas)
            for name, tensor in bucket.tensors():
                if self.keep is None or self.keep(name):
                    self.handed += 1
                    yield name, tensor


def receive_weights(engine, group=None, *, src: int, verify: bool = True,
                    keep: Callable[[str], bool] | None = None, device: str | torch.device = "cpu",
                    _corrupt=None) -> SyncStats:
    """Receive the stream `send_weights` broadcasts from global rank `src` into `engine` (None: drop it).

    `keep(name)`: the tensors this engine needs (default: all; vLLM slices them for a TP engine). `device`:
    where the buffers are received (the group's device: "cuda" for NCCL). `_corrupt(bucket)` is a test
    hook called on each received bucket before verification. Raises WeightSyncError on a checksum
    mismatch (naming the bucket and tensors) or if the engine stops reading before the stream ends.
    """
    start = time.perf_counter()
    feed = _Received(_receive_buckets(group, src, torch.device(device)), verify, keep, _corrupt)
    stream = iter(feed)
    if engine is not None:
        try:
            engine.load_weights(stream)
        except BaseException:
            feed.drain()  # the sender is still broadcasting: receive the rest, then fail
            raise
    leftover = sum(1 for _ in stream)
    if engine is not None and leftover:
        raise WeightSyncError(f"the engine stopped reading after {feed.handed - leftover} of {feed.handed} tensors")
    stats = SyncStats(feed.bytes, time.perf_counter() - start, feed.count, feed.tensors)
    log.info("weight sync received: %d tensors (%d kept), %.1f MB in %d buckets, %.3f s (%.1f MB/s)",
             stats.tensors, feed.handed, stats.bytes / 1e6, stats.buckets, stats.seconds, stats.bytes_per_s / 1e6)
    return stats

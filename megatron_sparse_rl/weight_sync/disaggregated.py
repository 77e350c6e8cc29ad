"""Disaggregated weight sync: learner ranks broadcast checksummed buckets over a process group to rollout ranks.

    # learner ranks [0, L) (every one of them: the TP/EP gathers are collective)
    stats = send_weights(learner, group, src=0, bucket_mb=256)
    # rollout ranks [L, L+R) (each owns one engine, or None to receive and drop)
    stats = receive_weights(engine, group, src=0)

`group` holds the sender `src` (a global rank, usually learner rank 0) and every rollout rank
(`ParallelLayout.weight_sync_group(src)`, which also builds Megatron's groups over the learner ranks only);
None means the default (world) group, right only when `src` is the sole learner rank. Learner ranks other than `src` take part in the gathers of `iter_hf_tensors`
and drop the stream. Per bucket the sender broadcasts its metadata (index, names, dtypes, shapes, offsets,
BLAKE2b digests, slices) with `broadcast_object_list`, then the flat uint8 buffer with `broadcast`; a `None`
header ends the stream. gloo on CPU; on GPU the buffer travels as-is if it is on the group's device.

Engines of tensor-parallel size t > 1: with `shards=EngineShards(spec, t)` and `shard_groups` (group r: `src`
plus every rollout rank of engine TP rank r, `ParallelLayout.engine_shard_groups`), the sender cuts each
chunk of the stream (at most `bucket_mb`) into t sliced buckets and broadcasts bucket r over group r, so an
engine rank receives only its slice of every split tensor (engine_shards.py); the receiver rebuilds
full-shape, NaN-padded tensors for vLLM's loaders and raises if a loader copied NaN out of one (it read
outside the slice it was sent).
Without them every rank receives whole tensors and vLLM's loaders narrow them.

Receive side: each bucket is checksum-verified (`verify_bucket`) before its tensors reach
`engine.load_weights` (one call, fed lazily: at most one bucket beyond the engine's weights is alive).
`keep(name) -> bool` filters by name (default: all).
On a failed checksum the receiver drains the rest of the stream (the sender never blocks) and raises
WeightSyncError naming the bucket; the engine then holds partly updated weights: sync again.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_sparse_rl.weight_sync.buckets import Bucket, pack_buckets, verify_bucket
from megatron_sparse_rl.weight_sync.colocated import SyncStats
from megatron_sparse_rl.weight_sync.engine_shards import Cut, EngineShards, expand
from megatron_sparse_rl.weight_sync.export import WeightSyncError, iter_hf_tensors

log = logging.getLogger(__name__)


def _payload(bucket: Bucket) -> int:
    return sum(m.nbytes for m in bucket.metas)


def _chunks(stream: Iterator[tuple[str, torch.Tensor]], bucket_mb: float) -> Iterator[list]:
    """The stream in lists of at most `bucket_mb` MiB (a larger tensor alone), as pack_buckets groups it."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0 (got {bucket_mb})")
    limit, size, pending = int(bucket_mb * 2**20), 0, []
    for name, tensor in stream:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > limit:
            yield pending
            size, pending = 0, []
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield pending


def _outgoing(learner, bucket_mb: float, shards: EngineShards | None, groups: list) -> Iterator[tuple]:
    """(group, bucket, {name: Cut}) in sending order: one bucket stream, or per chunk one sliced bucket per group."""
    stream = iter_hf_tensors(learner)
    if shards is None:
        for bucket in pack_buckets(stream, bucket_mb=bucket_mb):
            yield groups[0], bucket, {}
        return
    counts = [0] * len(groups)
    for chunk in _chunks(stream, bucket_mb):
        for r, group in enumerate(groups):
            cuts, pieces = {}, []
            for name, tensor in chunk:
                piece, where = shards.cut(name, tensor, r)
                pieces.append((name, piece))
                if where is not None:
                    cuts[name] = where
            for bucket in pack_buckets(pieces, bucket_mb=bucket_mb):
                bucket.index, counts[r] = counts[r], counts[r] + 1
                yield group, bucket, {m.name: cuts[m.name] for m in bucket.metas if m.name in cuts}


def send_weights(learner, group=None, *, src: int, bucket_mb: float = 256.0, shards: EngineShards | None = None,
                 shard_groups: list | None = None) -> SyncStats:
    """Every learner rank calls it; global rank `src` broadcasts the buckets, the others drop them.

    Whole tensors go to `group`; with `shards` (engine TP t > 1) and `shard_groups` (t groups, group r = `src`
    + the rollout ranks of engine TP rank r) each group gets the slices its ranks keep. Stats on `src`: the
    bytes sent (every group's buckets); on the other ranks: the whole stream's bytes, 0 buckets."""
    start = time.perf_counter()
    if (shards is None) != (shard_groups is None):
        raise ValueError("send_weights: pass both shards and shard_groups, or neither")
    if shards is not None and len(shard_groups) != shards.tp:
        raise ValueError(f"send_weights: {len(shard_groups)} shard groups for an engine of {shards.tp} ranks")
    nbytes = count = tensors = 0
    if dist.get_rank() != src:  # take part in the gathers, pack nothing
        for _, tensor in iter_hf_tensors(learner):
            nbytes, tensors = nbytes + tensor.numel() * tensor.element_size(), tensors + 1
        return SyncStats(nbytes, time.perf_counter() - start, 0, tensors)
    targets = list(shard_groups) if shards is not None else [group]
    for target, bucket, cuts in _outgoing(learner, bucket_mb, shards, targets):
        count, nbytes, tensors = count + 1, nbytes + _payload(bucket), tensors + len(bucket.metas)
        dist.broadcast_object_list([(bucket.index, bucket.metas, cuts)], src=src, group=target)
        dist.broadcast(bucket.buffer, src=src, group=target)
    for target in targets:
        dist.broadcast_object_list([None], src=src, group=target)
    stats = SyncStats(nbytes, time.perf_counter() - start, count, tensors)
    log.debug("weight sync sent: %d tensors, %.1f MB in %d buckets to %d group(s), %.3f s (%.1f MB/s)",
             stats.tensors, stats.bytes / 1e6, stats.buckets, len(targets), stats.seconds, stats.bytes_per_s / 1e6)
    return stats


def _receive_buckets(group, src: int, device: torch.device) -> Iterator[tuple[Bucket, dict[str, Cut]]]:
    while True:
        header = [None]
        dist.broadcast_object_list(header, src=src, group=group)
        if header[0] is None:
            return
        index, metas, cuts = header[0]
        end = metas[-1].offset + metas[-1].nbytes if metas else 0
        buffer = torch.empty((end + 15) // 16 * 16, dtype=torch.uint8, device=device)
        dist.broadcast(buffer, src=src, group=group)
        yield Bucket(index, buffer.cpu(), list(metas)), cuts


class _Received:
    """Verified, filtered tensors of the received buckets as one (name, tensor) stream, with counters."""

    def __init__(self, buckets: Iterator[tuple[Bucket, dict]], verify: bool, keep: Callable[[str], bool] | None,
                 corrupt, reads: _SliceReads):
        self.buckets, self.verify, self.keep, self.corrupt, self.reads = buckets, verify, keep, corrupt, reads
        self.bytes = self.count = self.tensors = self.handed = self.sliced = 0

    def drain(self) -> int:
        """Receive (and discard) whatever the sender still broadcasts; returns the buckets drained."""
        return sum(1 for _ in self.buckets)

    def __iter__(self):
        for bucket, cuts in self.buckets:
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
                    if name in cuts:
                        self.sliced += 1
                        tensor = expand(tensor, cuts[name])
                        self.reads.track(name, tensor)
                    yield name, tensor


class _SliceReads(TorchFunctionMode):
    """While the engine loads: notes every rebuilt (NaN-padded) tensor from which a weight loader copies NaN,
    i.e. reads outside the slice it was sent. Only copies whose source lies in a tracked tensor's storage are
    checked (the loaders' `copy_`/`__setitem__` of a narrowed view); nothing is raised inside vLLM's loaders."""

    def __init__(self):
        super().__init__()
        self.origin: dict[int, str] = {}
        self.bad: list[str] = []

    def track(self, name: str, whole: torch.Tensor) -> None:
        self.origin[whole.untyped_storage().data_ptr()] = name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = None
        if func is torch.Tensor.copy_ and len(args) > 1:
            src = args[1]
        elif func is torch.Tensor.__setitem__ and len(args) > 2:
            src = args[2]
        if self.origin and isinstance(src, torch.Tensor) and src.is_floating_point() and src.device.type != "meta":
            name = self.origin.get(src.untyped_storage().data_ptr())
            if name is not None and name not in self.bad and bool(torch.isnan(src).any()):
                self.bad.append(name)
        return func(*args, **kwargs)


def receive_weights(engine, group=None, *, src: int, verify: bool = True,
                    keep: Callable[[str], bool] | None = None, device: str | torch.device = "cpu",
                    _corrupt=None) -> SyncStats:
    """Receive the stream `send_weights` broadcasts from global rank `src` into `engine` (None: drop it).

    `keep(name)`: the tensors this engine needs (default: all). Sliced tensors (a sender with `shards`) are
    rebuilt NaN-padded to full shape for the engine's loaders; a loader copying NaN out of one (reading
    outside its slice) fails the sync after the load. `device`:
    where the buffers are received (the group's device: "cuda" for NCCL). `_corrupt(bucket)` is a test
    hook called on each received bucket before verification. Raises WeightSyncError on a checksum
    mismatch (naming the bucket and tensors) or if the engine stops reading before the stream ends.
    """
    start = time.perf_counter()
    reads = _SliceReads()
    feed = _Received(_receive_buckets(group, src, torch.device(device)), verify, keep, _corrupt, reads)
    stream = iter(feed)
    if engine is not None:
        try:
            with reads:
                engine.load_weights(stream)
        except BaseException:
            feed.drain()  # the sender is still broadcasting: receive the rest, then fail
            raise
    leftover = sum(1 for _ in stream)
    if engine is not None and leftover:
        raise WeightSyncError(f"the engine stopped reading after {feed.handed - leftover} of {feed.handed} tensors")
    if reads.bad:
        raise WeightSyncError(
            f"the engine's weight loaders read outside the slices sent for {len(reads.bad)} of {feed.sliced} sliced "
            f"tensors, e.g. {reads.bad[:4]} (or the learner's weights hold NaN there): a rule in "
            "weight_sync/engine_shards.py does not match vLLM's loader; sync again with "
            "trainer.sync_engine_slices=false to send whole tensors")
    stats = SyncStats(feed.bytes, time.perf_counter() - start, feed.count, feed.tensors)
    log.debug("weight sync received: %d tensors (%d kept), %.1f MB in %d buckets, %.3f s (%.1f MB/s)",
             stats.tensors, feed.handed, stats.bytes / 1e6, stats.buckets, stats.seconds, stats.bytes_per_s / 1e6)
    return stats

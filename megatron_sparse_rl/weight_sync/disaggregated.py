"""Disaggregated weight sync: learner ranks broadcast checksummed buckets over a `Bridge` to rollout ranks.

    # learner ranks [0, L) (every one of them: the TP/EP gathers are collective)
    stats = send_weights(learner, group, src=0, bucket_mb=256)
    # rollout ranks [L, L+R) (each owns one engine, or None to receive and drop)
    stats = receive_weights(engine, group, src=0)

`group` is the `Bridge` (parallel/bridge.py: a gloo group joining the learner and rollout ranks' separate
worlds) of the sender `src` (a global rank, usually learner rank 0) and every rollout rank
(`ParallelLayout.weight_sync_group(src)`). Learner ranks other than `src` take part in the gathers of
`iter_hf_tensors` and drop the stream (their `group` may be None). Per bucket the sender broadcasts its metadata
(index, names, dtypes, shapes, offsets, XXH3-128 digests, slices) with `broadcast_object`, then the flat uint8
buffer with `broadcast`; a `None` header ends the stream. gloo, CPU buffers.

Engines of tensor-parallel size t > 1: with `shards=EngineShards(spec, t)` and `shard_groups` (group r: `src`
plus every rollout rank of engine TP rank r, `ParallelLayout.engine_shard_groups`), the sender cuts each
chunk of the stream (at most `bucket_mb`) into t sliced buckets and broadcasts bucket r over group r, so an
engine rank receives only its slice of every split tensor (engine_shards.py); the receiver rebuilds
full-shape, NaN-padded tensors for vLLM's loaders and raises if a loader copied NaN out of one (it read
outside the slice it was sent).
Without them every rank receives whole tensors and vLLM's loaders narrow them.

Both ends are pipelined (weight_sync/pipeline.py): the sender exports, packs and digests bucket k+1 in a thread
while bucket k is on the wire; the receiver receives bucket k+1 in a thread while the engine loads bucket k. Each
side then holds at most three buckets (the one in use, one queued, the one being produced), and its phases overlap:
they add up to more than the sync's wall time.
Receive side: each bucket is checksum-verified (`verify_bucket`) before its tensors reach
`engine.load_weights` (one call, fed lazily).
`keep(name) -> bool` filters by name (default: all). Both sides return `SyncStats` whose `phases` hold the
seconds per phase (sender: export, pack, digest, transport; receiver: transport, verify, rebuild, load).
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

from megatron_sparse_rl.weight_sync.buckets import Bucket, Feed, PhaseTimes, SyncStats, group_tensors, seal, timed
from megatron_sparse_rl.weight_sync.engine_shards import Cut, EngineShards, expand
from megatron_sparse_rl.weight_sync.export import WeightSyncError, iter_hf_tensors
from megatron_sparse_rl.weight_sync.pipeline import prefetched

log = logging.getLogger(__name__)


def _outgoing(learner, bucket_mb: float, shards: EngineShards | None, groups: list, clock: PhaseTimes,
              convert=None, only: frozenset[str] | None = None) -> Iterator[tuple[object, Bucket]]:
    """(group, bucket) in sending order: per chunk of the stream (at most `bucket_mb`, grouped as `pack_buckets`
    groups it) one bucket per group, holding whole tensors, or with `shards` the slices group r's engine rank keeps."""
    stream = timed(iter_hf_tensors(learner, convert, only), clock)
    for index, chunk in enumerate(group_tensors(stream, bucket_mb=bucket_mb)):
        for rank, group in enumerate(groups):
            bucket = seal(index, chunk, clock=clock) if shards is None else _sliced(index, chunk, shards, rank, clock)
            yield group, bucket


def _sliced(index: int, chunk: list[tuple[str, torch.Tensor]], shards: EngineShards, rank: int,
            clock: PhaseTimes) -> Bucket:
    pieces, cuts = [], {}
    for name, tensor in chunk:
        piece, where = shards.cut(name, tensor, rank)
        pieces.append((name, piece))
        if where is not None:
            cuts[name] = where
    return seal(index, pieces, cuts, clock)


def send_weights(learner, group=None, *, src: int, bucket_mb: float = 256.0, shards: EngineShards | None = None,
                 shard_groups: list | None = None, convert=None, only: frozenset[str] | None = None) -> SyncStats:
    """Every learner rank calls it; global rank `src` broadcasts the buckets, the others drop them.

    Whole tensors go to `group` (a `Bridge`; None on the other learner ranks); with `shards` (engine TP t > 1)
    and `shard_groups` (t bridges, bridge r = `src` + the rollout ranks of engine TP rank r) each bridge gets the
    slices its ranks keep; `convert(name, tensor)` replaces each HF tensor when given (the engine's weight format,
    weight_sync/engine_weights.py); `only`: those HF tensors alone (weight_sync/scope.py). Stats on `src`: the
    bytes sent (every group's buckets); on the other ranks: the whole stream's bytes, 0 buckets."""
    start = time.perf_counter()
    if (shards is None) != (shard_groups is None):
        raise ValueError("send_weights: pass both shards and shard_groups, or neither")
    if shards is not None and len(shard_groups) != shards.tp:
        raise ValueError(f"send_weights: {len(shard_groups)} shard groups for an engine of {shards.tp} ranks")
    nbytes = count = tensors = 0
    clock = PhaseTimes()
    if dist.get_rank() != src:  # take part in the gathers, pack nothing
        for _, tensor in timed(iter_hf_tensors(learner, convert, only), clock):
            nbytes, tensors = nbytes + tensor.numel() * tensor.element_size(), tensors + 1
        return SyncStats(nbytes, time.perf_counter() - start, 0, tensors, dict(clock.seconds), clock.expert_seconds)
    targets = list(shard_groups) if shards is not None else [group]
    # pack bucket k+1 (export, copy, digest: a thread of its own) while bucket k is on the wire
    for target, bucket in prefetched(_outgoing(learner, bucket_mb, shards, targets, clock, convert, only)):
        count, nbytes, tensors = count + 1, nbytes + bucket.payload, tensors + len(bucket.metas)
        sending = time.perf_counter()
        target.broadcast_object((bucket.index, bucket.metas, bucket.cuts), src=src)
        target.broadcast(bucket.buffer, src=src)
        clock.add("transport", sending)
    sending = time.perf_counter()
    for target in targets:
        target.broadcast_object(None, src=src)
    clock.add("transport", sending)
    stats = SyncStats(nbytes, time.perf_counter() - start, count, tensors, dict(clock.seconds), clock.expert_seconds)
    log.info("weight sync sent: %d tensors, %.1f MB in %d buckets to %d group(s), %.3f s (%.1f MB/s)",
             stats.tensors, stats.bytes / 1e6, stats.buckets, len(targets), stats.seconds, stats.bytes_per_s / 1e6)
    return stats


def _receive_buckets(group, src: int, clock: PhaseTimes) -> Iterator[Bucket]:
    while True:
        start = time.perf_counter()
        header = group.broadcast_object(None, src=src)
        if header is None:
            clock.add("transport", start)
            return
        bucket = Bucket.receiving(*header)  # (index, metas, cuts)
        group.broadcast(bucket.buffer, src=src)
        clock.add("transport", start)
        yield bucket


class _SliceReads(TorchFunctionMode):
    """While the engine loads: notes every rebuilt (NaN-padded) tensor from which a weight loader copies NaN,
    i.e. reads outside the slice it was sent. Only copies whose source lies in a tracked tensor's storage are
    checked (the loaders' `copy_`/`__setitem__` of a narrowed view); nothing is raised inside vLLM's loaders."""

    def __init__(self):
        super().__init__()
        self.origin: dict[int, str] = {}
        self.bad: list[str] = []
        self.sliced = 0

    def rebuild(self, name: str, piece: torch.Tensor, where: Cut) -> torch.Tensor:
        """The full-shape, NaN-padded tensor of a received slice, watched from now on."""
        whole = expand(piece, where)
        self.origin[whole.untyped_storage().data_ptr()] = name
        self.sliced += 1
        return whole

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


def receive_weights(engine, group, *, src: int, verify: bool = True, keep: Callable[[str], bool] | None = None,
                    version: int | None = None, _corrupt=None) -> SyncStats:
    """Receive the stream `send_weights` broadcasts from global rank `src` into `engine` (None: drop it), which
    then holds weight version `version` (None: its version unchanged; `RolloutEngine.load_weights`).

    `keep(name)`: the tensors this engine needs (default: all). Sliced tensors (a sender with `shards`) are
    rebuilt NaN-padded to full shape for the engine's loaders; a loader copying NaN out of one (reading
    outside its slice) fails the sync after the load. `group`: the `Bridge` from `src`. `_corrupt(bucket)` is a
    test hook called on each received bucket before verification. Raises WeightSyncError on a checksum
    mismatch (naming the bucket and tensors) or if the engine stops reading before the stream ends.
    """
    start = time.perf_counter()
    reads, clock = _SliceReads(), PhaseTimes()
    # receive bucket k+1 (a thread of its own) while the engine loads bucket k
    feed = Feed(prefetched(_receive_buckets(group, src, clock)), verify=verify, keep=keep, rebuild=reads.rebuild,
                corrupt=_corrupt, clock=clock)
    feed.load_into(engine, watch=reads, version=version)
    if reads.bad:
        raise WeightSyncError(
            f"the engine's weight loaders read outside the slices sent for {len(reads.bad)} of {reads.sliced} "
            f"sliced tensors, e.g. {reads.bad[:4]} (or the learner's weights hold NaN there): a rule in the model "
            "adapter's tensor maps (EngineSplit, weight_sync/engine_shards.py) does not match vLLM's loader; sync "
            "again with trainer.sync_engine_slices=false to send whole tensors")
    stats = feed.stats(time.perf_counter() - start)
    log.info("weight sync received: %d tensors (%d kept), %.1f MB in %d buckets, %.3f s (%.1f MB/s)",
             stats.tensors, feed.handed, stats.bytes / 1e6, stats.buckets, stats.seconds, stats.bytes_per_s / 1e6)
    return stats

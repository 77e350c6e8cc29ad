"""Colocated weight sync: the learner's weights -> this process's `RolloutEngine`, bucketed and checksummed.

    stats = sync_to_engine(learner, engine, bucket_mb=256)         # every learner rank calls it

Every learner rank must call it (it runs collectives); `engine` may be None on ranks that own no
engine: they take part in the gathers and drop the stream. What arrived is checked with
`weight_sync/verify.py`. The stream reaches the engine through ONE
`engine.load_weights` call fed lazily, bucket by bucket (`buckets.Feed`, as in a disaggregated sync); each bucket
is checksum-verified before its tensors are handed over. The two ends are pipelined (weight_sync/pipeline.py): a
thread exports (the learners' gathers), packs and digests bucket k+1 while the engine loads bucket k, so at most
three buckets (plus the tensor being gathered) are alive beyond the engine's own weights. `stats.phases` holds the
seconds per phase (export, pack, digest, verify, load; `buckets.PHASES`), which overlap.

What the checksum covers here: each tensor's digest is taken over the exported bytes (`iter_hf_tensors`' tensor,
made contiguous) and checked over the bucket bytes the engine is then given, i.e. the packing copy and the
buffer between packing and loading. In one process that mostly guards the packing code itself; it is kept on
by default because XXH3 costs about a tenth of the copy it checks (docs/weight_sync.md, "Phases").
"""
from __future__ import annotations

import logging
import time

from megatron_sparse_rl.weight_sync.buckets import Feed, PhaseTimes, SyncStats, pack_buckets, timed
from megatron_sparse_rl.weight_sync.export import iter_hf_tensors
from megatron_sparse_rl.weight_sync.pipeline import prefetched

log = logging.getLogger(__name__)


def sync_to_engine(learner, engine, *, bucket_mb: float = 256.0, verify: bool = True, convert=None,
                   version: int | None = None, only: frozenset[str] | None = None, _corrupt=None) -> SyncStats:
    """Move the learner's full weights (with `only`: those HF tensors alone, weight_sync/scope.py) into `engine`
    (None: take part in the collectives only), each HF tensor replaced by `convert(name, tensor)` when given (the
    engine's weight format: weight_sync/engine_weights.py); the engine then holds weight version `version` (None: its
    version unchanged; `RolloutEngine.load_weights`).

    Raises WeightSyncError if a bucket fails its checksum or the engine stops before the stream ends.
    `_corrupt(bucket)` is a test hook called on each bucket before verification.
    """
    start = time.perf_counter()
    clock = PhaseTimes()
    buckets = pack_buckets(timed(iter_hf_tensors(learner, convert, only), clock), bucket_mb=bucket_mb, clock=clock)
    # export, pack and digest bucket k+1 (a thread of its own) while the engine loads bucket k
    feed = Feed(prefetched(buckets), verify=verify, corrupt=_corrupt, clock=clock)
    feed.load_into(engine, version=version)
    stats = feed.stats(time.perf_counter() - start)
    log.debug("weight sync: %d tensors, %.1f MB in %d buckets, %.3f s (%.1f MB/s)", stats.tensors,
             stats.bytes / 1e6, stats.buckets, stats.seconds, stats.bytes_per_s / 1e6)
    return stats

"""Colocated weight sync: the learner's weights -> this process's `RolloutEngine`, bucketed and verified.

    stats = sync_to_engine(learner, engine, bucket_mb=256)         # every learner rank calls it
    diff = verify_logprobs(learner, engine, probe_tokens, tol=1e-4)  # every learner rank calls it

Every learner rank must call both (they run collectives); `engine` may be None on ranks that own no
engine: they take part in the gathers and drop the stream. The stream reaches the engine through ONE
`engine.load_weights` call fed lazily, bucket by bucket, so at most one bucket (plus the tensor being
gathered) is alive beyond the engine's own weights; each bucket is checksum-verified before its tensors
are handed over.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_sparse_rl.weight_sync.buckets import Bucket, pack_buckets, verify_bucket
from megatron_sparse_rl.weight_sync.export import WeightSyncError, iter_hf_tensors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncStats:
    bytes: int
    """Tensor bytes moved (bucket payload, padding excluded)."""
    seconds: float
    buckets: int
    tensors: int

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


class _Feed:
    """Verified bucket contents as one (name, tensor) stream, counting what passed through."""

    def __init__(self, buckets: Iterator[Bucket], verify: bool, corrupt=None):
        self.buckets, self.verify, self.corrupt = buckets, verify, corrupt
        self.bytes = self.count = self.tensors = 0

    def __iter__(self):
        for bucket in self.buckets:
            if self.corrupt is not None:  # test hook: damage a bucket after its checksums were taken
                self.corrupt(bucket)
            if self.verify:
                try:
                    verify_bucket(bucket)
                except WeightSyncError:
                    # finish the gathers the other ranks are running, then fail (the engine's weights are
                    # now partly updated: sync again or restart it)
                    for _ in self.buckets:
                        pass
                    raise
            self.count += 1
            self.bytes += sum(m.nbytes for m in bucket.metas)
            self.tensors += len(bucket.metas)
            yield from bucket.tensors()


def sync_to_engine(learner, engine, *, bucket_mb: float = 256.0, verify: bool = True, _corrupt=None) -> SyncStats:
    """Move the learner's full weights into `engine` (None: take part in the collectives only).

    Raises WeightSyncError if a bucket fails its checksum or the engine stops before the stream ends.
    `_corrupt(bucket)` is a test hook called on each bucket before verification.
    """
    start = time.perf_counter()
    feed = _Feed(pack_buckets(iter_hf_tensors(learner), bucket_mb=bucket_mb), verify, _corrupt)
    stream = iter(feed)
    if engine is not None:
        try:
            engine.load_weights(stream)
        except BaseException:
            for _ in stream:  # run the gathers the other ranks are waiting on, then fail
                pass
            raise
    # a rank without an engine, or an engine that stopped early: the remaining gathers must still run
    leftover = sum(1 for _ in stream)
    if engine is not None and leftover:
        raise WeightSyncError(f"the engine stopped reading after {feed.tensors - leftover} of {feed.tensors} tensors")
    stats = SyncStats(feed.bytes, time.perf_counter() - start, feed.count, feed.tensors)
    log.debug("weight sync: %d tensors, %.1f MB in %d buckets, %.3f s (%.1f MB/s)", stats.tensors,
             stats.bytes / 1e6, stats.buckets, stats.seconds, stats.bytes_per_s / 1e6)
    return stats


def _probe_rows(tokens) -> torch.Tensor:
    rows = torch.as_tensor(tokens, dtype=torch.long)
    if rows.dim() == 1:
        rows = rows[None]
    if rows.dim() != 2 or rows.shape[1] < 2:
        raise ValueError(f"probe tokens must be [B, S] with S >= 2, unpadded (got shape {tuple(rows.shape)})")
    return rows


def verify_logprobs(learner, engine, tokens, tol: float) -> float | None:
    """Max |engine prompt logprob - learner logprob| on the probe `tokens` ([B, S] or [S], no padding).

    Every learner rank calls it (the learner forward is collective); ranks with `engine` None return None.
    Raises WeightSyncError when the difference exceeds `tol`. The learner scores at temperature 1 here,
    whatever its training temperature (the engine's prompt logprobs are of the raw logits).
    """
    rows = _probe_rows(tokens)
    with learner.scoring_temperature(1.0):
        ours = learner.forward_logprobs(rows)["logprobs"]
    if engine is None:
        return None
    theirs = torch.stack(engine.prompt_logprobs(rows.tolist()))
    diff = (theirs.float() - ours.float()).abs().max().item()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not diff <= tol:
        raise WeightSyncError(f"rank {rank}: engine logprobs differ from the learner's by {diff:.3e} on the probe "
                              f"(tolerance {tol:.1e}): the weight sync moved wrong weights")
    return diff

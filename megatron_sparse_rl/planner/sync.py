"""Weight-sync time of a planned layout, learner -> rollout engines (`msrl plan ... --sync-bandwidth GBPS`).

    volume = sync_volume(shape, layout=(8, 8, 32), learner_gpus=256, gpus_per_node=8, engine_gpus=64, engines=4,
                         weight_bytes=2)
    built = as_built(volume, SyncCosts(), link_gbps=50)         # what weight_sync/disaggregated.py does
    s2s = shard_to_shard(volume, SyncCosts(), link_gbps=50)     # a scheme not built here
    built.total_s, built.bandwidth_for(2.0)                     # None: no link is fast enough

A lower bound from volumes and rates; nothing was measured on GPUs (docs/weight_sync.md "What 1T in <= 2 s takes"
has the reasoning and the numbers). Every engine rank receives its slice of every tensor-parallel tensor (what the
sliced sync sends: the adapter's EngineSplit rules, weight_sync/engine_shards.py) in the engine's dtype; the
non-transport phases cost bytes / rate, with the rates `msrl bench sync` measured (MEASURED_GBPS, overridable);
the link moves `link_gbps` GB/s per GPU (each learner and each engine GPU has one; NCCL stripes a node's
traffic over all of its GPUs' links). Phases are added, not overlapped: the sync runs them bucket after bucket,
each waiting for the last (docs/weight_sync.md "Phases"); overlapping buckets would bring a sync down towards its
largest phase (`SyncEstimate.largest_s`).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, fields

from megatron_sparse_rl.planner.memory import stage_params
from megatron_sparse_rl.planner.shapes import ModelShape

BENCH_BYTES = 397_149_184
"""Bytes one sync of `msrl bench sync` moves (its default model: 99,287,296 fp32 parameters)."""
BENCH_SECONDS = {"pack": 0.145, "digest": 0.026, "verify": 0.074, "load": 0.552}
"""Seconds of each phase of that bench's disaggregated sync (XXH3-128 digests), docs/weight_sync.md "Phases",
"After": the sender's pack (copy into buckets) and digest, the receiver's verify and load (vLLM's loaders and CPU
layerwise reload into a CPU engine). One run on a 2-core CPU machine shared with a training run."""
MEASURED_GBPS = {phase: BENCH_BYTES / s / 1e9 for phase, s in BENCH_SECONDS.items()}
"""Per-byte rates, GB/s: pack 2.74, digest 15.3, verify 5.37, load 0.719."""
LEARNER_BYTES = 2
"""Bytes per learner weight (bf16, as planner/memory.py counts them): what the gathers move."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SyncCosts:
    """Rates of the sync's per-byte phases, GB/s (1e9 bytes/s); defaults are MEASURED_GBPS (a CPU machine)."""

    pack_gbps: float = MEASURED_GBPS["pack"]
    """Copying the tensors into buckets (sender)."""
    digest_gbps: float = MEASURED_GBPS["digest"]
    """XXH3-128 over the bytes sent (sender, one thread)."""
    verify_gbps: float = MEASURED_GBPS["verify"]
    """XXH3-128 recomputed over each received bucket (every engine rank)."""
    load_gbps: float = MEASURED_GBPS["load"]
    """`engine.load_weights` of the received tensors (every engine rank)."""

    def __post_init__(self):
        for f in fields(self):
            rate = getattr(self, f.name)
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"sync cost {f.name} must be a finite number of GB/s > 0 (got {rate!r})")


@dataclass(kw_only=True, frozen=True, slots=True)
class SyncVolume:
    """What one sync moves, in bytes."""

    model_bytes: int
    """The model in the engine's dtype (every parameter once)."""
    engine_bytes: int
    """Every rank of one engine together: each rank's slices (replicated tensors once per rank), engine dtype."""
    rank_bytes: int
    """The busiest rank of one engine."""
    gather_bytes: int
    """Learner bytes learner rank 0's node does not hold: what rank 0 must receive to gather the whole model."""
    engines: int
    engine_gpus: int
    learner_gpus: int
    gpus_per_node: int


@dataclass(kw_only=True, frozen=True, slots=True)
class SyncEstimate:
    scheme: str
    link_gbps: float
    wire_bytes: float
    """Bytes through the busiest link, one after another (transport_s = wire_bytes / link rate)."""
    transport_s: float
    pack_s: float
    digest_s: float
    """Sender's digest plus receiver's verify."""
    load_s: float

    @property
    def total_s(self) -> float:
        return self.transport_s + self.pack_s + self.digest_s + self.load_s

    @property
    def largest_s(self) -> float:
        """The floor if buckets overlapped perfectly: the longest phase."""
        return max(self.transport_s, self.pack_s, self.digest_s, self.load_s)

    @property
    def per_byte_s(self) -> float:
        """The phases no link speeds up: pack, digest, load."""
        return self.pack_s + self.digest_s + self.load_s

    def bandwidth_for(self, target_s: float) -> float | None:
        """Link GB/s that brings the sync to `target_s`; None when the per-byte phases alone take that long."""
        spare = target_s - self.per_byte_s
        return self.wire_bytes / spare / 1e9 if spare > 0 else None


def engine_rank_bytes(shape: ModelShape, engine_tp: int, weight_bytes: int) -> list[int]:
    """Bytes each rank of one engine of tensor-parallel size `engine_tp` receives from a sliced sync: its slice of
    every split tensor, replicated tensors whole, `weight_bytes` per element. The slices are the ones the sync cuts
    (EngineShards over the model adapter's tensor maps); tensors of one split and shape are counted once. A DSA
    model's indexer is whole on every rank (its maps are "replicated": vLLM replicates it)."""
    from megatron_sparse_rl.models import adapter_for
    from megatron_sparse_rl.weight_sync.engine_shards import EngineShards

    shards, kinds, example = EngineShards(shape.spec, engine_tp), Counter(), {}
    for tm in adapter_for(shape.spec).tensor_maps(shape.spec):
        for name, dims, split in zip(tm.hf, tm.shapes, tm.engine_splits):
            kinds[split, dims] += 1
            example.setdefault((split, dims), name)
    out = [0] * engine_tp
    for (split, dims), n in kinds.items():
        for rank in range(engine_tp):
            cut = shards.slice_of(example[split, dims], dims, rank)
            elems = math.prod(dims) if cut is None else math.prod(dims) // dims[cut.dim] * cut.length
            out[rank] += n * elems * weight_bytes
    return out


def sync_volume(shape: ModelShape, *, layout: tuple[int, int, int], learner_gpus: int, gpus_per_node: int,
                engine_gpus: int, engines: int, weight_bytes: int) -> SyncVolume:
    """The bytes of one sync of `shape` from a learner laid out as (tp, pp, ep) to `engines` engines of
    tensor-parallel size `engine_gpus` holding `weight_bytes` per parameter. Learner rank 0's node holds at most
    `gpus_per_node` shards of the worst pipeline stage (memory.stage_params), so the gather needs the rest."""
    per_rank = engine_rank_bytes(shape, engine_gpus, weight_bytes)
    own = sum(stage_params(shape, *layout))
    node = min(gpus_per_node, learner_gpus) * own
    total = shape.total_params()
    return SyncVolume(model_bytes=total * weight_bytes, engine_bytes=sum(per_rank), rank_bytes=max(per_rank),
                      gather_bytes=round(LEARNER_BYTES * max(0.0, total - node)), engines=engines,
                      engine_gpus=engine_gpus, learner_gpus=learner_gpus, gpus_per_node=gpus_per_node)


def broadcast_rounds(members: int) -> int:
    """Rounds of gloo's broadcast over `members` ranks (gloo/broadcast.cc: a binomial tree, log2ceil(size) rounds;
    the root sends the whole buffer once per round, and each round waits for the previous one)."""
    return math.ceil(math.log2(members)) if members > 1 else 0


def _estimate(scheme: str, v: SyncVolume, c: SyncCosts, link_gbps: float, *, wire: float, sent: float) -> SyncEstimate:
    """`wire`: bytes through the busiest link in series; `sent`: bytes one sender packs and digests. Every engine
    rank verifies and loads its own `v.rank_bytes` at the same time as the others."""
    gb = 1e9
    return SyncEstimate(scheme=scheme, link_gbps=link_gbps, wire_bytes=wire, transport_s=wire / (link_gbps * gb),
                        pack_s=sent / (c.pack_gbps * gb),
                        digest_s=sent / (c.digest_gbps * gb) + v.rank_bytes / (c.verify_gbps * gb),
                        load_s=v.rank_bytes / (c.load_gbps * gb))


def as_built(v: SyncVolume, c: SyncCosts, link_gbps: float) -> SyncEstimate:
    """weight_sync/disaggregated.py: every learner rank takes part in the gathers, learner rank 0 receives the whole
    model (at best over all of its node's links), cuts every engine rank's slices, packs and digests them, and
    broadcasts slice r over bridge r (rank 0 + engine rank r of every engine; gloo, from rank 0's one link)."""
    wire = v.gather_bytes / v.gpus_per_node + broadcast_rounds(v.engines + 1) * v.engine_bytes
    return _estimate("as built (learner rank 0 gathers, slices, broadcasts)", v, c, link_gbps, wire=wire,
                     sent=v.engine_bytes)


def shard_to_shard(v: SyncVolume, c: SyncCosts, link_gbps: float) -> SyncEstimate:
    """Not built: no gather; every learner GPU packs and digests the engine slices of what it holds, once, and sends
    them to the engine ranks that need them, all links at once. The busiest link is a learner GPU's (engines x
    engine bytes shared by the learner GPUs) or an engine GPU's (its slices)."""
    wire = max(v.engines * v.engine_bytes / v.learner_gpus, v.rank_bytes)
    return _estimate("shard-to-shard (not built; every learner GPU sends what it holds)", v, c, link_gbps, wire=wire,
                     sent=v.engine_bytes / v.learner_gpus)

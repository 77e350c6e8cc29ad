"""Pack a (name, tensor) stream into fixed-size, checksummed buckets, and feed them to an engine verified.

    for bucket in pack_buckets(iter_hf_tensors(learner), bucket_mb=256):
        verify_bucket(bucket)                  # receiver side: raises WeightSyncError on corruption
        engine_weights.extend(bucket.tensors())

    feed = Feed(buckets)                       # what colocated and disaggregated sync both do with the buckets
    feed.load_into(engine)                     # one engine.load_weights call, fed lazily, bucket by bucket
    stats = feed.stats(seconds)

A `Bucket` is one flat uint8 buffer (what a transport sends in one message) plus the metadata to cut it
back into tensors. Tensors are packed whole and in stream order; one larger than the bucket size gets a
bucket of its own. Each tensor's exported bytes get an XXH3-128 digest (xxhash: faster than a memory copy; a
corrupted tensor passes with odds of about 2**-128, and every single-byte flip is caught in the tests) when packed;
`verify_bucket` recomputes them over the bytes the engine is given and names the bucket and the tensors that
differ. The digest covers the bytes only; names, dtypes, shapes and offsets travel as metadata and are checked for
consistency with the buffer. A device bucket (`seal(..., digester=DeviceDigester(device))`) is packed on the
tensors' device and digested there (weight_sync/device_digest.py, `Bucket.digest` names the algorithm);
`verify_bucket` then checks it on the buffer's device. A bucket of a sliced sync (engine_shards.py) also says where
each sliced tensor sits in its full tensor (`cuts`); `Feed` rebuilds those full-shape before the engine sees them.

Each phase of a sync is timed with one `perf_counter` pair per tensor or bucket (`PhaseTimes`, returned in
`SyncStats.phases`): export, pack, digest, transport, verify, rebuild, load (the engine's own time).
"""
from __future__ import annotations

import re
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import xxhash

from megatron_sparse_rl.weight_sync.device_digest import ALGORITHM as DEVICE_DIGEST
from megatron_sparse_rl.weight_sync.device_digest import DeviceDigester
from megatron_sparse_rl.weight_sync.engine_shards import Cut, expand
from megatron_sparse_rl.weight_sync.export import WeightSyncError

XXH3 = "xxh3_128"
"""`Bucket.digest` of a host bucket: XXH3-128 (xxhash) on the CPU."""

_ALIGN = 16  # bytes: every tensor starts aligned, so views of any dtype are valid


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


PHASES = ("export", "pack", "digest", "transport", "verify", "rebuild", "load")
"""The timed phases of a sync, in pipeline order. export: the learner's gathers and HF conversion (pulling the
next tensor of `iter_hf_tensors`); pack: copying tensors into bucket buffers; digest: the sender's checksums;
transport: disaggregated send or receive (waiting for the other side included); verify: the receiver's checksum
check; rebuild: full-shape tensors of received slices; load: `engine.load_weights` minus the time it spent
pulling the stream (vLLM's loaders, layerwise reload, MoE repack)."""


_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")
"""An HF name of one routed expert's tensor (`mlp.experts.3.`, Mixtral's `block_sparse_moe.experts.3.`): only to
attribute time to experts, never to route tensors."""


class PhaseTimes:
    """Seconds per phase of one sync, accumulated with `perf_counter` pairs (never inside per-element loops), and
    the export + engine-load seconds of routed-expert tensors (`expert_seconds`)."""

    __slots__ = ("seconds", "expert_seconds", "_lock")

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.expert_seconds = 0.0
        self._lock = threading.Lock()  # a pipelined sync times its two ends from two threads (pipeline.py)

    def expert(self, name: str, seconds: float) -> None:
        """Count `seconds` spent on tensor `name` to the experts when it is a routed expert's."""
        if _ROUTED_EXPERT.search(name):
            with self._lock:
                self.expert_seconds += seconds

    def add(self, phase: str, since: float) -> float:
        """Count `now - since` to `phase`; returns now (the start of whatever follows)."""
        now = time.perf_counter()
        with self._lock:
            self.seconds[phase] += now - since
        return now


def timed(named_tensors: Iterable[tuple[str, torch.Tensor]], clock: PhaseTimes,
          phase: str = "export") -> Iterator[tuple[str, torch.Tensor]]:
    """`named_tensors` unchanged, the time spent producing each item counted to `phase`."""
    items = iter(named_tensors)
    while True:
        start = time.perf_counter()
        item = next(items, None)
        if item is None:
            clock.add(phase, start)
            return
        clock.expert(item[0], clock.add(phase, start) - start)
        yield item


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved: colocated, sent (`send_weights`) or received (`receive_weights`)."""

    bytes: int
    """Tensor bytes moved (bucket payload, padding excluded)."""
    seconds: float
    buckets: int
    tensors: int
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (`PHASES`) on this rank; what they leave of `seconds` is untimed glue."""
    expert_seconds: float = 0.0
    """Export and engine-load seconds of the routed experts' tensors (their pack/digest/verify are per byte)."""
    full_bytes: int = 0
    """What a full sync moves (a placement's: its last full sync's bytes, weight_sync/scope.py); 0: not known."""

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    digest: bytes


@dataclass
class Bucket:
    index: int
    buffer: torch.Tensor
    """Flat uint8; tensor i occupies [metas[i].offset, + metas[i].nbytes), offsets aligned to 16 bytes."""
    metas: list[TensorMeta]
    cuts: dict[str, Cut] = field(default_factory=dict)
    """Sliced sync: name -> where that tensor's slice sits in the full tensor (tensors not named are whole)."""
    digest: str = XXH3
    """The algorithm of the metas' digests: XXH3 (host), or device_digest.ALGORITHM (on the buffer's device)."""

    @classmethod
    def receiving(cls, index: int, metas: list[TensorMeta], cuts: dict[str, Cut]) -> Bucket:
        """An empty bucket of the buffer size `metas` describe, for a transport to receive the buffer into."""
        return cls(index, torch.empty(_extent(metas), dtype=torch.uint8), list(metas), cuts)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def payload(self) -> int:
        """Tensor bytes (padding excluded)."""
        return sum(m.nbytes for m in self.metas)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views into the buffer (no copy)."""
        return [(m.name, self.buffer[m.offset:m.offset + m.nbytes].view(m.dtype).view(m.shape)) for m in self.metas]


def _digest(data: torch.Tensor) -> bytes:
    """XXH3-128 of the bytes of a contiguous CPU uint8 tensor (no copy: numpy exposes the buffer). Not a
    cryptographic hash: it guards against corruption in transit or in memory, not against an adversary."""
    return xxhash.xxh3_128_digest(data.numpy())


def _as_bytes(tensor: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def _packed_size(tensor: torch.Tensor) -> int:
    return _aligned(tensor.numel() * tensor.element_size())


def _extent(metas: list[TensorMeta]) -> int:
    return _aligned(metas[-1].offset + metas[-1].nbytes) if metas else 0


def seal(index: int, items: list[tuple[str, torch.Tensor]], cuts: dict[str, Cut] | None = None,
         clock: PhaseTimes | None = None, *, digester: DeviceDigester | None = None,
         into: torch.Tensor | None = None) -> Bucket:
    """One bucket holding `items` in order (copied, digested), whatever their size; times pack and digest.

    Without `digester`: a host bucket (CPU buffer, XXH3). With one: a device bucket, packed and digested on the
    digester's device (the host clock then times the kernels' launches, the digests' waits included). `into`: a
    uint8 buffer on that device to pack into (a sender reusing one buffer); the bucket's buffer is its head."""
    clock = clock or PhaseTimes()
    start = time.perf_counter()
    device = digester.device if digester is not None else torch.device("cpu")
    total = sum(_packed_size(tensor) for _, tensor in items)
    if into is None:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)  # padding bytes are never read or digested
    elif into.dtype != torch.uint8 or into.device.type != device.type or into.numel() < total:
        raise ValueError(f"bucket {index}: `into` must be uint8 on {device} with at least {total} bytes (got "
                         f"{into.numel()} {into.dtype} on {into.device})")
    else:
        buffer = into[:total]
    metas, offset = [], 0
    for name, tensor in items:
        raw = _as_bytes(tensor, device)
        buffer[offset:offset + raw.numel()].copy_(raw)
        start = clock.add("pack", start)
        # digest the exported bytes, not the packed copy: the receiver's check then covers the packing copy too
        digest = _digest(raw) if digester is None else digester(raw)
        metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset, raw.numel(), digest))
        start = clock.add("digest", start)
        offset = _aligned(offset + raw.numel())
    return Bucket(index, buffer, metas, dict(cuts or {}), XXH3 if digester is None else DEVICE_DIGEST)


def group_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                  bucket_mb: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream in lists that pack into at most `bucket_mb` MiB each (a larger tensor alone), in order."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0 (got {bucket_mb})")
    limit = int(bucket_mb * 2**20)
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = _packed_size(tensor)
        if pending and size + nbytes > limit:
            yield pending
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield pending


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_mb: float = 256.0,
                 clock: PhaseTimes | None = None) -> Iterator[Bucket]:
    """Group the stream into buckets of at most `bucket_mb` MiB (a larger tensor gets its own bucket)."""
    for index, items in enumerate(group_tensors(named_tensors, bucket_mb=bucket_mb)):
        yield seal(index, items, clock=clock)


def verify_bucket(bucket: Bucket, *, digester: DeviceDigester | None = None) -> None:
    """Recompute every tensor digest of `bucket`; raise WeightSyncError naming the bucket and its tensors.

    A device bucket is checked on its buffer's device with `digester` (default: an eager one there)."""
    names = [m.name for m in bucket.metas]
    if bucket.digest == DEVICE_DIGEST:
        recompute = digester or DeviceDigester(bucket.buffer.device, compiled=False)
    elif bucket.digest == XXH3:
        recompute = _digest
    else:
        raise WeightSyncError(f"bucket {bucket.index}: unknown digest algorithm {bucket.digest!r} (known: "
                              f"{XXH3!r}, {DEVICE_DIGEST!r}); tensors: {names}")
    end = _extent(bucket.metas)
    if bucket.buffer.dtype != torch.uint8 or bucket.buffer.numel() != end:
        raise WeightSyncError(f"bucket {bucket.index}: buffer of {bucket.buffer.numel()} {bucket.buffer.dtype} "
                              f"elements does not match its metadata ({end} bytes); tensors: {names}")
    bad = [m.name for m in bucket.metas if recompute(bucket.buffer[m.offset:m.offset + m.nbytes]) != m.digest]
    if bad:
        raise WeightSyncError(f"bucket {bucket.index}: checksum mismatch in {len(bad)} of {len(names)} tensors "
                              f"{bad}; the bucket holds {names}")


class Feed:
    """Buckets as ONE (name, tensor) stream for `engine.load_weights`, each bucket checksum-verified before its
    tensors are handed over, sliced tensors rebuilt full-shape; counts what passed. Both placements feed engines
    with it: colocated (the buckets packed here) and disaggregated (the buckets received).

    Pulling a bucket runs what the other ranks wait on (the learners' gathers, the sender's broadcasts), so the
    stream is always pulled to its end: a failed checksum or an engine error drains the rest, then raises (the
    engine then holds partly updated weights: sync again).
    `keep(name)`: the tensors to hand over (default all). `rebuild(name, piece, cut)`: the full-shape tensor of a
    slice (default `expand`). `corrupt(bucket)`: a test hook called on each bucket before verification.
    """

    def __init__(self, buckets: Iterable[Bucket], *, verify: bool = True, keep: Callable[[str], bool] | None = None,
                 rebuild: Callable[[str, torch.Tensor, Cut], torch.Tensor] | None = None, corrupt=None,
                 clock: PhaseTimes | None = None):
        self.buckets, self.verify, self.keep, self.corrupt = iter(buckets), verify, keep, corrupt
        self.rebuild = rebuild or (lambda name, piece, cut: expand(piece, cut))
        self.bytes = self.count = self.tensors = self.handed = 0
        self.clock = clock or PhaseTimes()
        """Times verify and rebuild here, load in `load_into`; the bucket source times its own phases."""
        self.pulling = 0.0
        """Seconds spent inside this stream (pulling buckets, verifying, rebuilding): not the engine's."""

    def drain(self) -> int:
        """Pull (and drop) the buckets still to come; returns how many."""
        return sum(1 for _ in self.buckets)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        resumed = time.perf_counter()  # the time between a yield and the next resume is the engine's
        for bucket in self.buckets:
            if self.corrupt is not None:  # test hook: damage a bucket after its checksums were taken
                self.corrupt(bucket)
            if self.verify:
                start = time.perf_counter()
                try:
                    verify_bucket(bucket)
                except WeightSyncError:
                    self.drain()
                    raise
                self.clock.add("verify", start)
            self.count += 1
            self.bytes += bucket.payload
            self.tensors += len(bucket.metas)
            for name, tensor in bucket.tensors():
                if self.keep is None or self.keep(name):
                    self.handed += 1
                    cut = bucket.cuts.get(name)
                    if cut is not None:
                        start = time.perf_counter()
                        tensor = self.rebuild(name, tensor, cut)
                        self.clock.add("rebuild", start)
                    handed = time.perf_counter()
                    self.pulling += handed - resumed
                    yield name, tensor
                    resumed = time.perf_counter()
                    self.clock.expert(name, resumed - handed)
        self.pulling += time.perf_counter() - resumed

    def load_into(self, engine, *, watch: AbstractContextManager | None = None, version: int | None = None) -> None:
        """The whole stream through ONE `engine.load_weights` call (inside `watch`), the weights then of version
        `version` (None: the engine's unchanged); engine None: drop it.

        Raises what the engine raised, WeightSyncError on a failed checksum, or WeightSyncError if the engine
        stopped reading before the stream ended."""
        stream = iter(self)
        if engine is not None:
            start, pulled = time.perf_counter(), self.pulling
            try:
                with watch or nullcontext():
                    engine.load_weights(stream, version=version)
            except BaseException:
                self.drain()
                raise
            self.clock.seconds["load"] += time.perf_counter() - start - (self.pulling - pulled)
        leftover = sum(1 for _ in stream)  # no engine, or one that stopped early: the stream must still end
        if engine is not None and leftover:
            raise WeightSyncError(f"the engine stopped reading after {self.handed - leftover} of {self.handed} tensors")

    def stats(self, seconds: float) -> SyncStats:
        return SyncStats(self.bytes, seconds, self.count, self.tensors, dict(self.clock.seconds),
                         self.clock.expert_seconds)

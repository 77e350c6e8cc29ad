"""Pack a (name, tensor) stream into fixed-size, checksummed buckets and verify them on arrival.

    for bucket in pack_buckets(iter_hf_tensors(learner), bucket_mb=256):
        verify_bucket(bucket)                  # receiver side: raises WeightSyncError on corruption
        engine_weights.extend(bucket.tensors())

A `Bucket` is one flat uint8 buffer (what a transport sends in one message) plus the metadata to cut it
back into tensors. Tensors are packed whole and in stream order; one larger than the bucket size gets a
bucket of its own. Each tensor's bytes get a BLAKE2b digest (exact: any flipped bit changes it) when
packed; `verify_bucket` recomputes them and names the bucket and the tensors that differ. The digest
covers the bytes only; names, dtypes, shapes and offsets travel as metadata and are checked for
consistency with the buffer.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from megatron_sparse_rl.weight_sync.export import WeightSyncError

_DIGEST_BYTES = 16
_ALIGN = 16  # bytes: every tensor starts aligned, so views of any dtype are valid


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


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

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views into the buffer (no copy)."""
        return [(m.name, self.buffer[m.offset:m.offset + m.nbytes].view(m.dtype).view(m.shape)) for m in self.metas]


def _digest(data: torch.Tensor) -> bytes:
    """BLAKE2b over the bytes of a contiguous CPU uint8 tensor (no copy: numpy exposes the buffer)."""
    return hashlib.blake2b(data.numpy(), digest_size=_DIGEST_BYTES).digest()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _seal(index: int, items: list[tuple[str, torch.Tensor]], total: int) -> Bucket:
    buffer = torch.empty(total, dtype=torch.uint8)  # padding bytes are never read or digested
    metas, offset = [], 0
    for name, tensor in items:
        raw = _as_bytes(tensor)
        piece = buffer[offset:offset + raw.numel()]
        piece.copy_(raw)
        # digest the packed copy: what the receiver will check is exactly what was sent
        metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset, raw.numel(), _digest(piece)))
        offset = _aligned(offset + raw.numel())
    return Bucket(index, buffer, metas)


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_mb: float = 256.0) -> Iterator[Bucket]:
    """Group the stream into buckets of at most `bucket_mb` MiB (a larger tensor gets its own bucket)."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0 (got {bucket_mb})")
    limit = int(bucket_mb * 2**20)
    pending: list[tuple[str, torch.Tensor]] = []
    size, index = 0, 0
    for name, tensor in named_tensors:
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if pending and size + nbytes > limit:
            yield _seal(index, pending, size)
            index, pending, size = index + 1, [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield _seal(index, pending, size)


def verify_bucket(bucket: Bucket) -> None:
    """Recompute every tensor digest of `bucket`; raise WeightSyncError naming the bucket and its tensors."""
    names = [m.name for m in bucket.metas]
    end = _aligned(bucket.metas[-1].offset + bucket.metas[-1].nbytes) if bucket.metas else 0
    if bucket.buffer.dtype != torch.uint8 or bucket.buffer.numel() != end:
        raise WeightSyncError(f"bucket {bucket.index}: buffer of {bucket.buffer.numel()} {bucket.buffer.dtype} "
                              f"elements does not match its metadata ({end} bytes); tensors: {names}")
    bad = [m.name for m in bucket.metas if _digest(bucket.buffer[m.offset:m.offset + m.nbytes]) != m.digest]
    if bad:
        raise WeightSyncError(f"bucket {bucket.index}: checksum mismatch in {len(bad)} of {len(names)} tensors "
                              f"{bad}; the bucket holds {names}")

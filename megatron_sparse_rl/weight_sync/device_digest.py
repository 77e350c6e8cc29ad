"""A 128-bit corruption digest of a contiguous uint8 tensor, computed with torch integer ops on the tensor's own
device: the bytes never leave it, only the 16-byte result comes back. CPU and CUDA give the same bytes.

    digester = DeviceDigester(torch.device("cuda"))    # compiles its kernel on CUDA (eager where that fails)
    digest = digester(buffer[offset:offset + nbytes])  # 16 bytes; digester.path says "compiled" or "eager"

NOT cryptographic: it guards weight-sync buffers against corruption in transit or in memory (every single-word
change alters it; see the formula), not against an adversary who can choose the bytes.

The formula (`ALGORITHM`), all arithmetic modulo 2**64 on unsigned 64-bit values:
- the n bytes, zero-padded to a multiple of 4, are little-endian 32-bit words w_i, i = 0 .. m-1;
- lane l in (0, 1): x_i = w_i + i * 2**32 + S_l, and L_l = sum_i fmix_l(x_i); fmix_l is a bijective 64-bit
  finalizer (lane 0: splitmix64's, lane 1: MurmurHash3's fmix64), so a word changed at one index always changes
  its term; the sum is order independent, hence the same on every device whatever the reduction order;
- h_l = fmix_l(L_l ^ fmix_l(n + S_l)) (the byte length mixed in: trailing zero bytes count);
- digest = h_0 then h_1, 8 little-endian bytes each.
Words are processed in chunks of `CHUNK_BYTES` (bounding the int64 temporaries of the eager path), each as rows
of `ROW_WORDS` words summed per row, then over the rows: a reduction of many parallel rows, which Inductor spreads
over the whole GPU (a 1-D reduction of dynamic length was measured at 115 GB/s on an H100); the words after the
last whole row and the zero-padded tail go in one more single-row call.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ALGORITHM = "msrl_mix128"
"""The name a bucket records for digests made here (buckets.py `Bucket.digest`)."""

CHUNK_BYTES = 64 * 2**20
"""Bytes digested per kernel call: the eager path holds a few int64 temporaries of CHUNK_BYTES * 2 each."""

ROW_WORDS = 4096
"""Words per row of a chunk (CHUNK_BYTES is a multiple of the row's bytes)."""

_MASK64 = 2**64 - 1

LANES = (
    (0x9E3779B97F4A7C15, (30, 0xBF58476D1CE4E5B9, 27, 0x94D049BB133111EB, 31)),  # splitmix64
    (0xD1B54A32D192ED03, (33, 0xFF51AFD7ED558CCD, 33, 0xC4CEB9FE1A85EC53, 33)),  # MurmurHash3 fmix64
)
"""Per lane: (S_l, (shift, multiplier, shift, multiplier, shift) of fmix_l)."""


def _signed(value: int) -> int:
    """The int64 with the bits of unsigned 64-bit `value`."""
    return value - 2**64 if value >= 2**63 else value


def _constants(device: torch.device) -> torch.Tensor:
    """[2**32, S_0, m_0a, m_0b, S_1, m_1a, m_1b] as int64 on `device`. Tensors, not Python literals: Inductor
    splits the index into x0 * BLOCK + r0 and would fold a literal multiplier into a constant Triton cannot
    represent (seen on an H100 with torch 2.11)."""
    values = [2**32]
    for seed, (_, m1, _, m2, _) in LANES:
        values += [seed, m1, m2]
    return torch.tensor([_signed(v) for v in values], dtype=torch.int64, device=device)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _fmix(z: torch.Tensor, s1: int, m1: torch.Tensor, s2: int, m2: torch.Tensor, s3: int) -> torch.Tensor:
    z = (z ^ _shr(z, s1)) * m1  # int64 multiplication wraps (two's complement) on CPU, CUDA and Triton alike
    z = (z ^ _shr(z, s2)) * m2
    return z ^ _shr(z, s3)


def lane_sums(words: torch.Tensor, base: torch.Tensor, consts: torch.Tensor) -> torch.Tensor:
    """[L_0, L_1] (int64 bits) of int32 `words` (rows, cols), row-major, whose first word has index `base`
    (0-dim int64)."""
    rows, cols = words.shape
    index = torch.arange(rows * cols, device=words.device, dtype=torch.int64).view(rows, cols) + base
    x = (words.to(torch.int64) & 0xFFFFFFFF) + index * consts[0]
    sums = []
    for lane, (_, (s1, _, s2, _, s3)) in enumerate(LANES):
        seed, m1, m2 = consts[1 + 3 * lane], consts[2 + 3 * lane], consts[3 + 3 * lane]
        sums.append(_fmix(x + seed, s1, m1, s2, m2, s3).sum(dim=1).sum())
    return torch.stack(sums)


def _fmix_int(z: int, lane: int) -> int:
    s1, m1, s2, m2, s3 = LANES[lane][1]
    z = ((z ^ (z >> s1)) * m1) & _MASK64
    z = ((z ^ (z >> s2)) * m2) & _MASK64
    return z ^ (z >> s3)


def finish(sums: list[int], nbytes: int) -> bytes:
    """The 16-byte digest of lane sums `sums` (any int representation of their 64 bits) over `nbytes` bytes."""
    out = b""
    for lane, total in enumerate(sums):
        length = _fmix_int((nbytes + LANES[lane][0]) & _MASK64, lane)
        out += _fmix_int((total & _MASK64) ^ length, lane).to_bytes(8, "little")
    return out


def check_bytes(data: torch.Tensor) -> None:
    """Raise unless `data` is a contiguous 1-D uint8 tensor (what a digest is taken of)."""
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError(f"a device digest takes a contiguous 1-D uint8 tensor (got {data.dtype}, shape "
                         f"{tuple(data.shape)}, contiguous={data.is_contiguous()}): view the tensor's bytes with "
                         f"t.contiguous().reshape(-1).view(torch.uint8)")


class DeviceDigester:
    """Digests (the formula above) of uint8 tensors on `device`, with one chunk kernel: torch.compile'd when
    `compiled` (default: on CUDA), else eager torch ops. `path` says which one ran: "compiled", or "eager" (asked
    for, or the compile failed: then logged as a warning with the error, and `compile_error` holds it)."""

    def __init__(self, device: torch.device | str, *, compiled: bool | None = None):
        self.device = torch.device(device)
        want = self.device.type == "cuda" if compiled is None else compiled
        self.path = "compiled" if want else "eager"
        self.compile_error: str | None = None
        self._consts = _constants(self.device)
        self._kernel = torch.compile(lane_sums, dynamic=True, fullgraph=True) if want else lane_sums

    def _sums(self, words: torch.Tensor, base: int) -> torch.Tensor:
        base_t = torch.full((), base, dtype=torch.int64, device=words.device)  # a fill kernel, no host copy
        if self.path == "compiled":
            try:
                return self._kernel(words, base_t, self._consts)
            except Exception as e:  # noqa: BLE001 - any compile failure: the eager ops compute the same sums
                self.path, self.compile_error, self._kernel = "eager", f"{type(e).__name__}: {e}", lane_sums
                logger.warning("device digest: torch.compile failed on %s, using eager torch ops: %s",
                               self.device, self.compile_error[:500])
        return self._kernel(words, base_t, self._consts)

    def __call__(self, data: torch.Tensor) -> bytes:
        """The 16-byte digest of `data` (contiguous 1-D uint8 on this digester's device)."""
        check_bytes(data)
        if data.device.type != self.device.type:
            raise ValueError(f"this digester runs on {self.device}; the data is on {data.device}")
        n = data.numel()
        rows_end = n - n % (4 * ROW_WORDS)
        acc = torch.zeros(2, dtype=torch.int64, device=data.device)
        for start in range(0, rows_end, CHUNK_BYTES):
            chunk = data[start:min(start + CHUNK_BYTES, rows_end)]
            if chunk.data_ptr() % 4:  # an unaligned slice cannot be viewed as int32: an aligned copy, same device
                chunk = chunk.clone()
            acc += self._sums(chunk.view(torch.int32).view(-1, ROW_WORDS), start // 4)
        if n > rows_end:  # the last part row and the tail bytes, zero-padded to whole words (< 16 KiB copied)
            rest = torch.zeros(-(-(n - rows_end) // 4) * 4, dtype=torch.uint8, device=data.device)
            rest[:n - rows_end] = data[rows_end:]
            acc += self._sums(rest.view(torch.int32).view(1, -1), rows_end // 4)
        return finish(acc.tolist(), n)  # the only device-to-host transfer: 16 bytes


def device_digest(data: torch.Tensor) -> bytes:
    """The digest of `data` with eager torch ops on its device (no compile): for a one-off digest."""
    return DeviceDigester(data.device, compiled=False)(data)

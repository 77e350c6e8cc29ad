"""The device digest (weight_sync/device_digest.py) on CPU against an independent numpy uint64 implementation of its
formula (written from the module docstring) on random data of odd lengths, several chunks included; every sampled
single-byte flip and a swap of two words change it; the empty input has a digest; non-uint8, non-contiguous and
multi-dimensional inputs are refused naming what is allowed. Device buckets: packed with a digester, verified, a
flipped byte refused by tensor name.

    .venv/bin/python -m pytest -q tests/unit/test_device_digest.py
"""
import numpy as np
import pytest
import torch

from megatron_sparse_rl.weight_sync import WeightSyncError
from megatron_sparse_rl.weight_sync import device_digest as D
from megatron_sparse_rl.weight_sync.buckets import seal, verify_bucket

SEEDS = (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03)
MIXERS = ((30, 0xBF58476D1CE4E5B9, 27, 0x94D049BB133111EB, 31), (33, 0xFF51AFD7ED558CCD, 33, 0xC4CEB9FE1A85EC53, 33))


def _fmix(z, lane):
    s1, m1, s2, m2, s3 = (np.uint64(v) for v in MIXERS[lane])
    z = (z ^ (z >> s1)) * m1
    z = (z ^ (z >> s2)) * m2
    return z ^ (z >> s3)


def reference(data: bytes) -> bytes:
    """The formula in numpy uint64 arithmetic (wrapping, logical shifts), one pass, no chunks."""
    n = len(data)
    padded = data + b"\0" * (-n % 4)
    words = np.frombuffer(padded, dtype="<u4").astype(np.uint64)
    index = np.arange(words.size, dtype=np.uint64)
    out = b""
    with np.errstate(over="ignore"):
        for lane in (0, 1):
            x = words + (index << np.uint64(32)) + np.uint64(SEEDS[lane])
            total = np.add.reduce(_fmix(x, lane), dtype=np.uint64)  # wraps modulo 2**64; 0 when empty
            length = _fmix(np.array([n], np.uint64) + np.uint64(SEEDS[lane]), lane)[0]
            out += int(_fmix(np.array([total ^ length], np.uint64), lane)[0]).to_bytes(8, "little")
    return out


def _bytes(n, seed=0):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 3, 4, 5, 1001, 4099, 65_537, 100_003])
def test_digest_equals_numpy_reference(n):
    data = _bytes(n, seed=n)
    assert D.device_digest(data) == reference(data.numpy().tobytes())


def test_chunks_and_unaligned_slices_match_the_reference(monkeypatch):
    monkeypatch.setattr(D, "ROW_WORDS", 64)
    monkeypatch.setattr(D, "CHUNK_BYTES", 1024)  # several chunks of 4 rows, then a part row and a tail
    data = _bytes(10_003, seed=7)
    assert D.device_digest(data) == reference(data.numpy().tobytes())
    assert D.device_digest(data[1:5002]) == reference(data[1:5002].numpy().tobytes())  # not 4-byte aligned


def test_empty_input():
    empty = torch.empty(0, dtype=torch.uint8)
    assert D.device_digest(empty) == reference(b"")
    assert len(D.device_digest(empty)) == 16
    assert D.device_digest(empty) != D.device_digest(torch.zeros(4, dtype=torch.uint8))  # length counts


def test_every_sampled_byte_flip_and_a_word_swap_change_it():
    data = _bytes(4103, seed=1)
    clean = D.device_digest(data)
    for pos in list(range(0, 4103, 37)) + [4102]:
        for flip in (1, 0x80, 0xFF):
            bad = data.clone()
            bad[pos] ^= flip
            assert D.device_digest(bad) != clean, (pos, flip)
    words = data[:4100].clone().view(torch.int32)
    words[[3, 700]] = words[[700, 3]]
    assert D.device_digest(torch.cat([words.view(torch.uint8), data[4100:]])) != clean


@pytest.mark.parametrize("bad", [torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.uint8)[::2],
                                 torch.zeros(2, 4, dtype=torch.uint8)], ids=["int32", "strided", "2-d"])
def test_refuses_other_inputs(bad):
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        D.device_digest(bad)


def test_device_bucket_is_verified_and_names_a_corrupted_tensor():
    digester = D.DeviceDigester("cpu")
    items = [("a", torch.randn(5, 3)), ("b", torch.randn(7, dtype=torch.float64).to(torch.bfloat16))]
    bucket = seal(0, items, digester=digester)
    assert bucket.digest == D.ALGORITHM and digester.path == "eager"
    assert [m.digest for m in bucket.metas] == [reference(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                                                for _, t in items]
    verify_bucket(bucket, digester=digester)
    bucket.buffer[bucket.metas[1].offset] ^= 1
    with pytest.raises(WeightSyncError, match=r"checksum mismatch in 1 of 2 tensors \['b'\]"):
        verify_bucket(bucket, digester=digester)

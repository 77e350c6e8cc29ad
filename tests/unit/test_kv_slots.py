"""kv/slots.py: the sparse-KV worker's K/V reads and compaction copy. On every layout the worker discovers (vLLM's CPU
per-head cache, K transposed and V in rows, at both CPU block shapes; its CPU MLA latent cache, one 512 + 64 row per
token) and on hand-made ones (K | V per token as the GPU test's cache; runs of D not starting at a multiple of D; a
K column layout), with random caches (random bits, NaNs included), random shuffled block tables and random
ascending keep sets, the row path must leave the whole cache bit-identical to the element path, and both must
match a loop that copies entry by entry through the discovered element offsets.

    .venv/bin/python -m pytest -q tests/unit/test_kv_slots.py
"""
from types import SimpleNamespace

import pytest
import torch

from megatron_sparse_rl.kv.slots import SlotIndex

REQUESTS, BLOCKS_EACH, STORED, BUDGET = 3, 5, 70, 23


def _vllm_layouts(isa: str, block_size: int, heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(K index, V index, block_len) that `discover_slot_layout` finds through vLLM's CPU attention KV writer."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from megatron_sparse_rl.kv.vllm_worker import discover_slot_layout

    impl = SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype="auto")
    impl.do_kv_cache_update = lambda *a: CPUAttentionBackendImpl.do_kv_cache_update(impl, *a)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, impl=impl)
    cache = torch.zeros(2, heads, block_size, 2 * d, dtype=torch.bfloat16)
    k, v = discover_slot_layout(layer, cache)
    return k, v, cache[0].numel()


def _vllm_latent_layout(block_size: int, rank: int, rope: int) -> tuple[torch.Tensor, int]:
    """(latent index, block_len) that `discover_latent_layout` finds through vLLM's CPU MLA latent writer."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from megatron_sparse_rl.kv.vllm_worker import discover_latent_layout

    impl = SimpleNamespace(do_kv_cache_update=lambda *a: CPUMLAImpl.do_kv_cache_update(None, *a))
    layer = SimpleNamespace(kv_lora_rank=rank, impl=impl)
    cache = torch.zeros(2, block_size, rank + rope, dtype=torch.bfloat16)
    return discover_latent_layout(layer, cache), cache[0].numel()


def _token_major(heads: int, block_size: int, d: int, header: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K | V of each token side by side per head ([H, block_size, 2D] in a block), after `header` elements."""
    element = header + torch.arange(heads * block_size * 2 * d).view(heads, block_size, 2 * d)
    return element[..., :d].contiguous(), element[..., d:].contiguous(), header + element.numel()


def _random_case(index: SlotIndex, seed: int):
    """(cache [blocks, block_len] of random bf16 bits, block tables [R, BLOCKS_EACH], keep [R, H, BUDGET])."""
    g = torch.Generator().manual_seed(seed)
    nb = REQUESTS * BLOCKS_EACH + 4  # some blocks no request holds
    bits = torch.randint(-2**15, 2**15, (nb, index.block_len), generator=g, dtype=torch.int16)
    blocks = torch.randperm(nb, generator=g)[: REQUESTS * BLOCKS_EACH].view(REQUESTS, BLOCKS_EACH)
    stored = min(STORED, BLOCKS_EACH * index.block_size)
    keep = torch.stack([torch.randperm(stored, generator=g)[:BUDGET].sort().values
                        for _ in range(REQUESTS * index.heads)]).view(REQUESTS, index.heads, BUDGET)
    return bits.view(torch.bfloat16), blocks, keep


def _loop_copy(cache: torch.Tensor, element: torch.Tensor, blocks: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The compacted cache by hand: each kept entry's D elements read from the original, written slot by slot."""
    out, bs = cache.clone(), element.shape[1]
    for r in range(keep.shape[0]):
        for h in range(keep.shape[1]):
            for n, s in enumerate(keep[r, h].tolist()):
                out[blocks[r, n // bs], element[h, n % bs]] = cache[blocks[r, s // bs], element[h, s % bs]]
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def _check(element: torch.Tensor, block_len: int, rows: bool, seed: int) -> None:
    """The row path (if `rows`) or the element path (else) is what `SlotIndex.of` picks; read and copy give the
    element path's bits on the whole cache, and the copy gives the hand loop's."""
    chosen = SlotIndex.of(element, block_len)
    assert (chosen.row is not None) == rows
    by_element = SlotIndex(element, None, block_len)
    cache, blocks, keep = _random_case(chosen, seed)
    slots = torch.arange(BUDGET + 5).expand(REQUESTS, chosen.heads, -1)
    assert torch.equal(_bits(chosen.read(cache, blocks, slots)), _bits(by_element.read(cache, blocks, slots)))
    dst = torch.arange(BUDGET).expand(REQUESTS, chosen.heads, BUDGET)
    a, b = cache.clone(), cache.clone()
    chosen.copy(a, blocks, keep, dst)
    by_element.copy(b, blocks, keep, dst)
    assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(a), _bits(_loop_copy(cache, element, blocks, keep)))
    assert not torch.equal(_bits(a), _bits(cache))  # something moved


@pytest.mark.parametrize("isa,block_size", [("vec", 32), ("vec16", 16)])
def test_vllm_cpu_cache_k_by_element_v_by_row(isa, block_size):
    k, v, block_len = _vllm_layouts(isa, block_size, heads=2, d=64)
    _check(k, block_len, rows=False, seed=1)  # the vec ISAs store K transposed: element path
    _check(v, block_len, rows=True, seed=2)


def test_vllm_cpu_latent_cache_by_row_of_576():
    index, block_len = _vllm_latent_layout(block_size=16, rank=512, rope=64)
    assert index.shape == (1, 16, 576)
    _check(index, block_len, rows=True, seed=3)


def test_k_and_v_side_by_side_by_row():
    k, v, block_len = _token_major(heads=4, block_size=8, d=16)
    _check(k, block_len, rows=True, seed=4)
    _check(v, block_len, rows=True, seed=5)


def test_runs_not_at_a_multiple_of_d_by_element():
    k, v, block_len = _token_major(heads=2, block_size=8, d=16, header=8)
    _check(k, block_len, rows=False, seed=6)
    _check(v, block_len, rows=False, seed=7)


def test_block_not_a_multiple_of_d_by_element():
    k, _, block_len = _token_major(heads=2, block_size=8, d=16)
    _check(k, block_len + 8, rows=False, seed=8)


def test_k_columns_by_element():
    heads, bs, d = 2, 8, 16
    k = torch.arange(heads * bs * d).view(heads, d, bs).transpose(1, 2).contiguous()
    _check(k, heads * bs * d, rows=False, seed=9)


def test_rows_refuse_a_cache_of_other_blocks():
    k, _, block_len = _token_major(heads=2, block_size=8, d=16)
    index = SlotIndex.of(k, block_len)
    with pytest.raises(ValueError, match="blocks of 1024 elements, the layout was found on blocks of 512"):
        index.read(torch.zeros(4, 2 * block_len), torch.zeros(1, 1, dtype=torch.int64),
                   torch.zeros(1, 2, 1, dtype=torch.int64))

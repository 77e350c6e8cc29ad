"""Where one block's K (or V, or latent row) entries lie in a layer's KV cache, and how the sparse-KV worker
(kv/vllm_worker.py) reads and moves them: element by element through the discovered index, or, where the layout
stores every (head, slot) entry as one run of D consecutive elements starting at a multiple of D, as whole rows of
the cache viewed as [-1, D] (an index D times smaller, D-wide loads and stores). Both paths give the same bits;
`SlotIndex.of` takes the row path wherever the layout allows it, once per layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotIndex:
    """One layout of K (or V) entries in the blocks of a layer's cache flattened to [blocks, block_len]."""

    element: torch.Tensor
    """int64 [heads, block_size, D]: offset, within one block, of element d of head h's entry at block slot s (as
    `discover_slot_layout` / `discover_latent_layout` return it)."""
    row: torch.Tensor | None
    """int64 [heads, block_size]: the same entries as rows of D elements within one block, or None where the layout
    does not store them as aligned runs of D (they are then moved element by element)."""
    block_len: int
    """Elements in one block of the cache."""

    @classmethod
    def of(cls, element: torch.Tensor, block_len: int) -> SlotIndex:
        """The index of layout `element` in blocks of `block_len` elements, with rows where every entry is an
        aligned run (element[h, s, d] = element[h, s, 0] + d, element[h, s, 0] % D == 0, block_len % D == 0)."""
        d = element.shape[-1]
        start = element[..., :1]
        runs = torch.equal(element - start, torch.arange(d, device=element.device).expand_as(element))
        aligned = block_len % d == 0 and not bool((start % d).any())
        return cls(element, start[..., 0] // d if runs and aligned else None, block_len)

    @property
    def heads(self) -> int:
        return self.element.shape[0]

    @property
    def block_size(self) -> int:
        return self.element.shape[1]

    @property
    def head_dim(self) -> int:
        return self.element.shape[2]

    def read(self, flat: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """[R, H, N, D]: the entries at stored token indices `slots` [R, H, N] of R requests whose block tables are
        `blocks` [R, blocks each], from one layer's cache `flat` [blocks, block_len]."""
        if self.row is None:
            return flat[self._elements(blocks, slots)]
        return self._rows_of(flat)[self._rows(blocks, slots)]

    def copy(self, flat: torch.Tensor, blocks: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Write the entries at stored indices `src` [R, H, N] onto those at `dst` [R, H, N] (same requests and
        block tables as in `read`), every source read before any destination is written."""
        if self.row is None:
            flat[self._elements(blocks, dst)] = flat[self._elements(blocks, src)]
        else:
            rows = self._rows_of(flat)
            rows[self._rows(blocks, dst)] = rows[self._rows(blocks, src)]

    def _block_and_slot(self, blocks: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, H, N], [R, H, N]): the cache block and the in-block slot of each stored index in `slots`."""
        req = torch.arange(blocks.shape[0], device=slots.device)[:, None, None]
        return blocks[req, slots // self.block_size], slots % self.block_size

    def _elements(self, blocks: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, H, N, 1], [R, H, N, D]): block and in-block offset of every element of the entries at `slots`."""
        b, o = self._block_and_slot(blocks, slots)
        h = torch.arange(self.heads, device=slots.device)[None, :, None, None]
        return b[..., None], self.element[h, o[..., None], torch.arange(self.head_dim, device=slots.device)]

    def _rows(self, blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """[R, H, N]: the row, in the cache viewed as [-1, D], of every entry at `slots`."""
        b, o = self._block_and_slot(blocks, slots)
        h = torch.arange(self.heads, device=slots.device)[None, :, None]
        return b * (self.block_len // self.head_dim) + self.row[h, o]

    def _rows_of(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.shape[1] != self.block_len:
            raise ValueError(f"sparse KV: cache blocks of {flat.shape[1]} elements, the layout was found on blocks of "
                             f"{self.block_len}")
        return flat.view(-1, self.head_dim)

"""The last `window` queries of every running request, per attention layer, kept for the score policies (R-KV,
SnapKV) in one ring buffer per layer, written for all requests of a step at once (kv/vllm_worker.py).

    windows = QueryWindows(layers=2, window=8)
    plan = windows.plan(req_ids, qsl)           # once per engine step: which tokens go where
    windows.write(0, plan, q)                   # per layer: q [plan.tokens, heads, D] (the tokens plan.token picks)
    windows.get(0, "req-1")                     # [heads, n <= window, D], oldest first
    windows.release("req-1")                    # finished or preempted

A request's slot holds its queries at ring positions; `get` returns them in the order they were written.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class WritePlan:
    """One step's writes: token[i] (a row of the step's query tensor) goes to slot[i], ring position ring[i]."""

    token: torch.Tensor
    slot: torch.Tensor
    ring: torch.Tensor


class QueryWindows:
    """Per layer a float32 buffer [slots, heads, window, D], grown on demand; a slot per running request."""

    def __init__(self, layers: int, window: int):
        self.window = window
        self.bufs: list[torch.Tensor | None] = [None] * layers
        self.slots: dict[str, int] = {}
        self.free: list[int] = []
        self.written = np.zeros(0, dtype=np.int64)  # queries written per slot since it was taken

    def _slot(self, rid: str) -> int:
        slot = self.slots.get(rid)
        if slot is None:
            slot = self.free.pop() if self.free else len(self.slots)
            self.slots[rid] = slot
            if slot >= len(self.written):
                self.written = np.concatenate([self.written, np.zeros(max(16, len(self.written)), dtype=np.int64)])
            self.written[slot] = 0
        return slot

    def release(self, rid: str) -> None:
        slot = self.slots.pop(rid, None)
        if slot is not None:
            self.free.append(slot)

    def plan(self, req_ids: list[str], qsl: np.ndarray) -> WritePlan:
        """The writes of a step whose request r has query rows qsl[r]..qsl[r + 1] - 1: each request's last
        `window` rows. Advances the ring positions (call once per step, before the layers write)."""
        tokens, slots, rings = [], [], []
        for row, rid in enumerate(req_ids):
            a, b = int(qsl[row]), int(qsl[row + 1])
            if b <= a:
                continue
            a = max(a, b - self.window)
            slot = self._slot(rid)
            start = int(self.written[slot])
            tokens.append(np.arange(a, b))
            slots.append(np.full(b - a, slot))
            rings.append((start + np.arange(b - a)) % self.window)
            self.written[slot] = start + b - a
        if not tokens:
            empty = torch.zeros(0, dtype=torch.int64)
            return WritePlan(empty, empty, empty)
        return WritePlan(*(torch.from_numpy(np.concatenate(x).astype(np.int64)) for x in (tokens, slots, rings)))

    def write(self, layer: int, plan: WritePlan, q: torch.Tensor) -> None:
        """q float32 [len(plan.token), heads, D]: the queries of the planned rows, in plan order."""
        buf = self.bufs[layer]
        need = int(plan.slot.max()) + 1 if len(plan.slot) else 0
        if buf is None or buf.shape[0] < need:
            grown = q.new_zeros((max(need, 16, 2 * (0 if buf is None else buf.shape[0])), q.shape[1], self.window,
                                 q.shape[2]))
            if buf is not None:
                grown[:buf.shape[0]] = buf
            self.bufs[layer] = buf = grown
        buf[plan.slot, :, plan.ring] = q

    def get(self, layer: int, rid: str) -> torch.Tensor | None:
        """[heads, n, D] float32, the request's last n <= window queries at this layer, oldest first (None: none)."""
        slot = self.slots.get(rid)
        buf = self.bufs[layer]
        if slot is None or buf is None or self.written[slot] == 0:
            return None
        n = int(self.written[slot])
        if n <= self.window:
            return buf[slot, :, :n]
        return torch.roll(buf[slot], -(n % self.window), dims=1)

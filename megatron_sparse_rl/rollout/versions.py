"""Which weight version sampled each token of a rollout, when the engine's weights change while it samples
(asynchronous RL's in-flight updates, docs/async.md).

    log = VersionLog(start=3)                       # the engine held version 3 when the requests were added
    log.update(4, {("0", 0): 5, ("0", 1): 2})       # version 4 loaded after 5 and 2 tokens of those samples
    versions = log.token_versions([("0", 0), ("0", 1), ("1", 0)], width=8)   # int64 [3, 8]

A sample absent from an update's counts had already finished (it keeps `start` throughout); a sample that had
not started yet is counted with 0 tokens (all of its tokens are newer).

    too_stale(token_version, response_mask, version=7, bound=2)   # bool [B]: a token older than version 5
"""
from __future__ import annotations

import torch

Key = tuple[str, int]
"""(output request id, sample index): one sampled sequence."""


class VersionLog:
    """The weight versions an engine loaded while one `generate` ran, and how far each sample had got."""

    def __init__(self, start: int):
        self.start = start
        self.updates: list[tuple[int, dict[Key, int]]] = []

    def update(self, version: int, counts: dict[Key, int]) -> None:
        """Version `version` loaded after `counts[key]` tokens of each unfinished sample."""
        last = self.updates[-1][0] if self.updates else self.start
        if version <= last:
            raise ValueError(f"weight version {version} loaded after version {last}: versions must increase")
        self.updates.append((version, dict(counts)))

    def token_versions(self, keys: list[Key], width: int) -> torch.Tensor:
        """int64 [len(keys), width]: the version that sampled token t of sample keys[i] (past a sample's length the
        value is the last version it saw; callers mask it)."""
        out = torch.full((len(keys), width), self.start, dtype=torch.int64)
        for version, counts in self.updates:
            for i, key in enumerate(keys):
                if key in counts:
                    out[i, counts[key]:] = version
        return out

    @property
    def versions(self) -> int:
        """How many versions sampled (1 + updates)."""
        return 1 + len(self.updates)


def too_stale(token_version: torch.Tensor, response_mask: torch.Tensor, version: int, bound: int) -> torch.Tensor:
    """bool [B]: which samples hold a response token sampled more than `bound` versions before `version`
    (trainer.max_staleness; the positions outside `response_mask` do not count)."""
    return ((version - token_version > bound) & response_mask.bool()).any(dim=1)

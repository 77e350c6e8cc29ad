"""`KVKeepRecord`: what the sparse KV cache kept for one sample, and the attention mask that replays it.

One record per sample (`RolloutBatch.kv_keep` is a tuple of them, one per row). At compaction c the
engine had stored the KV of true positions 0..lengths[c]-1 (prompt + response so far) minus what earlier
compactions dropped, and kept `kept[c][layer, kv_head]` (ascending TRUE token positions, original RoPE
positions). The query of position t >= lengths[c] (and < lengths[c+1]) attends to kept[c] plus the
positions lengths[c]..t. `kept` is None when `rollout.kv.record_keep` is false (only the steps are kept).
`preempted`: the request was preempted after a compaction and recomputed densely by vLLM, so its
response mixes two caches; drop or correct such samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVKeepRecord:
    lengths: tuple[int, ...]
    kept: tuple[torch.Tensor, ...] | None = None
    preempted: bool = False

    @property
    def num_compactions(self) -> int:
        return len(self.lengths)

    @staticmethod
    def join_heads(parts: "list[KVKeepRecord]") -> "KVKeepRecord":
        """One sample's record from the records of the ranks of a tensor-parallel engine, each holding its
        own KV heads (rank order = head order): the kept positions concatenated over the head dimension.
        The ranks compact at the same steps (each runs the same deterministic scheduler): a disagreement
        raises."""
        first = parts[0]
        if any(p.lengths != first.lengths for p in parts):
            raise RuntimeError(f"engine ranks compacted at different steps: {[p.lengths for p in parts]}")
        kept = None
        if first.kept is not None:
            kept = tuple(torch.cat([p.kept[c] for p in parts], dim=1) for c in range(first.num_compactions))
        return KVKeepRecord(first.lengths, kept, any(p.preempted for p in parts))

    def attention_mask(self, seq_len: int) -> torch.Tensor:
        """bool [layers, kv_heads, seq_len, seq_len]: may query position t attend to key position s.

        Causal and dense before the first compaction; then per layer and KV head what the engine kept.
        Needs the full record (`record_keep`); a learner recomputes pi_sparse with it.
        """
        if self.kept is None:
            raise ValueError("KVKeepRecord.attention_mask needs the kept positions (set rollout.kv.record_keep)")
        if not self.kept:
            raise ValueError("KVKeepRecord.attention_mask: no compaction happened (use a causal mask)")
        layers, heads, _ = self.kept[0].shape
        pos = torch.arange(seq_len)
        mask = (pos[None, :] <= pos[:, None]).expand(layers, heads, seq_len, seq_len).clone()
        bounds = list(self.lengths) + [seq_len]
        for c, kept in enumerate(self.kept):
            start, end = bounds[c], min(bounds[c + 1], seq_len)
            if start >= seq_len:
                break
            rows = torch.zeros(layers, heads, seq_len, dtype=torch.bool)
            rows.scatter_(2, kept.long(), True)
            block = rows[:, :, None, :].expand(layers, heads, end - start, seq_len).clone()
            block |= (pos[None, :] >= start) & (pos[None, :] <= pos[start:end, None])
            mask[:, :, start:end] = block
        return mask


def batch_attention_mask(records, seq_len: int) -> torch.Tensor | None:
    """bool [B, layers, kv_heads, seq_len, seq_len] for a batch of records (rows without a compaction see
    causally), or None when no row was compacted (the dense causal forward is already exact)."""
    compacted = [r for r in records if r.num_compactions]
    if not compacted:
        return None
    if compacted[0].kept is None:
        raise ValueError("recomputing sparse logprobs needs the kept positions (set rollout.kv.record_keep)")
    layers, heads, _ = compacted[0].kept[0].shape
    pos = torch.arange(seq_len)
    causal = (pos[None, :] <= pos[:, None]).expand(layers, heads, seq_len, seq_len)
    return torch.stack([r.attention_mask(seq_len) if r.num_compactions else causal for r in records])

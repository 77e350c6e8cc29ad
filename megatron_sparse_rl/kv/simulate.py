"""The keep sets a sparse engine would make on a given (teacher-forced) sequence, from its keys and queries.

Sparsity-aware SFT (training/sft_kv.py, docs/sparse_kv.md "Sparsity-aware SFT") trains a warm start under the
compression its own rollouts will meet. This module replays the engine's compaction rule and policy on keys and
queries that the caller computed (a learner forward), in pure torch:

    points = compaction_points(prompt_len, total_len, kv.budget, kv.interval)
    kept = []
    for c in range(len(points)):                        # each compaction sees what the one before kept
        kept.append(keep_at(kv, queries, keys, points, kept))
    record = KVKeepRecord(points, tuple(kept))          # record.attention_mask(T) replays it

The rule (kv/vllm_scheduler.py `_msrl_compact`): before each decode step whose input token sits at true position
t (t = prompt_len .. total_len - 2; the last token is sampled, never fed back), a sequence whose stored length
(t minus what earlier compactions dropped) reached budget + interval is cut back to `budget` entries per layer and
KV head. At compaction c the cache holds, per layer and KV head, what compaction c - 1 kept plus the positions
since it (all positions before the first); the policy scores those keys with the last `window` queries (true
positions t - window .. t - 1), exactly as kv/policies.py `select_keep` does inside the engine.

queries: one [q_heads, T, D] per layer, keys: one [kv_heads, T, D] per layer (after RoPE; T >= the last
compaction point). H2O (attention accumulated over every query since generation began) is not replayed here.
"""
from __future__ import annotations

import torch

from megatron_sparse_rl.config.rollout import KVConfig
from megatron_sparse_rl.config.trainer import SFT_KV_POLICIES
from megatron_sparse_rl.kv.policies import select_keep
from megatron_sparse_rl.kv.record import KVKeepRecord


def compaction_points(prompt_len: int, total_len: int, budget: int, interval: int) -> tuple[int, ...]:
    """The true lengths (= positions of the first query that sees the compacted cache) at which the engine compacts
    a sequence of `prompt_len` prompt tokens and `total_len` tokens in all."""
    stored, out = prompt_len, []
    for t in range(prompt_len, total_len - 1):
        if stored >= budget + interval:
            out.append(t)
            stored = budget
        stored += 1
    return tuple(out)


def held_positions(points: tuple[int, ...], kept: list[torch.Tensor], layers: int, heads: int) -> torch.Tensor:
    """int64 [layers, heads, n]: the true positions the cache holds at compaction len(kept), ascending."""
    c = len(kept)
    if c == 0:
        return torch.arange(points[0]).expand(layers, heads, points[0])
    since = torch.arange(points[c - 1], points[c]).expand(layers, heads, points[c] - points[c - 1])
    return torch.cat([kept[c - 1].long(), since], dim=-1)


def keep_at(kv: KVConfig, queries: list[torch.Tensor], keys: list[torch.Tensor], points: tuple[int, ...],
            kept: list[torch.Tensor]) -> torch.Tensor:
    """int64 [layers, kv_heads, budget]: the true positions compaction len(kept) keeps (ascending per head), given
    the keep sets of the compactions before it."""
    if kv.policy not in SFT_KV_POLICIES:
        raise ValueError(f"keep sets are simulated for rollout.kv.policy in {list(SFT_KV_POLICIES)} "
                         f"(got {kv.policy!r})")
    t = points[len(kept)]
    held = held_positions(points, kept, len(keys), keys[0].shape[0])
    out = []
    for layer, (q, k) in enumerate(zip(queries, keys)):
        if k.shape[1] < t or q.shape[1] < t:
            raise ValueError(f"layer {layer}: keys/queries cover {k.shape[1]}/{q.shape[1]} positions, compaction "
                             f"{len(kept)} needs {t}")
        rows = held[layer]
        stored = k.gather(1, rows[..., None].expand(-1, -1, k.shape[-1]))  # [kv_heads, n, D]
        index = select_keep(kv.policy, stored, q[:, t - kv.window:t], kv)
        out.append(rows.gather(1, index))
    return torch.stack(out)


def simulate_keep(kv: KVConfig, queries: list[torch.Tensor], keys: list[torch.Tensor], prompt_len: int,
                  total_len: int) -> KVKeepRecord:
    """One sequence's record: every compaction of the rule, each scored on the same `queries` / `keys`."""
    points = compaction_points(prompt_len, total_len, kv.budget, kv.interval)
    kept: list[torch.Tensor] = []
    for _ in points:
        kept.append(keep_at(kv, queries, keys, points, kept))
    return KVKeepRecord(points, tuple(kept))

"""Sparsity-aware SFT (`trainer.sft.kv_keep`): train the warm start under the keep sets its own compression makes.

For each SFT batch, the rows chosen for it (the first ceil(fraction x rows) of this rank's share) get the keep
sets the run's sparse engine (`rollout.kv`: policy, budget, window, interval) would make on that teacher-forced
sequence: compactions at the points the engine's rule gives for the row's prompt and total length
(kv/simulate.py `compaction_points`), each scored by the policy on that layer's post-RoPE keys and window queries,
captured from a no-grad learner forward (learner/qk_capture.py). The step then trains under
`ForwardExtras(attention_mask=batch_attention_mask(records, T - 1))`: each target token's logprob is computed from
what the compressed cache would hold.

keys "dense": one causal forward gives every compaction's keys and queries; the engine's keys after its first
compaction come from its own sparse history, so later keep sets are an approximation. keys "sequential": forward c
runs under the masks of compactions 0..c-1 (one forward per compaction of the longest row), which is what an
engine fed the same tokens computed, up to numerics. The budget is rollout.kv.budget (a budget schedule's first).
"""
from __future__ import annotations

import math

import torch

from megatron_sparse_rl.config.rollout import KVConfig
from megatron_sparse_rl.config.trainer import SFTKVKeepConfig
from megatron_sparse_rl.kv.record import KVKeepRecord, batch_attention_mask
from megatron_sparse_rl.kv.simulate import compaction_points, keep_at
from megatron_sparse_rl.learner.extras import ForwardExtras
from megatron_sparse_rl.learner.qk_capture import QueryKeyCapture


def _capture(learner, tokens: torch.Tensor, records: list[KVKeepRecord] | None):
    """Each layer's queries and keys of `tokens` [b, w] (under the records' masks, if any)."""
    mask = None if records is None else batch_attention_mask(records, tokens.shape[1] - 1)
    with QueryKeyCapture(learner.model) as capture:
        learner.forward_logprobs(tokens, extras=ForwardExtras(attention_mask=mask))
    return capture.layers(rows=tokens.shape[0])


def _simulate(kv: KVConfig, queries, keys, points: tuple[int, ...], kept: list[torch.Tensor],
              upto: int) -> list[torch.Tensor]:
    """Compactions len(kept)..upto-1 of R rows that share `points`, the rows stacked as extra KV heads (every policy
    scores each head on its own): queries / keys [layers] of [R, heads, T, D]; kept [L, R x kv_heads, budget] each."""
    q, k = [x.flatten(0, 1) for x in queries], [x.flatten(0, 1) for x in keys]
    kept = list(kept)
    while len(kept) < upto:
        kept.append(keep_at(kv, q, k, points, kept))
    return kept


def sft_keep_records(learner, tokens: torch.Tensor, prompt_lens: list[int], lengths: list[int], kv: KVConfig,
                     keys: str = "dense") -> list[KVKeepRecord]:
    """One record per row of `tokens` [B, W] (row i: prompt_lens[i] prompt tokens of lengths[i] real ones): the
    compactions the engine's rule makes on it and, per layer and KV head, what each keeps (module docstring)."""
    points = [compaction_points(p, n, kv.budget, kv.interval) for p, n in zip(prompt_lens, lengths)]
    kept: list[list[torch.Tensor]] = [[] for _ in points]
    most = max(map(len, points), default=0)
    for c in range(most if keys == "sequential" else min(1, most)):
        todo = [i for i, p in enumerate(points) if len(p) > c]
        upto = {i: c + 1 if keys == "sequential" else len(points[i]) for i in todo}
        width = max(points[i][upto[i] - 1] for i in todo) + 1  # inputs 0..width - 2: every query and key read
        records = [KVKeepRecord(points[i][:c], tuple(kept[i])) for i in todo] if c else None
        queries, keys_ = _capture(learner, tokens[todo, :width], records)
        groups: dict[tuple[int, ...], list[int]] = {}
        for j, i in enumerate(todo):
            groups.setdefault(points[i], []).append(j)
        heads = keys_[0].shape[1]
        for shared, js in groups.items():
            rows = [todo[j] for j in js]
            stacked = [torch.cat([kept[i][n] for i in rows], dim=1) for n in range(c)]
            out = _simulate(kv, [x[js] for x in queries], [x[js] for x in keys_], shared, stacked, upto[rows[0]])
            for r, i in enumerate(rows):
                kept[i] = [s[:, r * heads:(r + 1) * heads] for s in out]
    return [KVKeepRecord(p, tuple(k)) for p, k in zip(points, kept)]


def sft_kv_extras(learner, tokens: torch.Tensor, loss_mask: torch.Tensor, prompt_lens: list[int],
                  lengths: list[int], kv: KVConfig, cfg: SFTKVKeepConfig) -> tuple[ForwardExtras, list[float]]:
    """(the SFT step's extras, counts [target tokens whose query attended a compressed cache, rows trained under keep
    sets, their compactions]) for `tokens` [B, W] and `loss_mask` [B, W - 1]. Rows after the first
    ceil(cfg.fraction x B) train densely (causal); no mask at all when no chosen row reaches a compaction."""
    chosen = math.ceil(cfg.fraction * tokens.shape[0])
    records = sft_keep_records(learner, tokens[:chosen], prompt_lens[:chosen], lengths[:chosen], kv, cfg.keys)
    records += [KVKeepRecord(())] * (tokens.shape[0] - chosen)
    seq_len = tokens.shape[1] - 1
    compressed = torch.stack([r.compressed_queries(seq_len) for r in records])
    counts = [float((loss_mask.bool() & compressed).sum()), float(chosen),
              float(sum(r.num_compactions for r in records))]
    return ForwardExtras(attention_mask=batch_attention_mask(records, seq_len)), counts


def sft_kv_metrics(counts: list[float], target_tokens: float, rows: float) -> dict[str, float]:
    """The step's `sft/kv_*` metrics from global sums of `sft_kv_extras`' counts."""
    compressed, chosen, compactions = counts
    return {"sft/kv_compressed_target_frac": compressed / max(target_tokens, 1.0),
            "sft/kv_masked_rows_frac": chosen / max(rows, 1.0),
            "sft/kv_compactions_per_masked_row": compactions / max(chosen, 1.0)}

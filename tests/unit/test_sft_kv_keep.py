"""Sparsity-aware SFT's pure parts (trainer.sft.kv_keep; kv/simulate.py, training/sft_kv.py): the compaction points
against a hand table, the simulated keep sets against a reference written out here (float64 scores per head, no
shared code with kv/policies.py), the log-line metrics, and the refusals at load / validate, each naming the field.

    .venv/bin/python -m pytest -q tests/unit/test_sft_kv_keep.py
"""
from __future__ import annotations

import pytest
import torch

from megatron_sparse_rl.config import ConfigError, RunConfig
from megatron_sparse_rl.config.loader import from_dict, merge_overrides
from megatron_sparse_rl.config.rollout import KVConfig
from megatron_sparse_rl.config.trainer import SFTConfig
from megatron_sparse_rl.kv.simulate import compaction_points, simulate_keep
from megatron_sparse_rl.training.sft_kv import sft_kv_metrics
from megatron_sparse_rl.validation import validate


# (prompt, total, budget, interval, points), by hand: the first compaction when prompt + decoded inputs reach
# budget + interval (checked before the input at position t), then every `interval` tokens, never at total - 1
POINTS = [
    (7, 88, 40, 4, tuple(range(44, 86, 4))),   # the digit chain: 44, 48, ..., 84
    (6, 44, 40, 4, ()),                        # input positions end at 42 < 44: never compacted
    (6, 45, 40, 4, ()),                        # ... at 43
    (6, 46, 40, 4, (44,)),                     # ... at 44: one compaction
    (50, 60, 40, 4, (50, 54, 58)),             # a prompt past the trigger: compacted at the first decode step
    (10, 40, 16, 8, (24, 32)),
]


@pytest.mark.parametrize("prompt,total,budget,interval,want", POINTS)
def test_compaction_points_follow_the_rule(prompt, total, budget, interval, want):
    assert compaction_points(prompt, total, budget, interval) == want


def reference_snapkv(keys, queries, held, t, kv):
    """SnapKV at compaction t, one KV head at a time, float64: the window queries' causal softmax over the held keys
    (a held position p is visible to query position q iff p <= q), summed over the window, averaged over the head's
    query group, max-pooled (kernel kv.kernel), top (budget - window) of the candidates + the last window held."""
    out = []
    kv_heads, groups = keys.shape[0], queries.shape[0] // keys.shape[0]
    for h in range(kv_heads):
        k = keys[h, held[h]].double()
        score = torch.zeros(len(held[h]), dtype=torch.float64)
        for g in range(groups):
            for qpos in range(t - kv.window, t):
                logits = queries[h * groups + g, qpos].double() @ k.T / k.shape[-1] ** 0.5
                visible = torch.tensor([p <= qpos for p in held[h]])
                score += logits.masked_fill(~visible, float("-inf")).softmax(-1) / groups
        cand = score[: len(held[h]) - kv.window]
        pad = kv.kernel // 2
        pooled = [max(cand[max(0, i - pad): i + pad + 1]).item() for i in range(len(cand))]
        top = sorted(range(len(cand)), key=lambda i: (-pooled[i], i))[: kv.budget - kv.window]
        out.append(sorted([held[h][i] for i in top] + held[h][-kv.window:]))
    return out


def test_simulated_snapkv_keep_sets_equal_a_written_out_reference():
    torch.manual_seed(0)
    kv = KVConfig(policy="snapkv", budget=12, window=4, interval=4, kernel=3)
    layers, kv_heads, heads, length, dim = 2, 2, 4, 40, 8
    keys = [torch.randn(kv_heads, length, dim) for _ in range(layers)]
    queries = [torch.randn(heads, length, dim) for _ in range(layers)]
    record = simulate_keep(kv, queries, keys, prompt_len=5, total_len=length + 1)
    assert record.lengths == (16, 20, 24, 28, 32, 36)
    prev = None
    for c, t in enumerate(record.lengths):
        for layer in range(layers):
            since = set(range(record.lengths[c - 1], t)) if c else set()
            held = [list(range(t)) if prev is None else sorted(set(prev[layer][h]) | since) for h in range(kv_heads)]
            want = reference_snapkv(keys[layer], queries[layer], held, t, kv)
            assert record.kept[c][layer].tolist() == want, (c, layer)
        prev = [[record.kept[c][layer][h].tolist() for h in range(kv_heads)] for layer in range(layers)]


def test_streamingllm_keeps_sinks_and_the_most_recent():
    kv = KVConfig(policy="streamingllm", budget=10, window=4, interval=4, sinks=2)
    keys, queries = [torch.randn(1, 30, 4)], [torch.randn(2, 30, 4)]
    record = simulate_keep(kv, queries, keys, prompt_len=3, total_len=31)
    assert record.lengths == (14, 18, 22, 26)
    for t, kept in zip(record.lengths, record.kept):
        assert kept[0, 0].tolist() == [0, 1] + list(range(t - 8, t))


def test_rows_stacked_as_heads_keep_what_each_row_keeps_alone():
    """training/sft_kv.py scores the rows that share compaction points as one batch of KV heads."""
    from megatron_sparse_rl.training.sft_kv import _simulate

    torch.manual_seed(1)
    kv = KVConfig(policy="rkv", budget=10, window=4, interval=4)
    rows, layers, kv_heads, heads, length = 3, 2, 2, 4, 30
    queries = [torch.randn(rows, heads, length, 8) for _ in range(layers)]
    keys = [torch.randn(rows, kv_heads, length, 8) for _ in range(layers)]
    points = compaction_points(6, length + 1, kv.budget, kv.interval)
    stacked = _simulate(kv, queries, keys, points, [], len(points))
    for r in range(rows):
        alone = simulate_keep(kv, [q[r] for q in queries], [k[r] for k in keys], 6, length + 1)
        assert [s[:, r * kv_heads:(r + 1) * kv_heads].tolist() for s in stacked] == [a.tolist() for a in alone.kept]


def test_metrics_are_shares_of_the_global_counts():
    got = sft_kv_metrics([30.0, 8.0, 24.0], target_tokens=120.0, rows=16.0)
    assert got == {"sft/kv_compressed_target_frac": 0.25, "sft/kv_masked_rows_frac": 0.5,
                   "sft/kv_compactions_per_masked_row": 3.0}


def run_of(*overrides: str) -> RunConfig:
    base = {"model": {"path": "/nonexistent/tiny", "tiny": {}}}
    sets = ["rollout.kv.policy=rkv", "rollout.kv.budget=40", "rollout.kv.interval=4", "rollout.kv.block_size=32",
            "rollout.max_model_len=512", "trainer.sft.max_steps=2", "trainer.sft.kv_keep.enabled=true", *overrides]
    return from_dict(RunConfig, merge_overrides(base, sets))


def test_off_by_default_and_a_valid_run_passes():
    assert not SFTConfig().kv_keep.enabled and SFTConfig().kv_keep.fraction == 1.0
    validate(run_of(), 1, cuda=False)
    validate(run_of("rollout.kv.policy=snapkv", "trainer.sft.kv_keep.keys=sequential",
                    "trainer.sft.kv_keep.fraction=0.5"), 1, cuda=False)
    validate(run_of("rollout.kv.policy=none", "trainer.sft.kv_keep.enabled=false"), 1, cuda=False)


@pytest.mark.parametrize("sets,world,match", [
    (("rollout.kv.policy=none",), 1,
     r"trainer\.sft\.kv_keep\.enabled trains under the keep sets .* rollout\.kv\.policy is 'none'"),
    (("rollout.kv.policy=h2o",), 1, r"trainer\.sft\.kv_keep\.enabled simulates rollout\.kv\.policy in .*'h2o'"),
    (("parallel.tp=2",), 2, r"trainer\.sft\.kv_keep\.enabled .* needs parallel\.tp = cp = pp = 1 \(got tp 2"),
    (("parallel.pp=2",), 2, r"trainer\.sft\.kv_keep\.enabled .* needs parallel\.tp = cp = pp = 1 .*pp 2"),
    (("trainer.sft.kv_keep.fraction=0",), 1, r"trainer\.sft\.kv_keep\.fraction must be in \(0, 1\]"),
    (("trainer.sft.kv_keep.keys=exact",), 1,
     r"trainer\.sft\.kv_keep\.keys: 'exact' is not allowed; choose one of 'dense', 'sequential'"),
])
def test_bad_input_is_refused_naming_the_field(sets, world, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        validate(run_of(*sets), world, cuda=False)

"""KV policies (megatron_sparse_rl.kv.policies) against straightforward float64 loops written here from
each paper's rule (references.md, "KV compression policies"), and KVConfig validation.

    .venv/bin/python -m pytest -q tests/unit/test_kv_policies.py
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_sparse_rl.config.rollout import KVConfig
from megatron_sparse_rl.kv import policies as P

HKV, HQ, T, D = 2, 4, 40, 16


def data(seed=0, t=T):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(HKV, t, D, generator=g)
    queries = torch.randn(HQ, t, D, generator=g)  # one query per stored token
    # make some keys near-duplicates so R-KV's redundancy term matters
    keys[:, 5] = keys[:, 3] + 0.05 * torch.randn(HKV, D, generator=g)
    keys[:, 20] = keys[:, 3] + 0.05 * torch.randn(HKV, D, generator=g)
    return keys, queries


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [v / s for v in e]


def pool(xs, kind, k):
    n, r, out = len(xs), k // 2, []
    for i in range(n):
        win = xs[max(0, i - r): min(n, i + r + 1)]
        out.append(max(win) if kind == "max" else sum(win) / len(win))
    return out


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def keep_from(scores, t, budget, recent):
    """Reference selection: indices of the largest (budget - recent) scores plus the last `recent`."""
    order = sorted(range(len(scores)), key=lambda j: -scores[j])[: budget - recent]
    return sorted(order + list(range(t - recent, t)))


def ref_rkv(keys, queries, p):
    k64, q64 = keys.double().tolist(), queries.double().tolist()
    t, w, group = len(k64[0]), p.window, HQ // HKV
    n, out = t - w, []
    for h in range(HKV):
        imp = [0.0] * n
        for qi in range(t - w, t):
            per_head = []
            for g in range(group):
                q = q64[h * group + g][qi]
                per_head.append(softmax([dot(q, k64[h][j]) / math.sqrt(D) for j in range(n)]))
            for j in range(n):
                imp[j] += max(ph[j] for ph in per_head) / w
        imp = pool(imp, p.pooling, p.kernel)
        norm = [math.sqrt(dot(k, k)) for k in k64[h]]
        sim = [[0.0 if i == j else dot(k64[h][i], k64[h][j]) / (norm[i] * norm[j] + 1e-8 * 0) for j in range(t)]
               for i in range(t)]
        for i in range(t):
            similar = [j for j in range(t) if sim[i][j] > p.rkv_threshold]
            if similar:
                sim[i][max(similar)] = 0.0
        red = softmax([sum(sim[i][j] for i in range(t)) / t for j in range(t)])[:n]
        score = [p.rkv_lambda * a - (1 - p.rkv_lambda) * b for a, b in zip(imp, red)]
        out.append((score, keep_from(score, t, p.budget, w)))
    return out


def ref_snapkv(keys, queries, p):
    k64, q64 = keys.double().tolist(), queries.double().tolist()
    t, w, group = len(k64[0]), p.window, HQ // HKV
    out = []
    for h in range(HKV):
        acc = [0.0] * (t - w)
        for g in range(group):
            for qi in range(t - w, t):
                q = q64[h * group + g][qi]
                probs = softmax([dot(q, k64[h][j]) / math.sqrt(D) for j in range(qi + 1)])  # causal
                for j in range(t - w):
                    acc[j] += probs[j] / group
        score = pool(acc, p.pooling, p.kernel)
        out.append((score, keep_from(score, t, p.budget, w)))
    return out


def ref_h2o(keys, queries, p):
    """Accumulated attention of every query 0..T-1 over the keys it saw (causal), summed over the group."""
    k64, q64 = keys.double().tolist(), queries.double().tolist()
    t, group = len(k64[0]), HQ // HKV
    out = []
    for h in range(HKV):
        acc = [0.0] * t
        for g in range(group):
            for qi in range(t):
                q = q64[h * group + g][qi]
                for j, pr in enumerate(softmax([dot(q, k64[h][j]) / math.sqrt(D) for j in range(qi + 1)])):
                    acc[j] += pr
        out.append((acc, keep_from(acc[: t - p.window], t, p.budget, p.window)))
    return out


@pytest.mark.parametrize("pooling,kernel", [("max", 7), ("avg", 5), ("max", 1)])
def test_rkv_matches_reference(pooling, kernel):
    keys, queries = data(1)
    p = KVConfig(budget=16, window=8, pooling=pooling, kernel=kernel)
    scores = P.rkv_scores(keys, queries, p)
    keep = P.select_keep("rkv", keys, queries, p)
    for h, (ref_score, ref_keep) in enumerate(ref_rkv(keys, queries, p)):
        assert torch.allclose(scores[h].double(), torch.tensor(ref_score, dtype=torch.float64), atol=1e-6, rtol=1e-5)
        assert keep[h].tolist() == ref_keep
    # the redundancy term: among the near-duplicate keys 3, 5, 20 the most recent copy (20) is not penalised
    p_red = KVConfig(budget=16, window=8, rkv_lambda=0.0)
    red_score = P.rkv_scores(keys, queries, p_red)
    assert (red_score[:, 20] > red_score[:, 3]).all()


@pytest.mark.parametrize("pooling,kernel", [("avg", 5), ("max", 7)])
def test_snapkv_matches_reference(pooling, kernel):
    keys, queries = data(2)
    p = KVConfig(budget=12, window=8, pooling=pooling, kernel=kernel)
    scores = P.snapkv_scores(keys, queries, p)
    keep = P.select_keep("snapkv", keys, queries[:, -8:], p)
    for h, (ref_score, ref_keep) in enumerate(ref_snapkv(keys, queries, p)):
        assert torch.allclose(scores[h].double(), torch.tensor(ref_score, dtype=torch.float64), atol=1e-6, rtol=1e-5)
        assert keep[h].tolist() == ref_keep


def test_h2o_matches_reference_and_accumulates_across_calls():
    keys, queries = data(3)
    p = KVConfig(budget=14, window=4)
    full = P.h2o_scores(keys, queries, torch.arange(T))
    # the same sums in two pieces: queries 0..24 over keys 0..24, then 25..39 carrying the first piece
    first = P.h2o_scores(keys[:, :25], queries[:, :25], torch.arange(25))
    second = P.h2o_scores(keys, queries[:, 25:], torch.arange(25, T), previous=first)
    keep = P.select_keep("h2o", keys, None, p, h2o_acc=full)
    for h, (ref_acc, ref_keep) in enumerate(ref_h2o(keys, queries, p)):
        ref = torch.tensor(ref_acc, dtype=torch.float64)
        assert torch.allclose(full[h].double(), ref, atol=1e-5, rtol=1e-5)
        assert torch.allclose(second[h].double(), ref, atol=1e-5, rtol=1e-5)
        assert keep[h].tolist() == ref_keep
    assert abs(full.sum().item() - HQ * T) < 1e-3  # every query's probabilities sum to 1


def test_streamingllm_keeps_sinks_and_recent():
    keys, _ = data(4)
    p = KVConfig(budget=10, sinks=4, window=6)  # the budget holds the sinks and the window
    keep = P.select_keep("streamingllm", keys, None, p)
    assert keep.shape == (HKV, 10)
    for h in range(HKV):
        assert keep[h].tolist() == [0, 1, 2, 3] + list(range(T - 6, T))


def test_gqa_groups_are_consecutive_query_heads():
    """Queries of the other KV group must not change a head's choice."""
    keys, queries = data(5)
    p = KVConfig(budget=12, window=8)
    base = P.select_keep("snapkv", keys, queries[:, -8:], p)
    other = queries.clone()
    other[2:] = torch.randn_like(other[2:])  # query heads 2, 3 belong to KV head 1
    moved = P.select_keep("snapkv", keys, other[:, -8:], p)
    assert torch.equal(base[0], moved[0])


def test_select_keep_errors():
    keys, queries = data(6)
    p = KVConfig(budget=12, window=8)
    with pytest.raises(ValueError, match="more entries than the budget"):
        P.select_keep("snapkv", keys[:, :12], queries, p)
    with pytest.raises(ValueError, match="needs the last 8 queries"):
        P.select_keep("rkv", keys, queries[:, :3], p)
    with pytest.raises(ValueError, match="h2o needs"):
        P.select_keep("h2o", keys, None, p)
    with pytest.raises(ValueError, match="policy must be one of"):
        P.select_keep("pyramid", keys, queries, p)


@pytest.mark.parametrize("kwargs,message", [
    (dict(budget=4, window=8), "rollout.kv.budget must be >= window"),
    (dict(policy="streamingllm", budget=4, window=2, sinks=4), "budget must be > sinks"),
    (dict(kernel=4), "rollout.kv.kernel must be an odd integer"),
    (dict(pooling="median"), "rollout.kv.pooling must be one of"),
    (dict(rkv_lambda=1.5), "rollout.kv.rkv_lambda must be in"),
    (dict(policy="lru"), "rollout.kv.policy must be one of"),
])
def test_kv_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVConfig(**kwargs)


def test_kv_config_policy_defaults():
    p = KVConfig(policy="rkv", budget=128)
    assert (p.budget, p.window, p.sinks, p.pooling, p.kernel, p.rkv_lambda, p.rkv_threshold) == \
        (128, 8, 4, "max", 7, 0.1, 0.5)

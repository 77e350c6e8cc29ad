"""KV policies on the MLA latent cache (megatron_sparse_rl.kv.latent) against a float64 reference written here
that DECOMPRESSES the keys (k_h = [W_UK_h c_kv, k_pe], the non-absorbed form) and applies each policy's rule
(references.md, "KV compression policies") with all query heads as one group. Real CPU latent shape
(kv_lora_rank 512, rope 64), tiny head counts.

    .venv/bin/python -m pytest -q tests/unit/test_kv_latent.py
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_sparse_rl.config.rollout import KVConfig
from megatron_sparse_rl.kv import latent as L

H, NOPE, R, ROPE = 4, 32, 512, 64
SCALE = 1.3 / math.sqrt(NOPE + ROPE)  # a YaRN-like mscale^2 on top of 1/sqrt(qk_head_dim)


def data(seed, t, q=None, dtype=torch.float64):
    """Random MLA layer state: latent [T, R] (RMS-normalised scale), k_pe [T, ROPE], w_uk [H, NOPE, R],
    queries [H, Q, .] of the last Q tokens (default Q = T). Rows 5 and 20 near-copy row 3 (R-KV redundancy)."""
    g = torch.Generator().manual_seed(seed)
    q = t if q is None else q
    latent = torch.randn(t, R, generator=g, dtype=torch.float64)
    k_pe = torch.randn(t, ROPE, generator=g, dtype=torch.float64)
    for j in (5, 20):
        latent[j] = latent[3] + 0.05 * torch.randn(R, generator=g, dtype=torch.float64)
        k_pe[j] = k_pe[3] + 0.05 * torch.randn(ROPE, generator=g, dtype=torch.float64)
    w_uk = torch.randn(H, NOPE, R, generator=g, dtype=torch.float64) / math.sqrt(R)
    q_nope = 1.5 * torch.randn(H, q, NOPE, generator=g, dtype=torch.float64)
    q_pe = 1.5 * torch.randn(H, q, ROPE, generator=g, dtype=torch.float64)
    return {k: v.to(dtype) for k, v in dict(latent=latent, k_pe=k_pe, w_uk=w_uk, q_nope=q_nope, q_pe=q_pe).items()}


# ---- float64 reference: decompressed keys, each policy's rule -------------------------------------------------
def ref_logits(x):
    """[H, Q, T] q_h . k_h * scale with k_h = [W_UK_h c_kv, k_pe] decompressed per head."""
    d = {k: v.double() for k, v in x.items()}
    t = d["latent"].shape[0]
    k_nope = torch.einsum("hnr,tr->htn", d["w_uk"], d["latent"])
    keys = torch.cat([k_nope, d["k_pe"][None].expand(H, t, ROPE)], dim=-1)
    queries = torch.cat([d["q_nope"], d["q_pe"]], dim=-1)
    return torch.einsum("hqd,htd->hqt", queries, keys) * SCALE


def pool(xs, kind, k):
    n, r = len(xs), k // 2
    return [max(xs[max(0, i - r): i + r + 1]) if kind == "max" else
            sum(xs[max(0, i - r): i + r + 1]) / len(xs[max(0, i - r): i + r + 1]) for i in range(n)]


def keep_from(scores, t, budget, recent):
    order = sorted(range(len(scores)), key=lambda j: -scores[j])[: budget - recent]
    return sorted(order + list(range(t - recent, t)))


def ref_rkv(x, p):
    logits = ref_logits(x)
    t, w = logits.shape[2], p.window
    n = t - w
    probs = logits[:, -w:, :n].softmax(dim=-1)  # the last w queries (the window) over the candidates
    imp = pool(probs.amax(dim=0).mean(dim=0).tolist(), p.pooling, p.kernel)  # max over ALL heads
    rows = torch.cat([x["latent"], x["k_pe"]], dim=-1).double()  # redundancy on the stored rows
    unit = rows / rows.norm(dim=-1, keepdim=True)
    sim = unit @ unit.T
    sim.fill_diagonal_(0.0)
    for i in range(t):
        similar = [j for j in range(t) if sim[i, j] > p.rkv_threshold]
        if similar:
            sim[i, max(similar)] = 0.0
    red = sim.mean(dim=0).softmax(dim=0)[:n].tolist()
    score = [p.rkv_lambda * a - (1 - p.rkv_lambda) * b for a, b in zip(imp, red)]
    return keep_from(score, t, p.budget, w)


def ref_snapkv(x, p):
    logits = ref_logits(x)
    t, w = logits.shape[2], p.window
    acc = [0.0] * (t - w)
    for h in range(H):
        for i, pos in enumerate(range(t - w, t)):  # the last w queries, at stored positions t - w .. t - 1
            probs = logits[h, -w + i, : pos + 1].softmax(dim=0)  # causal
            for j in range(t - w):
                acc[j] += probs[j].item() / H
    return keep_from(pool(acc, p.pooling, p.kernel), t, p.budget, w)


def ref_h2o_acc(x, query_index):
    logits = ref_logits(x)
    acc = torch.zeros(logits.shape[2], dtype=torch.float64)
    for h in range(H):
        for qi, pos in enumerate(query_index.tolist()):
            acc[: pos + 1] += logits[h, qi, : pos + 1].softmax(dim=0)
    return acc


def call(x, policy, p, **kw):
    return L.select_latent(policy, x["latent"], x["k_pe"], p, q_nope=x["q_nope"], q_pe=x["q_pe"], w_uk=x["w_uk"],
                           scale=SCALE, **kw)


# ---- tests ---------------------------------------------------------------------------------------------------
def test_absorbed_attention_equals_decompressed():
    x = data(0, 150)
    logits = L.absorbed_scores(x["q_nope"], x["q_pe"], x["w_uk"], x["latent"], x["k_pe"], SCALE)
    ref = ref_logits(x)
    assert logits.dtype == torch.float64 and logits.shape == (H, 150, 150)
    assert torch.allclose(logits, ref, rtol=1e-12, atol=1e-10)
    assert (logits.softmax(-1) - ref.softmax(-1)).abs().max().item() < 1e-10
    # float32 inputs (the engine's) stay within float32 rounding
    x32 = data(0, 150, dtype=torch.float32)
    l32 = L.absorbed_scores(x32["q_nope"], x32["q_pe"], x32["w_uk"], x32["latent"], x32["k_pe"], SCALE)
    assert l32.dtype == torch.float32
    assert (l32.double().softmax(-1) - ref.softmax(-1)).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed,t,budget,pooling,kernel", [
    (1, 120, 16, "max", 7), (2, 200, 64, "avg", 5), (3, 100, 32, "max", 1)])
def test_rkv_matches_decompressed_reference(seed, t, budget, pooling, kernel, dtype):
    x = data(seed, t, q=12, dtype=dtype)
    p = KVConfig(budget=budget, window=8, pooling=pooling, kernel=kernel)
    keep = call(x, "rkv", p)
    assert keep.dtype == torch.int64 and keep.shape == (budget,)
    assert keep.tolist() == ref_rkv(x, p)


def test_rkv_redundancy_spares_most_recent_copy():
    """Redundancy alone (lambda 0): of the near-duplicate rows 3, 5, 20 the newest (20) is unpenalised, so
    dropping two rows drops the older copies 3 and 5."""
    x = data(4, 120, q=8)
    p = KVConfig(budget=118, window=8, rkv_lambda=0.0, kernel=1)
    keep = call(x, "rkv", p).tolist()
    assert keep == ref_rkv(x, p)
    assert sorted(set(range(120)) - set(keep)) == [3, 5]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed,t,budget,pooling,kernel", [(5, 150, 16, "avg", 5), (6, 180, 48, "max", 7)])
def test_snapkv_matches_decompressed_reference(seed, t, budget, pooling, kernel, dtype):
    x = data(seed, t, q=8, dtype=dtype)
    p = KVConfig(budget=budget, window=8, pooling=pooling, kernel=kernel)
    assert call(x, "snapkv", p).tolist() == ref_snapkv(x, p)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_h2o_matches_decompressed_reference_and_accumulates(dtype):
    t = 140
    x = data(7, t, dtype=dtype)
    p = KVConfig(budget=40, window=8)
    args = (x["q_nope"], x["q_pe"], x["w_uk"], x["latent"], x["k_pe"], SCALE)
    full = L.latent_h2o_scores(*args, torch.arange(t))
    ref = ref_h2o_acc(x, torch.arange(t))
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert full.shape == (t,) and torch.allclose(full.double(), ref, rtol=tol, atol=tol)
    assert abs(full.sum().item() - H * t) < tol * t  # every query's probabilities sum to 1 per head
    # the same sums in two pieces: queries 0..89 over rows 0..89, then 90..139 carrying the first piece
    first = L.latent_h2o_scores(x["q_nope"][:, :90], x["q_pe"][:, :90], x["w_uk"], x["latent"][:90],
                                x["k_pe"][:90], SCALE, torch.arange(90))
    second = L.latent_h2o_scores(x["q_nope"][:, 90:], x["q_pe"][:, 90:], x["w_uk"], x["latent"], x["k_pe"], SCALE,
                                 torch.arange(90, t), previous=first)
    assert torch.allclose(second.double(), ref, rtol=tol, atol=tol)
    keep = L.select_latent("h2o", x["latent"], x["k_pe"], p, h2o_acc=full)
    assert keep.tolist() == keep_from(ref[: t - p.window].tolist(), t, p.budget, p.window)


def test_streamingllm_is_positional():
    x = data(8, 100, q=8)
    p = KVConfig(budget=20, sinks=4)
    assert L.select_latent("streamingllm", x["latent"], x["k_pe"], p).tolist() == [0, 1, 2, 3] + list(range(84, 100))


@pytest.mark.parametrize("policy", ["rkv", "snapkv", "h2o", "streamingllm"])
@pytest.mark.parametrize("t", [30, 64])
def test_budget_at_least_length_keeps_everything_in_order(policy, t):
    x = data(9, t, q=8)
    keep = call(x, policy, KVConfig(budget=64, window=8), h2o_acc=torch.rand(t, dtype=torch.float64))
    assert keep.tolist() == list(range(t))


@pytest.mark.parametrize("change,name", [
    (lambda x: dict(latent=x["latent"][None]), "latent must be"),
    (lambda x: dict(k_pe=x["k_pe"][:-1]), "k_pe must be"),
    (lambda x: dict(w_uk=x["w_uk"][..., :-1]), "w_uk must be"),
    (lambda x: dict(w_uk=x["w_uk"][0]), "w_uk must be"),
    (lambda x: dict(q_nope=x["q_nope"][:-1]), "q_nope must be"),
    (lambda x: dict(q_nope=x["q_nope"][..., :-1]), "q_nope must be"),
    (lambda x: dict(q_pe=x["q_pe"][..., :-1]), "q_pe must be"),
    (lambda x: dict(q_pe=x["q_pe"][:, :-1]), "q_pe must be"),
])
def test_bad_shapes_name_the_argument(change, name):
    x = data(10, 80, q=8)
    y = {**x, **change(x)}
    p = KVConfig(budget=16, window=8)
    with pytest.raises(ValueError, match=name):
        call(y, "rkv", p)
    with pytest.raises(ValueError, match=name):
        L.absorbed_scores(y["q_nope"], y["q_pe"], y["w_uk"], y["latent"], y["k_pe"], SCALE)


def test_bad_arguments_raise():
    x = data(11, 80, q=8)
    p = KVConfig(budget=16, window=8)
    with pytest.raises(ValueError, match="h2o_acc must be"):
        L.select_latent("h2o", x["latent"], x["k_pe"], p, h2o_acc=torch.zeros(79))
    with pytest.raises(ValueError, match="h2o_acc must be"):
        L.select_latent("h2o", x["latent"], x["k_pe"], p)
    with pytest.raises(ValueError, match="needs q_pe, scale"):
        L.select_latent("snapkv", x["latent"], x["k_pe"], p, q_nope=x["q_nope"], w_uk=x["w_uk"])
    with pytest.raises(ValueError, match="scale must be"):
        L.absorbed_scores(x["q_nope"], x["q_pe"], x["w_uk"], x["latent"], x["k_pe"], -1.0)
    with pytest.raises(ValueError, match="query_index must be"):
        L.latent_h2o_scores(x["q_nope"], x["q_pe"], x["w_uk"], x["latent"], x["k_pe"], SCALE, torch.arange(7))
    with pytest.raises(ValueError, match="previous must be"):
        L.latent_h2o_scores(x["q_nope"], x["q_pe"], x["w_uk"], x["latent"], x["k_pe"], SCALE, torch.arange(72, 80),
                            previous=torch.zeros(81))
    with pytest.raises(ValueError, match="policy must be one of"):
        L.select_latent("pyramid", x["latent"], x["k_pe"], p)
    with pytest.raises(ValueError, match="needs the last 8 queries"):
        call({**x, "q_nope": x["q_nope"][:, :3], "q_pe": x["q_pe"][:, :3]}, "rkv", p)

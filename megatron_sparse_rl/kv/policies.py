"""KV compression policies as pure torch functions: scores and per-KV-head keep sets.

Every policy answers one question: given the cached keys of one layer [kv_heads, T, D] (stored after
RoPE) and recent queries [q_heads, W, D] (GQA: query head q belongs to KV head q // (q_heads // kv_heads)),
which `budget` of the T entries does each KV head keep? `select_keep` returns int64 [kv_heads, budget],
ascending stored indices; the caller copies those entries to the front of the cache. Math and defaults
follow the section "KV compression policies" of references.md:

- R-KV (arXiv 2505.24133): importance from the last `window` (alpha) queries, redundancy from key
  cosine similarity, score = lambda * imp - (1 - lambda) * red; keep top (B - alpha) + the last alpha.
- SnapKV (arXiv 2404.14469): window queries' attention summed over the window, pooled; keep top
  (B - window) + the window.
- H2O (arXiv 2306.14048): attention accumulated by every query since generation began ("heavy
  hitters"); keep top (B - window) + the recent window. The accumulation is exact across compactions:
  `h2o_scores` adds the contributions of the queries seen since the last compaction to the carried sums.
- StreamingLLM (arXiv 2309.17453): `sinks` first tokens + the last (B - sinks).

Logits are q . k * `scale` (default 1 / sqrt(D)); `kv.latent` runs these policies on the MLA latent cache
as one KV head (the stored latent row) with its own softmax scale.

No vLLM imports; the vLLM integration (megatron_sparse_rl.kv.vllm_*) calls these at each compaction.
"""
from __future__ import annotations

import math
from typing import get_args

import torch
import torch.nn.functional as F

from megatron_sparse_rl.config.rollout import KVConfig, KVPolicy

POLICIES = tuple(p for p in get_args(KVPolicy) if p != "none")


# The policies' knobs (budget, window, sinks, pooling, kernel, rkv_lambda, rkv_threshold) are fields of the one
# KV schema, `rollout.kv`: a `KVConfig` (or the `SparseKVSettings` subclass vLLM carries) is what the policies
# take. Built directly where no run config exists (tests, benchmarks): `KVConfig(budget=16, window=8)`.


def _group(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[q_heads, W, D] -> [kv_heads, group, W, D] (GQA: consecutive query heads share a KV head)."""
    hq, w, d = queries.shape
    if hq % kv_heads:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({kv_heads})")
    return queries.reshape(kv_heads, hq // kv_heads, w, d)


def _pool(scores: torch.Tensor, pooling: str, kernel: int) -> torch.Tensor:
    """Same-length 1-D pooling over the last dim of [H, N] (odd kernel, stride 1, zero/-inf padding)."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    pad = kernel // 2
    x = scores[:, None, :]
    if pooling == "max":
        out = F.max_pool1d(x, kernel, stride=1, padding=pad)
    elif pooling == "avg":
        out = F.avg_pool1d(x, kernel, stride=1, padding=pad, count_include_pad=False)
    else:
        raise ValueError(f"pooling must be 'max' or 'avg' (got {pooling!r})")
    return out[:, 0, : scores.shape[-1]]


def _logits(keys: torch.Tensor, queries: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """[kv_heads, group, W, T]: q . k * scale per query head against its KV head's keys.

    scale None = 1 / sqrt(D). Computed in float32, or float64 when an input is float64 (float64 references)."""
    dtype = torch.promote_types(torch.promote_types(keys.dtype, queries.dtype), torch.float32)
    q = _group(queries, keys.shape[0]).to(dtype)
    dots = torch.einsum("hgwd,htd->hgwt", q, keys.to(dtype))
    return dots / math.sqrt(keys.shape[-1]) if scale is None else dots * scale


def rkv_scores(keys: torch.Tensor, queries: torch.Tensor, p: KVConfig, *,
               scale: float | None = None) -> torch.Tensor:
    """R-KV score of the candidates (every entry but the last `window`): float32 [kv_heads, T - window].

    importance: softmax over the candidates of each window query's logits, max over the query heads of
    the KV group, mean over the window, `pooling` with `kernel`. redundancy: S = cos(K, K) with a zero
    diagonal; in each row i the most recent j with S_ij > threshold is zeroed (that copy survives);
    red_j = softmax_j(mean_i S_ij) over all T, restricted to the candidates.
    """
    t = keys.shape[1]
    n = t - p.window
    probs = _logits(keys[:, :n], queries[:, -p.window:], scale).softmax(dim=-1)  # [H, G, W, n]
    imp = _pool(probs.amax(dim=1).mean(dim=1), p.pooling, p.kernel)
    k = F.normalize(keys.to(torch.float32), dim=-1, eps=1e-8)
    sim = k @ k.transpose(1, 2)  # [H, T, T]
    sim.diagonal(dim1=1, dim2=2).zero_()
    over = sim > p.rkv_threshold
    idx = torch.arange(t, device=keys.device)
    last = torch.where(over, idx, -1).amax(dim=-1, keepdim=True)  # most recent similar j per row, -1 if none
    # rows without one write their column 0 back unchanged: no data-dependent shape (nonzero) to sync the host on
    col = last.clamp(min=0)
    sim.scatter_(2, col, torch.where(last >= 0, 0.0, sim.gather(2, col)))
    red = sim.mean(dim=1).softmax(dim=-1)[:, :n]
    return p.rkv_lambda * imp - (1.0 - p.rkv_lambda) * red


def snapkv_scores(keys: torch.Tensor, queries: torch.Tensor, p: KVConfig, *,
                  scale: float | None = None) -> torch.Tensor:
    """SnapKV score of the candidates: float32 [kv_heads, T - window].

    The last `window` queries (stored at T - window .. T - 1, causal among themselves) attend over all T
    keys; their softmax probabilities on the candidates are summed over the window, averaged over the
    KV group's query heads, then pooled.
    """
    t = keys.shape[1]
    w = p.window
    logits = _logits(keys, queries[:, -w:], scale)  # [H, G, W, T]
    qpos = torch.arange(t - w, t, device=keys.device)
    causal = torch.arange(t, device=keys.device)[None, :] <= qpos[:, None]  # [W, T]
    probs = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return _pool(probs[..., : t - w].sum(dim=2).mean(dim=1), p.pooling, p.kernel)


def h2o_scores(keys: torch.Tensor, queries: torch.Tensor, query_index: torch.Tensor,
               previous: torch.Tensor | None = None, *, scale: float | None = None) -> torch.Tensor:
    """H2O accumulated attention: float32 [kv_heads, T].

    queries [q_heads, Q, D] are the queries seen since the last compaction; query_index int [Q] is the
    stored index of each query's own token (it attended to keys 0..query_index[i]). `previous`
    [kv_heads, T0] carries the sums of the entries kept by earlier compactions (T0 <= T; new entries start
    at 0). Sums over queries and over the KV group's query heads.
    """
    t = keys.shape[1]
    logits = _logits(keys, queries, scale)  # [H, G, Q, T]
    causal = torch.arange(t, device=keys.device)[None, :] <= query_index.to(keys.device)[:, None]
    probs = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    acc = probs.sum(dim=(1, 2))
    if previous is not None:
        acc[:, : previous.shape[1]] += previous.to(acc.dtype)
    return acc


def _top_plus_recent(scores: torch.Tensor, t: int, budget: int, recent: int) -> torch.Tensor:
    """Ascending indices: top (budget - recent) of the candidates' scores [H, t - recent] + the last `recent`.

    Ties (plateaus of max pooling) go to the earlier entry, so the choice is deterministic."""
    top = scores.sort(dim=-1, descending=True, stable=True).indices[:, : budget - recent]
    tail = torch.arange(t - recent, t, device=scores.device).expand(scores.shape[0], recent)
    return torch.cat([top, tail], dim=-1).sort(dim=-1).values


def streamingllm_keep(kv_heads: int, t: int, p: KVConfig, device=None) -> torch.Tensor:
    """StreamingLLM: the first `sinks` and the last (budget - sinks) entries, same for every head."""
    keep = torch.cat([torch.arange(p.sinks, device=device), torch.arange(t - (p.budget - p.sinks), t, device=device)])
    return keep.expand(kv_heads, p.budget).clone()


def select_keep(policy: str, keys: torch.Tensor, queries: torch.Tensor | None, p: KVConfig, *,
                h2o_acc: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """int64 [kv_heads, budget]: ascending stored indices each KV head keeps out of keys' T (> budget).

    keys [kv_heads, T, D]; queries [q_heads, W, D] (R-KV, SnapKV: the last `window` queries; H2O:
    unused, pass its accumulated scores [kv_heads, T] as `h2o_acc`); StreamingLLM needs neither.
    `scale` multiplies q . k before the softmax (None: 1 / sqrt(D); kv.latent passes MLA's softmax scale).
    """
    h, t = keys.shape[0], keys.shape[1]
    if t <= p.budget:
        raise ValueError(f"select_keep needs more entries than the budget (got T={t}, budget={p.budget})")
    if policy == "streamingllm":
        return streamingllm_keep(h, t, p, keys.device)
    if policy == "h2o":
        if h2o_acc is None or h2o_acc.shape != (h, t):
            raise ValueError(f"h2o needs h2o_acc of shape {(h, t)}")
        return _top_plus_recent(h2o_acc[:, : t - p.window], t, p.budget, p.window)
    if queries is None or queries.shape[1] < p.window:
        raise ValueError(f"{policy} needs the last {p.window} queries "
                         f"(got {None if queries is None else queries.shape[1]})")
    if policy == "rkv":
        return _top_plus_recent(rkv_scores(keys, queries, p, scale=scale), t, p.budget, p.window)
    if policy == "snapkv":
        return _top_plus_recent(snapkv_scores(keys, queries, p, scale=scale), t, p.budget, p.window)
    raise ValueError(f"policy must be one of {list(POLICIES)} (got {policy!r})")

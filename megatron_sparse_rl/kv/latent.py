"""KV compression policies on the multi-head latent attention (MLA) cache: one keep set per layer.

MLA (DeepSeek-V2, arXiv 2405.04434, section 2.1; DeepSeek-V3, arXiv 2412.19437; Kimi-K2) caches ONE row per
token and layer, shared by every query head: the normalised latent c_kv [kv_lora_rank] (after kv_a_layernorm)
followed by the rotated rope key k_pe [qk_rope_head_dim] (vLLM CPU: `[blocks, block_size, kv_lora_rank +
rope]`, 512 + 64). Head h's key is k_h = [W_UK_h c_kv, k_pe] and its logit q_h . k_h * scale. With the
up-projection absorbed into the query (DeepSeek-V2's "absorb W_UK into W_Q", what vLLM's MLA decode runs):

    score_h(q, t) = ((W_UK_h^T q_nope_h) . c_kv_t + q_pe_h . k_pe_t) * scale
                  = [W_UK_h^T q_nope_h, q_pe_h] . [c_kv_t, k_pe_t] * scale

So the latent cache is the per-head case of `kv.policies` with ONE KV head whose stored key is the row
[c_kv, k_pe] and ONE query group made of all heads, whose queries are the absorbed [W_UK_h^T q_nope_h,
q_pe_h]. `select_latent` hands exactly that to `policies.select_keep` (same windows, pooling, top-k, recent
window and tie rule), so each policy's "over the query heads of a KV group" becomes "over all heads":
- R-KV (arXiv 2505.24133): importance = max over all heads of the window queries' softmax, mean over the
  window, pooled. Redundancy: cosine between the stored rows [c_kv, k_pe] (see below).
- SnapKV (arXiv 2404.14469): window attention summed over the window, averaged over all heads, pooled.
- H2O (arXiv 2306.14048): attention summed over every query since generation began and over all heads.
- StreamingLLM (arXiv 2309.17453): positional (sinks + recent), nothing to score.

R-KV redundancy on the latent: cosine similarity between the stored rows [c_kv, k_pe] (width
kv_lora_rank + rope), not between decompressed per-head keys. Why:
- It is what the engine stores and drops: the row is the unit of the keep set, and it is already in the
  cache (no decompression).
- Cost: one [T, 576] x [576, T] product per layer. Decompressed keys averaged over heads would need
  T x kv_lora_rank x heads x qk_nope to decompress and heads x T^2 x (qk_nope + rope) for the similarities:
  ~43x more at DeepSeek-V3 shape (128 heads x 192 vs 576 per T^2 pair).
- It is a sufficient witness for every head: decompression is linear, so rows that are parallel
  ([c, p]' = a [c, p], a > 0) give parallel keys ([W_UK_h c, p]) AND values (W_UV_h c) in every head;
  near-parallel rows give near-parallel keys up to W_UK's conditioning. The converse does not hold (a
  per-head key can repeat while the row does not), so this errs on the side of keeping tokens.
- Like the per-head policies (keys stored after RoPE), the rope part is included, so identical content at
  distant positions is less redundant than at neighbouring ones. c_kv is RMS-normalised while k_pe is not:
  the cosine weighs the two parts by their norms, as the attention logit itself does.

Shapes: latent [T, kv_lora_rank], k_pe [T, rope] (the two slices of the stored rows, in stored order);
q_nope [heads, Q, qk_nope] and q_pe [heads, Q, rope] (q_pe rotated at each query's true position);
w_uk [heads, qk_nope, kv_lora_rank] = kv_b_proj.weight.view(heads, qk_nope + v_head_dim,
kv_lora_rank)[:, :qk_nope] (vLLM's W_UK_T); scale = the attention's softmax scale (1/sqrt(qk_nope + rope),
times YaRN's mscale^2 where used). Pure torch: no vLLM or Megatron imports.
"""
from __future__ import annotations

import torch

from megatron_sparse_rl.config.rollout import KVConfig
from megatron_sparse_rl.kv import policies as P


def _check_cache(latent: torch.Tensor, k_pe: torch.Tensor) -> None:
    if latent.dim() != 2:
        raise ValueError(f"latent must be [T, kv_lora_rank] (got shape {tuple(latent.shape)})")
    if k_pe.dim() != 2 or k_pe.shape[0] != latent.shape[0]:
        raise ValueError(f"k_pe must be [T, rope] with T = latent's {latent.shape[0]} (got shape {tuple(k_pe.shape)})")


def _check_queries(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, latent: torch.Tensor,
                   k_pe: torch.Tensor, scale: float) -> None:
    _check_cache(latent, k_pe)
    if w_uk.dim() != 3 or w_uk.shape[2] != latent.shape[1]:
        raise ValueError(f"w_uk must be [heads, qk_nope, kv_lora_rank = latent's {latent.shape[1]}] "
                         f"(got shape {tuple(w_uk.shape)})")
    heads, nope = w_uk.shape[0], w_uk.shape[1]
    if q_nope.dim() != 3 or q_nope.shape[0] != heads or q_nope.shape[2] != nope:
        raise ValueError(f"q_nope must be [heads = {heads}, Q, qk_nope = {nope}] like w_uk "
                         f"(got shape {tuple(q_nope.shape)})")
    want = (heads, q_nope.shape[1], k_pe.shape[1])
    if tuple(q_pe.shape) != want:
        raise ValueError(f"q_pe must be [heads, Q, rope] = {want} like q_nope and k_pe (got shape {tuple(q_pe.shape)})")
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float (got {scale!r})")


def absorb_queries(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[heads, Q, kv_lora_rank + rope]: each head's query in latent space, [W_UK_h^T q_nope_h, q_pe_h].

    Its dot product with a stored row [c_kv, k_pe] is q_h . k_h (k_h decompressed), before the scale."""
    q_lat = torch.einsum("hqn,hnr->hqr", q_nope, w_uk.to(q_nope.dtype))
    return torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)


def latent_rows(latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """[T, kv_lora_rank + rope]: the stored rows [c_kv, k_pe] (what vLLM's MLA cache holds per token)."""
    return torch.cat([latent, k_pe.to(latent.dtype)], dim=-1)


def absorbed_scores(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, latent: torch.Tensor,
                    k_pe: torch.Tensor, scale: float) -> torch.Tensor:
    """[heads, Q, T]: attention logits score_h(q, t) of every query against every stored row, unmasked.

    float32 (float64 when an input is float64); softmax over T gives the weights the heads pay."""
    _check_queries(q_nope, q_pe, w_uk, latent, k_pe, scale)
    rows = latent_rows(latent, k_pe)[None]  # one KV head
    return P._logits(rows, absorb_queries(q_nope, q_pe, w_uk), scale)[0]


def latent_h2o_scores(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, latent: torch.Tensor,
                      k_pe: torch.Tensor, scale: float, query_index: torch.Tensor,
                      previous: torch.Tensor | None = None) -> torch.Tensor:
    """H2O accumulated attention per stored row: [T], summed over the queries and all heads.

    q_nope/q_pe [heads, Q, .] are the queries seen since the last compaction; query_index int [Q] the stored
    index of each query's own token (causal: it saw rows 0..query_index[i]); previous [T0 <= T] carries the
    sums of the rows kept by earlier compactions (`policies.h2o_scores` with one KV head)."""
    _check_queries(q_nope, q_pe, w_uk, latent, k_pe, scale)
    if query_index.shape != (q_nope.shape[1],):
        raise ValueError(f"query_index must be [Q = {q_nope.shape[1]}] (got shape {tuple(query_index.shape)})")
    if previous is not None and (previous.dim() != 1 or previous.shape[0] > latent.shape[0]):
        raise ValueError(f"previous must be [T0 <= T = {latent.shape[0]}] (got shape {tuple(previous.shape)})")
    rows = latent_rows(latent, k_pe)[None]
    prev = None if previous is None else previous[None]
    return P.h2o_scores(rows, absorb_queries(q_nope, q_pe, w_uk), query_index, prev, scale=scale)[0]


def select_latent(policy: str, latent: torch.Tensor, k_pe: torch.Tensor, p: KVConfig, *,
                  q_nope: torch.Tensor | None = None, q_pe: torch.Tensor | None = None,
                  w_uk: torch.Tensor | None = None, scale: float | None = None,
                  h2o_acc: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [budget]: ascending stored indices of the rows one MLA layer keeps (all heads share them).

    T = latent.shape[0] <= budget keeps everything: arange(T). R-KV and SnapKV need the last `window`
    queries (q_nope, q_pe; more are cut to the last window) with w_uk and scale; H2O needs `h2o_acc` [T]
    from `latent_h2o_scores`; StreamingLLM needs neither. Knobs (budget, window, sinks, pooling, kernel,
    rkv_lambda, rkv_threshold) come from `p` as for `policies.select_keep`.
    """
    if policy not in P.POLICIES:
        raise ValueError(f"policy must be one of {list(P.POLICIES)} (got {policy!r})")
    _check_cache(latent, k_pe)
    t = latent.shape[0]
    if policy in ("rkv", "snapkv"):
        missing = [n for n, v in (("q_nope", q_nope), ("q_pe", q_pe), ("w_uk", w_uk), ("scale", scale)) if v is None]
        if missing:
            raise ValueError(f"{policy} on the latent cache needs {', '.join(missing)}")
        _check_queries(q_nope, q_pe, w_uk, latent, k_pe, scale)
    if policy == "h2o" and (h2o_acc is None or h2o_acc.shape != (t,)):
        raise ValueError(f"h2o_acc must be [T = {t}] for h2o "
                         f"(got {None if h2o_acc is None else tuple(h2o_acc.shape)})")
    if t <= p.budget:
        return torch.arange(t, device=latent.device)
    if policy in ("h2o", "streamingllm"):  # these read only T from the keys
        acc = None if h2o_acc is None else h2o_acc[None]
        return P.select_keep(policy, latent[None], None, p, h2o_acc=acc)[0]
    queries = absorb_queries(q_nope[:, -p.window:], q_pe[:, -p.window:], w_uk)
    return P.select_keep(policy, latent_rows(latent, k_pe)[None], queries, p, scale=scale)[0]

"""Routing statistics: agreement between two route sets, flipped-token fraction, expert drift, expert load and its
entropy.

Pure tensor math on `RouteStore`s (no Megatron, no vLLM):

    agreement(a, b)         -> per-layer fraction of tokens whose top-k SETS are equal (order ignored)
    flipped_fraction(a, b)  -> fraction of tokens with a different set in at least one layer
    flip_counts(a, b)       -> per-layer flipped tokens, tokens flipped in any layer, tokens (sums over ranks)
    expert_load(a)          -> int64 [layers, experts] token counts
    load_entropy(load)      -> per-layer entropy of the load distribution, normalised to [0, 1]
    routing_metrics(...)    -> the flat `routing/...` metric dict a trainer logs each step (summed over the
                               data-parallel `group` first, when given); names in docs/routing.md
    drift_metrics(old, new) -> one update's expert drift pi_old -> pi_theta: `routing/drift/...` (same counts)
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_sparse_rl.moe.storage import RouteStore, RoutingError


def _check_aligned(a: RouteStore, b: RouteStore) -> None:
    if not torch.equal(a.offsets, b.offsets):
        raise RoutingError(f"route sets cover different tokens: lengths {a.lengths.tolist()[:8]} vs "
                           f"{b.lengths.tolist()[:8]}")
    bad = (a.token_hash != b.token_hash).nonzero().flatten().tolist()
    if bad:
        raise RoutingError(f"sequence {bad[0]}: the two route sets belong to different tokens "
                           f"({len(bad)} sequences differ)")
    if a.layers != b.layers or a.topk != b.topk:
        raise RoutingError(f"route sets differ in layers {a.layers} vs {b.layers} or top-k {a.topk} vs {b.topk}")


def set_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool [..., ] : whether the top-k sets (last dim) of a and b are equal, order ignored."""
    return (a.long().sort(dim=-1).values == b.long().sort(dim=-1).values).all(dim=-1)


def agreement(a: RouteStore, b: RouteStore) -> torch.Tensor:
    """float64 [layers]: fraction of tokens whose top-k set is the same in `a` and `b`."""
    _check_aligned(a, b)
    if a.indices.shape[0] == 0:
        return torch.ones(len(a.layers), dtype=torch.float64)
    return set_equal(a.indices, b.indices).double().mean(dim=0)


def flipped_fraction(a: RouteStore, b: RouteStore) -> float:
    """Fraction of tokens whose top-k set differs in at least one layer."""
    _check_aligned(a, b)
    if a.indices.shape[0] == 0:
        return 0.0
    return float((~set_equal(a.indices, b.indices)).any(dim=1).double().mean())


def expert_load(a: RouteStore) -> torch.Tensor:
    """int64 [layers, experts]: how many tokens each expert received, per layer."""
    layers, k = len(a.layers), a.topk
    idx = a.indices.long().permute(1, 0, 2).reshape(layers, -1)
    return torch.zeros(layers, a.num_experts, dtype=torch.int64).scatter_add_(1, idx, torch.ones_like(idx)) \
        if k else torch.zeros(layers, a.num_experts, dtype=torch.int64)


def load_entropy(load: torch.Tensor) -> torch.Tensor:
    """float64 [layers]: entropy of each layer's expert-load distribution / log(experts) (1 = perfectly even)."""
    p = load.double() / load.sum(dim=1, keepdim=True).clamp_min(1)
    h = -(p * p.clamp_min(1e-300).log()).sum(dim=1)
    return h / math.log(load.shape[1]) if load.shape[1] > 1 else torch.ones(load.shape[0], dtype=torch.float64)


def flip_counts(a: RouteStore, b: RouteStore) -> torch.Tensor:
    """float64 [layers + 2]: per layer, the tokens whose top-k set differs between `a` and `b` (order ignored);
    then the tokens that differ in at least one layer; then the token count. Counts, so they add up over ranks."""
    _check_aligned(a, b)
    differ = ~set_equal(a.indices, b.indices)  # [tokens, layers]
    return torch.cat([differ.sum(dim=0).double(), differ.any(dim=1).sum().double().reshape(1),
                      torch.tensor([float(differ.shape[0])], dtype=torch.float64)])


def _global(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def routing_metrics(routes: RouteStore, reference: RouteStore | None = None, *, prefix: str = "routing",
                    group=None) -> dict:
    """Flat metrics: load entropy (and max/mean load) per layer of `routes`; with `reference` (e.g. the
    rollout engine's routes vs the learner's), the flip rate per layer (fraction of tokens whose top-k set
    differs), its mean over layers and the fraction of tokens flipped in at least one layer. With a process
    `group` (data parallel) the loads and flip counts are summed over its ranks first (every rank must call)."""
    load = expert_load(routes)
    counts = flip_counts(reference, routes) if reference is not None else torch.zeros(0, dtype=torch.float64)
    summed = _global(torch.cat([load.double().flatten(), counts]), group)
    load, counts = summed[:load.numel()].view_as(load), summed[load.numel():]
    out: dict[str, float] = {}
    ent = load_entropy(load)
    for j, layer in enumerate(routes.layers):
        out[f"{prefix}/load_entropy/layer{layer}"] = float(ent[j])
        mean = float(load[j].mean())
        out[f"{prefix}/load_max_over_mean/layer{layer}"] = float(load[j].max()) / mean if mean else 0.0
    out[f"{prefix}/load_entropy_mean"] = float(ent.mean()) if ent.numel() else 1.0
    if reference is not None:
        out.update(_rates(counts, routes.layers, f"{prefix}/flip_rate/layer", f"{prefix}/flip_rate_mean",
                          f"{prefix}/flipped_token_fraction"))
    return out


def drift_metrics(old: RouteStore, new: RouteStore, *, prefix: str = "routing", group=None) -> dict:
    """One update's expert drift: per MoE layer the fraction of tokens whose top-k set differs between `old` (pi_old's
    own routes of the rows, from the learner's old-logprob forward) and `new` (the routes pi_theta's routers choose in
    the update's forward, same rows and tokens), its mean over the layers and the fraction of tokens that differ in
    at least one layer. With a process `group` (data parallel) the counts are summed over its ranks before dividing
    (every rank must call)."""
    counts = _global(flip_counts(old, new), group)
    return _rates(counts, old.layers, f"{prefix}/drift/layer", f"{prefix}/drift_mean",
                  f"{prefix}/drift_token_fraction")


def _rates(counts: torch.Tensor, layers: tuple[int, ...], per_layer: str, mean: str, any_layer: str) -> dict:
    """`flip_counts` (summed) -> per-layer rates `{per_layer}{L}`, their mean over layers and the any-layer fraction."""
    n = len(layers)
    tokens = max(float(counts[-1]), 1.0)
    rate = counts[:n] / tokens
    out = {f"{per_layer}{layer}": float(rate[j]) for j, layer in enumerate(layers)}
    out[mean] = float(rate.mean()) if n else 0.0
    out[any_layer] = float(counts[n]) / tokens
    return out

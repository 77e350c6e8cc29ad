"""Data parallelism of the per-step mismatch and routing metrics: on 2 gloo ranks, each holding part of the
batch, `mismatch_metrics`, `routing_attribution`, `routing_metrics` and `drift_metrics` with the DP group equal
float64 formulas over the whole batch written here (means over all tokens, not a mean of the ranks' means).

    .venv/bin/python -m pytest -q -m distributed tests/distributed/test_mismatch_dp.py
"""
import math

import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

B, T, SPLIT, LAYERS, K, EXPERTS = 5, 6, 1, (0, 2), 2, 6  # rank 0 holds 1 row, rank 1 holds 4: unequal shares


def make_batch():
    g = torch.Generator().manual_seed(7)
    mu = -(torch.rand(B, T, generator=g, dtype=torch.float64) * 2 + 0.1)
    engine = mu + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    own = engine + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    own[3, 1], mask[3, 1] = float("nan"), True
    return engine, own, mu, mask


def make_routes():
    """Per row: engine and learner top-K sets over 3 tokens; the learner's differ on some tokens and layers."""
    g = torch.Generator().manual_seed(3)
    sets = [torch.randperm(EXPERTS, generator=g)[:K] for _ in range(B * 3 * len(LAYERS))]
    eng = list(torch.stack(sets).view(B, 3, len(LAYERS), K))
    own = [e.flip(-1).clone() for e in eng]  # the same sets, listed the other way round
    for i, t, j in [(0, 0, 0), (1, 2, 1), (3, 1, 0), (3, 1, 1), (4, 0, 1)]:
        own[i][t, j, 0] = next(x for x in range(EXPERTS) if x not in eng[i][t, j].tolist())
    return eng, own


def _stores(rows):
    from megatron_sparse_rl.moe.storage import RouteStore

    eng, own = make_routes()
    toks = [[100 * i + t for t in range(3)] for i in rows]
    own, eng = ([seqs[i] for i in rows] for seqs in (own, eng))
    return (RouteStore.from_sequences(own, toks, num_experts=EXPERTS, layers=LAYERS),
            RouteStore.from_sequences(eng, toks, num_experts=EXPERTS, layers=LAYERS))


def metrics_on(rows, group):
    from megatron_sparse_rl.algorithms.metrics import mismatch_metrics, routing_attribution
    from megatron_sparse_rl.moe.stats import drift_metrics, routing_metrics

    engine, own, mu, mask = (t[rows] for t in make_batch())
    out = {k: float(v) for k, v in mismatch_metrics(own, mu, mask, group=group).items()}
    out.update({k: float(v) for k, v in routing_attribution(engine, own, mu, mask, group=group).items()})
    own, eng = _stores(list(range(B))[rows])
    out.update(routing_metrics(own, eng, group=group))
    out.update(drift_metrics(eng, own, group=group))  # the same counts, read as pi_old's routes -> pi_theta's
    return out


def _rank_fn(rank, world_size):
    return metrics_on(slice(0, SPLIT) if rank == 0 else slice(SPLIT, B), dist.group.WORLD)


def hand_reference() -> dict[str, float]:
    engine, own, mu, mask = make_batch()
    valid = [(i, t) for i in range(B) for t in range(T) if mask[i, t] and math.isfinite(float(own[i, t]))]
    n = len(valid)
    lr = {(i, t): float(own[i, t] - mu[i, t]) for i, t in valid}
    lr_e = {(i, t): float(engine[i, t] - mu[i, t]) for i, t in valid}
    k3 = sum(math.exp(x) - x - 1 for x in lr.values()) / n
    k3_e = sum(math.exp(x) - x - 1 for x in lr_e.values()) / n
    want = {"mismatch/k1": -sum(lr.values()) / n, "mismatch/k3": k3,
            "mismatch/chi2": sum(math.exp(2 * x) for x in lr.values()) / n - 1,
            "mismatch/max_abs_log_rho": max(abs(x) for x in lr.values()), "mismatch/nonfinite_tokens": 1.0,
            "mismatch/ppl_old": math.exp(-sum(float(own[v]) for v in valid) / n),
            "mismatch/k3_learner_routes": k3, "mismatch/k3_engine_routes": k3_e,
            "mismatch/k1_engine_routes": -sum(lr_e.values()) / n, "mismatch/routing_share": (k3 - k3_e) / k3}
    eng, own_routes = make_routes()
    tokens = [(i, t) for i in range(B) for t in range(3)]
    differs = {(i, t): [set(eng[i][t, j].tolist()) != set(own_routes[i][t, j].tolist()) for j in range(len(LAYERS))]
               for i, t in tokens}
    for j, layer in enumerate(LAYERS):
        want[f"routing/flip_rate/layer{layer}"] = sum(d[j] for d in differs.values()) / len(tokens)
    want["routing/flipped_token_fraction"] = sum(any(d) for d in differs.values()) / len(tokens)
    for j, layer in enumerate(LAYERS):
        want[f"routing/drift/layer{layer}"] = want[f"routing/flip_rate/layer{layer}"]
    want["routing/drift_mean"] = sum(want[f"routing/drift/layer{layer}"] for layer in LAYERS) / len(LAYERS)
    want["routing/drift_token_fraction"] = want["routing/flipped_token_fraction"]
    for j, layer in enumerate(LAYERS):  # the learner's expert load over every row
        load = [sum(e in own_routes[i][t, j].tolist() for i, t in tokens) for e in range(EXPERTS)]
        p = [c / sum(load) for c in load]
        want[f"routing/load_entropy/layer{layer}"] = -sum(x * math.log(x) for x in p if x) / math.log(EXPERTS)
        want[f"routing/load_max_over_mean/layer{layer}"] = max(load) / (sum(load) / EXPERTS)
    return want


def test_two_ranks_give_the_full_batch_values():
    want = hand_reference()
    assert 0 < want["routing/flipped_token_fraction"] < 1 and 0 < want["mismatch/routing_share"] < 1
    for out in run_distributed(_rank_fn, world_size=2, timeout=120):
        for k, v in want.items():
            assert out[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k

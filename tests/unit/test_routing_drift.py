"""Expert drift pi_old -> pi_theta per update (issue 32), without Megatron: `drift_metrics` on recorded routes
against counts made by loops here; the requests `LearnerRouting.update` makes under off/R2/R3 with and without
routing.record_stats; and `training/update.py` `update` over mini-batches with a stand-in learner: each update's own
routes are compared with the old forward's routes of the SAME rows, averaged over the updates, and drift_last is the
last update's. The real learner (loss and grad norm unchanged by recording, 0 on policy) is
tests/distributed/test_routing.py.

    .venv/bin/python -m pytest -q tests/unit/test_routing_drift.py
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_sparse_rl.algorithms.objective import ObjectiveSums
from megatron_sparse_rl.config.algorithm import AlgorithmConfig
from megatron_sparse_rl.config.routing import RoutingConfig
from megatron_sparse_rl.learner.extras import RouteRequest
from megatron_sparse_rl.learner.routing import LearnerRouting
from megatron_sparse_rl.moe.stats import drift_metrics
from megatron_sparse_rl.moe.storage import RouteStore
from megatron_sparse_rl.training import update as U

LAYERS, K, EXPERTS = (1, 3), 2, 6
LENGTHS = [5, 4, 3, 5, 4, 2]  # tokens per row: routes for length - 1 input positions


def _tokens() -> torch.Tensor:
    t = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        t[i, :n] = torch.arange(n) + 10 * (i + 1)  # every row distinct
    return t


def _random_sets(seed: int) -> list[list[list[list[int]]]]:
    """Per row, per input position, per layer: a top-K set of distinct experts (python lists)."""
    g = torch.Generator().manual_seed(seed)
    return [[[torch.randperm(EXPERTS, generator=g)[:K].tolist() for _ in LAYERS] for _ in range(n - 1)]
            for n in LENGTHS]


def _drifted(sets, seed: int, p: float):
    """`sets` with each set listed in reverse order (not a change) and, with probability p, one expert swapped for
    one outside the set (a change)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for row in sets:
        out.append([])
        for pos in row:
            new_pos = []
            for s in pos:
                s = list(reversed(s))
                if float(torch.rand(1, generator=g)) < p:
                    s[0] = next(e for e in range(EXPERTS) if e not in s)
                new_pos.append(s)
            out[-1].append(new_pos)
    return out


def _store(sets, rows=None) -> RouteStore:
    rows = list(range(len(LENGTHS))) if rows is None else rows
    toks = _tokens()
    return RouteStore.from_sequences([torch.tensor(sets[i]) for i in rows],
                                     [toks[i, :LENGTHS[i] - 1] for i in rows], num_experts=EXPERTS, layers=LAYERS)


def _hand_drift(old, new, rows) -> dict[str, float]:
    """Per-layer fraction of the rows' tokens whose sets differ, its mean over layers, the any-layer fraction."""
    differ, any_differ, n = [0] * len(LAYERS), 0, 0
    for i in rows:
        for o_pos, n_pos in zip(old[i], new[i]):
            n += 1
            d = [set(o) != set(x) for o, x in zip(o_pos, n_pos)]
            differ = [a + b for a, b in zip(differ, d)]
            any_differ += any(d)
    out = {f"routing/drift/layer{layer}": differ[j] / n for j, layer in enumerate(LAYERS)}
    out["routing/drift_mean"] = sum(differ) / n / len(LAYERS)
    out["routing/drift_token_fraction"] = any_differ / n
    return out


def test_drift_metrics_equal_a_hand_count_on_recorded_routes():
    old, new = _random_sets(0), _drifted(_random_sets(0), 1, 0.3)
    want = _hand_drift(old, new, range(len(LENGTHS)))
    assert 0 < want["routing/drift_mean"] < want["routing/drift_token_fraction"] < 1  # the data has drift
    got = drift_metrics(_store(old), _store(new))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-15), k
    same = drift_metrics(_store(old), _store(_drifted(old, 2, 0.0)))  # reordered sets only
    assert same["routing/drift_mean"] == 0.0 and same["routing/drift_token_fraction"] == 0.0


def test_a_drift_request_compares_recorded_routes_and_selects_their_rows():
    old = _store(_random_sets(0))
    with pytest.raises(ValueError, match=r"compare_with.*needs record=True"):
        RouteRequest(replay=old, compare_with=old)
    sub = RouteRequest(replay=old, record=True, compare_with=old).select([4, 1])
    assert torch.equal(sub.compare_with.token_hash, old.token_hash[[4, 1]])
    assert torch.equal(sub.compare_with.indices, old.select([4, 1]).indices)


def _routing(cfg: RoutingConfig) -> LearnerRouting:
    routing = object.__new__(LearnerRouting)  # no model: only the step logic is under test
    routing.cfg, routing.groups = cfg, SimpleNamespace(dp=None)
    return routing


@pytest.mark.parametrize("mode", ["off", "R2", "R3"])
@pytest.mark.parametrize("stats", [True, False])
def test_update_requests_the_drift_with_routing_statistics_only(mode, stats):
    replayed, own = _store(_random_sets(5)), _store(_random_sets(0))
    request = _routing(RoutingConfig(mode=mode, record_stats=stats)).update(None if mode == "off" else replayed, own)
    if mode == "off" and not stats:
        assert request is None
        return
    assert request.replay is (None if mode == "off" else replayed)
    assert request.record == stats and request.compare_with is (own if stats else None)
    no_old = _routing(RoutingConfig(mode=mode, record_stats=stats)).update(None if mode == "off" else replayed, None)
    assert no_old is None if mode == "off" else (no_old.compare_with is None and not no_old.record)


class DriftingLearner:
    """Stands in for the Megatron learner around the real LearnerRouting.update: the routers of update u choose
    `new[u]`; a train step finds its rows by their tokens and compares their routes with the request's
    `compare_with` (as LearnerRouting.finish does, with `drift_metrics`)."""

    def __init__(self, cfg: RoutingConfig, new):
        self.routing, self.new, self.rows_run = _routing(cfg), new, []
        self.indexer = None  # no DSA indexer

    def train_step(self, tokens, loss_fn, *, lengths=None, extras=None):
        full = _tokens()
        rows = [next(i for i in range(len(full)) if torch.equal(full[i], t)) for t in tokens]
        own = _store(self.new[len(self.rows_run)], rows)
        self.rows_run.append(rows)
        request = extras.routes
        metrics = {"loss": 0.0, "grad_norm": 1.0, "lr": 1e-6, U.OBJECTIVE: ObjectiveSums({}, {"n": 1.0})}
        if request is not None and request.replay is not None:
            assert torch.equal(request.replay.token_hash, own.token_hash)  # the rows' routes are replayed
            metrics["routing/replay_applied_fraction"] = 1.0
        if request is not None and request.compare_with is not None:
            metrics.update(drift_metrics(request.compare_with, own))  # raises on other rows' routes
        return metrics


@pytest.mark.parametrize("mode", ["off", "R2", "R3"])
def test_update_averages_each_updates_drift_against_its_own_rows(mode):
    old = _random_sets(0)
    new = [_drifted(old, 10, 0.0), _drifted(old, 11, 0.2), _drifted(old, 12, 0.5)]  # pi_theta moves away
    learner = DriftingLearner(RoutingConfig(mode=mode), new)
    tokens = _tokens()
    positions = torch.arange(tokens.shape[1] - 1)[None]
    mask = (positions >= 1) & (positions < torch.tensor(LENGTHS)[:, None] - 1)  # the response: after 1 prompt token
    f = torch.zeros(mask.shape)
    prep = U.PreparedBatch(tokens=tokens, mask=mask, old_logprobs=f, rollout_logprobs=f,
                           advantages=torch.zeros(len(LENGTHS)), weights=torch.ones(mask.shape), metrics={},
                           lengths=torch.tensor(LENGTHS), routes=None if mode == "off" else _store(_random_sets(5)),
                           learner_routes=_store(old))
    out = U.update(learner, prep, AlgorithmConfig(), updates=3, dp_group=None)
    chunks = [[0, 1], [2, 3], [4, 5]]  # 6 rows in 3 updates
    assert learner.rows_run == chunks
    per_update = [_hand_drift(old, new[u], rows) for u, rows in enumerate(chunks)]
    assert per_update[0]["routing/drift_mean"] == 0.0 < per_update[2]["routing/drift_mean"]
    for k in per_update[0]:
        assert out[k] == pytest.approx(sum(d[k] for d in per_update) / 3, abs=1e-15), k
    assert out["routing/drift_last"] == pytest.approx(per_update[2]["routing/drift_mean"], abs=1e-15)
    without = U.update(DriftingLearner(RoutingConfig(mode=mode, record_stats=False), new), prep, AlgorithmConfig(),
                       updates=3, dp_group=None)
    assert not any(k.startswith("routing/drift") for k in without)

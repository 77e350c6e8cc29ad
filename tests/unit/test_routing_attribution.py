"""Routing's part of the train-inference mismatch, without Megatron or vLLM: the flip-rate metrics of recorded
routes against counts made by loops here; the routing share (`routing_attribution`) against a float64 formula;
routing.attribute_mismatch's config checks; and prepare's extra forward (which pi_old ran the engine's routes,
under off, R2 and R3) with a stand-in learner around the real LearnerRouting step logic.

    .venv/bin/python -m pytest -q tests/unit/test_routing_attribution.py
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_sparse_rl.algorithms.metrics import routing_attribution
from megatron_sparse_rl.config import ConfigError, RunConfig
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.algorithm import AlgorithmConfig
from megatron_sparse_rl.config.loader import from_dict, merge_overrides
from megatron_sparse_rl.config.routing import RoutingConfig
from megatron_sparse_rl.learner.routing import LearnerRouting, RoutingResult
from megatron_sparse_rl.moe.stats import routing_metrics
from megatron_sparse_rl.moe.storage import RouteStore
from megatron_sparse_rl.rollout.batch import FeatureRecords, RolloutBatch
from megatron_sparse_rl.training import update as U

LAYERS = (1, 2, 4)  # MoE layer numbers as a model with dense layers 0 and 3 would have them


def _store(seqs: list[list], tokens: list[list[int]]) -> RouteStore:
    return RouteStore.from_sequences([torch.tensor(s) for s in seqs], tokens, num_experts=8, layers=LAYERS)


# three sequences (4, 2 and 3 tokens), three MoE layers, top-2 of 8 experts; engine routes vs learner routes.
# The learner lists some sets in the other order (the same set, not a flip) and flips one expert elsewhere.
ENGINE = [
    [[[0, 1], [2, 3], [4, 5]], [[1, 2], [3, 4], [5, 6]], [[6, 7], [0, 2], [1, 3]], [[2, 5], [4, 6], [0, 7]]],
    [[[3, 4], [5, 1], [6, 2]], [[0, 7], [1, 6], [2, 5]]],
    [[[5, 6], [7, 0], [1, 4]], [[2, 3], [4, 1], [6, 0]], [[1, 7], [2, 6], [3, 5]]],
]
LEARNER = [
    [[[1, 0], [2, 3], [4, 5]], [[1, 2], [3, 7], [6, 5]], [[6, 7], [0, 2], [1, 3]], [[2, 4], [4, 6], [7, 0]]],
    [[[4, 3], [1, 5], [6, 2]], [[0, 7], [1, 6], [2, 3]]],
    [[[5, 6], [0, 7], [1, 4]], [[3, 2], [4, 1], [0, 6]], [[7, 1], [6, 0], [5, 3]]],
]
TOKENS = [[11, 12, 13, 14], [21, 22], [31, 32, 33]]


def _hand_flips() -> tuple[list[float], float]:
    """Per-layer flip rate and the any-layer flipped-token fraction, by loops over tokens and layers."""
    flipped, any_flip, n = [0] * len(LAYERS), 0, 0
    for eng_seq, own_seq in zip(ENGINE, LEARNER):
        for eng_tok, own_tok in zip(eng_seq, own_seq):
            n += 1
            differs = [set(e) != set(o) for e, o in zip(eng_tok, own_tok)]
            for j, d in enumerate(differs):
                flipped[j] += d
            any_flip += any(differs)
    return [f / n for f in flipped], any_flip / n


def test_flip_metrics_equal_a_hand_count_on_recorded_routes():
    rates, any_frac = _hand_flips()
    assert rates == [1 / 9, 2 / 9, 1 / 9] and any_frac == 4 / 9  # the data mixes flips and reorderings as meant
    m = routing_metrics(_store(LEARNER, TOKENS), _store(ENGINE, TOKENS))
    for layer, rate in zip(LAYERS, rates):
        assert m[f"routing/flip_rate/layer{layer}"] == pytest.approx(rate, abs=1e-15)
    assert m["routing/flip_rate_mean"] == pytest.approx(sum(rates) / len(rates), abs=1e-15)
    assert m["routing/flipped_token_fraction"] == pytest.approx(any_frac, abs=1e-15)
    same = routing_metrics(_store(LEARNER, TOKENS), _store(LEARNER, TOKENS))
    assert same["routing/flip_rate_mean"] == 0.0 and same["routing/flipped_token_fraction"] == 0.0
    assert not any(k.startswith("routing/flip") for k in routing_metrics(_store(LEARNER, TOKENS)))


# ---- the routing share ----------------------------------------------------------------------------------
def _hand_attribution(engine, own, mu, mask) -> dict[str, float]:
    """k1/k3 of mu against each pi_old and the share, in float64 by loops over the tokens finite in all three."""
    sums = {"k1_e": 0.0, "k3_e": 0.0, "k1_l": 0.0, "k3_l": 0.0}
    n = 0
    for i in range(mu.shape[0]):
        for t in range(mu.shape[1]):
            vals = [float(engine[i, t]), float(own[i, t]), float(mu[i, t])]
            if not mask[i, t] or not all(math.isfinite(v) for v in vals):
                continue
            e, o, m = vals
            n += 1
            sums["k1_e"] += m - e
            sums["k3_e"] += math.exp(e - m) - (e - m) - 1
            sums["k1_l"] += m - o
            sums["k3_l"] += math.exp(o - m) - (o - m) - 1
    k = {key: v / n for key, v in sums.items()}
    return {"mismatch/k1_engine_routes": k["k1_e"], "mismatch/k3_engine_routes": k["k3_e"],
            "mismatch/k1_learner_routes": k["k1_l"], "mismatch/k3_learner_routes": k["k3_l"],
            "mismatch/routing_share": (k["k3_l"] - k["k3_e"]) / k["k3_l"]}


def _logprobs(seed: int, shape=(4, 7)):
    g = torch.Generator().manual_seed(seed)
    mu = -(torch.rand(shape, generator=g) * 3 + 0.05)
    engine = mu + 0.05 * torch.randn(shape, generator=g)  # numerics only
    own = engine + 0.4 * torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.3)  # + flips
    mask = torch.rand(shape, generator=g) < 0.75
    return engine, own, mu, mask


def test_routing_share_equals_a_float64_hand_computation():
    engine, own, mu, mask = _logprobs(0)
    mask[1, 3] = mask[2, 0] = True
    own[1, 3], mu[2, 0] = float("nan"), float("-inf")  # left out of every mean, as in mismatch_metrics
    got = routing_attribution(engine, own, mu, mask)
    want = _hand_attribution(engine, own, mu, mask)
    assert set(got) == set(want)
    for k, v in want.items():
        assert float(got[k]) == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert 0.0 < float(got["mismatch/routing_share"]) < 1.0


def test_routing_share_is_zero_without_mismatch_and_negative_when_replay_makes_it_worse():
    engine, own, mu, mask = _logprobs(1)
    none = routing_attribution(mu, mu, mu, mask)
    assert float(none["mismatch/k3_learner_routes"]) == 0.0 and float(none["mismatch/routing_share"]) == 0.0
    worse = routing_attribution(own, engine, mu, mask)  # the far pi_old labelled as the engine-routes one
    assert float(worse["mismatch/routing_share"]) == pytest.approx(
        _hand_attribution(own, engine, mu, mask)["mismatch/routing_share"], rel=1e-12)
    assert float(worse["mismatch/routing_share"]) < 0.0


# ---- config -----------------------------------------------------------------------------------------------
def test_attribute_mismatch_needs_the_engines_routes():
    with pytest.raises(ValueError, match=r"routing\.attribute_mismatch needs the engine's routes.*'R2'.*"
                                         r"routing\.capture_rollout_routes = true"):
        RoutingConfig(mode="R2", attribute_mismatch=True)
    assert RoutingConfig(mode="R3", attribute_mismatch=True).capture
    off = RoutingConfig(record_stats=False, capture_rollout_routes=True, attribute_mismatch=True)
    assert off.replay  # the learner's routers must carry RouterReplay to replay the engine's routes


def _run(*overrides: str) -> RunConfig:
    return from_dict(RunConfig, merge_overrides({"model": {"path": "/nonexistent/tiny", "tiny": {}}}, list(overrides)))


def test_attribute_mismatch_needs_the_learners_pi_old():
    with pytest.raises(ConfigError, match=r"routing\.attribute_mismatch compares.*old_logprobs = 'engine'"):
        validate(_run("algorithm.old_logprobs=engine", "routing.mode=R3", "routing.attribute_mismatch=true"), 1,
                 cuda=False)
    validate(_run("routing.mode=R3", "routing.attribute_mismatch=true"), 1, cuda=False)


# ---- prepare: the extra forward -------------------------------------------------------------------------------
class RoutedLearner:
    """Stands in for the Megatron learner around the real LearnerRouting step logic (old_forward, after_old_forward,
    counterfactual): a call that replays routes returns `engine_lp` (the engine's experts ran), a call whose routers
    route themselves returns `own_lp`, and a recording call returns `own_routes` as the learner's routes."""

    def __init__(self, cfg: RoutingConfig, engine_lp, own_lp, own_routes):
        self.routing = object.__new__(LearnerRouting)  # no model: only the step logic is under test
        self.routing.cfg, self.routing.groups = cfg, SimpleNamespace(dp=None)
        self.indexer = None  # no DSA indexer
        self.engine_lp, self.own_lp, self.own_routes, self.calls = engine_lp, own_lp, own_routes, []

    def forward_logprobs(self, tokens, *, lengths=None, extras=None):
        request = extras.routes
        replay = request is not None and request.replay is not None
        self.calls.append("replay" if replay else "own")
        out = {"logprobs": (self.engine_lp if replay else self.own_lp).clone()}
        if request is not None:
            own = self.own_routes if request.record else None
            out["routing"] = RoutingResult(routes=request.replay if replay else own, learner_routes=own)
        return out


def _routed_batch() -> tuple[RolloutBatch, RouteStore, RouteStore]:
    """Two rows of 5 tokens (routes for 4 input positions each) with the engine's routes attached."""
    prompts, responses = [[1, 5, 6], [1, 9, 3]], [[7, 2], [4, 4]]
    toks = [p + r[:-1] for p, r in zip(prompts, responses)]
    engine = _store([ENGINE[0], ENGINE[0][::-1]], toks)
    own = _store([LEARNER[0], LEARNER[0][::-1]], toks)
    batch = RolloutBatch(
        prompt_ids=torch.tensor(prompts), prompt_lens=torch.tensor([3, 3]), response_ids=torch.tensor(responses),
        response_mask=torch.ones(2, 2, dtype=torch.bool), rollout_logprobs=torch.tensor([[-0.1, -0.2], [-0.3, -0.4]]),
        finish_reasons=("stop", "stop"), group_ids=torch.tensor([0, 0]), reward=torch.tensor([1.0, 0.0]),
        features=FeatureRecords(routed_experts=engine))
    return batch, engine, own


@pytest.mark.parametrize("cfg, calls", [
    (RoutingConfig(mode="off", record_stats=False, capture_rollout_routes=True, attribute_mismatch=True),
     ["own", "replay"]),
    (RoutingConfig(mode="R2", capture_rollout_routes=True, attribute_mismatch=True), ["own", "replay"]),
    (RoutingConfig(mode="R3", attribute_mismatch=True), ["replay", "own"]),
])
def test_prepare_logs_the_share_with_each_pi_old_on_its_side(cfg, calls):
    batch, _, own_routes = _routed_batch()
    engine_lp = torch.tensor([[0.0, 0.0, -0.15, -0.2], [0.0, 0.0, -0.35, -0.45]])  # [B, T-1], response at 2, 3
    own_lp = torch.tensor([[0.0, 0.0, -0.6, -0.1], [0.0, 0.0, -0.3, -1.2]])
    learner = RoutedLearner(cfg, engine_lp, own_lp, own_routes)
    prep = U.prepare(learner, batch, AlgorithmConfig(), pad_id=0, dp_group=None)
    assert learner.calls == calls  # the old forward first, then the one routed the other way
    mu, mask = prep.rollout_logprobs, prep.loss_mask
    for k, v in _hand_attribution(engine_lp, own_lp, mu, mask).items():
        assert prep.metrics[k] == pytest.approx(v, rel=1e-6), k
    old_is_engine = cfg.mode == "R3"
    assert torch.equal(prep.old_logprobs, engine_lp if old_is_engine else own_lp)  # the extra pi_old is metrics only
    if cfg.record_stats:  # the learner's recorded routes against the engine's, every step
        rates, any_frac = _hand_flips_of(batch.features.routed_experts, own_routes)
        assert prep.metrics["routing/flipped_token_fraction"] == pytest.approx(any_frac)
        assert [prep.metrics[f"routing/flip_rate/layer{layer}"] for layer in LAYERS] == pytest.approx(rates)
    else:
        assert not any(k.startswith("routing/flip") for k in prep.metrics)


def _hand_flips_of(a: RouteStore, b: RouteStore) -> tuple[list[float], float]:
    flipped, any_flip = [0] * len(LAYERS), 0
    for t in range(a.indices.shape[0]):
        differs = [set(a.indices[t, j].tolist()) != set(b.indices[t, j].tolist()) for j in range(len(LAYERS))]
        flipped = [f + d for f, d in zip(flipped, differs)]
        any_flip += any(differs)
    n = a.indices.shape[0]
    return [f / n for f in flipped], any_flip / n

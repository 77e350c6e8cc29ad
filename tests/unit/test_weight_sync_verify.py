"""The one engine-vs-learner probe comparison (weight_sync/verify.py), with a stand-in learner whose logprobs are
given: the worst |difference| over every engine it is handed, None when there is none to compare, the first engine
over the tolerance named, the learner scored at temperature 1 whatever its training temperature.

    .venv/bin/python -m pytest -q tests/unit/test_weight_sync_verify.py
"""
import contextlib

import pytest
import torch

from megatron_sparse_rl.weight_sync import WeightSyncError, compare_engines, verify_logprobs

OURS = torch.tensor([[-1.0, -2.0, -0.5]])
PROBE = [[3, 4, 5, 6]]
EPS = 2.0**-19  # ~1.9e-6; OURS +- small multiples of it are exact in float32, so the differences are exact


class StandIn:
    """forward_logprobs returns OURS / temperature (the stand-in's training temperature is 2)."""

    def __init__(self):
        self.temperature, self.calls = 2.0, []

    @contextlib.contextmanager
    def scoring_temperature(self, t):
        before, self.temperature = self.temperature, t
        try:
            yield
        finally:
            self.temperature = before

    def forward_logprobs(self, rows):
        self.calls.append(rows.tolist())
        return {"logprobs": OURS / self.temperature}


class Engine:
    def __init__(self, shift):
        self.shift = shift

    def prompt_logprobs(self, rows):
        return [OURS[0] + self.shift for _ in rows]


def test_worst_difference_over_every_engine():
    engines = {"rollout rank 2": OURS + EPS, "rollout rank 3": OURS - 3 * EPS}
    learner = StandIn()
    assert compare_engines(learner, PROBE, 1e-4, lambda rows: engines) == 3 * EPS
    assert learner.calls == [PROBE] and learner.temperature == 2.0


def test_a_rank_without_engines_joins_the_forward_and_compares_nothing():
    learner = StandIn()
    assert compare_engines(learner, PROBE, 1e-4, None) is None
    assert verify_logprobs(learner, None, PROBE, 1e-4) is None
    assert learner.calls == [PROBE, PROBE]


def test_the_engine_over_the_tolerance_is_named():
    engines = {"rollout rank 2": OURS, "rollout rank 3": OURS + 0.5}
    with pytest.raises(WeightSyncError, match=r"^rollout rank 3: engine logprobs differ from the learner's by 5\.000e-01"):
        compare_engines(StandIn(), PROBE, 1e-4, lambda rows: engines)


def test_this_ranks_own_engine():
    assert verify_logprobs(StandIn(), Engine(2 * EPS), PROBE, 1e-4) == 2 * EPS
    with pytest.raises(WeightSyncError, match=r"^rank 0: engine logprobs differ"):
        verify_logprobs(StandIn(), Engine(1e-2), PROBE, 1e-4)

"""The placements (placement/placements.py) with stand-in engines: which engine calls each step method makes,
with what arguments, and what it returns. No vLLM, no Megatron; `shares_of` runs in a gloo world of one.

    .venv/bin/python -m pytest -q tests/unit/test_placement.py
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron_sparse_rl import weight_sync
from megatron_sparse_rl.config.rollout import RolloutConfig
from megatron_sparse_rl.weight_sync.buckets import SyncStats
from megatron_sparse_rl.weight_sync.engine_weights import EngineWeights
from megatron_sparse_rl.placement.placements import Colocated, ColocatedSharedEngine, Disaggregated, Placement

STATS = SyncStats(bytes=1000, seconds=0.5, buckets=1, tensors=3)
STATS_FULL = SyncStats(bytes=1000, seconds=0.5, buckets=1, tensors=3, full_bytes=1000)
"""What the stand-ins' syncs move, and what a placement returns for a full one (`full_bytes` set to its bytes)."""


class StandInEngine:
    """The engine surface the colocated placements touch: pad_id, shutdown()."""

    pad_id = 7

    def __init__(self):
        self.calls = []

    def shutdown(self):
        self.calls.append(("shutdown",))


class StandInRemote:
    """placement/disaggregated.py `RemoteEngine`'s surface the disaggregated placement calls."""

    pad_id = 5
    driver = True

    def __init__(self, batches):
        self.batches, self.calls = batches, []

    def run(self, request):
        self.calls.append(("run", request))
        return f"batch of {request}"

    def run_ahead(self, requests, *, recompute):
        self.calls.append(("run_ahead", requests, recompute))

    def collect_ahead(self):
        self.calls.append(("collect_ahead",))
        return self.batches, {"engine_s": 1.5}

    def sync_weights(self, learner, *, bucket_mb, version, convert, only=None):
        self.calls.append(("sync_weights", learner, bucket_mb, version, convert, only))
        return STATS

    def probe_logprobs(self, tokens):
        raise AssertionError("not called in these tests")

    def shutdown(self):
        self.calls.append(("shutdown",))


def _groups(dp_rank=0):
    return SimpleNamespace(tp_rank=0, pp_rank=0, cp_rank=0, dp_rank=dp_rank, model_parallel=None, learner=None)


def _recording_work(seen):
    def work(engine, d):
        seen.append((engine, d))
        return f"share {d}"
    return work


def test_colocated_runs_work_once_on_its_engine_for_its_share():
    engine, seen = StandInEngine(), []
    placement = Colocated(engine, _groups(dp_rank=3), model_parallel=1)
    assert isinstance(placement, Placement) and placement.pad_id == 7
    assert placement.generate(_recording_work(seen)) == "share 3"
    assert seen == [(engine, 3)]


def test_colocated_sync_and_verify_hand_its_engine_to_weight_sync(monkeypatch):
    engine, learner, calls = StandInEngine(), object(), []
    monkeypatch.setattr(weight_sync, "sync_to_engine", lambda lrn, eng, *, bucket_mb, convert, version, only:
                        calls.append(("sync", lrn, eng, bucket_mb, convert, version, only)) or STATS)
    monkeypatch.setattr(weight_sync, "probe_metrics", lambda lrn, tokens, tol, engine_logprobs, weights:
                        calls.append(("verify", lrn, tokens, tol, weights)) or {"sync/probe_max_abs_diff": 0.25})
    weights = EngineWeights.of(RolloutConfig(quantization="fp8"))
    placement = Colocated(engine, _groups(), model_parallel=1, weights=weights)
    # a learner without adapters: the whole model (only=None) at every sync, and a full sync's bytes are its own
    assert placement.sync(learner, bucket_mb=64, version=4) == STATS_FULL
    assert placement.verify(learner, "probe", 1e-3) == {"sync/probe_max_abs_diff": 0.25}
    assert calls == [("sync", learner, engine, 64, weights.convert, 4, None),
                     ("verify", learner, "probe", 1e-3, weights)]
    placement.shutdown()
    assert engine.calls == [("shutdown",)]


def test_colocated_does_not_sample_ahead():
    with pytest.raises(NotImplementedError, match="needs the disaggregated placement"):
        Colocated(StandInEngine(), _groups(), model_parallel=1).sample_ahead([], lambda b, d: b)


def test_a_shared_engine_runs_every_share_in_order_and_keeps_its_own():
    engine, seen = StandInEngine(), []
    placement = ColocatedSharedEngine(engine, _groups(dp_rank=2), model_parallel=1, shares=(0, 2, 5))
    assert placement.generate(_recording_work(seen)) == "share 2"
    assert seen == [(engine, 0), (engine, 2), (engine, 5)]  # every rank of the engine makes the same calls


@pytest.fixture
def world_of_one(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_shares_of_an_engine_in_a_world_of_one(world_of_one):
    assert ColocatedSharedEngine.shares_of(dp_rank=0, engine_tp=1) == (0,)


def test_disaggregated_runs_every_share_through_the_remote_engines():
    remote, seen = StandInRemote(batches=[]), []
    placement = Disaggregated(remote, _groups(dp_rank=1), dp=3, learner_ranks=1)
    assert placement.pad_id == 5
    assert placement.generate(_recording_work(seen)) == "share 1"
    assert seen == [(remote, 0), (remote, 1), (remote, 2)]
    learner = object()
    assert placement.sync(learner, bucket_mb=32, version=2) == STATS_FULL
    placement.shutdown()
    assert remote.calls == [("sync_weights", learner, 32, 2, None, None), ("shutdown",)]


def test_disaggregated_samples_every_share_through_the_remote_engines_and_finishes_it():
    remote = StandInRemote(batches=[])
    placement = Disaggregated(remote, _groups(dp_rank=1), dp=2, learner_ranks=1)
    out = placement.sample(["request 0", "request 1"], lambda batch, d: f"{batch} finished by {d}")
    assert out == "batch of request 1 finished by 1"
    assert remote.calls == [("run", "request 0"), ("run", "request 1")]


@pytest.mark.parametrize("depth", [1, 2])
def test_disaggregated_queues_batches_sampled_ahead_and_collects_the_oldest_when_taken(depth):
    """One queue for every depth (trainer.max_staleness): the sync never collects; take_ahead does, oldest first."""
    remote = StandInRemote(batches=["batch 0", "batch 1"])
    placement = Disaggregated(remote, _groups(dp_rank=1), dp=2, learner_ranks=1, recompute_kv=True, depth=depth)
    requests = [["prompts 0", "prompts 1"], ["later 0", "later 1"]][:depth]
    for r in requests:
        placement.sample_ahead(r, lambda batch, d: f"{batch} finished by {d}")
    assert remote.calls == [("run_ahead", r, True) for r in requests]  # started at once, nothing collected yet
    with pytest.raises(RuntimeError, match=f"trainer.max_staleness {depth}"):
        placement.sample_ahead(["one too many"], lambda batch, d: batch)
    placement.sync(None, bucket_mb=8, version=1)
    ahead = placement.take_ahead()
    assert (ahead.result, ahead.engine_s, ahead.requests) == ("batch 1 finished by 1", {"engine_s": 1.5}, requests[0])
    assert [c[0] for c in remote.calls[depth:]] == ["sync_weights", "collect_ahead"]
    for _ in requests[1:]:
        placement.take_ahead()
    assert placement.take_ahead() is None  # each handed over once


@pytest.mark.parametrize("depth, first, want", [
    (0, 0, [[], [], [], [], [], []]),                     # synchronous: nothing sampled ahead
    (1, 0, [[1], [2], [3], [4], [5], []]),                # k = 1: the next step, until the last
    (2, 0, [[1, 2], [3], [4], [5], [], []]),              # k = 2: a launch's first step hands over two
    (2, 3, [[4, 5], [], []]),                             # resumed at step 3 (a fresh placement): 4 and 5
    (8, 0, [[1, 2, 3, 4, 5], [], [], [], [], []]),        # a window wider than the run stops at the last step
])
def test_the_placement_owns_the_window_of_steps_sampled_ahead(depth, first, want):
    """The asynchronous window (trainer.max_staleness k = depth) over a 6-step run (steps 0-5): after step s's batch,
    the steps to hand over, each once, up to k past s; hand-computed."""
    remote = StandInRemote(batches=[])
    placement = Disaggregated(remote, _groups(), dp=1, learner_ranks=1, depth=depth)
    assert [list(placement.steps_ahead(step, 5)) for step in range(first, 6)] == want
    colocated = Colocated(StandInEngine(), _groups(), model_parallel=1)
    assert [list(colocated.steps_ahead(step, 5)) for step in range(6)] == [[]] * 6

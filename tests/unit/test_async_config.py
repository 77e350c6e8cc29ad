"""Asynchronous RL's configuration and bookkeeping: `trainer.max_staleness` / `trainer.in_flight_kv` refused where
they cannot run (each error names the field and what is allowed), and `VersionLog`, which says which weight version
sampled each token of a partial rollout (checked against a hand-built expectation).

    .venv/bin/python -m pytest -q tests/unit/test_async_config.py
"""
from __future__ import annotations

import re

import pytest
import torch

from megatron_sparse_rl.config import ConfigError, RunConfig, validate
from megatron_sparse_rl.config.loader import from_dict, merge_overrides
from megatron_sparse_rl.rollout.versions import VersionLog


def run_of(*overrides: str) -> RunConfig:
    return from_dict(RunConfig, merge_overrides({"model": {"path": "/nonexistent/tiny", "tiny": {}}}, list(overrides)))


ASYNC = ("launch.nproc_per_node=2", "launch.rollout_ranks=1", "trainer.max_staleness=1")


def test_async_on_a_disaggregated_run_validates():
    validate(run_of(*ASYNC), 2, cuda=False)
    validate(run_of(*ASYNC, "trainer.in_flight_kv=recompute"), 2, cuda=False)
    validate(run_of("trainer.max_staleness=0"), 1, cuda=False)  # 0: the synchronous loop anywhere
    for k in (2, 8):  # any k up to the bound, either stale policy
        validate(run_of(*ASYNC[:2], f"trainer.max_staleness={k}", "trainer.stale_policy=recompute"), 2, cuda=False)


@pytest.mark.parametrize("overrides,message", [
    (["trainer.max_staleness=-1"], "trainer.max_staleness must be an integer in [0, 8]"),
    (["trainer.max_staleness=9"], "trainer.max_staleness must be an integer in [0, 8]: 0 synchronous"),
    (["trainer.stale_policy=keep"], "trainer.stale_policy: 'keep' is not allowed; choose one of 'drop', 'recompute'"),
    (["trainer.in_flight_kv=drop"], "trainer.in_flight_kv: 'drop' is not allowed; choose one of 'keep', 'recompute'"),
])
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_of(*overrides)


@pytest.mark.parametrize("overrides,world,message", [
    (["trainer.max_staleness=1"], 1, "trainer.max_staleness = 1 samples on the rollout ranks while the learner ranks "
                                     "train: it needs the disaggregated placement"),
    (["trainer.max_staleness=4"], 1, "trainer.max_staleness = 4 samples on the rollout ranks"),
    ([*ASYNC[:1], "launch.nproc_per_node=3", "launch.rollout_ranks=2", "trainer.max_staleness=1",
      "rollout.tensor_parallel_size=2", "parallel.tp=1"], 3, "needs rollout.tensor_parallel_size = 1 (got 2)"),
    ([*ASYNC, "trainer.in_flight_kv=recompute", "rollout.kv.policy=rkv", "rollout.kv.budget=16",
      "rollout.kv.window=4"], 2, "trainer.in_flight_kv = 'recompute' re-prefills the running requests densely"),
])
def test_async_is_refused_where_it_cannot_run(overrides, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(run_of(*overrides), world, cuda=False)


def test_version_log_marks_the_tokens_after_each_update():
    log = VersionLog(start=3)
    log.update(4, {("a", 0): 2, ("a", 1): 0})  # ("b", 0) had finished: all its tokens are version 3
    log.update(5, {("a", 0): 4})               # ("a", 1) finished between the two updates
    got = log.token_versions([("a", 0), ("a", 1), ("b", 0)], width=6)
    want = torch.tensor([[3, 3, 4, 4, 5, 5], [4, 4, 4, 4, 4, 4], [3, 3, 3, 3, 3, 3]])
    assert torch.equal(got, want) and log.versions == 3
    assert torch.equal(VersionLog(start=0).token_versions([("x", 0)], width=2), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="versions must increase"):
        log.update(5, {})
